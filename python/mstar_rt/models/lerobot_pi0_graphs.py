"""pi0 / pi0.5 flow steps as CUDA graphs, one per batch-size bucket.

A flow step (the expert over a chunk of action tokens per request, attending to the cached
prefixes) is a few hundred small kernels at robot batch sizes: on a GPU its launches, not its
arithmetic, set the step's time. Here a batch is padded up to the next bucket and the step runs
over static buffers -- the noisy actions, the flow-time embeddings, and a static
:class:`~mstar_rt.models.lerobot_pi0_suffix.SuffixAttention` holding every request's prefix K/V
padded to the policy's longest prefix, with its key mask, positions and rotary tables. On CUDA
the first step of a bucket is captured and every later one replays it; on the CPU the same
static path runs eagerly (that is how it is tested without a GPU), and ``compile`` wraps it in
``torch.compile``.

The buffers are refilled only when the batch's requests change (once per chunk in the common
case): copying the prefixes in is the same work the dynamic path does. Empty slots of a bucket
see only their own action tokens and their rows are dropped. The graph computes the velocity
only; real-time-chunking guidance and the Euler step stay outside it (a few elementwise ops).
Batches larger than the largest bucket run the dynamic path.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence, Union

import torch

from mstar_rt.engines.cuda_graphs import capture as capture_graph, static_path
from mstar_rt.models.lerobot_pi0_layers import PiModule
from mstar_rt.models.lerobot_pi0_suffix import SuffixAttention

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32)


class _Bucket:
    def __init__(self, size: int, suffix: SuffixAttention, module: PiModule) -> None:
        c = module.config
        self.size, self.suffix = size, suffix
        self.x = torch.zeros(size * c.chunk_size, c.max_action_dim, dtype=module.dtype,
                             device=module.device)
        self.time = torch.zeros(size, c.expert.width, dtype=module.dtype, device=module.device)
        self.graph: Optional[Any] = None
        self.out: Optional[torch.Tensor] = None


class FlowGraphs:
    """Flow-step velocities of ``module`` through per-bucket static buffers; captured as CUDA
    graphs when ``capture`` (default: the module is on CUDA), eagerly otherwise. ``compile``
    wraps the static step in ``torch.compile`` (a string names the backend)."""

    def __init__(self, module: PiModule, buckets: Sequence[int] = DEFAULT_BUCKETS,
                 capture: Optional[bool] = None, compile: Union[bool, str] = False) -> None:
        if not buckets or min(buckets) < 1:
            raise ValueError(f"buckets must be positive batch sizes, got {tuple(buckets)}")
        self.module = module
        self.buckets = tuple(sorted(set(int(b) for b in buckets)))
        self.capture, self._fn = static_path(self._forward, module.device, capture, compile,
                                             "the policy", "static flow step")
        self._buckets: dict[int, _Bucket] = {}
        self._pool: Any = None
        self.runs = 0       # steps served by the static path (replays or eager)
        self.captures = 0
        self.fills = 0      # batches whose prefixes were copied in

    def bucket_for(self, batch: int) -> Optional[int]:
        return next((b for b in self.buckets if b >= batch), None)

    def velocity(self, key: tuple, prefixes: Callable[[], Optional[list[torch.Tensor]]],
                 x: torch.Tensor, time: torch.Tensor) -> Optional[torch.Tensor]:
        """The velocity ``[B * chunk, max_action_dim]`` of noisy actions ``x`` (the batch's
        chunks, flat) at flow-time embeddings ``time [B, width]``, for the batch ``key`` names
        (compared by identity, item by item); ``prefixes()`` gives the requests' prefix
        snapshots when the batch changed (None: they cannot be had). None when the step is not
        one the static path serves (the caller then runs it dynamically)."""
        n = len(key)
        size = self.bucket_for(n)
        if size is None:
            return None
        with torch.inference_mode():
            bucket = self._buckets.get(size)
            last = None if bucket is None else bucket.suffix.key
            if last is None or len(last) != n or any(a is not b for a, b in zip(last, key)):
                snapshots = prefixes()
                if snapshots is None:
                    return None
                if bucket is None:
                    bucket = self._buckets[size] = self._new_bucket(size, snapshots[0])
                bucket.suffix.fill(key, snapshots)
                self.fills += 1
            assert bucket is not None
            chunk = self.module.config.chunk_size
            bucket.x[:n * chunk].copy_(x)
            bucket.x[n * chunk:].zero_()
            bucket.time[:n].copy_(time)
            bucket.time[n:].zero_()
            if not self.capture:
                v = self._fn(bucket)
            elif bucket.graph is None:
                if self._pool is None:
                    self._pool = torch.cuda.graph_pool_handle()
                b = bucket
                bucket.graph, bucket.out = capture_graph(lambda: self._fn(b), self._pool)
                self.captures += 1
                v = bucket.out
            else:
                bucket.graph.replay()
                assert bucket.out is not None
                v = bucket.out
            self.runs += 1
            # A copy: the static output is overwritten by the bucket's next replay.
            return v[:n * chunk].clone()

    def warm_up(self, sizes: Optional[Sequence[int]] = None) -> None:
        """Runs (captures, compiles) each bucket of ``sizes`` (default: all) once over empty
        prefixes, so that no robot's first chunk waits for it."""
        m, c = self.module, self.module.config
        b = c.backbone
        like = torch.zeros(b.depth, 2, 1, b.num_kv_heads, b.head_dim, dtype=m.dtype,
                           device=m.device)
        x = torch.zeros(c.chunk_size, c.max_action_dim, dtype=m.dtype, device=m.device)
        time = torch.zeros(1, c.expert.width, dtype=m.dtype, device=m.device)
        for size in sizes or self.buckets:
            if size not in self.buckets:
                raise ValueError(f"{size} is not one of the buckets {self.buckets}")
            key = tuple(object() for _ in range(size))
            self.velocity(key, lambda: [like] * size, x.repeat(size, 1), time.repeat(size, 1))
        self.forget()

    @property
    def holding(self) -> int:
        """Buckets still holding a batch's requests (and their prefixes' copies)."""
        return sum(b.suffix.key is not None for b in self._buckets.values())

    def forget(self) -> None:
        """Drops the buckets' hold on the last batch's requests (their chunks are done)."""
        for bucket in self._buckets.values():
            bucket.suffix.key = None

    def _new_bucket(self, size: int, like: torch.Tensor) -> _Bucket:
        m = self.module
        c = m.config
        suffix = SuffixAttention(size, c.max_prefix, c.chunk_size, like, m.rope, m.dtype,
                                 static=True)
        return _Bucket(size, suffix, m)

    def _forward(self, bucket: _Bucket) -> torch.Tensor:
        m, s = self.module, bucket.suffix
        tokens, cond = m.action_tokens(bucket.x, None, s.rows, bucket.time)
        return m.velocity(tokens, s.positions, s, cond, s.tables)

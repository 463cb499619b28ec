"""Flow-matching steps of a VLA policy as CUDA graphs, one per batch-size bucket.

A flow step (the action expert over a chunk of action tokens per request, attending to the
requests' cached prefixes) is a few hundred small kernels at robot batch sizes: on a GPU its
launches, not its arithmetic, set the step's time. Here a batch is padded up to the next bucket
and the step runs over static buffers -- the noisy actions, the flow times (or their
embeddings), and a static attention object holding every request's prefix K/V padded to the
policy's longest prefix, with its masks, positions and rotary tables. On CUDA the first step of
a bucket is captured and every later one replays it; on the CPU the same static path runs
eagerly (that is how it is tested without a GPU), and ``compile`` wraps it in
``torch.compile``.

The policy's side is a :class:`FlowStep` (pi0 / pi0.5:
:class:`~mstar_rt.models.lerobot_pi0_graphs.PiFlowStep`; SmolVLA:
:class:`~mstar_rt.models.smolvla_flow.SmolFlowStep`). The buffers are refilled only when the
batch's requests change (once per chunk in the common case): copying the prefixes in is the
same work the dynamic path does. Empty slots of a bucket see only their own action tokens and
their rows are dropped. The graph computes the velocity only; real-time-chunking guidance and
the Euler step stay outside it (a few elementwise ops). Batches larger than the largest bucket,
and prefixes longer than the policy's longest (a tokenizer step allowing longer prompts than
the config), run the dynamic path. Memory: every bucket holds its slots' prefix K/V at the
longest prefix (full-size pi0 in bfloat16: 11 MB per slot, 0.7 GB for buckets 1 to 32).
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Protocol, Sequence, Union

import torch

from mstar_rt.engines.cuda_graphs import capture as capture_graph, static_path

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32)


class TimeEmbeddings:
    """Each flow time's embedding, computed once (``embed``: times ``[1]`` -> ``[1, width]``):
    a chunk's Euler steps visit the same few times over and over."""

    def __init__(self, embed: Callable[[torch.Tensor], torch.Tensor], device: Any) -> None:
        self.embed, self.device = embed, device
        self.known: dict[float, torch.Tensor] = {}

    def __call__(self, times: Sequence[float]) -> torch.Tensor:
        for t in times:
            if t not in self.known:
                self.known[t] = self.embed(torch.tensor([t], device=self.device))
        return torch.cat([self.known[t] for t in times])


def same_batch(key: Optional[Sequence[Any]], requests: Sequence[Any]) -> bool:
    """Whether ``key`` holds exactly ``requests``, compared by identity (a request prefixed again
    brings a new object, so kept prefixes never outlive theirs)."""
    return key is not None and len(key) == len(requests) and \
        all(a is b for a, b in zip(key, requests))


class FlowStep(Protocol):
    """A policy's flow step as :class:`FlowGraphs` runs it."""

    device: torch.device
    chunk: int

    def inputs(self, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Zeroed static buffers for ``size`` requests: the noisy actions ``[size * chunk,
        action_dim]`` and the flow times as the step takes them (``[size, ...]``)."""

    def attention(self, size: int, like: Any) -> Any:
        """A static attention object for ``size`` requests (``fits(prefixes)``, ``fill(key,
        prefixes)``, ``key``); ``like``: one request's prefix, for sizes and dtypes."""

    def empty_prefix(self) -> Any:
        """A one-token prefix (for warm-up runs)."""

    def velocity(self, x: torch.Tensor, time: torch.Tensor, attention: Any) -> torch.Tensor:
        """The velocity ``[size * chunk, action_dim]`` (static-shape code: no host syncs)."""


class _Bucket:
    def __init__(self, size: int, attention: Any, step: FlowStep) -> None:
        self.size, self.attention = size, attention
        self.x, self.time = step.inputs(size)
        self.graph: Optional[Any] = None
        self.out: Optional[torch.Tensor] = None


class FlowGraphs:
    """Flow-step velocities through per-bucket static buffers; captured as CUDA graphs when
    ``capture`` (default: the policy is on CUDA), eagerly otherwise. ``compile`` wraps the
    static step in ``torch.compile`` (a string names the backend)."""

    def __init__(self, step: FlowStep, buckets: Sequence[int] = DEFAULT_BUCKETS,
                 capture: Optional[bool] = None, compile: Union[bool, str] = False) -> None:
        if not buckets or min(buckets) < 1:
            raise ValueError(f"buckets must be positive batch sizes, got {tuple(buckets)}")
        self.step = step
        self.buckets = tuple(sorted(set(int(b) for b in buckets)))
        self.capture, self._fn = static_path(self._forward, step.device, capture, compile,
                                             "the policy", "static flow step")
        self._buckets: dict[int, _Bucket] = {}
        self._pool: Any = None
        self.runs = 0       # steps served by the static path (replays or eager)
        self.captures = 0
        self.fills = 0      # batches whose prefixes were copied in

    def bucket_for(self, batch: int) -> Optional[int]:
        return next((b for b in self.buckets if b >= batch), None)

    def velocity(self, key: tuple, prefixes: Callable[[], Optional[Sequence[Any]]],
                 x: torch.Tensor, time: torch.Tensor) -> Optional[torch.Tensor]:
        """The velocity ``[B * chunk, action_dim]`` of noisy actions ``x`` (the batch's chunks,
        flat) at flow times ``time`` (``[B, ...]``, as the step takes them), for the batch
        ``key`` names (compared by identity, item by item); ``prefixes()`` gives the requests'
        prefixes when the batch changed (None: they cannot be had). None when the step is not
        one the static path serves (the caller then runs it dynamically)."""
        n = len(key)
        size = self.bucket_for(n)
        if size is None:
            return None
        with torch.inference_mode():
            bucket = self._buckets.get(size)
            if bucket is None or not same_batch(bucket.attention.key, key):
                given = prefixes()
                if given is None:
                    return None
                if bucket is None:
                    bucket = self._buckets[size] = _Bucket(
                        size, self.step.attention(size, given[0]), self.step)
                if not bucket.attention.fits(given):  # a prefix past the policy's longest
                    return None
                bucket.attention.fill(key, given)
                self.fills += 1
            assert bucket is not None
            rows = n * self.step.chunk
            bucket.x[:rows].copy_(x)
            bucket.x[rows:].zero_()
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
            return v[:rows].clone()

    def warm_up(self, sizes: Optional[Sequence[int]] = None) -> None:
        """Runs (captures, compiles) each bucket of ``sizes`` (default: all) once over one-token
        prefixes, so that no robot's first chunk waits for it."""
        empty = self.step.empty_prefix()
        for size in sizes or self.buckets:
            if size not in self.buckets:
                raise ValueError(f"{size} is not one of the buckets {self.buckets}")
            x, time = self.step.inputs(size)
            self.velocity(tuple(object() for _ in range(size)), lambda: [empty] * size, x, time)
        self.forget()

    @property
    def built(self) -> tuple[int, ...]:
        """The buckets run (captured, compiled) at least once."""
        return tuple(sorted(self._buckets))

    @property
    def holding(self) -> int:
        """Buckets still holding a batch's requests (and their prefixes' copies)."""
        return sum(b.attention.key is not None for b in self._buckets.values())

    def forget(self) -> None:
        """Drops the buckets' hold on the last batch's requests (their chunks are done)."""
        for bucket in self._buckets.values():
            bucket.attention.key = None

    def _forward(self, bucket: _Bucket) -> torch.Tensor:
        return self.step.velocity(bucket.x, bucket.time, bucket.attention)


def policy_graphs(step: FlowStep, largest: int, cuda_graphs: bool,
                  compile: Union[bool, str]) -> Optional[FlowGraphs]:
    """A policy's graphs when ``cuda_graphs`` or ``compile`` asks for them: buckets up to
    ``largest``, the most works one engine step takes (several batches of the flow-step node can
    share a step), captured on CUDA (``cuda_graphs``) or run eagerly (``compile`` alone)."""
    if not (cuda_graphs or compile):
        return None
    buckets = [b for b in DEFAULT_BUCKETS if b < largest] + [largest]
    return FlowGraphs(step, buckets, capture=None if cuda_graphs else False, compile=compile)

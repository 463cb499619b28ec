"""Decode steps as CUDA graphs, one per batch-size bucket.

A decode step (every work one causal token that persists) is padded up to the next bucket and
run through static buffers: token ids, positions, the slots the new K/V go to, and a
static-shape attention plan — for the torch backend a block table and lengths from which the
graph derives gather slots padded to ``max_seq_len`` and a mask; for FlashInfer its cuda-graph
decode wrapper. On CUDA the first step of a bucket is captured and later ones replay it; on the
CPU the same static path runs eagerly (that is how it is tested without a GPU).

Padding rows must not change any page: each one "writes" the first real row's K/V into that
row's own slot (the same bytes twice, so the duplicate index is harmless) and reads a page the
first real row holds. No page is taken from the cache, so its free list and counts stay as they
were. Positions beyond ``max_seq_len``, prefill, masked or non-persisted works, and batches
larger than the largest bucket take the ordinary dynamic path.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional, Sequence as Seq, TypeVar, Union

import torch

from mstar_rt.engines.attention import AttentionBackend, StaticDecodeAttention
from mstar_rt.engines.attention_base import SeqStep, StaticDecodePlan, causal_equivalent
from mstar_rt.engines.kv_engine import KVStep
from mstar_rt.engines.paged_kv import PagedKVCache
from mstar_rt.engines.torch_backend import StaticTorchDecode

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32, 64)


class DecodeOut(NamedTuple):
    hidden: torch.Tensor   # [B, hidden]
    logits: torch.Tensor   # [B, vocab]


class _Bucket:
    def __init__(self, size: int, plan: StaticDecodePlan, attention: StaticDecodeAttention,
                 device: Any) -> None:
        self.size, self.plan = size, plan
        self.ids = torch.zeros(size, dtype=torch.long, device=device)
        self.step = KVStep(attention, plan)
        self.graph: Optional[Any] = None
        self.out: Optional[tuple[torch.Tensor, torch.Tensor]] = None


class DecodeGraphs:
    """Runs decode steps of ``module`` (``forward(ids, step) -> hidden``, ``logits(hidden)``)
    through per-bucket static buffers; captured as CUDA graphs when ``capture`` (default: the
    cache is on CUDA), eagerly otherwise. ``attention`` is the static attention
    (:class:`StaticTorchDecode` by default); ``compile`` wraps the static forward in
    ``torch.compile`` (one compilation per bucket; a string names the compile backend)."""

    def __init__(self, module: torch.nn.Module, cache: PagedKVCache,
                 buckets: Seq[int] = DEFAULT_BUCKETS, max_seq_len: Optional[int] = None,
                 attention: Optional[StaticDecodeAttention] = None,
                 capture: Optional[bool] = None,
                 compile: Union[bool, str] = False) -> None:
        if not buckets or min(buckets) < 1:
            raise ValueError(f"buckets must be positive batch sizes, got {tuple(buckets)}")
        self.module, self.cache = module, cache
        self.buckets = tuple(sorted(set(int(b) for b in buckets)))
        self.max_seq_len = int(max_seq_len or module.config.max_position_embeddings)
        self.attention: StaticDecodeAttention = (
            attention or StaticTorchDecode(cache, self.max_seq_len))
        self.capture, self._fn = static_path(
            self._forward, torch.device(cache.layout.device), capture, compile,
            "the model and KV cache", "static decode path")
        self._buckets: dict[int, _Bucket] = {}
        self._pool: Any = None
        self.runs = 0       # steps served by the static path (replays or eager)
        self.captures = 0

    @staticmethod
    def for_backend(module: torch.nn.Module, backend: AttentionBackend, max_seq_len: int,
                    buckets: Seq[int] = DEFAULT_BUCKETS,
                    compile: Union[bool, str] = False) -> "DecodeGraphs":
        """The graphs over the static decode attention of the engine's backend (FlashInfer's
        cuda-graph decode wrapper, or the torch static plan, which serves sequences up to
        :data:`~mstar_rt.engines.torch_backend.TORCH_STATIC_MAX_LEN` tokens)."""
        attention = backend.static_decode(int(module.config.num_attention_heads), max_seq_len)
        return DecodeGraphs(module, backend.cache, buckets, attention.max_seq_len, attention,
                            compile=compile)

    def bucket_for(self, steps: Seq[SeqStep]) -> Optional[int]:
        """The bucket serving ``steps``, or None when they are not a plain decode step that
        fits."""
        if not steps or len(steps) > self.buckets[-1]:
            return None
        ps = self.cache.page_size
        for s in steps:
            if (s.new != 1 or not s.persist or not causal_equivalent(s)
                    or s.cached + 1 > self.max_seq_len or len(s.pages) * ps < s.cached + 1):
                return None
        return next(b for b in self.buckets if b >= len(steps))

    def run(self, token_ids: torch.Tensor, steps: Seq[SeqStep]) -> Optional[DecodeOut]:
        """Runs one decode step (``token_ids [B]``, one per step); None when it is not one the
        static path serves (the caller then runs it dynamically)."""
        size = self.bucket_for(steps)
        if size is None:
            return None
        with torch.inference_mode():
            bucket = self._buckets.get(size)
            if bucket is None:
                plan = self.attention.new_plan(size)
                bucket = self._buckets[size] = _Bucket(size, plan, self.attention,
                                                       self.cache.layout.device)
            n = len(steps)
            bucket.ids[:n].copy_(token_ids.reshape(-1))
            bucket.ids[n:].zero_()
            self.attention.fill(bucket.plan, steps)
            if not self.capture:
                hidden, logits = self._fn(bucket.ids, bucket.step)
            elif bucket.graph is None:
                hidden, logits = self._capture(bucket)
            else:
                bucket.graph.replay()
                assert bucket.out is not None
                hidden, logits = bucket.out
            self.runs += 1
            # Copies: the static outputs are overwritten by the next replay of any bucket.
            return DecodeOut(hidden[:n].clone(), logits[:n].clone())

    def _forward(self, ids: torch.Tensor, step: KVStep) -> tuple[torch.Tensor, torch.Tensor]:
        self.attention.prepare(step.plan)
        hidden = self.module(ids, step)
        return hidden, self.module.logits(hidden)

    def _capture(self, bucket: _Bucket) -> tuple[torch.Tensor, torch.Tensor]:
        # Warm-up runs the real step (it rewrites the same K/V the replay writes again), so no
        # dummy step ever touches the pages.
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        bucket.graph, bucket.out = capture(lambda: self._fn(bucket.ids, bucket.step), self._pool)
        self.captures += 1
        return bucket.out


T = TypeVar("T")
F = TypeVar("F", bound=Callable[..., Any])


def static_path(forward: F, device: torch.device, capture: Optional[bool],
                compile: Union[bool, str], holder: str, path: str) -> tuple[bool, F]:
    """Whether a static path captures CUDA graphs (default: ``device`` is CUDA; asking for it
    elsewhere is a ValueError naming ``holder`` and ``path``), and the function it runs:
    ``forward``, under ``torch.compile`` when ``compile`` (a string names the backend)."""
    on_cuda = device.type == "cuda"
    use = on_cuda if capture is None else capture
    if use and not on_cuda:
        raise ValueError(f"CUDA graphs need {holder} on a CUDA device; pass capture=False to run "
                         f"the {path} eagerly")
    if not compile:
        return use, forward
    backend = {"backend": compile} if isinstance(compile, str) else {}
    return use, torch.compile(forward, dynamic=False, **backend)


def capture(fn: Callable[[], T], pool: Any) -> tuple[Any, T]:
    """``fn`` captured as a CUDA graph in memory ``pool`` (``torch.cuda.graph_pool_handle()``),
    after one warm-up run on a side stream; the graph has been replayed once, so its outputs
    (returned, static) hold this step's result. ``fn`` runs twice: it must be safe to repeat."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    # thread_local: other engines' threads may use the GPU while this one captures.
    with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
        out = fn()
    graph.replay()
    return graph, out

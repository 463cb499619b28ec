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

from typing import Any, NamedTuple, Optional, Sequence as Seq, Union

import torch
import torch.nn.functional as F

from mstar_rt.engines.attention import SeqStep
from mstar_rt.engines.flashinfer_backend import causal_equivalent
from mstar_rt.engines.kv_engine import KVStep
from mstar_rt.engines.paged_kv import PagedKVCache

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
# The torch static plan gathers max_seq_len keys per row and layer; beyond this many tokens the
# padded gather costs more than the launches a graph saves, so longer sequences decode eagerly.
TORCH_STATIC_MAX_LEN = 2048


def decode_rows(steps: Seq[SeqStep], size: int, page_size: int) -> torch.Tensor:
    """Host ``[4, size]`` int64: positions, write slots, write sources (row whose K/V is written)
    and key counts, for ``steps`` padded to ``size`` rows."""
    rows = torch.zeros(4, size, dtype=torch.long)
    for i, s in enumerate(steps):
        pos = s.cached
        rows[0, i] = pos
        rows[1, i] = s.pages[pos // page_size] * page_size + pos % page_size
        rows[2, i] = i
        rows[3, i] = pos + 1
    n = len(steps)
    rows[1, n:] = rows[1, 0]  # padding rewrites row 0's slot with row 0's K/V
    rows[2, n:] = 0
    rows[3, n:] = 1
    return rows


class StaticDecodePlan:
    """The fixed-address buffers of one bucket; what :class:`KVStep` and the attention read."""

    def __init__(self, size: int, device: Any) -> None:
        self.size = size
        self.rows = torch.zeros(4, size, dtype=torch.long, device=device)
        self.positions, self.w_slot, self.w_src, self.kv_len = self.rows.unbind(0)
        self.last_token = torch.arange(size, device=device)
        self.block_table: Optional[torch.Tensor] = None   # torch flavour
        self.c_slots: Optional[torch.Tensor] = None       # derived inside the graph
        self.mask: Optional[torch.Tensor] = None
        self.wrapper: Any = None                          # FlashInfer flavour: its wrapper
        self.indptr: Optional[torch.Tensor] = None        # and the wrapper's index buffers
        self.indices: Optional[torch.Tensor] = None
        self.last_page_len: Optional[torch.Tensor] = None


class StaticTorchDecode:
    """Static-shape decode attention with torch ops (any device): keys gathered through the
    block table up to ``max_seq_len``, the positions past each row's length masked."""

    def __init__(self, cache: PagedKVCache, max_seq_len: int) -> None:
        self.cache, self.max_seq_len = cache, max_seq_len
        ps, dev = cache.page_size, cache.layout.device
        self.max_pages = -(-max_seq_len // ps)
        self.kpos = torch.arange(max_seq_len, device=dev)
        self.page_of, self.within = self.kpos // ps, self.kpos % ps

    def new_plan(self, size: int) -> StaticDecodePlan:
        plan = StaticDecodePlan(size, self.cache.layout.device)
        plan.block_table = torch.zeros(size, self.max_pages, dtype=torch.long,
                                       device=self.cache.layout.device)
        return plan

    def fill(self, plan: StaticDecodePlan, steps: Seq[SeqStep]) -> None:
        ps = self.cache.page_size
        plan.rows.copy_(decode_rows(steps, plan.size, ps))
        table = torch.zeros(plan.size, self.max_pages, dtype=torch.long)
        for i, s in enumerate(steps):
            n = -(-(s.cached + 1) // ps)
            table[i, :n] = torch.tensor(s.pages[:n])
        table[len(steps):, 0] = steps[0].pages[0]
        assert plan.block_table is not None
        plan.block_table.copy_(table)

    def prepare(self, plan: StaticDecodePlan) -> None:
        """Once per step, inside the graph: gather slots and mask from the table and lengths."""
        assert plan.block_table is not None
        ps = self.cache.page_size
        plan.c_slots = plan.block_table[:, self.page_of] * ps + self.within
        plan.mask = (self.kpos[None, :] < plan.kv_len[:, None])[:, None, None, :]

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               plan: StaticDecodePlan, scale: Optional[float] = None) -> torch.Tensor:
        kc, vc = self.cache.k[layer], self.cache.v[layer]
        hkv, d = kc.shape[2], kc.shape[3]
        kf, vf = kc.view(-1, hkv, d), vc.view(-1, hkv, d)
        kf[plan.w_slot] = k[plan.w_src]
        vf[plan.w_slot] = v[plan.w_src]
        keys, values = kf[plan.c_slots], vf[plan.c_slots]  # [B, L, Hkv, D]
        out = F.scaled_dot_product_attention(
            q[:, :, None, :], keys.transpose(1, 2), values.transpose(1, 2), attn_mask=plan.mask,
            scale=scale, enable_gqa=q.shape[1] != hkv)
        return out[:, :, 0, :]


class DecodeOut(NamedTuple):
    hidden: torch.Tensor   # [B, hidden]
    logits: torch.Tensor   # [B, vocab]


class _Bucket:
    def __init__(self, size: int, plan: StaticDecodePlan, attention: Any, device: Any) -> None:
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
                 attention: Any = None, capture: Optional[bool] = None,
                 compile: Union[bool, str] = False) -> None:
        if not buckets or min(buckets) < 1:
            raise ValueError(f"buckets must be positive batch sizes, got {tuple(buckets)}")
        self.module, self.cache = module, cache
        self.buckets = tuple(sorted(set(int(b) for b in buckets)))
        self.max_seq_len = int(max_seq_len or module.config.max_position_embeddings)
        self.attention = attention or StaticTorchDecode(cache, self.max_seq_len)
        on_cuda = torch.device(cache.layout.device).type == "cuda"
        self.capture = on_cuda if capture is None else capture
        if self.capture and not on_cuda:
            raise ValueError("CUDA graphs need the model and KV cache on a CUDA device; pass "
                             "capture=False to run the static decode path eagerly")
        self._fn = self._forward
        if compile:
            backend = {"backend": compile} if isinstance(compile, str) else {}
            self._fn = torch.compile(self._forward, dynamic=False, **backend)
        self._buckets: dict[int, _Bucket] = {}
        self._pool: Any = None
        self.runs = 0       # steps served by the static path (replays or eager)
        self.captures = 0

    @staticmethod
    def for_backend(module: torch.nn.Module, backend: Any, max_seq_len: int,
                    buckets: Seq[int] = DEFAULT_BUCKETS,
                    compile: Union[bool, str] = False) -> "DecodeGraphs":
        """The graphs matching the engine's attention backend (FlashInfer's cuda-graph decode
        wrapper, else the torch static plan, capped at :data:`TORCH_STATIC_MAX_LEN`)."""
        cache = backend.cache
        if getattr(backend, "name", "") == "flashinfer":
            from mstar_rt.engines.flashinfer_backend import FlashInferStaticDecode

            heads = int(module.config.num_attention_heads)
            attention: Any = FlashInferStaticDecode(backend, heads, max_seq_len)
        else:
            max_seq_len = min(max_seq_len, TORCH_STATIC_MAX_LEN)
            attention = StaticTorchDecode(cache, max_seq_len)
        return DecodeGraphs(module, cache, buckets, max_seq_len, attention, compile=compile)

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
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self._fn(bucket.ids, bucket.step)
        torch.cuda.current_stream().wait_stream(side)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        # thread_local: other engines' threads may use the GPU while this one captures.
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            bucket.out = self._fn(bucket.ids, bucket.step)
        bucket.graph = graph
        self.captures += 1
        graph.replay()
        return bucket.out

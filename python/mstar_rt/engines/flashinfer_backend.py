"""FlashInfer attention over the paged KV cache (CUDA; fp16/bf16), with the semantics of
:class:`~mstar_rt.engines.torch_backend.TorchAttention`. The ``flashinfer`` package is an optional
CUDA-only dependency: it is imported when a backend is built, never with this module.

The cache is FlashInfer's "NHD" paged layout as it is: ``k[layer]``/``v[layer]`` of shape
``[num_pages, page_size, num_kv_heads, head_dim]``. A step splits its sequences in two groups:

* persisted works: their new K/V are written into the pages first (plain index writes, the same
  slots the torch backend writes), then the queries attend to the whole sequence in the pages
  (cached + new) with the batch decode kernel (every work one causal token) or the paged
  prefill kernel (causal flag, or a custom mask when any work's mask is not plain causal).
* non-persisted works: their cached K/V are gathered with the new K/V into a ragged buffer and
  attended with the ragged prefill kernel. Their tokens must not reach the pages: written after
  the sequence's last token they would land in a page a fork may share (two forks reading in
  one step would even write the same slots), and scratch pages would have to come out of the
  cache's own allocator. The gather copies the prefix per layer, a cost these works
  (rollouts, flow-matching steps over a context) pay rarely.

FlashInfer's causal mask aligns the queries with the last keys (query ``i`` of ``qo_len`` sits at
key position ``kv_len - qo_len + i``), exactly the positions ``cached .. cached+new-1`` here; the
custom mask is each work's ``[new, cached+new]`` boolean matrix, flattened and concatenated.
``plan`` only builds host arrays; the wrappers are planned on the first ``attend`` of a step
(once for all layers), when the query heads and the softmax scale are known.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional, Sequence as Seq

import torch

from mstar_rt.engines.attention_base import (
    SeqStep, StaticDecodePlan, causal_equivalent, check_dtype, decode_rows)
from mstar_rt.engines.paged_kv import PagedKVCache

WORKSPACE_BYTES = 128 << 20  # FlashInfer's recommended float workspace (split-kv partials)


def import_flashinfer() -> Any:
    try:
        import flashinfer
    except ImportError as e:
        raise ImportError(
            "the flashinfer attention backend needs the FlashInfer package: "
            "pip install 'mstar_rt[cuda]' (or pip install flashinfer-python), or pick "
            "attention_backend='torch'") from e
    return flashinfer


def flashinfer_available() -> bool:
    """Whether the FlashInfer package imports (what ``attention_backend="auto"`` asks)."""
    try:
        import_flashinfer()
    except ImportError:
        return False
    return True


# Query heads per KV head that FlashInfer's CUDA-core decode kernels are built for (its
# DISPATCH_GQA_GROUP_SIZE; 6 only in recent releases). Other groups (Qwen2.5's 7, 16) take the
# tensor-core decode, which FlashInfer recommends from a group of 4 anyway.
CUDA_CORE_GROUPS = (1, 2, 3, 4, 8)


def tensor_cores(num_qo_heads: int, num_kv_heads: int) -> bool:
    """Whether decode for this head split runs on FlashInfer's tensor-core kernels."""
    return num_qo_heads // max(num_kv_heads, 1) not in CUDA_CORE_GROUPS


def _takes(fn: Any, name: str) -> bool:
    """Whether callable ``fn`` accepts keyword ``name`` (FlashInfer's signatures grow)."""
    import inspect

    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def _mask_rows(s: SeqStep) -> torch.Tensor:
    """The work's ``[new, cached+new]`` allowed matrix, flattened row-major (FlashInfer's custom
    mask layout)."""
    kv = torch.arange(s.cached + s.new)
    return s.mask.allowed(kv[s.cached:], kv).reshape(-1)


def _indptr(lengths: list[int]) -> torch.Tensor:
    out = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    out[1:] = torch.tensor(lengths, dtype=torch.int32).cumsum(0)
    return out


@dataclass
class _Group:
    """The works of a step that one FlashInfer call serves."""

    kind: str                          # "decode" | "paged" | "ragged"
    rows: Optional[torch.Tensor]       # their tokens in the step's flat order; None: all, in order
    qo_indptr: torch.Tensor            # host int32 [n+1]
    kv_indptr: torch.Tensor            # pages (decode/paged) or tokens (ragged), host int32
    kv_indices: Optional[torch.Tensor] = None      # pages, host int32 (decode/paged)
    last_page_len: Optional[torch.Tensor] = None   # host int32 (decode/paged)
    mask: Optional[torch.Tensor] = None            # flattened bool on the device; None: causal
    # ragged only: where the gathered keys come from
    kv_total: int = 0
    cached_dst: Optional[torch.Tensor] = None
    cached_slot: Optional[torch.Tensor] = None
    new_dst: Optional[torch.Tensor] = None
    new_src: Optional[torch.Tensor] = None


class FlashInferPlan:
    """A step as FlashInfer sees it: the write slots, the groups and their host arrays."""

    def __init__(self, steps: Seq[SeqStep], cache: PagedKVCache) -> None:
        device = cache.layout.device
        ps = cache.page_size
        self.steps = list(steps)
        self.num_tokens = sum(s.new for s in steps)
        offsets = [0]
        for s in steps:
            offsets.append(offsets[-1] + s.new)
        self.positions = torch.cat([torch.arange(s.cached, s.cached + s.new) for s in steps]
                                   ).to(device)
        self.last_token = (torch.tensor(offsets[1:]) - 1).to(device)
        w_tok, w_slot = [], []
        persisted = [i for i, s in enumerate(steps) if s.persist]
        transient = [i for i, s in enumerate(steps) if not s.persist]
        for i in persisted:
            s = steps[i]
            pos = torch.arange(s.cached, s.cached + s.new)
            pages = torch.tensor(s.pages, dtype=torch.long)
            w_tok.append(torch.arange(offsets[i], offsets[i + 1]))
            w_slot.append(pages[pos // ps] * ps + pos % ps)
        # w_tok None with w_slot set: every token persists, in order (no gather of k/v needed).
        everyone = len(persisted) == len(steps)
        self.w_tok = torch.cat(w_tok).to(device) if w_tok and not everyone else None
        self.w_slot = torch.cat(w_slot).to(device) if w_slot else None
        self.groups: list[_Group] = []
        if persisted:
            self.groups.append(self._paged(steps, persisted, offsets, ps, device))
        if transient:
            self.groups.append(self._ragged(steps, transient, offsets, ps, device))
        # Planned lazily by FlashInferAttention: (num_qo_heads, scale) it was planned for.
        self.planned_for: Optional[tuple] = None

    @staticmethod
    def _rows(steps: Seq[SeqStep], idx: list[int], offsets: list[int],
              device: Any) -> Optional[torch.Tensor]:
        if len(idx) == len(steps):
            return None  # the group is the whole step, in order
        return torch.cat([torch.arange(offsets[i], offsets[i + 1]) for i in idx]).to(device)

    def _paged(self, steps, idx, offsets, ps, device) -> _Group:
        sel = [steps[i] for i in idx]
        causal = all(causal_equivalent(s) for s in sel)
        kind = "decode" if causal and all(s.new == 1 for s in sel) else "paged"
        npages, last, indices = [], [], []
        for s in sel:
            kv = s.cached + s.new
            n = -(-kv // ps)
            if len(s.pages) < n:
                raise ValueError(f"a persisted work of {kv} tokens holds {len(s.pages)} pages of "
                                 f"{ps}; the engine must admit its pages before the step")
            npages.append(n)
            last.append(kv - (n - 1) * ps)
            indices.extend(s.pages[:n])
        mask = None if causal else torch.cat([_mask_rows(s) for s in sel]).to(device)
        return _Group(kind, self._rows(steps, idx, offsets, device),
                      _indptr([s.new for s in sel]), _indptr(npages),
                      torch.tensor(indices, dtype=torch.int32),
                      torch.tensor(last, dtype=torch.int32), mask)

    def _ragged(self, steps, idx, offsets, ps, device) -> _Group:
        sel = [steps[i] for i in idx]
        causal = all(causal_equivalent(s) for s in sel)
        c_dst, c_slot, n_dst, n_src = [], [], [], []
        kv_off = 0
        for i, s in zip(idx, sel):
            if s.cached:
                cpos = torch.arange(s.cached)
                pages = torch.tensor(s.pages, dtype=torch.long)
                c_dst.append(kv_off + cpos)
                c_slot.append(pages[cpos // ps] * ps + cpos % ps)
            n_dst.append(torch.arange(kv_off + s.cached, kv_off + s.cached + s.new))
            n_src.append(torch.arange(offsets[i], offsets[i + 1]))
            kv_off += s.cached + s.new
        mask = None if causal else torch.cat([_mask_rows(s) for s in sel]).to(device)
        empty = torch.zeros(0, dtype=torch.long)
        return _Group("ragged", self._rows(steps, idx, offsets, device),
                      _indptr([s.new for s in sel]), _indptr([s.cached + s.new for s in sel]),
                      mask=mask, kv_total=kv_off,
                      cached_dst=(torch.cat(c_dst) if c_dst else empty).to(device),
                      cached_slot=(torch.cat(c_slot) if c_slot else empty).to(device),
                      new_dst=torch.cat(n_dst).to(device), new_src=torch.cat(n_src).to(device))


class FlashInferAttention:
    """Paged attention with FlashInfer's batch decode / paged prefill / ragged prefill kernels;
    same interface and semantics as :class:`~mstar_rt.engines.torch_backend.TorchAttention`."""

    name = "flashinfer"

    def __init__(self, cache: PagedKVCache, workspace_bytes: int = WORKSPACE_BYTES) -> None:
        layout = cache.layout
        check_dtype(self.name, layout.dtype, layout.device)
        fi = import_flashinfer()
        self.cache = cache
        self.flashinfer = fi
        # One float workspace for every wrapper: it holds split-kv partials only while a run
        # executes, and runs are serialised on the worker's stream.
        self.workspace = torch.zeros(workspace_bytes, dtype=torch.uint8, device=layout.device)
        self._decodes: dict[bool, Any] = {}  # use_tensor_cores -> its decode wrapper
        self._decode: Any = None  # the one the last plan used
        # FlashAttention-2 kernels for prefill: with backend "auto" a wrapper picks its kernels
        # at its first plan and keeps them, and on Hopper a first plan without a mask picks FA3,
        # which refuses the custom masks (PrefixBidirectional, BlockCausal) later steps bring.
        fa2 = {"backend": "fa2"} if _takes(fi.BatchPrefillWithPagedKVCacheWrapper, "backend") \
            else {}
        self._paged = fi.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD", **fa2)
        self._ragged = fi.BatchPrefillWithRaggedKVCacheWrapper(self.workspace, "NHD", **fa2)
        self._planned: Optional[FlashInferPlan] = None  # the plan the wrappers hold now

    def plan(self, steps: Seq[SeqStep]) -> FlashInferPlan:
        return FlashInferPlan(steps, self.cache)

    def decode_wrapper(self, num_qo_heads: int, **kwargs: Any) -> Any:
        """The decode wrapper for ``num_qo_heads`` query heads (one per kernel kind; with
        ``kwargs``, a new one: a CUDA graph's)."""
        cores = tensor_cores(num_qo_heads, self.cache.layout.num_kv_heads)
        if kwargs:
            return self.flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace, "NHD", use_tensor_cores=cores, **kwargs)
        if cores not in self._decodes:
            self._decodes[cores] = self.flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace, "NHD", use_tensor_cores=cores)
        return self._decodes[cores]

    def static_decode(self, num_qo_heads: int, max_seq_len: int) -> "FlashInferStaticDecode":
        return FlashInferStaticDecode(self, num_qo_heads, max_seq_len)

    def _ensure_planned(self, plan: FlashInferPlan, num_qo_heads: int,
                        scale: Optional[float]) -> None:
        key = (num_qo_heads, scale)
        if self._planned is plan and plan.planned_for == key:
            return
        layout, ps = self.cache.layout, self.cache.page_size
        hkv, d, dtype = layout.num_kv_heads, layout.head_dim, layout.dtype
        dev = torch.device(layout.device)
        for g in plan.groups:
            # A custom mask is packed on the device, where FlashInfer wants its indptrs too.
            where = (lambda t: t.to(dev)) if g.mask is not None else (lambda t: t)
            common = dict(sm_scale=scale, q_data_type=dtype, kv_data_type=dtype)
            if g.kind == "decode":
                self._decode = self.decode_wrapper(num_qo_heads)
                self._decode.plan(g.kv_indptr, g.kv_indices, g.last_page_len, num_qo_heads, hkv,
                                  d, ps, **common)
            elif g.kind == "paged":
                mask = dict(custom_mask=g.mask) if g.mask is not None else dict(causal=True)
                self._paged.plan(where(g.qo_indptr), where(g.kv_indptr), where(g.kv_indices),
                                 where(g.last_page_len), num_qo_heads, hkv, d, ps,
                                 **mask, **common)
            else:
                mask = dict(custom_mask=g.mask) if g.mask is not None else dict(causal=True)
                self._ragged.plan(where(g.qo_indptr), where(g.kv_indptr), num_qo_heads, hkv, d,
                                  **mask, **common)
        plan.planned_for = key
        self._planned = plan

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               plan: FlashInferPlan, scale: Optional[float] = None) -> torch.Tensor:
        """q ``[T, Hq, D]``, k/v ``[T, Hkv, D]`` for the step's new tokens -> ``[T, Hq, D]``.
        Writes persisted K/V into the pages."""
        self._ensure_planned(plan, q.shape[1], scale)
        kc, vc = self.cache.k[layer], self.cache.v[layer]
        hkv, d = kc.shape[2], kc.shape[3]
        kf, vf = kc.view(-1, hkv, d), vc.view(-1, hkv, d)
        if plan.w_slot is not None:
            kf[plan.w_slot] = k if plan.w_tok is None else k[plan.w_tok]
            vf[plan.w_slot] = v if plan.w_tok is None else v[plan.w_tok]
        out: Optional[torch.Tensor] = None
        for g in plan.groups:
            qg = (q if g.rows is None else q[g.rows]).contiguous()
            if g.kind == "decode":
                o = self._decode.run(qg, (kc, vc))
            elif g.kind == "paged":
                o = self._paged.run(qg, (kc, vc))
            else:
                kr = k.new_empty(g.kv_total, hkv, d)
                vr = v.new_empty(g.kv_total, hkv, d)
                kr[g.cached_dst] = kf[g.cached_slot]
                vr[g.cached_dst] = vf[g.cached_slot]
                kr[g.new_dst] = k[g.new_src]
                vr[g.new_dst] = v[g.new_src]
                o = self._ragged.run(qg, kr, vr)
            if g.rows is None:
                return o
            if out is None:
                out = q.new_empty(q.shape[0], q.shape[1], vc.shape[3])
            out[g.rows] = o
        assert out is not None
        return out


class FlashInferStaticDecode:
    """Static-shape decode attention for CUDA-graph buckets (see
    :class:`~mstar_rt.engines.cuda_graphs.DecodeGraphs`): one cuda-graph decode wrapper per
    bucket, whose index buffers have fixed addresses; ``fill`` re-plans it before each replay
    (outside the graph, as FlashInfer requires), ``attend`` is what the graph captures."""

    def __init__(self, backend: FlashInferAttention, num_qo_heads: int, max_seq_len: int) -> None:
        self.backend, self.cache = backend, backend.cache
        self.num_qo_heads = num_qo_heads
        self.max_seq_len = max_seq_len
        self.max_pages = -(-max_seq_len // self.cache.page_size)
        self.default_scale = 1.0 / math.sqrt(self.cache.layout.head_dim)

    def new_plan(self, size: int) -> StaticDecodePlan:
        plan = StaticDecodePlan(size, self.cache.layout.device)
        dev = self.cache.layout.device
        plan.indptr = torch.zeros(size + 1, dtype=torch.int32, device=dev)
        plan.indices = torch.zeros(size * self.max_pages, dtype=torch.int32, device=dev)
        plan.last_page_len = torch.ones(size, dtype=torch.int32, device=dev)
        plan.wrapper = self.backend.decode_wrapper(
            self.num_qo_heads, use_cuda_graph=True,
            paged_kv_indptr_buffer=plan.indptr, paged_kv_indices_buffer=plan.indices,
            paged_kv_last_page_len_buffer=plan.last_page_len)
        return plan

    def fill(self, plan: StaticDecodePlan, steps: Seq[SeqStep]) -> None:
        ps = self.cache.page_size
        plan.rows.copy_(decode_rows(steps, plan.size, ps))
        npages, last, indices = [], [], []
        for s in steps:
            kv = s.cached + 1
            n = -(-kv // ps)
            npages.append(n)
            last.append(kv - (n - 1) * ps)
            indices.extend(s.pages[:n])
        # Padding rows read one token of the first real row's first page: a read, never a write.
        for _ in range(plan.size - len(steps)):
            npages.append(1)
            last.append(1)
            indices.append(steps[0].pages[0])
        layout = self.cache.layout
        plan.wrapper.plan(_indptr(npages), torch.tensor(indices, dtype=torch.int32),
                          torch.tensor(last, dtype=torch.int32), self.num_qo_heads,
                          layout.num_kv_heads, layout.head_dim, ps,
                          q_data_type=layout.dtype, kv_data_type=layout.dtype)

    def prepare(self, plan: StaticDecodePlan) -> None:
        """Nothing to derive inside the graph: the wrapper's buffers are the plan."""

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               plan: StaticDecodePlan, scale: Optional[float] = None) -> torch.Tensor:
        if scale is not None and not math.isclose(scale, self.default_scale, rel_tol=1e-6):
            raise ValueError(f"CUDA-graph decode with FlashInfer uses the default softmax scale "
                             f"1/sqrt(head_dim); got scale={scale}. Disable cuda_graphs")
        kc, vc = self.cache.k[layer], self.cache.v[layer]
        hkv, d = kc.shape[2], kc.shape[3]
        kc.view(-1, hkv, d)[plan.w_slot] = k[plan.w_src]
        vc.view(-1, hkv, d)[plan.w_slot] = v[plan.w_src]
        return plan.wrapper.run(q.contiguous(), (kc, vc))

"""Attention over the paged KV cache: masks, the per-step plan and the torch backend.

Every sequence in a step brings ``new`` tokens (queries) at positions ``cached .. cached+new-1``;
its keys are the ``cached`` tokens already in its pages followed by the new tokens themselves.
New tokens are written to the pages only when the work persists them, so a walk can read a
prefix without changing it (flow-matching steps, rollouts from a shared context).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence as Seq

import torch
import torch.nn.functional as F

from mstar_rt.engines.paged_kv import PagedKVCache


@dataclass(frozen=True)
class Causal:
    """Each token sees itself and every earlier token."""

    def allowed(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        return k[None, :] <= q[:, None]


@dataclass(frozen=True)
class PrefixBidirectional:
    """Tokens at positions below ``prefix`` see each other both ways (an image and prompt
    prefix); later tokens are causal and see the whole prefix."""

    prefix: int

    def allowed(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        return (k[None, :] <= q[:, None]) | (k[None, :] < self.prefix)


@dataclass(frozen=True)
class BlockCausal:
    """Tokens come in blocks of ``block`` (video frames, action chunks): a token sees its whole
    block and every earlier block. ``start`` shifts where block 0 begins (a text prefix before
    the frames is causal)."""

    block: int
    start: int = 0

    def allowed(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        qb = torch.div(q - self.start, self.block, rounding_mode="floor")
        kb = torch.div(k - self.start, self.block, rounding_mode="floor")
        causal = k[None, :] <= q[:, None]
        in_frames = (q[:, None] >= self.start) & (k[None, :] >= self.start)
        return causal | (in_frames & (kb[None, :] <= qb[:, None]))


MaskSpec = "Causal | PrefixBidirectional | BlockCausal"
CAUSAL = Causal()


@dataclass
class SeqStep:
    """One sequence's part of a step, as the backend sees it."""

    cached: int                  # tokens readable from the pages
    new: int                     # tokens this step computes (queries)
    pages: list[int]             # block table (covers at least cached (+ new if persist))
    persist: bool = True         # write the new tokens' K/V into the pages
    mask: object = CAUSAL


class StepPlan:
    """Index tensors for one step, built once and used by every layer."""

    def __init__(self, steps: Seq[SeqStep], cache: PagedKVCache) -> None:
        device = cache.layout.device
        ps = cache.page_size
        self.steps = list(steps)
        self.num_tokens = sum(s.new for s in steps)
        b = len(steps)
        self.max_new = max_new = max(s.new for s in steps)
        self.max_cached = max_cached = max(s.cached for s in steps)
        positions, q_index = [], torch.zeros(b, max_new, dtype=torch.long)
        q_valid = torch.zeros(b, max_new, dtype=torch.bool)
        c_slots = torch.zeros(b, max_cached, dtype=torch.long)
        mask = torch.zeros(b, 1, max_new, max_cached + max_new, dtype=torch.bool)
        w_tok, w_slot = [], []
        offset = 0
        for i, s in enumerate(steps):
            pages = torch.tensor(s.pages, dtype=torch.long)
            pos = torch.arange(s.cached, s.cached + s.new)
            positions.append(pos)
            q_index[i, : s.new] = torch.arange(offset, offset + s.new)
            q_valid[i, : s.new] = True
            if s.cached:
                cpos = torch.arange(s.cached)
                c_slots[i, : s.cached] = pages[cpos // ps] * ps + cpos % ps
                mask[i, 0, : s.new, : s.cached] = s.mask.allowed(pos, cpos)
            mask[i, 0, : s.new, max_cached: max_cached + s.new] = s.mask.allowed(pos, pos)
            mask[i, 0, s.new:, max_cached] = True  # padding rows: anything but all-masked (NaN)
            if s.persist:
                w_tok.append(torch.arange(offset, offset + s.new))
                w_slot.append(pages[pos // ps] * ps + pos % ps)
            offset += s.new
        self.positions = torch.cat(positions).to(device)
        self.q_index = q_index.to(device)
        self.q_valid = q_valid.to(device)
        self.c_slots = c_slots.to(device)
        self.mask = mask.to(device)
        self.w_tok = torch.cat(w_tok).to(device) if w_tok else None
        self.w_slot = torch.cat(w_slot).to(device) if w_slot else None
        self.last_token = (torch.tensor([s.new for s in steps]).cumsum(0) - 1).to(device)


class TorchAttention:
    """Paged gather + ``scaled_dot_product_attention`` with an explicit mask; CPU and CUDA."""

    name = "torch"

    def __init__(self, cache: PagedKVCache) -> None:
        check_dtype(self.name, cache.layout.dtype, cache.layout.device)
        self.cache = cache

    def plan(self, steps: Seq[SeqStep]) -> StepPlan:
        return StepPlan(steps, self.cache)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               plan: StepPlan, scale: Optional[float] = None) -> torch.Tensor:
        """q ``[T, Hq, D]``, k/v ``[T, Hkv, D]`` for the step's new tokens (flat, sequence after
        sequence) -> ``[T, Hq, D]``. Writes persisted K/V into the pages."""
        kc, vc = self.cache.k[layer], self.cache.v[layer]
        hkv, d = kc.shape[2], kc.shape[3]
        if plan.w_tok is not None:
            kc.view(-1, hkv, d)[plan.w_slot] = k[plan.w_tok]
            vc.view(-1, hkv, d)[plan.w_slot] = v[plan.w_tok]
        keys = torch.cat([kc.view(-1, hkv, d)[plan.c_slots], k[plan.q_index]], dim=1)
        values = torch.cat([vc.view(-1, hkv, d)[plan.c_slots], v[plan.q_index]], dim=1)
        queries = q[plan.q_index]  # [B, max_new, Hq, D]
        out = F.scaled_dot_product_attention(
            queries.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),
            attn_mask=plan.mask, scale=scale, enable_gqa=q.shape[1] != hkv)
        return out.transpose(1, 2)[plan.q_valid]


_SUPPORTED = {
    "torch": {"cpu": (torch.float32, torch.bfloat16),
              "cuda": (torch.float32, torch.float16, torch.bfloat16)},
    "flashinfer": {"cuda": (torch.float16, torch.bfloat16)},
}


def check_dtype(backend: str, dtype: torch.dtype, device: str) -> None:
    """Raises a ValueError naming what to change when ``backend`` cannot run ``dtype`` on
    ``device``."""
    kind = torch.device(device).type
    ok = _SUPPORTED.get(backend, {}).get(kind)
    if ok is None:
        where = ", ".join(_SUPPORTED.get(backend, {})) or "nowhere"
        raise ValueError(f"the {backend} attention backend does not run on {kind} (it runs on "
                         f"{where}); pick attention_backend='torch' or move the model")
    if dtype not in ok:
        names = ", ".join(str(t).removeprefix("torch.") for t in ok)
        raise ValueError(f"the {backend} attention backend cannot run "
                         f"{str(dtype).removeprefix('torch.')} on {kind}; load the model as one "
                         f"of: {names}")

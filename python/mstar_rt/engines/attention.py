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


class _Mask:
    """A mask is a rule over query and key positions. ``rule`` broadcasts (``q[..., Q, 1]``
    against ``k[..., 1, K]``) so a step builds the masks of many sequences at once."""

    def rule(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def allowed(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """``[Q, K]``: may the query at position ``q[i]`` see the key at position ``k[j]``."""
        return self.rule(q[:, None], k[None, :])


@dataclass(frozen=True)
class Causal(_Mask):
    """Each token sees itself and every earlier token."""

    def rule(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        return k <= q


@dataclass(frozen=True)
class PrefixBidirectional(_Mask):
    """Tokens at positions below ``prefix`` see each other both ways (an image and prompt
    prefix); later tokens are causal and see the whole prefix."""

    prefix: int

    def rule(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        return (k <= q) | (k < self.prefix)


@dataclass(frozen=True)
class BlockCausal(_Mask):
    """Tokens come in blocks of ``block`` (video frames, action chunks): a token sees its whole
    block and every earlier block. ``start`` shifts where block 0 begins (a text prefix before
    the frames is causal)."""

    block: int
    start: int = 0

    def rule(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        qb = torch.div(q - self.start, self.block, rounding_mode="floor")
        kb = torch.div(k - self.start, self.block, rounding_mode="floor")
        in_frames = (q >= self.start) & (k >= self.start)
        return (k <= q) | (in_frames & (kb <= qb))


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
    """Index tensors for one step, built once (vectorized over sequences) and used by every
    layer: where each new token's query sits in a ``[B, max_new]`` grid, which cache slots hold
    each sequence's cached keys, the ``[B, 1, max_new, max_cached + max_new]`` mask, and the
    slots persisted K/V go to."""

    def __init__(self, steps: Seq[SeqStep], cache: PagedKVCache) -> None:
        device = cache.layout.device
        ps = cache.page_size
        self.steps = list(steps)
        b = len(steps)
        cached = torch.tensor([s.cached for s in steps], dtype=torch.long)
        new = torch.tensor([s.new for s in steps], dtype=torch.long)
        self.num_tokens = t = int(new.sum())
        self.max_new = max_new = int(new.max())
        self.max_cached = max_cached = int(cached.max())
        starts = new.cumsum(0) - new
        seq_of = torch.repeat_interleave(torch.arange(b), new)
        offset_in_seq = torch.arange(t) - starts[seq_of]
        positions = cached[seq_of] + offset_in_seq

        j = torch.arange(max_new)
        q_valid = j[None, :] < new[:, None]
        q_index = torch.where(q_valid, starts[:, None] + j[None, :], 0)
        qpos = cached[:, None] + j[None, :]                         # [B, max_new]

        width = max(1, max(len(s.pages) for s in steps))
        table = torch.zeros(b, width, dtype=torch.long)
        for i, s in enumerate(steps):
            if s.pages:
                table[i, : len(s.pages)] = torch.tensor(s.pages, dtype=torch.long)
        cpos = torch.arange(max_cached)
        c_valid = cpos[None, :] < cached[:, None]                  # [B, max_cached]
        c_slots = torch.where(c_valid, table[:, cpos // ps] * ps + cpos % ps, 0)

        # Keys: the cached ones (positions 0..max_cached-1), then the new ones (= query grid).
        kpos = torch.cat([cpos.expand(b, max_cached), qpos], dim=1)
        kvalid = torch.cat([c_valid, q_valid], dim=1)
        mask = torch.zeros(b, max_new, max_cached + max_new, dtype=torch.bool)
        by_rule: dict[object, list[int]] = {}
        for i, s in enumerate(steps):
            by_rule.setdefault(s.mask, []).append(i)
        for rule, rows in by_rule.items():
            idx = torch.tensor(rows)
            mask[idx] = rule.rule(qpos[idx][:, :, None], kpos[idx][:, None, :])
        mask &= kvalid[:, None, :] & q_valid[:, :, None]
        # Padding query rows must see something, or softmax over nothing gives NaN.
        mask[:, :, max_cached] |= ~q_valid

        persist = torch.tensor([s.persist for s in steps], dtype=torch.bool)
        w_tok = torch.nonzero(persist[seq_of]).flatten()
        self.positions = positions.to(device)
        self.q_index = q_index.to(device)
        self.q_valid = q_valid.to(device)
        self.c_slots = c_slots.to(device)
        self.mask = mask[:, None].to(device)
        if w_tok.numel():
            wpos = positions[w_tok]
            self.w_tok = w_tok.to(device)
            self.w_slot = (table[seq_of[w_tok], wpos // ps] * ps + wpos % ps).to(device)
        else:
            self.w_tok = self.w_slot = None
        self.last_token = (starts + new - 1).to(device)


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

"""The torch attention backend: paged gather + ``scaled_dot_product_attention`` on any device.

Every sequence in a step brings ``new`` tokens (queries) at positions ``cached .. cached+new-1``;
its keys are the ``cached`` tokens already in its pages followed by the new tokens themselves.
New tokens are written to the pages only when the work persists them, so a walk can read a
prefix without changing it (flow-matching steps, rollouts from a shared context). The reference
the FlashInfer backend is checked against.
"""

from __future__ import annotations

from typing import Optional, Sequence as Seq

import torch
import torch.nn.functional as F

from mstar_rt.engines.attention_base import SeqStep, StaticDecodePlan, check_dtype, decode_rows
from mstar_rt.engines.paged_kv import PagedKVCache

# The torch static plan gathers max_seq_len keys per row and layer; beyond this many tokens the
# padded gather costs more than the launches a graph saves, so longer sequences decode eagerly.
TORCH_STATIC_MAX_LEN = 2048


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

    def static_decode(self, num_qo_heads: int, max_seq_len: int) -> "StaticTorchDecode":
        """Capped at :data:`TORCH_STATIC_MAX_LEN` (longer sequences then decode eagerly)."""
        return StaticTorchDecode(self.cache, min(max_seq_len, TORCH_STATIC_MAX_LEN))

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

"""The sparse mixture-of-experts feed-forward of Qwen3-Omni's thinker and talker.

A softmax router picks ``top_k`` of ``E`` SwiGLU experts per token; the thinker renormalises the
chosen probabilities (``norm_topk_prob``), the talker does not and adds a shared expert scaled by
a sigmoid gate. The experts live fused in memory (``gate_up_proj`` ``[E, 2I, H]``, gate rows
first, and ``down_proj`` ``[E, H, I]``, both in ``nn.Linear``'s ``[out, in]`` convention, as
transformers keeps them) so one sort groups a ragged batch's tokens by expert and each expert
runs one matmul over all of its tokens, whatever request they belong to.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn
from torch.nn import functional as F


class SwiGLU(nn.Module):
    """A dense ``down(silu(gate(x)) * up(x))`` block: the dense layers' MLP and the talker's
    shared expert (HF names ``gate_proj``, ``up_proj``, ``down_proj``)."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class FusedExperts(nn.Module):
    """``E`` SwiGLU experts in two stacked tensors, run grouped by expert."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, first: int = 0,
                 routed: Optional[int] = None) -> None:
        super().__init__()
        self.num_experts, self.intermediate = num_experts, intermediate
        # Expert parallelism: these are routed experts [first, first + num_experts) of
        # ``routed``; tokens routed elsewhere are another rank's (their share here is zero).
        self.first, self.routed = first, num_experts if routed is None else routed
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate))

    def forward(self, x: torch.Tensor, experts: torch.Tensor,
                weights: torch.Tensor) -> torch.Tensor:
        """``x`` ``[T, H]``; ``experts`` and ``weights`` ``[T, k]`` (the router's choice) ->
        ``[T, H]``, the weighted sum of each token's experts."""
        k = experts.shape[1]
        flat = experts.reshape(-1)
        pairs = None
        if self.num_experts != self.routed:  # only the (token, slot) pairs routed here
            flat = flat - self.first
            pairs = ((flat >= 0) & (flat < self.num_experts)).nonzero().squeeze(1)
            if not pairs.numel():  # none: its share is zero (and a grouped GEMM of no rows)
                return torch.zeros_like(x)
            flat = flat[pairs]
        order = flat.argsort(stable=True)            # (token, slot) pairs grouped by expert
        if pairs is not None:
            order = pairs[order]
        tokens = order // k
        counts = torch.bincount(flat, minlength=self.num_experts)
        h = self._grouped(x[tokens], counts)
        h = h * weights.reshape(-1)[order, None].to(h.dtype)
        return torch.zeros_like(x).index_add_(0, tokens, h.to(x.dtype))

    def _grouped(self, xs: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Rows of ``xs`` come grouped by expert, ``counts[e]`` rows for expert ``e``."""
        if _grouped_mm_fits(xs, self.gate_up_proj):
            offsets = counts.cumsum(0).to(torch.int32)
            assert _GROUPED_MM is not None
            gu = _GROUPED_MM(xs, self.gate_up_proj.transpose(1, 2), offs=offsets)
            gate, up = gu.split(self.intermediate, dim=-1)
            return _GROUPED_MM(F.silu(gate) * up, self.down_proj.transpose(1, 2), offs=offsets)
        # One host sync for the counts; then one matmul per expert that got tokens (never a
        # loop over tokens). Faster than grouped_mm on CPU, where that op is a reference loop.
        out = xs.new_empty(xs.shape[0], self.down_proj.shape[1])
        start = 0
        for e, n in enumerate(counts.tolist()):
            if n:
                rows = xs[start:start + n]
                gate, up = F.linear(rows, self.gate_up_proj[e]).split(self.intermediate, dim=-1)
                out[start:start + n] = F.linear(F.silu(gate) * up, self.down_proj[e])
                start += n
        return out


#: torch's grouped GEMM (``F.grouped_mm`` in recent torch, ``torch._grouped_mm`` before).
_GROUPED_MM = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def _grouped_mm_fits(xs: torch.Tensor, w: torch.Tensor) -> bool:
    """The grouped GEMM runs the whole dispatch in two kernels with no host sync (so a CUDA
    graph can capture it), but only on CUDA (sm80+) in bf16 with 16-byte aligned rows; on the
    CPU it is a reference loop, slower than ours."""
    return (_GROUPED_MM is not None and xs.is_cuda and xs.dtype == torch.bfloat16
            and w.shape[1] % 16 == 0 and w.shape[2] % 16 == 0
            and torch.cuda.get_device_capability(xs.device) >= (8, 0))


class SparseMoE(nn.Module):
    """Router (``gate``), fused experts and, for the talker, ``shared_expert`` with its
    ``shared_expert_gate``; names follow the HF checkpoints, except the fused experts."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, intermediate: int,
                 norm_topk_prob: bool, shared_intermediate: int = 0,
                 block: Optional[tuple[int, int]] = None) -> None:
        """``block``: ``[start, stop)`` of the routed experts this one holds (expert
        parallelism: the router stays whole), else all of them."""
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok {top_k} must be in [1, num_experts "
                             f"{num_experts}]")
        self.top_k, self.norm_topk_prob = top_k, norm_topk_prob
        self.gate = nn.Linear(hidden, num_experts, bias=False)
        start, stop = block or (0, num_experts)
        self.experts = FusedExperts(stop - start, hidden, intermediate, start, num_experts)
        self.shared_expert: Optional[SwiGLU] = None
        if shared_intermediate:
            self.shared_expert = SwiGLU(hidden, shared_intermediate)
            self.shared_expert_gate = nn.Linear(hidden, 1, bias=False)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(experts [T, k], weights [T, k])``: the top-k of a float32 softmax, renormalised
        to sum to one when ``norm_topk_prob``, in ``x``'s dtype."""
        logits = self.gate(x)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, experts = probs.topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return experts, weights.to(logits.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        experts, weights = self.route(x)
        out = self.experts(x, experts, weights)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out

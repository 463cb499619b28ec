"""Which share of a tensor-parallel model one rank holds, and whether a model splits that way.

Megatron-style: attention heads (query and KV alike) and MLP columns are divided evenly over
``size`` ranks; each rank's output projections (``o_proj``, ``down_proj``) produce partial sums
that ``reduce`` adds up across ranks. Embeddings, norms and the LM head are replicated. A
mixture of experts may split by whole experts instead (expert parallelism, ``experts``): each
rank holds an even block of them, and its partial sum is its experts' share of each token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch


@dataclass(frozen=True)
class TensorSplit:
    """Rank ``rank`` of ``size``; ``reduce`` sums a tensor over the ranks in place and returns
    it (None when ``size`` is 1: nothing to sum); ``experts``: the routed experts of each MoE
    layer, when they split by whole experts (0: every expert's columns split)."""

    rank: int = 0
    size: int = 1
    reduce: Optional[Callable[[torch.Tensor], torch.Tensor]] = None
    experts: int = 0

    def part(self, total: int) -> tuple[int, int]:
        """``[start, stop)`` of this rank's even share of ``total`` rows."""
        share = total // self.size
        return self.rank * share, (self.rank + 1) * share

    def expert_block(self) -> Optional[tuple[int, int]]:
        """``[start, stop)`` of the routed experts this rank holds whole (None: no expert
        parallelism, every rank holds every expert's share of the columns)."""
        return self.part(self.experts) if self.experts else None


WHOLE = TensorSplit()


def check_split(heads: int, kv_heads: int, intermediate: int, tp_size: int,
                source: str = "the model") -> None:
    """Raises a ValueError naming the fix when ``tp_size`` does not divide the query heads, the
    KV heads and the MLP width of ``source`` (each rank must hold whole heads, and as many as
    every other rank)."""
    if type(tp_size) is not int or tp_size < 1:
        raise ValueError(f"tp_size must be a positive integer, not {tp_size!r}")
    sizes = {"num_attention_heads": heads, "num_key_value_heads": kv_heads,
             "intermediate_size": intermediate}
    bad = {k: v for k, v in sizes.items() if v % tp_size}
    if bad:
        fits = [n for n in range(1, max(heads, 1) + 1)
                if all(v % n == 0 for v in sizes.values())]
        shown = ", ".join(f"{k} {v}" for k, v in bad.items())
        raise ValueError(f"tp_size {tp_size} does not divide {shown} of {source}: every rank "
                         f"must hold an equal share of whole heads and MLP columns; use a "
                         f"tp_size that divides all of {sizes} (one of {fits})")

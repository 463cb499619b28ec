"""Attention masks: which keys each new token of a sequence may see, as a rule over query and
key positions. A :class:`~mstar_rt.engines.kv_engine.KVWork` carries one; the attention backend
applies it (models pick them: a VLA's bidirectional prefix, a world model's frame blocks).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


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


CAUSAL = Causal()

__all__ = ["CAUSAL", "BlockCausal", "Causal", "PrefixBidirectional"]

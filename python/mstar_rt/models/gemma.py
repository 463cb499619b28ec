"""Gemma decoder layers as pi0 and pi0.5 run them: PaliGemma's language model (the backbone)
and the action expert, several of them in one attention call (pi0's shared attention).

Numerics follow ``transformers``' Gemma as LeRobot runs it: RMSNorm ``x / rms(x) * (1 + w)``
with the mean square in float32; GeGLU MLP with the tanh GELU; rotary positions with the halves
rotated (theta 10000); attention scaled by ``head_dim ** -0.5``, one KV head shared by every
query head. pi0.5's expert replaces each norm's weight by an adaptive RMSNorm: ``dense(cond)``
gives scale, shift and gate, the norm is ``x / rms(x) * (1 + scale) + shift`` and the residual
adds ``y * gate``.

Tokens lie flat, ``[T, width]``, several requests one after another; attention goes through any
object with a method ``attend(layer, q, k, v)`` over those tokens (a KV-engine step, or a dense
reference), so one piece of code runs both the served walks and the reference.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence, cast

import torch
import torch.nn.functional as F
from torch import nn

from mstar_rt.models.rope import RopeConfig, Rotary
from mstar_rt.models.siglip import gelu_tanh


@dataclass(frozen=True)
class GemmaSizes:
    width: int
    depth: int
    mlp_dim: int
    num_heads: int
    num_kv_heads: int
    head_dim: int


#: The two sizes LeRobot's pi0 / pi0.5 configs may name (openpi's ``gemma.get_config``).
GEMMA_VARIANTS = {
    "gemma_2b": GemmaSizes(width=2048, depth=18, mlp_dim=16384, num_heads=8, num_kv_heads=1,
                           head_dim=256),
    "gemma_300m": GemmaSizes(width=1024, depth=18, mlp_dim=4096, num_heads=8, num_kv_heads=1,
                             head_dim=256),
}


@dataclass
class Cond:
    """An adaptive-norm condition: one vector per request ``values [B, D]`` and the request of
    each flat token ``rows [T]`` (the dense layer runs once per request, not per token)."""

    values: torch.Tensor
    rows: torch.Tensor


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm (``weight``), or with ``cond_dim`` the adaptive one (``dense``).
    ``forward(x, cond)`` returns the normed tokens and the residual gate (None without cond)."""

    def __init__(self, dim: int, eps: float = 1e-6, cond_dim: Optional[int] = None) -> None:
        super().__init__()
        self.eps = eps
        if cond_dim is None:
            self.weight = nn.Parameter(torch.zeros(dim))
            self.dense = None
        else:
            self.dense = nn.Linear(cond_dim, 3 * dim)

    def forward(self, x: torch.Tensor, cond: Optional[Cond] = None
                ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        if self.dense is None and x.dtype == torch.float32:  # one fused op, the same numbers
            return F.rms_norm(x, x.shape[-1:], 1.0 + self.weight, self.eps), None
        var = x.float().square().mean(-1, keepdim=True)
        normed = x * torch.rsqrt(var + self.eps)  # float32
        if self.dense is None:
            return (normed * (1.0 + self.weight.float())).to(x.dtype), None
        if cond is None:
            raise ValueError("an adaptive RMSNorm needs its condition (pi0.5's flow time)")
        scale, shift, gate = self.dense(cond.values)[cond.rows].chunk(3, dim=-1)
        return (normed * (1 + scale.float()) + shift.float()).to(x.dtype), gate.to(x.dtype)


def _residual(x: torch.Tensor, y: torch.Tensor, gate: Optional[torch.Tensor]) -> torch.Tensor:
    return x + y if gate is None else x + y * gate


class GemmaAttention(nn.Module):
    def __init__(self, s: GemmaSizes) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = s.num_heads, s.num_kv_heads, s.head_dim
        self.q_proj = nn.Linear(s.width, s.num_heads * s.head_dim, bias=False)
        self.k_proj = nn.Linear(s.width, s.num_kv_heads * s.head_dim, bias=False)
        self.v_proj = nn.Linear(s.width, s.num_kv_heads * s.head_dim, bias=False)
        self.o_proj = nn.Linear(s.num_heads * s.head_dim, s.width, bias=False)


class GemmaMLP(nn.Module):
    def __init__(self, s: GemmaSizes) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(s.width, s.mlp_dim, bias=False)
        self.up_proj = nn.Linear(s.width, s.mlp_dim, bias=False)
        self.down_proj = nn.Linear(s.mlp_dim, s.width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(gelu_tanh(self.gate_proj(x), self.up_proj(x)))


class GemmaLayer(nn.Module):
    """One decoder layer, split around its attention so several layers can share one call."""

    def __init__(self, s: GemmaSizes, eps: float, cond_dim: Optional[int]) -> None:
        super().__init__()
        self.input_layernorm = GemmaRMSNorm(s.width, eps, cond_dim)
        self.self_attn = GemmaAttention(s)
        self.post_attention_layernorm = GemmaRMSNorm(s.width, eps, cond_dim)
        self.mlp = GemmaMLP(s)

    def attention_inputs(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                         cond: Optional[Cond], queries: bool = True) -> tuple[Any, ...]:
        """``x [T, width]`` -> q ``[T, heads, D]`` (None unless ``queries``), k, v ``[T,
        kv_heads, D]`` (rotated by the tables of :func:`rope_tables`) and the gate of the
        attention residual."""
        a = self.self_attn
        h, gate = self.input_layernorm(x, cond)
        t = x.shape[0]
        q = rotate(a.q_proj(h).view(t, a.heads, a.head_dim), cos, sin) if queries else None
        k = rotate(a.k_proj(h).view(t, a.kv_heads, a.head_dim), cos, sin)
        v = a.v_proj(h).view(t, a.kv_heads, a.head_dim)
        return q, k, v, gate

    def finish(self, x: torch.Tensor, attn: torch.Tensor, gate: Optional[torch.Tensor],
               cond: Optional[Cond]) -> torch.Tensor:
        """The rest of the layer after attention (``attn [T, heads, D]``)."""
        x = _residual(x, self.self_attn.o_proj(attn.reshape(x.shape[0], -1)), gate)
        h, gate = self.post_attention_layernorm(x, cond)
        return _residual(x, self.mlp(h), gate)


class GemmaStack(nn.Module):
    """Decoder layers and the final norm (and, for the backbone, the token embedding)."""

    def __init__(self, s: GemmaSizes, eps: float = 1e-6, vocab_size: Optional[int] = None,
                 cond_dim: Optional[int] = None) -> None:
        super().__init__()
        self.sizes = s
        if vocab_size is not None:
            self.embed_tokens = nn.Embedding(vocab_size, s.width)
        self.layers = nn.ModuleList(GemmaLayer(s, eps, cond_dim) for _ in range(s.depth))
        self.norm = GemmaRMSNorm(s.width, eps, cond_dim)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Gemma's scaled embedding: ``embed_tokens(ids) * sqrt(width)``, the scale rounded to
        the weights' dtype first as transformers does."""
        w = self.embed_tokens.weight
        return self.embed_tokens(ids) * torch.tensor(self.sizes.width ** 0.5, dtype=w.dtype,
                                                     device=w.device)


@dataclass
class Stream:
    """Tokens ``x [Ti, width]`` that ``stack`` runs, at rows ``rows`` of the step's flat tokens
    (None: all of them, in order), with an adaptive-norm condition for pi0.5's expert."""

    stack: GemmaStack
    x: torch.Tensor
    rows: Optional[torch.Tensor] = None
    cond: Optional[Cond] = None


def make_rope(head_dim: int, theta: float = 10000.0) -> Rotary:
    return Rotary(RopeConfig(theta=theta), head_dim)


def rope_tables(rope: Rotary, positions: torch.Tensor, dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """``positions``' cos ``[T, 1, D]`` and sin with its first half negated, for
    :func:`rotate`."""
    cos, sin = rope.tables(positions, dtype)
    half = sin.shape[-1] // 2
    return cos, torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)


def rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding with the halves rotated, ``x cos + [-x2, x1] sin``, as ``x cos +
    [x2, x1] [-sin1, sin2]``: a roll and one fused multiply-add instead of slices, a negation, a
    concatenation and two more ops."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, -1), signed_sin)


def run_streams(streams: Sequence[Stream], positions: torch.Tensor, attend: Any, rope: Rotary,
                final: bool = True, tables: Optional[tuple] = None
                ) -> list[Optional[torch.Tensor]]:
    """Runs the streams' stacks layer by layer, all their tokens in one attention call per layer
    (``attend.attend(layer, q, k, v)`` over ``positions.numel()`` flat tokens; with several
    streams each gives its ``rows``). Returns each stream's final-normed hidden states; with
    ``final=False`` only the keys and values matter (a prefix written to a cache): the last
    layer stops after its attention and None is returned. ``tables``: :func:`rope_tables` of
    ``positions`` if the caller keeps them (every flow step of a chunk has the same positions)."""
    total = positions.numel()
    cos, sin = tables if tables is not None else rope_tables(rope, positions, streams[0].x.dtype)
    tables = [(cos, sin) if s.rows is None else (cos[s.rows], sin[s.rows]) for s in streams]
    depth = len(streams[0].stack.layers)
    xs = [s.x for s in streams]
    for li in range(depth):
        layers = [cast(GemmaLayer, s.stack.layers[li]) for s in streams]
        kv_only = li == depth - 1 and not final
        parts = [layer.attention_inputs(x, c, si, s.cond, queries=not kv_only)
                 for layer, s, x, (c, si) in zip(layers, streams, xs, tables)]
        if len(streams) == 1 and streams[0].rows is None:
            q, k, v, _gate = parts[0]
        else:
            k, v = (_scatter([p[i] for p in parts], streams, total) for i in (1, 2))
            q = None if kv_only else _scatter([p[0] for p in parts], streams, total)
        if kv_only:
            # Only the writes of k and v matter here: the keys stand in for the queries (one
            # head per KV head), which spares the query projection and most of the attention.
            attend.attend(li, k, k, v)
            return [None] * len(streams)
        out = attend.attend(li, q, k, v)
        xs = [layer.finish(x, out if s.rows is None else out[s.rows], p[3], s.cond)
              for layer, s, x, p in zip(layers, streams, xs, parts)]
    return [s.stack.norm(x, s.cond)[0] for s, x in zip(streams, xs)]


def _scatter(pieces: list[torch.Tensor], streams: Sequence[Stream], total: int) -> torch.Tensor:
    first = pieces[0]
    out = first.new_empty((total,) + tuple(first.shape[1:]))
    for p, s in zip(pieces, streams):
        out[s.rows] = p
    return out

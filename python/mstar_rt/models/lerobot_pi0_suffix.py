"""The flow steps' attention over a cached prefix, set up once per action chunk instead of once
per step.

Every Euler step of a chunk reads the same prefix keys and values (the ``action_gen`` walk never
writes them), at the same positions. So each request's prefix K/V is copied out of its pages
once, at its first step (:func:`prefix_snapshot`, the cache's own ``export_sequence``), and a
batch of requests gets a :class:`SuffixAttention`: per layer one contiguous key and value buffer
``[B, kv_heads, prefix + chunk, head_dim]`` holding the prefixes, whose tail each step overwrites
with the action tokens' own keys and values; the positions and rotary tables of the action
tokens; and a key mask only when the prefixes differ in length. The buffers are reused for as
long as the batch holds the same requests (every step of a chunk, in the common case). The cost
is memory: while a request's flow steps run, its prefix K/V exists three times (its pages, its
snapshot, its rows of the batch's buffers); both copies go when its chunk is done.

The action tokens see every valid prefix token and every action token of their own chunk, and
nothing else (LeRobot's suffix mask), so which query comes first does not matter: with one KV
head (pi0's Gemma) the query heads are folded into the query length, a view of the flat tokens,
and one attention call per layer serves the whole batch without a copy of the queries.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
import torch.nn.functional as F

from mstar_rt.engines.kv_engine import KVStep
from mstar_rt.models.gemma import rope_tables


def prefix_snapshot(step: KVStep, request_id: int) -> Optional[torch.Tensor]:
    """The request's cached K/V ``[layers, 2, length, kv_heads, head_dim]`` (a copy), or None
    where the cache cannot hand it out (a tensor-parallel share): the step then attends through
    the engine."""
    cache = getattr(step.backend, "cache", None)
    if cache is None or cache.copy_log is not None:
        return None
    return cache.export_sequence(request_id, "main").data


class SuffixAttention:
    """``attend(layer, q, k, v)`` for ``chunk`` action tokens in each of ``slots`` requests over
    their prefix snapshots (:meth:`fill`), prefixes up to ``longest`` tokens; also the tokens'
    ``positions``, ``rows`` and rotary ``tables``, and ``key``, whatever identifies the batch to
    its owner. ``like``: a snapshot, for the layer count, head sizes, dtype and device.

    ``static``: every buffer keeps its shape and address across fills (a CUDA graph replays over
    them): the key mask always exists, and slots past the batch's requests see only their own
    action tokens. Otherwise the mask exists only when the prefixes differ in length."""

    def __init__(self, slots: int, longest: int, chunk: int, like: torch.Tensor, rope: Any,
                 dtype: torch.dtype, static: bool = False) -> None:
        layers, _two, _n, hkv, d = like.shape
        self.batch, self.longest, self.chunk, self.static = slots, longest, chunk, static
        self.kv_heads, self.head_dim, self.rope, self.dtype = hkv, d, rope, dtype
        self.key: Any = None
        dev = like.device
        shape = (slots, hkv, longest + chunk, d)
        self.k = [like.new_zeros(shape) for _ in range(layers)]
        self.v = [like.new_zeros(shape) for _ in range(layers)]
        self.mask: Optional[torch.Tensor] = (
            torch.ones((slots, 1, 1, longest + chunk), dtype=torch.bool, device=dev)
            if static else None)
        self.positions = torch.zeros(slots * chunk, dtype=torch.long, device=dev)
        self.rows = torch.arange(slots, device=dev).repeat_interleave(chunk)
        self.tables = rope_tables(rope, self.positions, dtype)

    def fits(self, prefixes: Sequence[torch.Tensor]) -> bool:
        return len(prefixes) <= self.batch and max(int(p.shape[2]) for p in prefixes) <= \
            self.longest

    def fill(self, key: Any, prefixes: Sequence[torch.Tensor]) -> "SuffixAttention":
        """Copies the requests' prefix snapshots in (request i in slot i) and sets their masks,
        positions and rotary tables."""
        lengths = [int(p.shape[2]) for p in prefixes]
        if not self.fits(prefixes):
            raise ValueError(f"{len(prefixes)} prefixes of up to {max(lengths)} tokens do not fit "
                             f"{self.batch} slots of {self.longest}")
        for i, p in enumerate(prefixes):
            n = lengths[i]
            for layer in range(len(self.k)):
                self.k[layer][i, :, :n] = p[layer, 0].transpose(0, 1)
                self.v[layer][i, :, :n] = p[layer, 1].transpose(0, 1)
        dev, longest, chunk = self.positions.device, self.longest, self.chunk
        n = torch.tensor(lengths + [0] * (self.batch - len(lengths)), device=dev)
        kpos = torch.arange(longest + chunk, device=dev)
        # padded keys of the shorter prefixes (and of empty slots) are never seen
        mask = ((kpos[None, :] < n[:, None]) | (kpos[None, :] >= longest))[:, None, None]
        positions = (n[:, None] + torch.arange(chunk, device=dev)).reshape(-1)
        cos, sin = rope_tables(self.rope, positions, self.dtype)
        if self.static:
            assert self.mask is not None
            self.mask.copy_(mask)
            self.positions.copy_(positions)
            self.tables[0].copy_(cos)
            self.tables[1].copy_(sin)
        else:
            self.mask = mask if min(lengths) != longest else None
            self.positions, self.tables = positions, (cos, sin)
        self.key = key
        return self

    @staticmethod
    def over(key: Any, prefixes: Sequence[torch.Tensor], chunk: int, rope: Any,
             dtype: torch.dtype) -> "SuffixAttention":
        """Exactly the batch's size: its requests, keys as long as its longest prefix."""
        longest = max(int(p.shape[2]) for p in prefixes)
        return SuffixAttention(len(prefixes), longest, chunk, prefixes[0], rope,
                               dtype).fill(key, prefixes)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
               ) -> torch.Tensor:
        """q ``[B * chunk, heads, D]``, k/v ``[B * chunk, kv_heads, D]`` -> ``[B * chunk, heads,
        D]``."""
        b, h, hkv, d, n = self.batch, self.chunk, self.kv_heads, self.head_dim, self.longest
        kb, vb = self.k[layer], self.v[layer]
        kb[:, :, n:] = k.view(b, h, hkv, d).transpose(1, 2)
        vb[:, :, n:] = v.view(b, h, hkv, d).transpose(1, 2)
        heads = q.shape[1]
        if hkv == 1:
            out = F.scaled_dot_product_attention(q.view(b, 1, h * heads, d), kb, vb,
                                                 attn_mask=self.mask)
            return out.view(b * h, heads, d)
        out = F.scaled_dot_product_attention(q.view(b, h, heads, d).transpose(1, 2), kb, vb,
                                             attn_mask=self.mask, enable_gqa=heads != hkv)
        return out.transpose(1, 2).reshape(b * h, heads, d)

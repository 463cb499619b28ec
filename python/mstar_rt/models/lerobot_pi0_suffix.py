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
    """``attend(layer, q, k, v)`` for ``chunk`` action tokens per request over the requests'
    prefix snapshots; also the tokens' ``positions``, ``rows`` and rotary ``tables``. ``key``:
    whatever identifies the batch to its owner."""

    def __init__(self, key: tuple, prefixes: Sequence[torch.Tensor], chunk: int,
                 rope: Any, dtype: torch.dtype) -> None:
        self.key, self.chunk = key, chunk
        first = prefixes[0]
        layers, _two, _n, hkv, d = first.shape
        lengths = [int(p.shape[2]) for p in prefixes]
        b, longest = len(prefixes), max(lengths)
        self.batch, self.longest, self.kv_heads, self.head_dim = b, longest, hkv, d
        dev = first.device
        shape = (b, hkv, longest + chunk, d)
        self.k = [first.new_zeros(shape) for _ in range(layers)]
        self.v = [first.new_zeros(shape) for _ in range(layers)]
        for i, p in enumerate(prefixes):
            n = lengths[i]
            for layer in range(layers):
                self.k[layer][i, :, :n] = p[layer, 0].transpose(0, 1)
                self.v[layer][i, :, :n] = p[layer, 1].transpose(0, 1)
        self.mask: Optional[torch.Tensor] = None
        if min(lengths) != longest:  # padded keys of the shorter prefixes are never seen
            kpos = torch.arange(longest + chunk, device=dev)
            n = torch.tensor(lengths, device=dev)
            self.mask = ((kpos[None, :] < n[:, None]) | (kpos[None, :] >= longest))[:, None, None]
        offsets = torch.arange(chunk, device=dev)
        self.positions = (torch.tensor(lengths, device=dev)[:, None] + offsets).reshape(-1)
        self.rows = torch.arange(b, device=dev).repeat_interleave(chunk)
        self.tables = rope_tables(rope, self.positions, dtype)

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

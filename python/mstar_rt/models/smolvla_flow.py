"""SmolVLA's flow-step attention, set up once per action chunk instead of once per step.

Every Euler step of a chunk reads the same prefix: the self-attention layers of the expert
attend to the VLM's cached K/V of their layer (then causally to the action tokens), the
cross-attention layers to that K/V mapped by their own projections (``cross_kv``, made by the
prefix node). So each request's prefix K/V is copied out of its pages once, at its first step
(the cache's ``export_sequence``), and a batch of requests gets a :class:`FlowAttention`: per
self-attention layer one key and value buffer ``[B, kv_heads, prefix + chunk, head_dim]``
holding the prefixes, whose tail each step overwrites with the action tokens' own keys and
values; per cross-attention layer the requests' ``cross_kv`` padded into ``[B, kv_heads,
prefix, head_dim]``; the masks; the rotary tables of both position sets. Each step is then one
attention call per layer for the whole batch, with no gather from the pages and no padding.

``static``: every buffer keeps its shape and address across fills (prefixes padded to the
policy's longest, the masks always present), which is what a CUDA graph replays over.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

import torch
import torch.nn.functional as F

from mstar_rt.models.smolvla_layers import SmolVLAModule, rope_tables

#: One request's prefix as the flow steps read it: its cached K/V ``[layers, 2, n, kv_heads,
#: head_dim]`` and its ``cross_kv`` (layer -> (k, v) ``[n, kv_heads, head_dim]``).
Prefix = tuple[torch.Tensor, Mapping[int, tuple[torch.Tensor, torch.Tensor]]]


class FlowAttention:
    """``attend(layer, q, k, v)`` (self-attention layers) and ``self(layer, q)`` (cross
    layers) for ``chunk`` action tokens in each of ``slots`` requests, prefixes up to
    ``longest`` tokens; ``tables``: the rotary tables of the tokens' own positions (after their
    prefix) and of the cross positions (from 0). ``key``: whatever identifies the batch."""

    def __init__(self, slots: int, longest: int, chunk: int, layers: int, cross: Sequence[int],
                 kv_heads: int, head_dim: int, dtype: torch.dtype, device: Any,
                 static: bool = False) -> None:
        self.batch, self.longest, self.chunk, self.static = slots, longest, chunk, static
        self.head_dim, self.key = head_dim, None
        self.cross_layers = set(cross)
        own = (slots, kv_heads, longest + chunk, head_dim)
        other = (slots, kv_heads, longest, head_dim)

        def zeros(shape: tuple) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)

        self.k = {i: zeros(other if i in self.cross_layers else own) for i in range(layers)}
        self.v = {i: zeros(other if i in self.cross_layers else own) for i in range(layers)}
        self.own_mask = torch.ones((slots, 1, chunk, longest + chunk), dtype=torch.bool,
                                   device=device)
        self.cross_mask: Optional[torch.Tensor] = (
            torch.ones((slots, 1, 1, longest), dtype=torch.bool, device=device)
            if static else None)
        steps = torch.arange(chunk, device=device).repeat(slots)
        cross_tables = rope_tables(steps, head_dim)  # positions from 0 in every request
        # the own positions' tables: set by fill (in place when static)
        own = tuple(torch.empty_like(t) for t in cross_tables) if static else cross_tables
        self.tables = (own, cross_tables)
        self.rows = torch.arange(slots, device=device).repeat_interleave(chunk)

    def fits(self, prefixes: Sequence[Prefix]) -> bool:
        return len(prefixes) <= self.batch and max(int(kv.shape[2]) for kv, _c in prefixes) <= \
            self.longest

    def fill(self, key: Any, prefixes: Sequence[Prefix]) -> "FlowAttention":
        """Copies the requests' prefixes in (request i in slot i); sets masks and tables."""
        lengths = [int(kv.shape[2]) for kv, _cross in prefixes]
        if not self.fits(prefixes):
            raise ValueError(f"{len(prefixes)} prefixes of up to {max(lengths)} tokens do not fit "
                             f"{self.batch} slots of {self.longest}")
        for i, (kv, cross) in enumerate(prefixes):
            n = lengths[i]
            for layer, k in self.k.items():
                if layer in self.cross_layers:
                    ck, cv = cross[layer]
                    k[i, :, :n] = ck.transpose(0, 1)
                    self.v[layer][i, :, :n] = cv.transpose(0, 1)
                else:
                    k[i, :, :n] = kv[layer, 0].transpose(0, 1)
                    self.v[layer][i, :, :n] = kv[layer, 1].transpose(0, 1)
        dev, longest, h = self.own_mask.device, self.longest, self.chunk
        n = torch.tensor(lengths + [0] * (self.batch - len(lengths)), device=dev)
        kpos = torch.arange(longest + h, device=dev)
        qpos = torch.arange(h, device=dev)
        valid = kpos[None, :] < n[:, None]  # [B, longest + h]: each prefix's own tokens
        causal = (kpos[None, :] >= longest) & (kpos[None, :] - longest <= qpos[:, None])
        own = valid[:, None, :] | causal[None]  # [B, h, longest + h]
        self.own_mask.copy_(own[:, None])
        cross = valid[:, None, None, :longest]
        if self.static:
            assert self.cross_mask is not None
            self.cross_mask.copy_(cross)
        else:
            self.cross_mask = cross if min(lengths) != longest else None
        positions = (n[:, None] + torch.arange(h, device=dev)).reshape(-1)
        cos, sin = rope_tables(positions, self.head_dim)
        if self.static:
            self.tables[0][0].copy_(cos)
            self.tables[0][1].copy_(sin)
        else:
            self.tables = ((cos, sin), self.tables[1])
        self.key = key
        return self

    @staticmethod
    def over(key: Any, prefixes: Sequence[Prefix], chunk: int, cross: Sequence[int]
             ) -> "FlowAttention":
        """Exactly the batch's size: its requests, keys as long as its longest prefix."""
        kv = prefixes[0][0]
        layers, _two, _n, hkv, d = kv.shape
        longest = max(int(p[0].shape[2]) for p in prefixes)
        return FlowAttention(len(prefixes), longest, chunk, layers, cross, hkv, d, kv.dtype,
                             kv.device).fill(key, prefixes)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
               ) -> torch.Tensor:
        """Self-attention: q ``[B * chunk, heads, D]``, k/v ``[B * chunk, kv_heads, D]``."""
        b, h, n = self.batch, self.chunk, self.longest
        kb, vb = self.k[layer], self.v[layer]
        kb[:, :, n:] = k.view(b, h, *k.shape[1:]).transpose(1, 2)
        vb[:, :, n:] = v.view(b, h, *v.shape[1:]).transpose(1, 2)
        return self._sdpa(q, kb, vb, self.own_mask)

    def __call__(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """Cross-attention to the requests' mapped prefix K/V."""
        return self._sdpa(q, self.k[layer], self.v[layer], self.cross_mask)

    def _sdpa(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              mask: Optional[torch.Tensor]) -> torch.Tensor:
        b, h = self.batch, self.chunk
        qb = q.view(b, h, *q.shape[1:]).transpose(1, 2)
        out = F.scaled_dot_product_attention(qb, k, v, attn_mask=mask,
                                             enable_gqa=q.shape[1] != k.shape[1])
        return out.transpose(1, 2).reshape(q.shape)


class SmolFlowStep:
    """SmolVLA's flow step as :class:`~mstar_rt.models.flow_graphs.FlowGraphs` runs it: the
    expert over a static :class:`FlowAttention` (prefixes padded to the policy's longest), the
    flow times as their embeddings ``[B, expert_width]``."""

    def __init__(self, module: SmolVLAModule) -> None:
        self.module, self.device = module, module.device
        self.chunk = module.config.chunk_size

    def inputs(self, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        m, c = self.module, self.module.config
        return (torch.zeros(size * c.chunk_size, c.max_action_dim, device=m.device),
                torch.zeros(size, c.expert_width, dtype=m.dtype, device=m.device))

    def attention(self, size: int, like: Prefix) -> FlowAttention:
        m, c = self.module, self.module.config
        layers, _two, _n, hkv, d = like[0].shape
        return FlowAttention(size, c.max_prefix, c.chunk_size, layers, m.cross_layers, hkv, d,
                             m.dtype, m.device, static=True)

    def empty_prefix(self) -> Prefix:
        m, t = self.module, self.module.config.text
        one = (1, t.num_kv_heads, t.head_dim)
        kv = torch.zeros((m.config.num_layers, 2) + one, dtype=m.dtype, device=m.device)
        cross = {i: (kv[i, 0], kv[i, 1]) for i in m.cross_layers}
        return kv, cross

    def velocity(self, x: torch.Tensor, time: torch.Tensor, attention: FlowAttention
                 ) -> torch.Tensor:
        m, a = self.module, attention
        suffix = m.suffix_embeds(x, None, a.rows, time)
        return m.velocity(m.expert_forward(suffix, None, a, None, a, a.tables))

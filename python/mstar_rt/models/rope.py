"""Rotary position embeddings, with the scalings Llama checkpoints use (default, linear,
llama3), read from either config dialect (transformers 4.x ``rope_theta`` + ``rope_scaling``,
5.x ``rope_parameters``)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Optional

import torch


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    kind: str = "default"                 # default | linear | llama3
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_positions: int = 8192

    @staticmethod
    def from_hf(config: Mapping[str, Any], source: str = "the config") -> "RopeConfig":
        from mstar_rt.models.checkpoint import ConfigFields

        top = ConfigFields(config, source)
        params: Optional[Mapping[str, Any]] = top.mapping("rope_parameters") \
            if config.get("rope_parameters") is not None else None
        if params is None:  # transformers 4.x
            params = dict(top.mapping("rope_scaling"))
            params.setdefault("rope_theta", config.get("rope_theta", 10000.0))
        p = ConfigFields(params, f"the rope parameters of {source}")
        kind = params.get("rope_type", params.get("type", "default")) or "default"
        if kind not in ("default", "linear", "llama3"):
            raise ValueError(f"rope type {kind!r} in {source} is not supported (supported: "
                             "default, linear, llama3); convert the checkpoint or add the "
                             "scaling to models/rope.py")
        return RopeConfig(
            theta=p.number("rope_theta", top.number("rope_theta", 10000.0)),
            kind=kind,
            factor=p.number("factor", 1.0),
            low_freq_factor=p.number("low_freq_factor", 1.0),
            high_freq_factor=p.number("high_freq_factor", 4.0),
            original_max_positions=p.integer("original_max_position_embeddings", 8192),
        )

    def inv_freq(self, head_dim: int) -> torch.Tensor:
        base = 1.0 / (self.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float()
                                     / head_dim))
        if self.kind == "linear":
            return base / self.factor
        if self.kind == "llama3":
            return self._llama3(base)
        return base

    def _llama3(self, inv_freq: torch.Tensor) -> torch.Tensor:
        # Long wavelengths (beyond the original context / low_freq_factor) are slowed by
        # `factor`, short ones kept, and the band between blended linearly in 1/wavelength.
        wavelen = 2 * math.pi / inv_freq
        low_wavelen = self.original_max_positions / self.low_freq_factor
        high_wavelen = self.original_max_positions / self.high_freq_factor
        scaled = torch.where(wavelen > low_wavelen, inv_freq / self.factor, inv_freq)
        t = (self.original_max_positions / wavelen - self.low_freq_factor) / (
            self.high_freq_factor - self.low_freq_factor)
        blended = (1 - t) * scaled / self.factor + t * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, blended, scaled)


class Rotary(torch.nn.Module):
    """cos/sin tables for positions, and their application to q and k ([T, H, D])."""

    def __init__(self, rope: RopeConfig, head_dim: int) -> None:
        super().__init__()
        self.register_buffer("inv_freq", rope.inv_freq(head_dim), persistent=False)

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq.float()[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype)[:, None, :], emb.sin().to(dtype)[:, None, :]

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin

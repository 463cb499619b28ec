"""A small causal codec decoder (codes -> audio): every layer looks only at the past, so a frame's
samples depend on the frames before it and none after. It stands in for causal codecs such as
Mimi or Qwen3-Omni's code2wav, whose streams need left context only (``LeftContext(C, L)``);
the streaming tests use it to pin down that case. Same code layout as SNAC (levels of 1, 2 and 4
codes per frame by default), so :class:`~mstar_rt.models.snac_stream.SnacStreamNode` streams it.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn


class _CausalConv(nn.Conv1d):
    """A Conv1d padded on the left only: output t sees inputs t - (k-1)*d .. t."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        reach = (self.kernel_size[0] - 1) * self.dilation[0]
        return super().forward(F.pad(x, (reach, 0)))


class _CausalUpsample(nn.ConvTranspose1d):
    """Upsampling by ``stride`` with a kernel of 2 * stride, cut to ``stride`` outputs per input:
    output o sees inputs o // stride - 1 and o // stride (the overhang to the right, which would
    look ahead, is dropped)."""

    def __init__(self, channels: int, stride: int) -> None:
        super().__init__(channels, channels, 2 * stride, stride=stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x)[..., : x.shape[-1] * self.stride[0]]


class CausalConvDecoder(nn.Module):
    """Codes -> audio [B, 1, frames * samples_per_frame]. ``codes`` is one LongTensor per level,
    [B, frames * codes_per_frame[i]]; each level's codes are embedded, repeated up to
    ``max(codes_per_frame)`` latent steps per frame and summed, then causal convolutions and
    causal upsampling by ``rates`` make the samples."""

    def __init__(self, codebook_size: int = 64, codes_per_frame: Sequence[int] = (1, 2, 4),
                 dim: int = 32, rates: Sequence[int] = (4, 4), kernel_size: int = 3) -> None:
        super().__init__()
        self.codebook_size = codebook_size
        self.codes_per_frame = tuple(int(c) for c in codes_per_frame)
        self.latent_per_frame = max(self.codes_per_frame)
        if any(self.latent_per_frame % c for c in self.codes_per_frame):
            raise ValueError(f"codes_per_frame {self.codes_per_frame} must each divide the "
                             f"largest, {self.latent_per_frame}")
        self.rates = tuple(int(r) for r in rates)
        self.embed = nn.ModuleList(nn.Embedding(codebook_size, dim) for _ in self.codes_per_frame)
        layers: list[nn.Module] = [_CausalConv(dim, dim, kernel_size), nn.ELU()]
        for r in self.rates:
            layers += [_CausalUpsample(dim, r), nn.ELU(),
                       _CausalConv(dim, dim, kernel_size, dilation=2), nn.ELU()]
        layers += [_CausalConv(dim, 1, kernel_size), nn.Tanh()]
        self.net = nn.Sequential(*layers)

    @property
    def samples_per_frame(self) -> int:
        return self.latent_per_frame * math.prod(self.rates)

    def receptive_field_frames(self) -> tuple[int, int]:
        """``(left, 0)``: frames before a frame that its samples depend on. Walks the layers
        backwards from the first sample of a frame far from the start."""
        frame = 1000
        lo = frame * self.samples_per_frame
        for layer in reversed(self.net):
            if isinstance(layer, _CausalConv):
                lo -= (layer.kernel_size[0] - 1) * layer.dilation[0]
            elif isinstance(layer, _CausalUpsample):
                lo = lo // layer.stride[0] - 1
        return frame - lo // self.latent_per_frame, 0

    @torch.no_grad()
    def decode(self, codes: Sequence[torch.Tensor]) -> torch.Tensor:
        if len(codes) != len(self.codes_per_frame):
            raise ValueError(f"decode needs {len(self.codes_per_frame)} code tensors (one per "
                             f"level), got {len(codes)}")
        z = None
        for embed, per_frame, c in zip(self.embed, self.codes_per_frame, codes):
            z_i = embed(c).transpose(1, 2).repeat_interleave(self.latent_per_frame // per_frame,
                                                             dim=-1)
            z = z_i if z is None else z + z_i
        return self.net(z)

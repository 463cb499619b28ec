"""Building blocks of the SNAC decoder (weight-normalised convolutions, Snake activations,
residual units, noise injection, windowed attention). Module and parameter names mirror the
`snac` package's, so a SNAC ``state_dict`` loads without a key mapping; the code is our own."""

from __future__ import annotations

import math
from typing import Callable, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

# Draws the noise a NoiseBlock adds, given the block's input [B, C, T]; None adds none.
NoiseDraw = Callable[[torch.Tensor], Optional[torch.Tensor]]


class WeightNorm(nn.Module):
    """A weight stored as magnitude and direction under torch's parametrization names
    (``original0`` = g with shape [shape[0], 1, 1], ``original1`` = v): weight = g * v / |v|,
    the norm taken over every dim but 0, as ``torch.nn.utils.parametrizations.weight_norm``."""

    def __init__(self, shape: Sequence[int]) -> None:
        super().__init__()
        v = torch.empty(*shape)
        nn.init.kaiming_uniform_(v, a=math.sqrt(5))
        self.original0 = nn.Parameter(_norm_except_dim0(v))
        self.original1 = nn.Parameter(v)

    def forward(self) -> torch.Tensor:
        return self.original1 * (self.original0 / _norm_except_dim0(self.original1))


def _norm_except_dim0(v: torch.Tensor) -> torch.Tensor:
    return v.flatten(1).norm(dim=1).view(-1, *([1] * (v.dim() - 1)))


class _Parametrizations(nn.Module):
    """Only here so the keys read ``<conv>.parametrizations.weight.original0``."""

    def __init__(self, shape: Sequence[int]) -> None:
        super().__init__()
        self.weight = WeightNorm(shape)


class WNConv1d(nn.Module):
    """A Conv1d (or ConvTranspose1d when ``transposed``) with a weight-normalised weight.
    :meth:`fold` replaces g and v by the plain weight they define, so inference stops
    recomputing it on every call."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, *, stride: int = 1,
                 padding: int = 0, dilation: int = 1, groups: int = 1, bias: bool = True,
                 transposed: bool = False, output_padding: int = 0) -> None:
        super().__init__()
        if transposed:
            shape = (in_channels, out_channels // groups, kernel_size)
        else:
            shape = (out_channels, in_channels // groups, kernel_size)
        self.parametrizations: Optional[_Parametrizations] = _Parametrizations(shape)
        self.register_parameter("weight", None)
        self.bias = nn.Parameter(torch.zeros(out_channels)) if bias else None
        self.stride, self.padding, self.dilation = stride, padding, dilation
        self.groups, self.transposed, self.output_padding = groups, transposed, output_padding

    @property
    def folded(self) -> bool:
        return self.parametrizations is None

    def effective_weight(self) -> torch.Tensor:
        if self.parametrizations is None:
            return self.weight
        return self.parametrizations.weight()

    def fold(self) -> None:
        if self.parametrizations is None:
            return
        with torch.no_grad():
            weight = self.parametrizations.weight()
        del self.parametrizations
        self.parametrizations = None
        self.weight = nn.Parameter(weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.effective_weight()
        if self.transposed:
            return F.conv_transpose1d(x, w, self.bias, self.stride, self.padding,
                                      self.output_padding, self.groups, self.dilation)
        return F.conv1d(x, w, self.bias, self.stride, self.padding, self.dilation, self.groups)


class Snake1d(nn.Module):
    """x + sin^2(alpha x) / alpha, per channel (the 1e-9 keeps alpha = 0 finite)."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.alpha = nn.Parameter(torch.ones(1, channels, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + (self.alpha + 1e-9).reciprocal() * torch.sin(self.alpha * x).pow(2)


class ResidualUnit(nn.Module):
    """Snake, dilated kernel-7 conv, Snake, 1x1 conv, plus the input. The padding keeps the
    length, so (unlike snac's generic version) there is never anything to crop."""

    def __init__(self, dim: int, dilation: int, groups: int = 1, kernel: int = 7) -> None:
        super().__init__()
        self.block = nn.Sequential(
            Snake1d(dim),
            WNConv1d(dim, dim, kernel, dilation=dilation, padding=(kernel - 1) * dilation // 2,
                     groups=groups),
            Snake1d(dim),
            WNConv1d(dim, dim, 1),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.block(x)


class NoiseBlock(nn.Module):
    """Adds noise [B, 1, T] scaled per channel and step by a 1x1 conv of the input. Where the
    noise comes from is the caller's choice (see ``snac.decode``'s ``noise``)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.linear = WNConv1d(dim, dim, 1, bias=False)

    def forward(self, x: torch.Tensor, noise: Optional[torch.Tensor]) -> torch.Tensor:
        if noise is None:
            return x
        return x + noise * self.linear(x)


class DecoderBlock(nn.Module):
    """Snake, transposed conv upsampling by ``stride`` (output length = input length * stride
    exactly), optional noise, then residual units with dilations 1, 3, 9."""

    def __init__(self, input_dim: int, output_dim: int, stride: int, noise: bool,
                 groups: int = 1) -> None:
        super().__init__()
        layers: list[nn.Module] = [
            Snake1d(input_dim),
            WNConv1d(input_dim, output_dim, 2 * stride, stride=stride,
                     padding=math.ceil(stride / 2), output_padding=stride % 2, transposed=True),
        ]
        if noise:
            layers.append(NoiseBlock(output_dim))
        layers += [ResidualUnit(output_dim, d, groups=groups) for d in (1, 3, 9)]
        self.block = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor, draw: NoiseDraw) -> torch.Tensor:
        for layer in self.block:
            x = layer(x, draw(x)) if isinstance(layer, NoiseBlock) else layer(x)
        return x


class _RotaryFrequencies(nn.Module):
    """Holds ``inv_freq`` (a persistent buffer in SNAC checkpoints) for rotary embeddings."""

    def __init__(self, dim_head: int) -> None:
        super().__init__()
        inv_freq = 1.0 / (10000 ** (torch.arange(0, dim_head, 2).float() / dim_head))
        self.register_buffer("inv_freq", inv_freq)


class LocalMHA(nn.Module):
    """Pre-norm self-attention within non-overlapping windows of ``window_size`` steps counted
    from the start of the input, with rotary positions restarting in every window."""

    def __init__(self, dim: int, window_size: int, dim_head: int = 64) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.heads, self.dim_head, self.window_size = dim // dim_head, dim_head, window_size
        self.to_qkv = nn.Linear(dim, dim * 3, bias=False)
        self.rel_pos = _RotaryFrequencies(dim_head)
        self.to_out = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, c, t = x.shape
        w = self.window_size
        if t % w:
            raise ValueError(f"LocalMHA needs a length that is a multiple of its window {w}, "
                             f"got {t} latent frames")
        q, k, v = self.to_qkv(self.norm(x.transpose(1, 2))).chunk(3, dim=-1)
        q, k, v = (z.reshape(b, t // w, w, self.heads, self.dim_head).permute(0, 3, 1, 2, 4)
                   for z in (q, k, v))
        angles = torch.outer(torch.arange(w, device=x.device).to(self.rel_pos.inv_freq),
                             self.rel_pos.inv_freq)
        angles = torch.cat((angles, angles), dim=-1)
        cos, sin = angles.cos(), angles.sin()
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        out = F.scaled_dot_product_attention(q, k, v)
        out = out.permute(0, 2, 3, 1, 4).reshape(b, t, c)
        return self.to_out(out).transpose(1, 2) + x


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)

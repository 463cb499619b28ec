"""Building blocks of Qwen3-Omni's code2wav: a sliding-window causal transformer over code
frames, then causal convolutions that upsample it to 24 kHz. Module and parameter names mirror
transformers' ``Qwen3OmniMoeCode2Wav*`` classes, so a checkpoint's ``code2wav.*`` tensors load
with the prefix stripped; the code is our own.

Every layer is causal except the kernel-2r transposed convolutions of the decoder blocks: their
output step t reads input steps t // r and t // r + 1. They trim the output that would read past
the input, which is why a decode of T frames is a little shorter than T frames of audio (see
:attr:`CausalTransConv.lookahead`).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

#: One attention layer's cached keys and values, [B, kv_heads, positions, head_dim] each.
LayerCache = tuple[torch.Tensor, torch.Tensor]

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu, "swish": F.silu, "gelu": F.gelu, "relu": F.relu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}
_QUERY_BLOCK = 1024  # queries per attention block: memory O(T * window), not O(T^2)


# ---- convolutions -------------------------------------------------------------------------------

class CausalConv(nn.Module):
    """A stride-1 Conv1d padded with zeros on the left only: output t reads inputs
    [t - reach, t], so the output is as long as the input."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int,
                 dilation: int = 1, groups: int = 1) -> None:
        super().__init__()
        self.conv = nn.Conv1d(in_channels, out_channels, kernel_size, dilation=dilation,
                              groups=groups)
        self.reach = (kernel_size - 1) * dilation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(F.pad(x, (self.reach, 0)))


class CausalTransConv(nn.Module):
    """ConvTranspose1d upsampling by ``stride``, with ``kernel - stride`` outputs trimmed at
    each end: output t then reads inputs t // stride .. t // stride + lookahead, and the trimmed
    tail is exactly the output that would read inputs past the end."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, stride: int) -> None:
        super().__init__()
        if not stride <= kernel_size <= 2 * stride:
            raise ValueError(f"CausalTransConv needs stride <= kernel <= 2 * stride, got kernel "
                             f"{kernel_size}, stride {stride}")
        self.conv = nn.ConvTranspose1d(in_channels, out_channels, kernel_size, stride=stride)
        self.stride, self.trim = stride, kernel_size - stride

    @property
    def lookahead(self) -> int:
        """Input steps after t // stride that output t reads (1 for kernel 2 * stride)."""
        return int(self.trim > 0)

    def out_length(self, length: int) -> int:
        return max(0, length * self.stride - self.trim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        return y[..., self.trim: y.shape[-1] - self.trim]


class SnakeBeta(nn.Module):
    """x + sin^2(x e^alpha) / e^beta per channel; alpha and beta are stored as logs."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.alpha = nn.Parameter(torch.zeros(channels))
        self.beta = nn.Parameter(torch.zeros(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        alpha = self.alpha.exp()[None, :, None]
        beta = self.beta.exp()[None, :, None]
        return x + (beta + 1e-9).reciprocal() * torch.sin(x * alpha).pow(2)


class ConvNeXtBlock(nn.Module):
    """Causal depthwise kernel-7 conv, LayerNorm over channels, 4x MLP, scaled residual."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.dwconv = CausalConv(dim, dim, 7, groups=dim)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.pwconv1 = nn.Linear(dim, 4 * dim)
        self.pwconv2 = nn.Linear(4 * dim, dim)
        self.gamma = nn.Parameter(torch.full((dim,), 1e-6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.dwconv(x).transpose(1, 2))
        h = self.gamma * self.pwconv2(F.gelu(self.pwconv1(h)))
        return x + h.transpose(1, 2)


class ResidualUnit(nn.Module):
    """Snake, causal dilated kernel-7 conv, Snake, 1x1 conv, plus the input."""

    def __init__(self, dim: int, dilation: int) -> None:
        super().__init__()
        self.act1 = SnakeBeta(dim)
        self.conv1 = CausalConv(dim, dim, 7, dilation=dilation)
        self.act2 = SnakeBeta(dim)
        self.conv2 = CausalConv(dim, dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.conv2(self.act2(self.conv1(self.act1(x))))


class DecoderBlock(nn.Module):
    """Snake, a kernel-2r transposed conv upsampling by r, residual units of dilation 1, 3, 9."""

    def __init__(self, in_dim: int, out_dim: int, rate: int) -> None:
        super().__init__()
        self.block = nn.ModuleList([SnakeBeta(in_dim), CausalTransConv(in_dim, out_dim, 2 * rate,
                                                                       rate)]
                                   + [ResidualUnit(out_dim, d) for d in (1, 3, 9)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.block:
            x = layer(x)
        return x


# ---- the pre-transformer -------------------------------------------------------------------------

class RMSNorm(nn.Module):
    """Normalised in float32 whatever the activations' dtype, as the reference does."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class LayerScale(nn.Module):
    def __init__(self, dim: int, initial: float) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.full((dim,), initial))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale * x


class Mlp(nn.Module):
    def __init__(self, dim: int, hidden: int, act: str) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)
        self.act = ACTIVATIONS[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class Attention(nn.Module):
    """Causal self-attention over the last ``window`` positions (the query's own included),
    rotary positions, grouped KV heads. ``cache`` holds the keys and values (rotated) of the
    positions just before ``x``; the returned cache adds x's and keeps only the last
    ``window - 1``: all a later position can read."""

    def __init__(self, dim: int, heads: int, kv_heads: int, head_dim: int, bias: bool,
                 window: int) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim, self.window = heads, kv_heads, head_dim, window
        self.q_proj = nn.Linear(dim, heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(dim, kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(dim, kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(heads * head_dim, dim, bias=bias)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache: Optional[LayerCache] = None) -> tuple[torch.Tensor, LayerCache]:
        b, n, _ = x.shape
        q, k, v = (proj(x).view(b, n, -1, self.head_dim).transpose(1, 2)
                   for proj in (self.q_proj, self.k_proj, self.v_proj))
        cos, sin = cos[:, None], sin[:, None]
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        if cache is not None:
            k, v = torch.cat((cache[0], k), dim=2), torch.cat((cache[1], v), dim=2)
        past = k.shape[2] - n
        repeat = self.heads // self.kv_heads
        keys, values = (z.repeat_interleave(repeat, dim=1) if repeat > 1 else z for z in (k, v))
        blocks = []
        for q0 in range(0, n, _QUERY_BLOCK):
            q1 = min(n, q0 + _QUERY_BLOCK)
            k0 = max(0, past + q0 - self.window + 1)
            qpos = torch.arange(past + q0, past + q1, device=x.device)[:, None]
            kpos = torch.arange(k0, past + q1, device=x.device)[None, :]
            mask = (kpos <= qpos) & (kpos > qpos - self.window)
            blocks.append(F.scaled_dot_product_attention(
                q[:, :, q0:q1], keys[:, :, k0:past + q1], values[:, :, k0:past + q1],
                attn_mask=mask))
        out = torch.cat(blocks, dim=2).transpose(1, 2).reshape(b, n, -1)
        keep = max(0, k.shape[2] - (self.window - 1))
        return self.o_proj(out), (k[:, :, keep:], v[:, :, keep:])


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


class TransformerLayer(nn.Module):
    """Pre-norm attention and MLP, each residual branch scaled per channel (LayerScale)."""

    def __init__(self, dim: int, heads: int, kv_heads: int, head_dim: int, bias: bool,
                 window: int, mlp_dim: int, act: str, eps: float, scale: float) -> None:
        super().__init__()
        self.self_attn = Attention(dim, heads, kv_heads, head_dim, bias, window)
        self.mlp = Mlp(dim, mlp_dim, act)
        self.input_layernorm = RMSNorm(dim, eps)
        self.post_attention_layernorm = RMSNorm(dim, eps)
        self.self_attn_layer_scale = LayerScale(dim, scale)
        self.mlp_layer_scale = LayerScale(dim, scale)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache: Optional[LayerCache]) -> tuple[torch.Tensor, LayerCache]:
        h, cache = self.self_attn(self.input_layernorm(x), cos, sin, cache)
        x = x + self.self_attn_layer_scale(h)
        x = x + self.mlp_layer_scale(self.mlp(self.post_attention_layernorm(x)))
        return x, cache


class PreTransformer(nn.Module):
    """The transformer over frame embeddings [B, T, H]. ``positions`` [B, T] are absolute frame
    indices: rotary angles then equal a one-shot decode's bit for bit, however the stream is
    cut. ``cache`` (one :data:`LayerCache` per layer, or None at the start) carries the last
    ``window - 1`` positions of every layer, which is all the next frames can see."""

    inv_freq: torch.Tensor

    def __init__(self, dim: int, layers: int, heads: int, kv_heads: int, head_dim: int,
                 bias: bool, window: int, mlp_dim: int, act: str, eps: float, scale: float,
                 rope_theta: float) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            TransformerLayer(dim, heads, kv_heads, head_dim, bias, window, mlp_dim, act, eps,
                             scale) for _ in range(layers))
        self.norm = RMSNorm(dim, eps)
        inv_freq = 1.0 / rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.float)
                                        / head_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)  # not in checkpoints

    def forward(self, x: torch.Tensor, positions: torch.Tensor,
                cache: Optional[list[LayerCache]] = None) -> tuple[torch.Tensor, list[LayerCache]]:
        angles = positions[..., None].float() * self.inv_freq.to(x.device)
        angles = torch.cat((angles, angles), dim=-1)
        cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
        new_cache = []
        for i, layer in enumerate(self.layers):
            x, layer_cache = layer(x, cos, sin, None if cache is None else cache[i])
            new_cache.append(layer_cache)
        return self.norm(x), new_cache

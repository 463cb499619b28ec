"""SmolVLM's image path as SmolVLA uses it: LeRobot's resize-with-padding, the SmolVLM vision
transformer (SigLIP layers; patch positions bucketed NaViT-style) and the connector (pixel
shuffle, then a linear map to the text width).

Parameter names follow ``transformers``' ``SmolVLMVisionTransformer`` and ``SmolVLMConnector``
(``embeddings.patch_embedding``, ``encoder.layers.N.self_attn.q_proj``, ...,
``connector.modality_projection.proj``), so LeRobot's state dict loads as it is.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mstar_rt.models.siglip import gelu_tanh
from mstar_rt.models.smolvla_config import SmolVLMVisionSizes


def resize_with_pad(images: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """LeRobot's SmolVLA resize: ``[B, 3, H, W]`` scaled by one ratio to fit ``height x width``
    (bilinear, ``align_corners=False``, no antialiasing), then zero-padded on the LEFT and TOP
    (not centred). An image already that size is returned unchanged."""
    h, w = images.shape[-2:]
    if (h, w) == (height, width):
        return images
    ratio = max(w / width, h / height)
    rh, rw = int(h / ratio), int(w / ratio)
    resized = F.interpolate(images, size=(rh, rw), mode="bilinear", align_corners=False)
    return F.pad(resized, (max(0, width - rw), 0, max(0, height - rh), 0), value=0.0)


def patch_positions(rows: int, cols: int, per_side: int) -> torch.Tensor:
    """Position-embedding index of each patch of a ``rows x cols`` grid (row-major), as
    SmolVLM buckets fractional coordinates onto its ``per_side x per_side`` table (for a full
    grid this is 0, 1, 2, ...)."""
    boundaries = torch.arange(1 / per_side, 1.0, 1 / per_side)
    h = torch.arange(rows, dtype=torch.float32) * (1.0 / torch.tensor([float(rows)]))
    w = torch.arange(cols, dtype=torch.float32) * (1.0 / torch.tensor([float(cols)]))
    bh = torch.bucketize(h.clamp(max=1.0 - 1e-6), boundaries, right=True)
    bw = torch.bucketize(w.clamp(max=1.0 - 1e-6), boundaries, right=True)
    return (bh[:, None] * per_side + bw[None, :]).reshape(-1)


class VisionEmbeddings(nn.Module):
    def __init__(self, v: SmolVLMVisionSizes) -> None:
        super().__init__()
        self.patch_size, self.per_side = v.patch_size, v.patches_per_side
        self.patch_embedding = nn.Conv2d(v.num_channels, v.hidden_size, v.patch_size,
                                         stride=v.patch_size)
        self.position_embedding = nn.Embedding(self.per_side ** 2, v.hidden_size)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        x = self.patch_embedding(pixels).flatten(2).transpose(1, 2)
        rows, cols = pixels.shape[-2] // self.patch_size, pixels.shape[-1] // self.patch_size
        ids = patch_positions(rows, cols, self.per_side).to(pixels.device)
        return x + self.position_embedding(ids)


# siglip.py's layers again (the hub's weights are SigLIP's), kept apart because SmolVLM
# registers the modules in another order, and a state dict's order is LeRobot's here too.
class VisionAttention(nn.Module):
    def __init__(self, v: SmolVLMVisionSizes) -> None:
        super().__init__()
        self.heads = v.num_heads
        d = v.hidden_size
        self.k_proj, self.v_proj = nn.Linear(d, d), nn.Linear(d, d)
        self.q_proj, self.out_proj = nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        q, k, v = (p(x).view(b, n, self.heads, -1).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        out = F.scaled_dot_product_attention(q, k, v)
        return self.out_proj(out.transpose(1, 2).reshape(b, n, d))


class VisionMLP(nn.Module):
    def __init__(self, v: SmolVLMVisionSizes) -> None:
        super().__init__()
        self.fc1 = nn.Linear(v.hidden_size, v.intermediate_size)
        self.fc2 = nn.Linear(v.intermediate_size, v.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(gelu_tanh(self.fc1(x)))


class VisionLayer(nn.Module):
    def __init__(self, v: SmolVLMVisionSizes) -> None:
        super().__init__()
        self.self_attn = VisionAttention(v)
        self.layer_norm1 = nn.LayerNorm(v.hidden_size, eps=v.layer_norm_eps)
        self.mlp = VisionMLP(v)
        self.layer_norm2 = nn.LayerNorm(v.hidden_size, eps=v.layer_norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class VisionEncoder(nn.Module):
    def __init__(self, v: SmolVLMVisionSizes) -> None:
        super().__init__()
        self.layers = nn.ModuleList(VisionLayer(v) for _ in range(v.num_layers))


class SmolVLMVision(nn.Module):
    """``[B, 3, S, S]`` pixels in [-1, 1] -> ``[B, (S / patch)^2, hidden]``
    (``last_hidden_state``)."""

    def __init__(self, v: SmolVLMVisionSizes) -> None:
        super().__init__()
        self.embeddings = VisionEmbeddings(v)
        self.encoder = VisionEncoder(v)
        self.post_layernorm = nn.LayerNorm(v.hidden_size, eps=v.layer_norm_eps)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        x = self.embeddings(pixels)
        for layer in self.encoder.layers:
            x = layer(x)
        return self.post_layernorm(x)


class ModalityProjection(nn.Module):
    def __init__(self, in_width: int, out_width: int) -> None:
        super().__init__()
        self.proj = nn.Linear(in_width, out_width, bias=False)


class Connector(nn.Module):
    """Pixel shuffle by ``scale_factor`` (each ``s x s`` block of patches becomes one token
    ``s^2`` times as wide), then ``modality_projection.proj`` to the text width."""

    def __init__(self, vision_width: int, text_width: int, scale_factor: int) -> None:
        super().__init__()
        self.scale_factor = scale_factor
        self.modality_projection = ModalityProjection(vision_width * scale_factor ** 2,
                                                      text_width)

    def pixel_shuffle(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        s = self.scale_factor
        side = int(n ** 0.5)
        x = x.view(b, side, side // s, d * s).permute(0, 2, 1, 3)
        x = x.reshape(b, side // s, side // s, d * s * s).permute(0, 2, 1, 3)
        return x.reshape(b, n // (s * s), d * s * s)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.modality_projection.proj(self.pixel_shuffle(x))

"""A SigLIP vision encoder (the image tower of PaliGemma and pi0) and its image preprocessing.

Parameter names follow ``transformers``' ``SiglipVisionModel`` (without its pooling head), so its
state dict loads as it is; the test checks the outputs against it with the same weights.
Preprocessing follows openpi: resize with padding to the model's square input (aspect ratio
kept, black bars), then scale to [-1, 1] -- with OpenCV, on uint8 ``[H, W, 3]`` RGB images.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Optional

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class SiglipConfig:
    """The defaults are a tiny random tower for tests; So400m/14 (pi0's) is hidden 1152,
    intermediate 4304, 27 layers, 16 heads, 224 px images in 14 px patches."""

    hidden_size: int = 32
    intermediate_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    image_size: int = 32
    patch_size: int = 8
    layer_norm_eps: float = 1e-6

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @staticmethod
    def from_hf(c: Any) -> "SiglipConfig":
        """From a ``transformers`` ``SiglipVisionConfig`` (object or dict)."""
        get = c.get if isinstance(c, Mapping) else lambda k, d=None: getattr(c, k, d)
        return SiglipConfig(int(get("hidden_size")), int(get("intermediate_size")),
                            int(get("num_hidden_layers")), int(get("num_attention_heads")),
                            int(get("image_size")), int(get("patch_size")),
                            float(get("layer_norm_eps", 1e-6)))


def preprocess_image(image: Any, size: int) -> torch.Tensor:
    """uint8 ``[H, W, 3]`` RGB -> float ``[3, size, size]`` in [-1, 1]: resized with OpenCV
    (area when shrinking, linear when growing) into a centred square, padded black."""
    import cv2

    a = np.asarray(image)
    if a.dtype != np.uint8 or a.ndim != 3 or a.shape[2] != 3 or min(a.shape[:2]) < 1:
        raise ValueError(f"an image must be a uint8 array [H, W, 3] (RGB); got {a.dtype} "
                         f"{list(a.shape)}")
    h, w = a.shape[:2]
    scale = size / max(h, w)
    nh, nw = max(1, round(h * scale)), max(1, round(w * scale))
    interp = cv2.INTER_AREA if scale < 1 else cv2.INTER_LINEAR
    resized = cv2.resize(np.ascontiguousarray(a), (nw, nh), interpolation=interp)
    out = np.zeros((size, size, 3), dtype=np.uint8)
    top, left = (size - nh) // 2, (size - nw) // 2
    out[top:top + nh, left:left + nw] = resized
    x = torch.from_numpy(out).permute(2, 0, 1).float()
    return x / 127.5 - 1.0


#: 2 * sqrt(2 / pi): tanh(z) = 2 sigmoid(2 z) - 1 folds GELU's 0.5 (1 + tanh(.)) into a sigmoid.
_GELU_TANH_SCALE = 2.0 * math.sqrt(2.0 / math.pi)


def gelu_tanh(x: torch.Tensor, up: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``F.gelu(x, approximate="tanh")`` (times ``up``, a gated MLP's other half, if given),
    written as ``x * sigmoid(2 sqrt(2/pi) (x + 0.044715 x^3))``: the same function, and on CPU
    torch's sigmoid runs about three times faster than its tanh (agrees within 1e-6 in float32;
    other dtypes keep torch's kernel, which rounds once where this rounds at every op). Without
    autograd it works in one new buffer: at a few hundred tokens these tensors outgrow the
    core's cache, and every fresh buffer is another trip to memory."""
    if x.dtype != torch.float32:
        out = F.gelu(x, approximate="tanh")
        return out if up is None else out * up
    if torch.is_grad_enabled():
        inner = torch.addcmul(x, x * x, x, value=0.044715).mul_(_GELU_TANH_SCALE)
        out = torch.sigmoid(inner) * x  # not in place: autograd keeps sigmoid's output
        return out if up is None else out * up
    u = x * x  # u <- C (x + 0.044715 x^3), computed as x (C + 0.044715 C x^2)
    u.mul_(0.044715 * _GELU_TANH_SCALE).add_(_GELU_TANH_SCALE).mul_(x)
    out = torch.sigmoid(u, out=u).mul_(x)
    return out if up is None else out.mul_(up)


class SiglipEmbeddings(nn.Module):
    def __init__(self, c: SiglipConfig) -> None:
        super().__init__()
        self.patch_embedding = nn.Conv2d(3, c.hidden_size, c.patch_size, stride=c.patch_size)
        self.position_embedding = nn.Embedding(c.num_patches, c.hidden_size)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        x = self.patch_embedding(pixels).flatten(2).transpose(1, 2)
        return x + self.position_embedding.weight


class SiglipAttention(nn.Module):
    def __init__(self, c: SiglipConfig) -> None:
        super().__init__()
        self.heads = c.num_heads
        self.q_proj = nn.Linear(c.hidden_size, c.hidden_size)
        self.k_proj = nn.Linear(c.hidden_size, c.hidden_size)
        self.v_proj = nn.Linear(c.hidden_size, c.hidden_size)
        self.out_proj = nn.Linear(c.hidden_size, c.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        q, k, v = (p(x).view(b, n, self.heads, -1).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        out = F.scaled_dot_product_attention(q, k, v)
        return self.out_proj(out.transpose(1, 2).reshape(b, n, d))


class SiglipMLP(nn.Module):
    def __init__(self, c: SiglipConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(c.hidden_size, c.intermediate_size)
        self.fc2 = nn.Linear(c.intermediate_size, c.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(gelu_tanh(self.fc1(x)))


class SiglipLayer(nn.Module):
    def __init__(self, c: SiglipConfig) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)
        self.self_attn = SiglipAttention(c)
        self.layer_norm2 = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)
        self.mlp = SiglipMLP(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class SiglipEncoder(nn.Module):
    def __init__(self, c: SiglipConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList(SiglipLayer(c) for _ in range(c.num_layers))


class SiglipVisionTower(nn.Module):
    """``forward(pixels [B, 3, S, S]) -> patch features [B, num_patches, hidden]``."""

    def __init__(self, config: SiglipConfig) -> None:
        super().__init__()
        self.config = config
        self.embeddings = SiglipEmbeddings(config)
        self.encoder = SiglipEncoder(config)
        self.post_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        x = self.embeddings(pixels)
        for layer in self.encoder.layers:
            x = layer(x)
        return self.post_layernorm(x)

    def load_hf_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        """Loads a ``SiglipVisionModel`` state dict (with or without ``vision_model.``; the
        pooling head, if any, is left out)."""
        own = {}
        for key, value in state.items():
            key = key.removeprefix("vision_model.")
            if not key.startswith("head."):
                own[key] = value
        self.load_state_dict(own, strict=True)

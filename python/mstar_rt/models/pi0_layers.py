"""The layers of a pi0-style VLA: a SigLIP image tower and projector, a decoder backbone over the
prefix (image tokens, prompt tokens, one state token), and an action expert over the action
tokens whose layer ``l`` attends to the backbone's layer-``l`` keys and values of the prefix plus
its own (pi0's shared attention). Backbone and expert are Llama-style decoder layers
(:mod:`mstar_rt.models.llama`) with the same depth, heads, KV heads and head size, so both read
and write one KV cache layout.

Flow matching in the convention of the real-time-chunking paper: time ``tau`` runs from 0
(noise) to 1 (clean actions), ``x_tau = tau * actions + (1 - tau) * noise``, the expert predicts
the velocity ``actions - noise``, and ``num_steps`` Euler steps of ``1 / num_steps`` integrate it
(openpi's ``t`` is ``1 - tau``). Each action token carries its own ``tau``, which trained
real-time chunking uses (:mod:`mstar_rt.models.pi0_rtc`).
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, field
from typing import Any, Optional, Union

import torch
import torch.nn.functional as F
from torch import nn

from mstar_rt.models.llama import LlamaBody, LlamaConfig, LlamaDecoderLayer, RMSNorm
from mstar_rt.models.rope import RopeConfig, Rotary
from mstar_rt.models.siglip import SiglipConfig, SiglipVisionTower


@dataclass(frozen=True)
class Pi0Config:
    """Sizes. The defaults are a tiny random model for tests; pi0 itself is SigLIP So400m,
    Gemma-2B (width 2048, 18 layers, 8 heads, 1 KV head, head size 256) and a 300 M expert of
    width 1024, 50 actions of 32 dims, 10 flow steps."""

    vision: SiglipConfig = field(default_factory=SiglipConfig)
    vocab_size: int = 64
    width: int = 64
    mlp_width: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 1
    head_dim: int = 16
    expert_width: int = 32
    expert_mlp_width: int = 64
    state_dim: int = 8
    action_dim: int = 7
    action_horizon: int = 8
    num_steps: int = 10
    max_images: int = 3
    max_prompt_tokens: int = 48
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0

    def __post_init__(self) -> None:
        if isinstance(self.vision, dict):
            object.__setattr__(self, "vision", SiglipConfig(**self.vision))

    def llama(self, expert: bool) -> LlamaConfig:
        width = self.expert_width if expert else self.width
        mlp = self.expert_mlp_width if expert else self.mlp_width
        return LlamaConfig(vocab_size=self.vocab_size, hidden_size=width, intermediate_size=mlp,
                           num_hidden_layers=self.num_layers, num_attention_heads=self.num_heads,
                           num_key_value_heads=self.num_kv_heads, head_dim=self.head_dim,
                           rms_norm_eps=self.rms_norm_eps, rope=RopeConfig(theta=self.rope_theta))

    @property
    def max_prefix(self) -> int:
        return self.max_images * self.vision.num_patches + self.max_prompt_tokens + 1

    def to_dict(self) -> dict:
        return {"model_type": "mstar_pi0", **asdict(self)}

    @staticmethod
    def from_dict(d: dict, source: str = "the pi0 config") -> "Pi0Config":
        """A config.json's fields, each checked (type, range), so a bad one is a ValueError
        naming it rather than an error in a layer, or an absurd allocation."""
        from mstar_rt.models.checkpoint import dataclass_config

        return dataclass_config(Pi0Config, d, source, ignore=("model_type", "architectures"))


def time_embedding(tau: torch.Tensor, width: int, min_period: float = 4e-3,
                   max_period: float = 4.0) -> torch.Tensor:
    """Sine-cosine embedding of flow times ``[T] -> [T, width]`` (openpi's periods)."""
    fraction = torch.linspace(0.0, 1.0, width // 2, dtype=torch.float64, device=tau.device)
    period = min_period * (max_period / min_period) ** fraction
    angle = tau.double()[:, None] * (2 * math.pi / period)[None]
    return torch.cat([angle.sin(), angle.cos()], dim=-1).to(tau.dtype)


class Pi0Module(nn.Module):
    """Weights and the pieces of the forward pass; attention goes through any object with
    ``attend(layer, q, k, v)`` over flat tokens (a KVStep, or a dense reference)."""

    def __init__(self, config: Pi0Config) -> None:
        super().__init__()
        c = self.config = config
        self.vision_tower = SiglipVisionTower(c.vision)
        self.multi_modal_projector = nn.Linear(c.vision.hidden_size, c.width)
        self.language_model = LlamaBody(c.llama(expert=False))
        self.state_proj = nn.Linear(c.state_dim, c.width)
        expert = c.llama(expert=True)
        self.expert_layers = nn.ModuleList(LlamaDecoderLayer(expert, i)
                                           for i in range(c.num_layers))
        self.expert_norm = RMSNorm(c.expert_width, c.rms_norm_eps)
        self.action_in_proj = nn.Linear(c.action_dim, c.expert_width)
        self.action_time_mlp_in = nn.Linear(2 * c.expert_width, c.expert_width)
        self.action_time_mlp_out = nn.Linear(c.expert_width, c.expert_width)
        self.action_out_proj = nn.Linear(c.expert_width, c.action_dim)
        self.rotary = Rotary(RopeConfig(theta=c.rope_theta), c.head_dim)

    @property
    def device(self) -> torch.device:
        return self.action_out_proj.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.action_out_proj.weight.dtype

    def kv_layout(self) -> Any:
        from mstar_rt.engines.paged_kv import KVLayout

        c = self.config
        return KVLayout(c.num_layers, c.num_kv_heads, c.head_dim, self.dtype, str(self.device))

    def image_tokens(self, pixels: torch.Tensor) -> torch.Tensor:
        """``[B, 3, S, S]`` preprocessed images -> ``[B, num_patches, width]``."""
        return self.multi_modal_projector(self.vision_tower(pixels))

    def prefix_embeds(self, image_tokens: torch.Tensor, prompt: torch.Tensor,
                      state: torch.Tensor) -> torch.Tensor:
        """Image tokens ``[n, width]``, prompt ids ``[L]``, state ``[state_dim]`` -> the prefix
        ``[n + L + 1, width]``."""
        return torch.cat([image_tokens, self.language_model.embed_tokens(prompt),
                          self.state_proj(state)[None]])

    def run_prefix(self, x: torch.Tensor, positions: torch.Tensor, attn: Any) -> None:
        """Runs the prefix through the backbone: only its keys and values matter (written by
        ``attn``), so the last layer's MLP and the final norm are skipped."""
        cos, sin = self.rotary.tables(positions, x.dtype)
        layers = self.language_model.layers
        for layer in layers[:-1]:
            x = layer(x, cos, sin, attn)
        last = layers[-1]
        last.self_attn(last.input_layernorm(x), cos, sin, attn)

    def suffix_embeds(self, x_t: torch.Tensor, tau: torch.Tensor) -> torch.Tensor:
        """Noisy actions ``[H, A]`` at per-action times ``tau [H]`` -> expert tokens."""
        a = self.action_in_proj(x_t)
        t = time_embedding(tau, self.config.expert_width)
        return self.action_time_mlp_out(F.silu(self.action_time_mlp_in(torch.cat([a, t], -1))))

    def velocity(self, suffix: torch.Tensor, positions: torch.Tensor, attn: Any) -> torch.Tensor:
        """Expert over the action tokens (attending to the prefix through ``attn``) -> the
        predicted velocity ``[H, A]``."""
        cos, sin = self.rotary.tables(positions, suffix.dtype)
        x = suffix
        for layer in self.expert_layers:
            x = layer(x, cos, sin, attn)
        return self.action_out_proj(self.expert_norm(x))


# ---- checkpoints and random weights -------------------------------------------------------------

def save_pi0(module: Pi0Module, path: Union[str, os.PathLike]) -> None:
    """Writes ``config.json`` and ``model.safetensors``."""
    from mstar_rt.models.checkpoint import save_checkpoint

    save_checkpoint(module, module.config.to_dict(), path)


def load_pi0(path: Union[str, os.PathLike], dtype: Optional[torch.dtype] = None,
             device: str = "cpu", progress: bool = True) -> Pi0Module:
    """Builds a :class:`Pi0Module` from a checkpoint directory written by :func:`save_pi0`."""
    from mstar_rt.models.checkpoint import (check_weights, load_weights, meta_module,
                                            read_config)

    config = Pi0Config.from_dict(read_config(path), os.path.join(path, "config.json"))
    # the config's sizes against the weights, before allocating
    check_weights(meta_module(lambda: Pi0Module(config), os.path.join(path, "config.json")), path)
    module = Pi0Module(config)
    module = module.to(device=device, dtype=dtype or torch.float32)
    load_weights(module, path, progress=progress)
    return module.eval()


def random_pi0(config: Optional[Pi0Config] = None, seed: int = 0, std: float = 0.1) -> Pi0Module:
    """A pi0 module with random weights (normal, ``std``) for tests and benchmarks."""
    torch.manual_seed(seed)
    module = Pi0Module(config or Pi0Config())
    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.dim() >= 2:
                p.normal_(0, std)
            elif name.endswith("bias"):
                p.normal_(0, 0.02)
    return module.eval()

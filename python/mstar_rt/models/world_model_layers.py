"""The layers of a V-JEPA-2-AC-style action-conditioned predictor.

Each frame is one block of ``2 + num_patches`` tokens: the frame's action token, its state
(proprioception) token and its encoder patch tokens, in that order. Attention is full inside a
block and causal across blocks, so a block's keys and values never change once it is written:
a rollout can cache them and process only the newest block per step. The predictor reads block
``t`` and predicts frame ``t + 1`` (patch features from the patch tokens, the next state from the
state token).

Attention goes through any object with ``attend(layer, q, k, v) -> out`` over flat tokens:
the KV engine's :class:`~mstar_rt.engines.kv_engine.KVStep`, :class:`DenseAttention` (one
sequence and an explicit mask: the recompute reference) or :class:`BatchedRolloutKV` (many
rollouts of the same shape: the CEM planner). Positions are 3-D RoPE (frame, row, column)
derived from each token's sequence position, so all three give the same numbers.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from typing import Any, Optional, Union

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class WorldModelConfig:
    """Sizes of the predictor. ``embed_dim`` is the frame encoder's feature width (what the
    predictor reads and predicts), ``hidden_size`` the predictor's own width; a frame has
    ``grid[0] * grid[1]`` patch tokens. The defaults are a small random model for tests; the
    V-JEPA 2-AC predictor is depth 24, width 1024, 16 heads, a 16x16 grid of 1024-d features."""

    embed_dim: int = 32
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    mlp_ratio: float = 4.0
    grid: tuple[int, int] = (4, 4)
    action_dim: int = 7
    state_dim: int = 7
    max_frames: int = 64
    rope_theta: float = 10000.0
    layer_norm_eps: float = 1e-6
    normalize_reps: bool = True   # layer-norm the predicted features before feeding them back

    def __post_init__(self) -> None:
        object.__setattr__(self, "grid", tuple(int(g) for g in self.grid))
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not a multiple of num_heads "
                             f"{self.num_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim {self.head_dim} must be even for rotary positions")

    @property
    def num_patches(self) -> int:
        return self.grid[0] * self.grid[1]

    @property
    def block_tokens(self) -> int:
        """Tokens per frame block: action, state, patches."""
        return 2 + self.num_patches

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @staticmethod
    def from_dict(d: dict, source: str = "the world-model config") -> "WorldModelConfig":
        """A config.json's fields, each checked (type, range), so a bad one is a ValueError
        naming it rather than an error in a layer, or an absurd allocation."""
        from mstar_rt.models.checkpoint import dataclass_config

        return dataclass_config(WorldModelConfig, d, source,
                                ignore=("model_type", "architectures"))

    def to_dict(self) -> dict:
        return {"model_type": "mstar_ac_predictor", **asdict(self)}


class Rope3D(nn.Module):
    """Rotary positions over (frame, row, column): the head's rotation pairs are split into a
    temporal share and two equal spatial shares. Action and state tokens sit at row = column =
    0; patch (r, c) at (r + 1, c + 1), so no patch shares a spatial position with them."""

    def __init__(self, c: WorldModelConfig) -> None:
        super().__init__()
        pairs = c.head_dim // 2
        spatial = pairs // 3
        self.split = (pairs - 2 * spatial, spatial, spatial)
        self.block, self.width = c.block_tokens, c.grid[1]
        for name, n in zip(("inv_t", "inv_r", "inv_c"), self.split):
            inv = 1.0 / (c.rope_theta ** (torch.arange(n, dtype=torch.float64) / max(n, 1)))
            self.register_buffer(name, inv.float(), persistent=False)

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """cos, sin ``[L, 1, head_dim/2]`` for token positions ``[L]`` (0 = frame 0's action)."""
        frame = torch.div(positions, self.block, rounding_mode="floor")
        slot = positions - frame * self.block
        patch = (slot - 2).clamp(min=0)
        is_patch = slot >= 2
        row = torch.where(is_patch, torch.div(patch, self.width, rounding_mode="floor") + 1, 0)
        col = torch.where(is_patch, patch % self.width + 1, 0)
        angles = torch.cat([frame[:, None].float() * self.inv_t, row[:, None].float() * self.inv_r,
                            col[:, None].float() * self.inv_c], dim=1)
        return angles.cos().to(dtype)[:, None], angles.sin().to(dtype)[:, None]

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotates adjacent pairs of ``x [..., L, H, D]``."""
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2)


class PredictorAttention(nn.Module):
    def __init__(self, c: WorldModelConfig, layer: int) -> None:
        super().__init__()
        self.layer, self.heads, self.head_dim = layer, c.num_heads, c.head_dim
        self.qkv = nn.Linear(c.hidden_size, 3 * c.hidden_size)
        self.proj = nn.Linear(c.hidden_size, c.hidden_size)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: Any) -> torch.Tensor:
        lead = x.shape[:-1]
        q, k, v = self.qkv(x).view(*lead, 3, self.heads, self.head_dim).unbind(-3)
        out = attn.attend(self.layer, Rope3D.apply(q, cos, sin), Rope3D.apply(k, cos, sin), v)
        return self.proj(out.reshape(*lead, -1))


class PredictorBlock(nn.Module):
    def __init__(self, c: WorldModelConfig, layer: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)
        self.attn = PredictorAttention(c, layer)
        self.norm2 = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)
        hidden = int(c.hidden_size * c.mlp_ratio)
        self.fc1 = nn.Linear(c.hidden_size, hidden)
        self.fc2 = nn.Linear(hidden, c.hidden_size)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: Any) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, attn)
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class ACPredictor(nn.Module):
    """The predictor. :meth:`embed` turns frames, states and actions into block tokens,
    :meth:`forward` runs tokens at given positions through the blocks, :meth:`predict` reads the
    next frame and state off the last block's outputs."""

    def __init__(self, config: WorldModelConfig) -> None:
        super().__init__()
        c = self.config = config
        self.predictor_embed = nn.Linear(c.embed_dim, c.hidden_size)
        self.action_encoder = nn.Linear(c.action_dim, c.hidden_size)
        self.state_encoder = nn.Linear(c.state_dim, c.hidden_size)
        self.blocks = nn.ModuleList(PredictorBlock(c, i) for i in range(c.num_layers))
        self.predictor_norm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)
        self.predictor_proj = nn.Linear(c.hidden_size, c.embed_dim)
        self.state_head = nn.Linear(c.hidden_size, c.state_dim)  # proprio dynamics (residual)
        self.rope = Rope3D(c)

    @property
    def device(self) -> torch.device:
        return self.predictor_proj.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.predictor_proj.weight.dtype

    def embed(self, frames: torch.Tensor, states: torch.Tensor,
              actions: torch.Tensor) -> torch.Tensor:
        """frames ``[..., T, N, E]``, states ``[..., T, S]``, actions ``[..., T, A]`` ->
        block tokens ``[..., T * (2 + N), hidden]``."""
        a = self.action_encoder(actions).unsqueeze(-2)
        s = self.state_encoder(states).unsqueeze(-2)
        z = self.predictor_embed(frames)
        x = torch.cat([a, s, z], dim=-2)
        return x.flatten(-3, -2)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, attn: Any) -> torch.Tensor:
        """Tokens ``[..., L, hidden]`` at ``positions [L]`` -> normed outputs (same shape)."""
        cos, sin = self.rope.tables(positions, x.dtype)
        for block in self.blocks:
            x = block(x, cos, sin, attn)
        return self.predictor_norm(x)

    def predict(self, block_out: torch.Tensor, state: torch.Tensor,
                action: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The outputs of one block ``[..., 2 + N, hidden]`` and that frame's state ``[..., S]``
        -> (next frame features ``[..., N, E]``, next state ``[..., S]``). The state head reads
        the action from the block, so ``action`` (the rollout's common interface, which the
        V-JEPA 2-AC predictor's pose update needs) is unused."""
        frame = self.predictor_proj(block_out[..., 2:, :])
        if self.config.normalize_reps:
            frame = F.layer_norm(frame, (frame.shape[-1],))
        return frame, state + self.state_head(block_out[..., 1, :])

    def kv_layout(self) -> Any:
        from mstar_rt.engines.paged_kv import KVLayout

        c = self.config
        return KVLayout(c.num_layers, c.num_heads, c.head_dim, self.dtype, str(self.device))


# ---- attention without the engine ------------------------------------------------------------

class DenseAttention:
    """One sequence ``[L]`` at once with a boolean ``[L, L]`` mask (True = may attend)."""

    def __init__(self, mask: torch.Tensor) -> None:
        self.mask = mask

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1),
                                             v.transpose(0, 1), attn_mask=self.mask)
        return out.transpose(0, 1)


def block_causal_mask(length: int, block: int, device: Any = None) -> torch.Tensor:
    """``[L, L]``: a token sees its whole block and every earlier block."""
    b = torch.arange(length, device=device) // block
    return b[None, :] <= b[:, None]


class BatchedRolloutKV:
    """Per-layer K/V of ``batch`` rollouts that advance in lockstep, one frame block per step,
    preallocated for ``capacity`` tokens. A new block sees every cached token and itself, so no
    mask is needed. :meth:`seed_context` writes a shared context's K/V (computed once) into
    every rollout by broadcasting it -- the dense counterpart of forking a KV prefix."""

    def __init__(self, predictor: ACPredictor, batch: int, capacity: int) -> None:
        c = predictor.config
        shape = (batch, capacity, c.num_heads, c.head_dim)
        self.k = [torch.empty(shape, dtype=predictor.dtype, device=predictor.device)
                  for _ in range(c.num_layers)]
        self.v = [torch.empty_like(t) for t in self.k]
        self.length = 0
        self._new = 0

    def begin(self, new: int) -> None:
        self._new = new

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        end = self.length + self._new
        kc, vc = self.k[layer], self.v[layer]
        kc[:, self.length:end] = k
        vc[:, self.length:end] = v
        out = F.scaled_dot_product_attention(q.transpose(1, 2), kc[:, :end].transpose(1, 2),
                                             vc[:, :end].transpose(1, 2))
        return out.transpose(1, 2)

    def commit(self) -> None:
        self.length += self._new
        self._new = 0

    def seed_context(self, context: "ContextKV") -> None:
        n = context.length
        for layer in range(len(self.k)):
            self.k[layer][:, :n] = context.k[layer]
            self.v[layer][:, :n] = context.v[layer]
        self.length = n


class ContextKV:
    """K/V of one context sequence, recorded while a :class:`DenseAttention` runs it."""

    def __init__(self, mask: torch.Tensor) -> None:
        self.inner = DenseAttention(mask)
        self.k: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}
        self.length = int(mask.shape[0])

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.k[layer], self.v[layer] = k, v
        return self.inner.attend(layer, q, k, v)


# ---- checkpoints -----------------------------------------------------------------------------

def save_world_model(module: ACPredictor, path: Union[str, os.PathLike]) -> None:
    """Writes ``config.json`` and ``model.safetensors`` (the layout :func:`load_world_model`
    and ``checkpoint.load_weights`` read)."""
    from mstar_rt.models.checkpoint import save_checkpoint

    save_checkpoint(module, module.config.to_dict(), path)


def load_world_model(path: Union[str, os.PathLike], dtype: Optional[torch.dtype] = None,
                     device: str = "cpu", progress: bool = True) -> ACPredictor:
    """Builds an :class:`ACPredictor` from a checkpoint directory (``config.json`` with the
    :class:`WorldModelConfig` fields, safetensors weights)."""
    from mstar_rt.models.checkpoint import (check_weights, load_weights, meta_module,
                                            read_config)

    config = WorldModelConfig.from_dict(read_config(path), os.path.join(path, "config.json"))
    # the config's sizes against the weights, before allocating
    check_weights(meta_module(lambda: ACPredictor(config), os.path.join(path, "config.json")), path)
    module = ACPredictor(config)
    module = module.to(device=device, dtype=dtype or torch.float32)
    load_weights(module, path, progress=progress)
    return module.eval()


def random_world_model(config: Optional[WorldModelConfig] = None, seed: int = 0,
                       std: float = 0.1) -> ACPredictor:
    """A predictor with random weights (normal, ``std``) for tests and benchmarks."""
    torch.manual_seed(seed)
    module = ACPredictor(config or WorldModelConfig())
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name == "state_head.weight":  # states drift slowly, as proprioception does
                p.normal_(0, std / 4)
            elif p.dim() == 2:
                p.normal_(0, std)
            elif name.endswith("bias"):
                p.normal_(0, 0.02)
    return module.eval()

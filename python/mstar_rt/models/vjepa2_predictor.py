"""The V-JEPA 2-AC action-conditioned predictor, laid out as upstream's
``VisionTransformerPredictorAC`` (facebookresearch/vjepa2, ``src/models/ac_predictor.py``): the
same parameter names and shapes, so upstream checkpoints load as they are, and the same numbers.

A frame is one block of ``cond + H*W`` tokens: its action token, its state token (and, with
``use_extrinsics``, a camera-extrinsics token), then its encoder patch tokens. Attention is full
inside a block and causal across blocks, so a block's keys and values never change once written:
the rollout walk caches them and runs only the newest block per step. The output of frame t's
patch tokens (normed, projected back to the encoder width) is the prediction of frame t + 1.

Positions are upstream's 3-D RoPE: each head splits into a frame, a row and a column part of
``2 * ((head_dim // 3) // 2)`` dimensions each (the rest is not rotated); the conditioning
tokens of a frame rotate only their frame part. Upstream's rotation pairs adjacent dimensions but
gives the two members of a pair different frequencies (its frequency vector is the half-size one
repeated, not interleaved); the pretrained weights depend on it, so it is kept here.

Attention goes through any object with ``attend(layer, q, k, v) -> out`` over tokens ``[..., L,
heads, head_dim]``: the KV engine's step, :class:`~mstar_rt.models.world_model_layers.
DenseAttention`, :class:`~mstar_rt.models.world_model_layers.BatchedRolloutKV` -- the same
interface as the miniature predictor of ``world_model_layers``, so the ``rollout`` walk and the
CEM machinery serve either.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class VJEPA2ACConfig:
    """Upstream's constructor arguments that shape the predictor (same names). The defaults are
    the published V-JEPA 2-AC predictor (``vjepa2_ac_vit_giant``: 256 px, 16 px patches, 64
    frames in tubelets of 2, over the 1408-wide ViT-g encoder; depth 24, width 1024, 16 heads).
    """

    img_size: tuple[int, int] = (256, 256)
    patch_size: int = 16
    num_frames: int = 64
    tubelet_size: int = 2
    embed_dim: int = 1408
    predictor_embed_dim: int = 1024
    depth: int = 24
    num_heads: int = 16
    mlp_ratio: float = 4.0
    qkv_bias: bool = True
    use_silu: bool = False
    wide_silu: bool = True
    use_rope: bool = True
    is_frame_causal: bool = True
    action_embed_dim: int = 7
    use_extrinsics: bool = False
    layer_norm_eps: float = 1e-6
    normalize_reps: bool = True   # layer-norm predicted features, as upstream's planner does

    def __post_init__(self) -> None:
        size = self.img_size
        if isinstance(size, int):
            size = (size, size)
        object.__setattr__(self, "img_size", tuple(int(s) for s in size))
        if len(self.img_size) != 2 or min(self.img_size) < self.patch_size:
            raise ValueError(f"img_size {self.img_size} must be (height, width), each at least "
                             f"patch_size {self.patch_size}")
        if self.predictor_embed_dim % self.num_heads:
            raise ValueError(f"predictor_embed_dim {self.predictor_embed_dim} is not a multiple "
                             f"of num_heads {self.num_heads}")
        if self.use_rope and self.rope_dim < 4:
            raise ValueError(f"head_dim {self.head_dim} leaves {self.rope_dim} dimensions per "
                             "RoPE axis; upstream needs at least 4 (head_dim >= 12)")
        if self.action_embed_dim < 2:
            raise ValueError("action_embed_dim must be >= 2 (the extrinsics have one less)")
        if not self.is_frame_causal:  # upstream's forward then slices a mask it lacks
            raise ValueError("is_frame_causal=False: upstream's predictor cannot run without "
                             "its frame-causal mask, so no checkpoint has it")
        if self.max_frames < 1:
            raise ValueError(f"num_frames {self.num_frames} // tubelet_size "
                             f"{self.tubelet_size} allows no frame")

    # ---- derived sizes (the names the rollout walk and the CEM planner read) ----

    @property
    def grid(self) -> tuple[int, int]:
        return (self.img_size[0] // self.patch_size, self.img_size[1] // self.patch_size)

    @property
    def num_patches(self) -> int:
        return self.grid[0] * self.grid[1]

    @property
    def cond_tokens(self) -> int:
        """Conditioning tokens per frame: action, state (and extrinsics)."""
        return 3 if self.use_extrinsics else 2

    @property
    def block_tokens(self) -> int:
        return self.cond_tokens + self.num_patches

    @property
    def max_frames(self) -> int:
        """Frame blocks the predictor takes (upstream sizes its mask by this)."""
        return self.num_frames // self.tubelet_size

    @property
    def hidden_size(self) -> int:
        return self.predictor_embed_dim

    @property
    def num_layers(self) -> int:
        return self.depth

    @property
    def head_dim(self) -> int:
        return self.predictor_embed_dim // self.num_heads

    @property
    def rope_dim(self) -> int:
        """Dimensions of each RoPE axis (frame, row, column)."""
        return 2 * ((self.head_dim // 3) // 2)

    @property
    def action_dim(self) -> int:
        return self.action_embed_dim

    @property
    def state_dim(self) -> int:
        return self.action_embed_dim

    @property
    def mlp_hidden(self) -> int:
        hidden = int(self.predictor_embed_dim * self.mlp_ratio)
        if self.use_silu and self.wide_silu:
            hidden = (int(2 * hidden / 3) + 7) // 8 * 8
        return hidden

    @staticmethod
    def from_dict(d: dict, source: str = "the V-JEPA 2-AC predictor config") -> "VJEPA2ACConfig":
        """A config.json's fields, each checked (type, range): a bad one is a ValueError naming
        it, not an error in a layer or an absurd allocation."""
        from mstar_rt.models.checkpoint import dataclass_config

        d = dict(d)
        if isinstance(d.get("img_size"), int):
            d["img_size"] = [d["img_size"]] * 2
        return dataclass_config(VJEPA2ACConfig, d, source, ignore=("model_type", "architectures"))

    def to_dict(self) -> dict:
        return {"model_type": "vjepa2_ac_predictor", **asdict(self)}


# ---- positions ------------------------------------------------------------------------------

def _axis_frequencies(dim: int) -> torch.Tensor:
    """Upstream's frequencies for one RoPE axis of ``dim`` dimensions, in its float32 order of
    operations, repeated (not interleaved) to the full ``dim``."""
    # on the CPU even while a model is built on meta (where arange takes seconds the first time)
    omega = torch.arange(dim // 2, dtype=torch.float32, device="cpu")
    omega /= dim / 2.0
    omega = 1.0 / 10000 ** omega
    return omega.repeat(2)


class ACRope:
    """cos / sin tables ``[L, 3 * rope_dim]`` for flat token positions (0 = frame 0's action).
    The frequencies stay float32 whatever the model's dtype (not a buffer, so ``.to(dtype)``
    leaves them)."""

    def __init__(self, c: VJEPA2ACConfig) -> None:
        self.block, self.cond, self.width = c.block_tokens, c.cond_tokens, c.grid[1]
        # upstream scales rows and columns to its grid height: rows x 1, columns x H / W
        self.row_scale, self.col_scale = 1.0, c.grid[0] / c.grid[1]
        self.omega = _axis_frequencies(c.rope_dim)

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        if self.omega.device != positions.device:
            self.omega = self.omega.to(positions.device)
        frame = torch.div(positions, self.block, rounding_mode="floor")
        slot = positions - frame * self.block
        patch = (slot - self.cond).clamp(min=0)
        is_patch = slot >= self.cond
        row = torch.where(is_patch, torch.div(patch, self.width, rounding_mode="floor"), 0)
        col = torch.where(is_patch, patch % self.width, 0)
        parts = [frame.float()[:, None] * self.omega,
                 (row.float() * self.row_scale)[:, None] * self.omega,
                 (col.float() * self.col_scale)[:, None] * self.omega]
        angles = torch.cat(parts, dim=1)
        return angles.cos().to(dtype), angles.sin().to(dtype)

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """``x [..., L, heads, D]``: the first ``3 * rope_dim`` dimensions turn, pairs (2i,
        2i+1) into (-x[2i+1], x[2i]) for sin; the rest stay as they are."""
        n = cos.shape[-1]
        head = x[..., :n]
        pairs = head.unflatten(-1, (-1, 2))
        turned = torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)
        head = head * cos[:, None, :] + turned * sin[:, None, :]
        return torch.cat([head, x[..., n:]], dim=-1) if n < x.shape[-1] else head


# ---- layers (named as upstream's ACBlock, ACRoPEAttention, MLP, SwiGLUFFN) ------------------

class ACAttention(nn.Module):
    def __init__(self, c: VJEPA2ACConfig, layer: int) -> None:
        super().__init__()
        self.layer, self.heads, self.head_dim = layer, c.num_heads, c.head_dim
        self.qkv = nn.Linear(c.hidden_size, 3 * c.hidden_size, bias=c.qkv_bias)
        self.proj = nn.Linear(c.hidden_size, c.hidden_size)

    def forward(self, x: torch.Tensor, rope: Optional[tuple[torch.Tensor, torch.Tensor]],
                attn: Any) -> torch.Tensor:
        lead = x.shape[:-1]
        q, k, v = self.qkv(x).view(*lead, 3, self.heads, self.head_dim).unbind(-3)
        if rope is not None:
            q, k = ACRope.apply(q, *rope), ACRope.apply(k, *rope)
        return self.proj(attn.attend(self.layer, q, k, v).reshape(*lead, -1))


class MLP(nn.Module):
    def __init__(self, c: VJEPA2ACConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(c.hidden_size, c.mlp_hidden)
        self.fc2 = nn.Linear(c.mlp_hidden, c.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class SwiGLU(nn.Module):
    def __init__(self, c: VJEPA2ACConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(c.hidden_size, c.mlp_hidden)
        self.fc2 = nn.Linear(c.hidden_size, c.mlp_hidden)
        self.fc3 = nn.Linear(c.mlp_hidden, c.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(F.silu(self.fc1(x)) * self.fc2(x))


class ACBlock(nn.Module):
    def __init__(self, c: VJEPA2ACConfig, layer: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)
        self.attn = ACAttention(c, layer)
        self.norm2 = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)
        self.mlp = SwiGLU(c) if c.use_silu else MLP(c)

    def forward(self, x: torch.Tensor, rope: Any, attn: Any) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), rope, attn)
        return x + self.mlp(self.norm2(x))


class MaskedAttention:
    """Dense attention over ``[..., L, heads, D]`` with a boolean ``[L, L]`` mask."""

    def __init__(self, mask: torch.Tensor) -> None:
        self.mask = mask

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out = F.scaled_dot_product_attention(q.transpose(-3, -2), k.transpose(-3, -2),
                                             v.transpose(-3, -2), attn_mask=self.mask)
        return out.transpose(-3, -2)


def frame_causal_mask(frames: int, block: int, device: Any = None) -> torch.Tensor:
    """``[T*block, T*block]``: a token sees its whole frame block and every earlier one."""
    b = torch.arange(frames * block, device=device) // block
    return b[None, :] <= b[:, None]


class VJEPA2ACPredictor(nn.Module):
    """The predictor. :meth:`forward_frames` is upstream's ``forward`` (features, actions and
    states of T frames -> predicted features of frames 1..T); the rollout walk uses the parts:
    :meth:`embed` (block tokens), :meth:`forward` (tokens at flat positions through the blocks,
    attending through ``attn``) and :meth:`predict` (next frame and state off one block)."""

    def __init__(self, config: VJEPA2ACConfig) -> None:
        super().__init__()
        c = self.config = config
        d, a = c.hidden_size, c.action_embed_dim
        self.predictor_embed = nn.Linear(c.embed_dim, d)
        self.action_encoder = nn.Linear(a, d)
        self.state_encoder = nn.Linear(a, d)
        self.extrinsics_encoder = nn.Linear(a - 1, d)  # present even when unused, as upstream
        self.predictor_blocks = nn.ModuleList(ACBlock(c, i) for i in range(c.depth))
        self.predictor_norm = nn.LayerNorm(d, eps=c.layer_norm_eps)
        self.predictor_proj = nn.Linear(d, c.embed_dim)
        self.rope = ACRope(c)

    @property
    def device(self) -> torch.device:
        return self.predictor_proj.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.predictor_proj.weight.dtype

    def embed(self, frames: torch.Tensor, states: torch.Tensor, actions: torch.Tensor,
              extrinsics: Optional[torch.Tensor] = None) -> torch.Tensor:
        """frames ``[..., T, N, E]``, states and actions ``[..., T, 7]`` (extrinsics ``[..., T,
        6]``) -> block tokens ``[..., T * block_tokens, hidden]``."""
        cond = [self.action_encoder(actions), self.state_encoder(states)]
        if self.config.use_extrinsics:
            if extrinsics is None:
                raise ValueError("this predictor has use_extrinsics=True; pass 'extrinsics' "
                                 f"[T, {self.config.action_embed_dim - 1}]")
            cond.append(self.extrinsics_encoder(extrinsics))
        x = torch.cat([t.unsqueeze(-2) for t in cond] + [self.predictor_embed(frames)], dim=-2)
        return x.flatten(-3, -2)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, attn: Any) -> torch.Tensor:
        """Tokens ``[..., L, hidden]`` at ``positions [L]`` -> normed outputs (same shape)."""
        rope = self.rope.tables(positions, x.dtype) if self.config.use_rope else None
        for block in self.predictor_blocks:
            x = block(x, rope, attn)
        return self.predictor_norm(x)

    def project(self, out: torch.Tensor) -> torch.Tensor:
        """Block outputs ``[..., block_tokens, hidden]`` -> predicted features ``[..., N, E]``."""
        return self.predictor_proj(out[..., self.config.cond_tokens:, :])

    def predict(self, block_out: torch.Tensor, state: torch.Tensor,
                action: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One block's outputs, that frame's state and action -> (next frame's features
        ``[..., N, E]``, layer-normed if ``normalize_reps``; next state: upstream's planner pose
        update, :func:`next_pose`)."""
        frame = self.project(block_out)
        if self.config.normalize_reps:
            frame = F.layer_norm(frame, (frame.shape[-1],))
        return frame, next_pose(state, action)

    def forward_frames(self, frames: torch.Tensor, actions: torch.Tensor, states: torch.Tensor,
                       extrinsics: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Upstream's ``forward``: ``frames [B, T*N, E]``, ``actions`` and ``states [B, T, 7]``
        -> ``[B, T*N, E]``, frame t's tokens predicting frame t + 1 (not layer-normed)."""
        c = self.config
        b, t = frames.shape[0], frames.shape[1] // c.num_patches
        if t > c.max_frames:
            raise ValueError(f"{t} frames exceed the predictor's max_frames {c.max_frames} "
                             f"(num_frames {c.num_frames} // tubelet_size {c.tubelet_size})")
        x = self.embed(frames.view(b, t, c.num_patches, -1), states, actions, extrinsics)
        n = x.shape[1]
        mask = frame_causal_mask(t, c.block_tokens, x.device)
        out = self(x, torch.arange(n, device=x.device), MaskedAttention(mask))
        return self.project(out.view(b, t, c.block_tokens, -1)).flatten(1, 2)

    def kv_layout(self) -> Any:
        from mstar_rt.engines.paged_kv import KVLayout

        c = self.config
        if c.use_extrinsics:
            raise ValueError("the rollout walk serves predictors without extrinsics (the "
                             "published V-JEPA 2-AC); use forward_frames for use_extrinsics=True")
        return KVLayout(c.num_layers, c.num_heads, c.head_dim, self.dtype, str(self.device))


# ---- the pose update of upstream's planner (notebooks/utils/mpc_utils.compute_new_pose) ------

def euler_to_matrix(angles: torch.Tensor) -> torch.Tensor:
    """Extrinsic x-y-z Euler angles ``[..., 3]`` -> rotation matrices ``[..., 3, 3]``
    (Rz @ Ry @ Rx, scipy's ``from_euler("xyz")``)."""
    ca, cb, cc = angles.cos().unbind(-1)
    sa, sb, sc = angles.sin().unbind(-1)
    rows = [cb * cc, sa * sb * cc - ca * sc, ca * sb * cc + sa * sc,
            cb * sc, sa * sb * sc + ca * cc, ca * sb * sc - sa * cc,
            -sb, sa * cb, ca * cb]
    return torch.stack(rows, -1).unflatten(-1, (3, 3))


def matrix_to_euler(m: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`euler_to_matrix`: x and z in [-pi, pi], y in [-pi/2, pi/2]."""
    a = torch.atan2(m[..., 2, 1], m[..., 2, 2])
    b = torch.atan2(-m[..., 2, 0], torch.hypot(m[..., 0, 0], m[..., 1, 0]))
    c = torch.atan2(m[..., 1, 0], m[..., 0, 0])
    return torch.stack([a, b, c], -1)


def next_pose(pose: torch.Tensor, action: torch.Tensor) -> torch.Tensor:
    """The end-effector pose after ``action`` (both ``[..., 7]``: xyz, x-y-z Euler angles,
    gripper): positions add, the action's rotation is applied on the left of the pose's, the
    gripper adds and is clipped to [0, 1]. Computed in float64, returned in ``pose``'s dtype."""
    p, a = pose.double(), action.double()
    rot = matrix_to_euler(euler_to_matrix(a[..., 3:6]) @ euler_to_matrix(p[..., 3:6]))
    grip = (p[..., 6:] + a[..., 6:]).clamp(0, 1)
    return torch.cat([p[..., :3] + a[..., :3], rot, grip], -1).to(pose.dtype)


def random_vjepa2_predictor(config: VJEPA2ACConfig, seed: int = 0,
                            std: float = 0.02) -> VJEPA2ACPredictor:
    """A predictor with upstream's initialisation (truncated normal ``std``, zero biases, unit
    norms, output projections scaled by 1/sqrt(2 * layer)) and random biases and norm affines
    of the same scale, so a test exercises every parameter."""
    torch.manual_seed(seed)
    module = VJEPA2ACPredictor(config)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.dim() == 2:
                nn.init.trunc_normal_(p, std=std, a=-2 * std, b=2 * std)
            elif "norm" in name and name.endswith("weight"):
                p.normal_(1.0, std)
            else:
                p.normal_(0.0, std)
        for i, block in enumerate(module.predictor_blocks):
            block.attn.proj.weight.div_(math.sqrt(2.0 * (i + 1)))
            block.mlp.fc2.weight.div_(math.sqrt(2.0 * (i + 1)))  # fc2 also for SwiGLU
    return module.eval()

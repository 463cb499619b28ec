"""SmolVLA's weights and forward pieces, in LeRobot's state-dict layout.

``SmolVLAModule().state_dict()`` has exactly the keys of LeRobot's ``SmolVLAPolicy``:
``model.vlm_with_expert.vlm.model.{vision_model, connector, text_model}``,
``model.vlm_with_expert.vlm.lm_head`` (in the checkpoint, never used for actions),
``model.vlm_with_expert.lm_expert.{layers.N, norm}`` and the heads ``model.state_proj``,
``model.action_in_proj``, ``model.action_out_proj``, ``model.action_time_mlp_in/out``.

The math is LeRobot's (``smolvlm_with_expert.py``, ``modeling_smolvla.py``):

* prefix = [image tokens of each camera, prompt tokens, one state token]; image and text
  embeddings are scaled by sqrt(text width); image and prompt tokens attend to each other both
  ways, the state token to everything; the VLM keeps its first ``num_vlm_layers`` layers.
* RoPE is LeRobot's ``apply_rope`` (max wavelength 10000, halves rotated), not the text
  config's ``rope_theta``.
* the action expert (Llama layers of width ``expert_width_multiplier`` x the text width, the
  VLM's heads and head size) runs the action tokens: its self-attention layers attend to the
  VLM's cached prefix K/V of that layer and causally to the action tokens (positions continue
  after the prefix); its cross-attention layers (every layer not a multiple of
  ``self_attn_every_n_layers``) attend only to the prefix, whose cached K/V their own
  ``k_proj``/``v_proj`` map, with query positions restarting at 0.

Attention goes through objects with ``attend(layer, q, k, v)`` over flat tokens ``[T, H, D]``
(a :class:`~mstar_rt.engines.kv_engine.KVStep`, or a dense reference); cross-attention through
a callable ``cross(layer, q) -> [T, H, D]``.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from mstar_rt.models.llama import RMSNorm
from mstar_rt.models.smolvla_config import ROPE_MAX_WAVELENGTH, SmolVLAConfig
from mstar_rt.models.smolvla_vision import Connector, SmolVLMVision

Cross = Callable[[int, torch.Tensor], torch.Tensor]


def rope_tables(positions: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin ``[T, 1, head_dim / 2]`` (float32) of LeRobot's ``apply_rope``."""
    exponents = (2.0 / head_dim) * torch.arange(head_dim // 2, dtype=torch.float32,
                                                device=positions.device)
    timescale = ROPE_MAX_WAVELENGTH ** exponents
    radians = positions.to(torch.float32)[:, None] / timescale[None, :]
    return radians.cos()[:, None, :], radians.sin()[:, None, :]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotates ``x [T, H, D]`` in float32 (first half against second), back in x's dtype."""
    half = x.shape[-1] // 2
    xf = x.float()
    x1, x2 = xf[..., :half], xf[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def time_embedding(t: torch.Tensor, width: int, min_period: float,
                   max_period: float) -> torch.Tensor:
    """Sine-cosine embedding of flow times ``[B] -> [B, width]`` (computed in float64)."""
    fraction = torch.linspace(0.0, 1.0, width // 2, dtype=torch.float64, device=t.device)
    period = min_period * (max_period / min_period) ** fraction
    angle = (1.0 / period * 2 * math.pi)[None, :] * t[:, None]
    return torch.cat([angle.sin(), angle.cos()], dim=1)


class Attention(nn.Module):
    """Llama attention projections; ``kv_width`` is what ``k_proj``/``v_proj`` read (the
    layer's width, or the VLM's K/V width in an expert cross-attention layer)."""

    def __init__(self, width: int, kv_width: int, heads: int, kv_heads: int, head_dim: int,
                 bias: bool, layer: int) -> None:
        super().__init__()
        self.layer, self.heads, self.kv_heads, self.head_dim = layer, heads, kv_heads, head_dim
        self.q_proj = nn.Linear(width, heads * head_dim, bias)
        self.k_proj = nn.Linear(kv_width, kv_heads * head_dim, bias)
        self.v_proj = nn.Linear(kv_width, kv_heads * head_dim, bias)
        self.o_proj = nn.Linear(heads * head_dim, width, bias)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                attn: Any) -> torch.Tensor:
        t = x.shape[0]
        q = apply_rope(self.q_proj(x).view(t, self.heads, self.head_dim), *rope)
        k = apply_rope(self.k_proj(x).view(t, self.kv_heads, self.head_dim), *rope)
        v = self.v_proj(x).view(t, self.kv_heads, self.head_dim)
        out = attn.attend(self.layer, q, k, v)
        return self.o_proj(out.reshape(t, -1))

    def cross(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
              cross: Cross) -> torch.Tensor:
        t = x.shape[0]
        q = apply_rope(self.q_proj(x).view(t, self.heads, self.head_dim), *rope)
        return self.o_proj(cross(self.layer, q).reshape(t, -1))

    def project_kv(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The VLM's prefix K/V ``[n, kv_heads, D]`` as this cross-attention layer sees them."""
        n = k.shape[0]
        return (self.k_proj(k.reshape(n, -1)).view(n, -1, self.head_dim),
                self.v_proj(v.reshape(n, -1)).view(n, -1, self.head_dim))


class MLP(nn.Module):
    def __init__(self, width: int, hidden: int, bias: bool) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(width, hidden, bias)
        self.up_proj = nn.Linear(width, hidden, bias)
        self.down_proj = nn.Linear(hidden, width, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, width: int, mlp: int, kv_width: int, c: SmolVLAConfig, layer: int) -> None:
        super().__init__()
        t = c.text
        self.self_attn = Attention(width, kv_width, t.num_heads, t.num_kv_heads, t.head_dim,
                                   t.attention_bias, layer)
        self.mlp = MLP(width, mlp, t.mlp_bias)
        self.input_layernorm = RMSNorm(width, t.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(width, t.rms_norm_eps)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], attn: Any,
                cross: Optional[Cross] = None) -> torch.Tensor:
        h = self.input_layernorm(x)
        x = x + (self.self_attn(h, rope, attn) if cross is None else
                 self.self_attn.cross(h, rope, cross))
        return x + self.mlp(self.post_attention_layernorm(x))


class TextModel(nn.Module):
    def __init__(self, c: SmolVLAConfig) -> None:
        super().__init__()
        t = c.text
        self.embed_tokens = nn.Embedding(t.vocab_size, t.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(t.hidden_size, t.intermediate_size,
                                                 t.hidden_size, c, i)
                                    for i in range(c.num_layers))
        self.norm = RMSNorm(t.hidden_size, t.rms_norm_eps)


class Expert(nn.Module):
    def __init__(self, c: SmolVLAConfig) -> None:
        super().__init__()
        w, kv = c.expert_width, c.text.num_kv_heads * c.text.head_dim
        self.layers = nn.ModuleList(DecoderLayer(w, c.expert_mlp_width, kv if c.is_cross(i) else w,
                                                 c, i) for i in range(c.num_layers))
        self.norm = RMSNorm(w, c.text.rms_norm_eps)


class SmolVLMBody(nn.Module):
    def __init__(self, c: SmolVLAConfig) -> None:
        super().__init__()
        self.vision_model = SmolVLMVision(c.vision)
        self.connector = Connector(c.vision.hidden_size, c.text.hidden_size, c.scale_factor)
        self.text_model = TextModel(c)


class SmolVLM(nn.Module):
    def __init__(self, c: SmolVLAConfig, lm_head: bool) -> None:
        super().__init__()
        self.model = SmolVLMBody(c)
        if lm_head:  # in every checkpoint; SmolVLA never produces logits
            self.lm_head = nn.Linear(c.text.hidden_size, c.text.vocab_size, bias=False)


class VLMWithExpert(nn.Module):
    def __init__(self, c: SmolVLAConfig, lm_head: bool) -> None:
        super().__init__()
        self.vlm = SmolVLM(c, lm_head)
        self.lm_expert = Expert(c)


class FlowMatching(nn.Module):
    def __init__(self, c: SmolVLAConfig, lm_head: bool) -> None:
        super().__init__()
        w, ew = c.text.hidden_size, c.expert_width
        self.vlm_with_expert = VLMWithExpert(c, lm_head)
        self.state_proj = nn.Linear(c.max_state_dim, w)
        self.action_in_proj = nn.Linear(c.max_action_dim, ew)
        self.action_out_proj = nn.Linear(ew, c.max_action_dim)
        self.action_time_mlp_in = nn.Linear(2 * ew, ew)
        self.action_time_mlp_out = nn.Linear(ew, ew)


class SmolVLAModule(nn.Module):
    """SmolVLA's weights (LeRobot's keys) and the pieces of its forward pass.
    ``lm_head=False`` leaves out the unused vocabulary projection (the loader's default)."""

    def __init__(self, config: SmolVLAConfig, lm_head: bool = True) -> None:
        super().__init__()
        self.config = config
        self.model = FlowMatching(config, lm_head)

    # ---- parts ---------------------------------------------------------------------------------

    @property
    def vlm(self) -> SmolVLMBody:
        return self.model.vlm_with_expert.vlm.model

    @property
    def expert(self) -> Expert:
        return self.model.vlm_with_expert.lm_expert

    @property
    def device(self) -> torch.device:
        return self.model.action_out_proj.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.action_out_proj.weight.dtype

    def kv_layout(self) -> Any:
        from mstar_rt.engines.paged_kv import KVLayout

        c = self.config
        return KVLayout(c.num_layers, c.text.num_kv_heads, c.text.head_dim, self.dtype,
                        str(self.device))

    @property
    def cross_layers(self) -> list[int]:
        return [i for i in range(self.config.num_layers) if self.config.is_cross(i)]

    # ---- the prefix ----------------------------------------------------------------------------

    def embed_images(self, pixels: torch.Tensor) -> torch.Tensor:
        """``[B, 3, S, S]`` (resized, in [-1, 1]) -> ``[B, tokens_per_image, text width]``, not
        yet scaled (LeRobot's ``embed_image``)."""
        return self.vlm.connector(self.vlm.vision_model(pixels))

    def prefix_embeds(self, image_embs: torch.Tensor, prompt: torch.Tensor,
                      state: torch.Tensor) -> torch.Tensor:
        """Image tokens ``[m, width]`` (every camera, unscaled), prompt ids ``[L]``, the
        normalised state padded to ``max_state_dim`` -> the prefix ``[m + L + 1, width]``."""
        width = self.config.text.hidden_size
        images = image_embs * torch.tensor(width ** 0.5, dtype=image_embs.dtype,
                                           device=image_embs.device)
        text = self.vlm.text_model.embed_tokens(prompt) * math.sqrt(width)
        return torch.cat([images, text, self.model.state_proj(state)[None]])

    def run_prefix(self, x: torch.Tensor, positions: torch.Tensor, attn: Any,
                   final_norm: bool = False) -> Optional[torch.Tensor]:
        """The VLM over prefix tokens ``[T, width]``; only the K/V that ``attn`` sees matter,
        so the last layer's MLP is skipped unless ``final_norm`` asks for the normed hidden
        states (LeRobot's prefix output, which no action depends on)."""
        rope = rope_tables(positions, self.config.text.head_dim)
        layers = self.vlm.text_model.layers
        if final_norm:
            for layer in layers:
                x = layer(x, rope, attn)
            return self.vlm.text_model.norm(x)
        for layer in layers[:-1]:
            x = layer(x, rope, attn)
        last: DecoderLayer = layers[-1]  # type: ignore[assignment]
        last.self_attn(last.input_layernorm(x), rope, attn)
        return None

    def cross_kv(self, layer: int, k: torch.Tensor,
                 v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The VLM's prefix K/V of ``layer`` (after RoPE) mapped for the expert's
        cross-attention layer ``layer``."""
        attention: Attention = self.expert.layers[layer].self_attn  # type: ignore[assignment]
        return attention.project_kv(k, v)

    # ---- the action expert ---------------------------------------------------------------------

    def time_embeds(self, t: torch.Tensor) -> torch.Tensor:
        """Flow times ``[B]`` -> their sine-cosine embeddings ``[B, expert_width]`` (dtype)."""
        c = self.config
        return time_embedding(t.reshape(-1), c.expert_width, c.min_period,
                              c.max_period).to(self.dtype)

    def suffix_embeds(self, x_t: torch.Tensor, t: Optional[torch.Tensor],
                      rows: Optional[torch.Tensor] = None,
                      time: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Noisy actions ``[T, max_action_dim]`` at flow times ``t [B]`` (``rows [T]``: each
        token's request; None: one request, ``t`` a 1-element tensor) -> expert tokens ``[T,
        expert_width]``. ``time``: ``time_embeds(t)`` if the caller keeps them (``t`` may then be
        None: a chunk's flow times recur)."""
        m = self.model
        a = m.action_in_proj(x_t.to(self.dtype))
        if time is None:
            assert t is not None, "suffix_embeds needs the flow times or their embeddings"
            time = self.time_embeds(t)
        te = time.to(a.dtype)
        te = te.expand_as(a) if rows is None else te[rows]
        return m.action_time_mlp_out(F.silu(m.action_time_mlp_in(torch.cat([a, te], dim=-1))))

    def expert_forward(self, suffix: torch.Tensor, positions: Optional[torch.Tensor], attn: Any,
                       cross_positions: Optional[torch.Tensor], cross: Cross,
                       tables: Optional[tuple] = None) -> torch.Tensor:
        """The expert over action tokens ``[T, expert_width]`` -> its final-normed output.
        ``positions`` (after each request's prefix) rotate the self-attention layers,
        ``cross_positions`` (from 0 in each request) the cross-attention layers; or ``tables``,
        both positions' :func:`rope_tables` if the caller keeps them."""
        if tables is None:
            assert positions is not None and cross_positions is not None
            hd = self.config.text.head_dim
            tables = (rope_tables(positions, hd), rope_tables(cross_positions, hd))
        own, other = tables
        x = suffix
        for i, layer in enumerate(self.expert.layers):
            if self.config.is_cross(i):
                x = layer(x, other, None, cross)
            else:
                x = layer(x, own, attn)
        return self.expert.norm(x)

    def velocity(self, expert_out: torch.Tensor) -> torch.Tensor:
        return self.model.action_out_proj(expert_out).float()


def parameter_count(module: nn.Module) -> tuple[int, int]:
    """(tensors, parameters) of a module's state dict (meta tensors count too)."""
    state = module.state_dict()
    return len(state), sum(t.numel() for t in state.values())

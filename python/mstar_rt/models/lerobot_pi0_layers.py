"""The pi0 / pi0.5 network as LeRobot defines it (``PI0Pytorch`` / ``PI05Pytorch``), on flat
tokens: SigLIP tower and projector, the PaliGemma Gemma backbone over the prefix, the Gemma
action expert over the suffix, and the action, state and time heads.

* pi0: the suffix is ``[state_proj(state), action_time_mlp_out(silu(action_time_mlp_in(
  [action_in_proj(x_t), sincos(t)])))]``; the expert's norms are plain Gemma norms.
* pi0.5: the state is text in the prompt; the suffix is ``action_in_proj(x_t)`` and the flow
  time enters every expert norm through adaRMS, conditioned on ``silu(time_mlp_out(silu(
  time_mlp_in(sincos(t)))))``.

Module names are short (``vision_tower``, ``backbone``, ``expert``, the heads);
:func:`lerobot_key` gives each parameter's key in LeRobot's state dict, so a checkpoint loads
key for key. The lm_heads are not built: the policy never decodes text.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from mstar_rt.models.gemma import Cond, GemmaStack, Stream, make_rope, run_streams
from mstar_rt.models.lerobot_pi0_config import BACKBONE, EXPERT, PROJECTOR, VISION, PiConfig
from mstar_rt.models.siglip import SiglipVisionTower

#: Own parameter-name prefix -> LeRobot's (the first that matches; heads sit under ``model.``).
KEY_PREFIXES = (("vision_tower.", VISION), ("multi_modal_projector.", PROJECTOR),
                ("backbone.", BACKBONE), ("expert.", EXPERT), ("", "model."))


def lerobot_key(own: str) -> str:
    for mine, theirs in KEY_PREFIXES:
        if own.startswith(mine):
            return theirs + own[len(mine):]
    raise AssertionError(own)  # the last prefix matches everything


def own_key(lerobot: str) -> Optional[str]:
    """The module's parameter name for a LeRobot key (None if no parameter has it)."""
    for mine, theirs in KEY_PREFIXES:
        if lerobot.startswith(theirs):
            return mine + lerobot[len(theirs):]
    return None


def sincos_time(t: torch.Tensor, width: int, min_period: float, max_period: float
                ) -> torch.Tensor:
    """openpi's sine-cosine embedding of flow times ``t [B] -> [B, width]``, in float64 and cast
    to ``t``'s dtype (periods from ``min_period`` to ``max_period``)."""
    fraction = torch.linspace(0.0, 1.0, width // 2, dtype=torch.float64, device=t.device)
    period = min_period * (max_period / min_period) ** fraction
    angle = (1.0 / period * 2 * math.pi)[None, :] * t[:, None]
    return torch.cat([torch.sin(angle), torch.cos(angle)], dim=1).to(t.dtype)


class PiModule(nn.Module):
    """Weights and the pieces of the forward pass. Attention goes through any object with
    ``attend(layer, q, k, v)`` over flat tokens (a KV-engine step or a dense reference)."""

    def __init__(self, config: PiConfig) -> None:
        super().__init__()
        c = self.config = config
        self.vision_tower = SiglipVisionTower(c.vision)
        self.multi_modal_projector = nn.Linear(c.vision.hidden_size, c.backbone.width)
        self.backbone = GemmaStack(c.backbone, c.rms_norm_eps, vocab_size=c.vocab_size)
        w = c.expert.width
        self.expert = GemmaStack(c.expert, c.rms_norm_eps, cond_dim=w if c.adarms else None)
        self.action_in_proj = nn.Linear(c.max_action_dim, w)
        self.action_out_proj = nn.Linear(w, c.max_action_dim)
        if c.adarms:
            self.time_mlp_in = nn.Linear(w, w)
            self.time_mlp_out = nn.Linear(w, w)
        else:
            self.state_proj = nn.Linear(c.max_state_dim, w)
            self.action_time_mlp_in = nn.Linear(2 * w, w)
            self.action_time_mlp_out = nn.Linear(w, w)
        self.rope = make_rope(c.backbone.head_dim)

    @property
    def device(self) -> torch.device:
        return self.action_out_proj.weight.device

    @property
    def dtype(self) -> torch.dtype:
        """The transformers' dtype: their tokens' and the KV cache's."""
        return self.backbone.layers[0].self_attn.q_proj.weight.dtype  # type: ignore[union-attr]

    @property
    def head_dtype(self) -> torch.dtype:
        """The heads' dtype, and the flow state's (float32 under LeRobot's bfloat16, see
        :func:`lerobot_precision`)."""
        return self.action_out_proj.weight.dtype

    def kv_layout(self) -> Any:
        from mstar_rt.engines.paged_kv import KVLayout

        b = self.config.backbone
        return KVLayout(b.depth, b.num_kv_heads, b.head_dim, self.dtype, str(self.device))

    # ---- prefix ------------------------------------------------------------------------------

    def image_tokens(self, pixels: torch.Tensor) -> torch.Tensor:
        """``[N, 3, S, S]`` images in [-1, 1] -> ``[N, patches, width]`` (SigLIP's last hidden
        state, post-layernormed, through the projector; no scaling)."""
        vision = self.multi_modal_projector.weight.dtype
        return self.multi_modal_projector(self.vision_tower(pixels.to(vision))).to(self.dtype)

    def prompt_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        return self.backbone.embed(ids)

    def state_token(self, state: torch.Tensor) -> torch.Tensor:
        """pi0: normalised states zero-padded to ``max_state_dim`` ``[B, D]`` -> ``[B, width]``."""
        return self.state_proj(state.to(self.head_dtype)).to(self.dtype)

    def run_prefix(self, prefix: torch.Tensor, positions: torch.Tensor, attend: Any,
                   prefix_rows: Optional[torch.Tensor] = None,
                   state: Optional[torch.Tensor] = None,
                   state_rows: Optional[torch.Tensor] = None, final: bool = False
                   ) -> list[Optional[torch.Tensor]]:
        """The backbone over ``prefix`` tokens and (pi0) the expert over state tokens, in one
        attention call per layer: their keys and values are what ``attend`` keeps. ``final``
        also returns their final-normed hidden states (else the last layer stops after its
        attention)."""
        streams = [Stream(self.backbone, prefix, prefix_rows)]
        if state is not None:
            streams.append(Stream(self.expert, state, state_rows))
        return run_streams(streams, positions, attend, self.rope, final)

    # ---- suffix ------------------------------------------------------------------------------

    def time_embedding(self, t: torch.Tensor) -> torch.Tensor:
        c = self.config
        return sincos_time(t, c.expert.width, c.min_period, c.max_period)

    def action_tokens(self, x_t: torch.Tensor, t: Optional[torch.Tensor], rows: torch.Tensor,
                      time: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, Optional[Cond]]:
        """Noisy actions ``[T, max_action_dim]`` of requests at flow times ``t [B]`` (``rows
        [T]``: each token's request) -> expert tokens, and pi0.5's adaRMS condition. ``time``:
        ``time_embedding(t)`` if the caller has it already (a flow step's times recur; ``t`` may
        then be None)."""
        a = self.action_in_proj(x_t.to(self.head_dtype))
        if time is None:
            assert t is not None, "action_tokens needs the flow times or their embedding"
            time = self.time_embedding(t.float())
        time = time.to(a.dtype)
        if self.config.adarms:  # the condition stays in the heads' dtype, as the norms' dense
            cond = F.silu(self.time_mlp_out(F.silu(self.time_mlp_in(time))))
            return a.to(self.dtype), Cond(cond, rows)
        fused = torch.cat([a, time[rows]], dim=-1)
        tokens = self.action_time_mlp_out(F.silu(self.action_time_mlp_in(fused)))
        return tokens.to(self.dtype), None

    def expert_out(self, tokens: torch.Tensor, positions: torch.Tensor, attend: Any,
                   cond: Optional[Cond], tables: Optional[tuple] = None) -> torch.Tensor:
        """The expert over suffix tokens, attending to the prefix through ``attend`` -> its
        final-normed hidden states (``tables``: the positions' rotary tables, if at hand)."""
        out = run_streams([Stream(self.expert, tokens, None, cond)], positions, attend,
                          self.rope, tables=tables)[0]
        assert out is not None
        return out

    def velocity(self, tokens: torch.Tensor, positions: torch.Tensor, attend: Any,
                 cond: Optional[Cond], tables: Optional[tuple] = None) -> torch.Tensor:
        """Action tokens -> the flow velocity ``[T, max_action_dim]`` (heads' dtype)."""
        out = self.expert_out(tokens, positions, attend, cond, tables)
        return self.action_out_proj(out.to(self.head_dtype))


#: What LeRobot keeps in float32 when a policy runs in bfloat16 (``PaliGemmaWithExpertModel.
#: to_bfloat16_for_selected_params``: substrings of its parameter names); its heads, outside
#: that module, stay float32 too.
LEROBOT_FLOAT32 = ("vision_tower", "multi_modal_projector", "input_layernorm",
                   "post_attention_layernorm", "model.norm")
WITH_EXPERT = "model.paligemma_with_expert."


def lerobot_precision(module: PiModule, dtype: torch.dtype) -> PiModule:
    """``module`` in ``dtype`` as LeRobot runs it: in float32 all of it; otherwise the Gemma
    layers' matrices and embeddings in ``dtype`` and the vision tower, projector, norms and
    heads in float32 (the flow state, time conditioning and velocities then stay float32)."""
    module.to(dtype)
    if dtype != torch.float32:
        for name, p in module.named_parameters():
            if stays_float32(name):
                p.data = p.data.float()
    return module


def stays_float32(name: str) -> bool:
    """Whether parameter ``name`` stays float32 in a reduced-precision LeRobot pi0."""
    key = lerobot_key(name)
    return not key.startswith(WITH_EXPERT) or any(part in key for part in LEROBOT_FLOAT32)


def meta_pi_module(config: PiConfig) -> PiModule:
    """The module on the meta device: shapes without memory."""
    with torch.device("meta"):
        return PiModule(config)


def parameter_count(config: PiConfig, with_lm_heads: bool = True) -> tuple[int, int]:
    """(tensors, parameters) of LeRobot's state dict for ``config`` (its lm_heads included
    unless ``with_lm_heads=False``: the module does not keep them)."""
    state = meta_pi_module(config).state_dict()
    tensors, params = len(state), sum(v.numel() for v in state.values())
    if with_lm_heads:
        tensors += 2
        params += config.vocab_size * (config.backbone.width + config.expert.width)
    return tensors, params

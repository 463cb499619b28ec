"""The sizes and settings of a pi0 / pi0.5 policy as LeRobot saves it, read from its
``config.json`` and the shapes in its ``model.safetensors``.

LeRobot's config names only the variants (``paligemma_variant="gemma_2b"``,
``action_expert_variant="gemma_300m"``) and builds the SigLIP tower with PaliGemma's defaults
(So400m/14); the real sizes of those names are in :data:`~mstar_rt.models.gemma.GEMMA_VARIANTS`
and :data:`SIGLIP_SO400M`. A checkpoint whose tensors have other shapes (a tiny test model, a
custom one) gets the widths, depths, MLP sizes and head size read from its tensors; the head
counts cannot be read from shapes, so they are the variant's (8 query heads, 1 KV head; 16 for
So400m) unless ``sizes`` gives them -- and a vision tower that is not So400m's width needs
``sizes={"vision_heads": N}``.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace
from typing import Any, Mapping, Optional

from mstar_rt.models.gemma import GEMMA_VARIANTS, GemmaSizes
from mstar_rt.models.lerobot_rtc import RtcSettings, rtc_settings
from mstar_rt.models.siglip import SiglipConfig

FAMILIES = ("pi0", "pi05")
#: PaliGemma's vision tower as LeRobot builds it (transformers' defaults, 224 px images).
SIGLIP_SO400M = SiglipConfig(hidden_size=1152, intermediate_size=4304, num_layers=27,
                             num_heads=16, image_size=224, patch_size=14, layer_norm_eps=1e-6)
#: PaliGemma's vocabulary (LeRobot sets it for the text embedding and both lm_heads).
PALIGEMMA_VOCAB = 257152
#: Head counts ``sizes`` may give (shapes cannot tell them).
SIZE_OVERRIDES = ("vision_heads", "backbone_heads", "backbone_kv_heads", "expert_heads",
                  "expert_kv_heads")
NORM_MODES = ("IDENTITY", "MEAN_STD", "MIN_MAX", "QUANTILES", "QUANTILE10")

_PALI = "model.paligemma_with_expert.paligemma."
VISION = _PALI + "model.vision_tower.vision_model."
PROJECTOR = _PALI + "model.multi_modal_projector.linear."
BACKBONE = _PALI + "model.language_model."
EXPERT = "model.paligemma_with_expert.gemma_expert.model."
#: The lm_heads LeRobot's state dict holds; a policy never decodes text, so they are not kept.
LM_HEADS = (_PALI + "lm_head.weight", "model.paligemma_with_expert.gemma_expert.lm_head.weight")


@dataclass(frozen=True)
class PiConfig:
    """Everything the module and its processor need. ``cameras`` are the checkpoint's image
    features in order; ``state_dim`` / ``action_dim`` the dataset's sizes (zero-padded to
    ``max_state_dim`` / ``max_action_dim`` inside the model)."""

    family: str
    backbone: GemmaSizes
    expert: GemmaSizes
    vision: SiglipConfig
    vocab_size: int = PALIGEMMA_VOCAB
    cameras: tuple[str, ...] = ("observation.images.base_0_rgb",)
    state_dim: int = 32
    action_dim: int = 32
    chunk_size: int = 50
    n_action_steps: int = 50
    max_state_dim: int = 32
    max_action_dim: int = 32
    num_steps: int = 10
    min_period: float = 4e-3
    max_period: float = 4.0
    tokenizer_max_length: int = 48
    state_norm: str = "MEAN_STD"
    action_norm: str = "MEAN_STD"
    rms_norm_eps: float = 1e-6
    rtc: Optional[RtcSettings] = None
    checkpoint_dtype: str = "float32"

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"family must be one of {FAMILIES}; got {self.family!r}")
        b, e = self.backbone, self.expert
        if (b.depth, b.num_kv_heads, b.head_dim) != (e.depth, e.num_kv_heads, e.head_dim):
            raise ValueError(f"the backbone ({b}) and the action expert ({e}) must have the same "
                             "depth, KV heads and head size: their layers share attention")
        if self.state_dim > self.max_state_dim or self.action_dim > self.max_action_dim:
            raise ValueError(f"state ({self.state_dim}) and action ({self.action_dim}) sizes "
                             f"must fit max_state_dim {self.max_state_dim} and max_action_dim "
                             f"{self.max_action_dim}")

    @property
    def adarms(self) -> bool:
        """pi0.5: the flow time enters the expert through adaptive RMSNorm."""
        return self.family == "pi05"

    @property
    def num_image_tokens(self) -> int:
        return self.vision.num_patches

    @property
    def max_prefix(self) -> int:
        """Cached tokens of one request at most: every camera, a full prompt (and pi0's
        state token)."""
        return (len(self.cameras) * self.num_image_tokens + self.tokenizer_max_length
                + (self.family == "pi0"))


def full_size(family: str, image_resolution: int = 224) -> PiConfig:
    """LeRobot's default pi0 / pi0.5 (PaliGemma 3B: So400m + gemma_2b; a gemma_300m expert)."""
    if family not in FAMILIES:
        raise ValueError(f"family must be one of {FAMILIES}; got {family!r}")
    return PiConfig(family, GEMMA_VARIANTS["gemma_2b"], GEMMA_VARIANTS["gemma_300m"],
                    replace(SIGLIP_SO400M, image_size=image_resolution),
                    tokenizer_max_length=48 if family == "pi0" else 200)


def checkpoint_layout(c: PiConfig) -> dict[str, tuple[int, ...]]:
    """Key -> shape of the state dict LeRobot saves for ``c`` (lm_heads included)."""
    from mstar_rt.models.lerobot_pi0_layers import lerobot_key, meta_pi_module

    layout = {lerobot_key(k): tuple(v.shape) for k, v in meta_pi_module(c).state_dict().items()}
    layout[LM_HEADS[0]] = (c.vocab_size, c.backbone.width)
    layout[LM_HEADS[1]] = (c.vocab_size, c.expert.width)
    return layout


# ---- reading a LeRobot config.json against the tensor shapes -----------------------------------

def _layers(shapes: Mapping[str, tuple], prefix: str) -> int:
    found = {int(m.group(1)) for k in shapes for m in [re.match(re.escape(prefix)
                                                                + r"layers\.(\d+)\.", k)] if m}
    return max(found) + 1 if found else 0


def _shape(shapes: Mapping[str, tuple], key: str, source: str) -> tuple:
    if key not in shapes:
        raise ValueError(f"{source}: missing key '{key}'; the checkpoint is truncated or not a "
                         "LeRobot pi0 / pi0.5 policy")
    return shapes[key]


def _gemma(shapes: Mapping[str, tuple], prefix: str, variant: str, what: str,
           heads: Optional[int], kv_heads: Optional[int], source: str) -> GemmaSizes:
    if variant not in GEMMA_VARIANTS:
        raise ValueError(f"{source}: the {what} variant {variant!r} is unknown; LeRobot "
                         f"builds {sorted(GEMMA_VARIANTS)}")
    v = GEMMA_VARIANTS[variant]
    layer0 = prefix + "layers.0."
    q = _shape(shapes, layer0 + "self_attn.q_proj.weight", source)
    k = _shape(shapes, layer0 + "self_attn.k_proj.weight", source)
    mlp = _shape(shapes, layer0 + "mlp.gate_proj.weight", source)
    heads, kv_heads = heads or v.num_heads, kv_heads or v.num_kv_heads
    if len(q) != 2 or len(k) != 2 or len(mlp) != 2 or k[0] % kv_heads:
        raise ValueError(f"{source}: the {what}'s attention weights {q} / {k} do not fit "
                         f"{kv_heads} KV head(s); give sizes={{'{what}_kv_heads': N}}")
    head_dim = k[0] // kv_heads
    if q[0] != heads * head_dim:
        raise ValueError(f"{source}: the {what}'s q_proj has {q[0]} rows, not {heads} heads x "
                         f"{head_dim}; give sizes={{'{what}_heads': N, '{what}_kv_heads': M}}")
    return GemmaSizes(width=q[1], depth=_layers(shapes, prefix), mlp_dim=mlp[0],
                      num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim)


def _vision(shapes: Mapping[str, tuple], resolution: int, heads: Optional[int],
            source: str) -> SiglipConfig:
    patch = _shape(shapes, VISION + "embeddings.patch_embedding.weight", source)
    positions = _shape(shapes, VISION + "embeddings.position_embedding.weight", source)
    fc1 = _shape(shapes, VISION + "encoder.layers.0.mlp.fc1.weight", source)
    hidden, p = patch[0], patch[-1]
    side = math.isqrt(positions[0])
    if side * side != positions[0] or side * p != resolution:
        raise ValueError(f"{source}: the vision tower has {positions[0]} positions of {p} px "
                         f"patches, which does not fit image_resolution {resolution}")
    if heads is None:
        if hidden != SIGLIP_SO400M.hidden_size:
            raise ValueError(f"{source}: the vision tower is {hidden} wide, not So400m's "
                             f"{SIGLIP_SO400M.hidden_size}, and its head count cannot be read "
                             "from the weights; give sizes={'vision_heads': N}")
        heads = SIGLIP_SO400M.num_heads
    if hidden % heads:
        raise ValueError(f"{source}: vision width {hidden} is not a multiple of {heads} heads")
    return SiglipConfig(hidden_size=hidden, intermediate_size=fc1[0],
                        num_layers=_layers(shapes, VISION + "encoder."), num_heads=heads,
                        image_size=resolution, patch_size=p, layer_norm_eps=1e-6)


def _features(cfg: Mapping[str, Any], name: str, source: str) -> Mapping[str, Any]:
    value = cfg.get(name) or {}
    if not isinstance(value, Mapping) or not all(
            isinstance(v, Mapping) and isinstance(v.get("shape"), list) for v in value.values()):
        raise ValueError(f"{source}: '{name}' must map feature names to {{type, shape}}")
    return value


def config_from_checkpoint(cfg: Mapping[str, Any], shapes: Mapping[str, tuple], source: str,
                           sizes: Optional[Mapping[str, int]] = None) -> PiConfig:
    """A :class:`PiConfig` from LeRobot's ``config.json`` fields and the checkpoint's tensor
    shapes (keys in LeRobot's layout, see :func:`~mstar_rt.models.lerobot_pi0_load.
    canonical_keys`); ValueError naming the field or key otherwise."""
    from mstar_rt.models.checkpoint import ConfigFields

    sizes = dict(sizes or {})
    unknown = sorted(set(sizes) - set(SIZE_OVERRIDES))
    if unknown:
        raise ValueError(f"sizes {unknown} are not known; give any of {list(SIZE_OVERRIDES)}")
    bad = {k: v for k, v in sizes.items() if type(v) is not int or v < 1}
    if bad:  # 0 divided by zero in a layer, '2' failed as a TypeError
        raise ValueError(f"sizes {bad}: head counts are integers >= 1")
    f = ConfigFields(cfg, source)
    family = f.text("type")
    if family not in FAMILIES:
        raise ValueError(f"{source}: type {family!r} is not a pi0 or pi0.5 policy "
                         f"(expected one of {FAMILIES})")
    if cfg.get("use_relative_actions"):
        raise ValueError(f"{source}: use_relative_actions=true (actions relative to the state) "
                         "is not supported; serve a policy trained with absolute actions")
    res = cfg.get("image_resolution", [224, 224])
    if not (isinstance(res, list) and len(res) == 2 and res[0] == res[1]
            and type(res[0]) is int and res[0] > 0):
        raise ValueError(f"{source}: image_resolution {res!r} must be a square [S, S]")
    inputs = _features(cfg, "input_features", source)
    outputs = _features(cfg, "output_features", source)
    cameras = tuple(k for k, v in inputs.items() if v.get("type") == "VISUAL")
    if not cameras:
        raise ValueError(f"{source}: input_features name no VISUAL feature (camera)")
    modes = f.mapping("normalization_mapping")
    for kind in ("STATE", "ACTION"):
        if modes.get(kind, "IDENTITY") not in NORM_MODES:
            raise ValueError(f"{source}: normalization_mapping.{kind} {modes.get(kind)!r} is "
                             f"not one of {NORM_MODES}")
    heads = {k: sizes.get(k) for k in SIZE_OVERRIDES}
    backbone = _gemma(shapes, BACKBONE, f.text("paligemma_variant", "gemma_2b"), "backbone",
                      heads["backbone_heads"], heads["backbone_kv_heads"], source)
    expert = _gemma(shapes, EXPERT, f.text("action_expert_variant", "gemma_300m"), "expert",
                    heads["expert_heads"], heads["expert_kv_heads"], source)
    vocab = _shape(shapes, BACKBONE + "embed_tokens.weight", source)[0]
    max_state = f.integer("max_state_dim", 32)
    max_action = f.integer("max_action_dim", 32)
    state = _feature_size(inputs, "observation.state", max_state, source)
    action = _feature_size(outputs, "action", max_action, source)
    chunk, steps = f.integer("chunk_size", 50), f.integer("n_action_steps", 50)
    if steps > chunk:
        raise ValueError(f"{source}: n_action_steps {steps} is more than chunk_size {chunk} "
                         "(a chunk holds that many actions)")
    dtype = f.text("dtype", "float32")
    if dtype not in ("float32", "bfloat16", "float16"):  # 'bf16' loaded float32 without a word
        raise ValueError(f"{source}: dtype {dtype!r} is not one of 'float32', 'bfloat16', "
                         "'float16'")
    return PiConfig(
        family=family, backbone=backbone, expert=expert,
        vision=_vision(shapes, res[0], heads["vision_heads"], source), vocab_size=vocab,
        cameras=cameras, state_dim=state, action_dim=action,
        chunk_size=chunk, n_action_steps=steps,
        max_state_dim=max_state, max_action_dim=max_action,
        num_steps=f.integer("num_inference_steps", 10),
        min_period=f.number("min_period", 4e-3), max_period=f.number("max_period", 4.0),
        tokenizer_max_length=f.integer("tokenizer_max_length", 48 if family == "pi0" else 200),
        state_norm=modes.get("STATE", "IDENTITY"), action_norm=modes.get("ACTION", "IDENTITY"),
        rtc=rtc_settings(cfg.get("rtc_config"), source),
        checkpoint_dtype=dtype)


def _feature_size(features: Mapping[str, Any], key: str, default: int, source: str) -> int:
    """The one size of a 1-D feature (``shape: [n]``); [] was an IndexError, [6.7] taken as 6."""
    shape = features.get(key, {}).get("shape", [default])
    if not (isinstance(shape, list) and len(shape) == 1 and type(shape[0]) is int
            and shape[0] >= 1):
        raise ValueError(f"{source}: {key}.shape {shape!r} must be [n], n an integer >= 1")
    return shape[0]

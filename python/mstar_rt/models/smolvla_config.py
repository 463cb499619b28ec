"""SmolVLA's sizes and settings, read from a LeRobot checkpoint's ``config.json`` and the
SmolVLM backbone's ``config.json`` (the folder its ``vlm_model_name`` names).

Only what changes the math is kept; every field is checked (type, range, supported value), so a
bad one is a ValueError naming the file and the field. Fields LeRobot accepts but that cannot
change a valid token's result are accepted and ignored: ``prefix_length`` and
``pad_language_to`` only add padding that attention masks out, ``use_cache`` only chooses
between two equal computations.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional

from mstar_rt.models.checkpoint import MAX_LAYERS, ConfigFields
from mstar_rt.models.lerobot_rtc import RtcSettings, rtc_settings

#: LeRobot's feature names.
STATE_KEY = "observation.state"
ACTION_KEY = "action"
NORM_MODES = ("IDENTITY", "MEAN_STD", "MIN_MAX", "QUANTILES", "QUANTILE10")
ROPE_MAX_WAVELENGTH = 10_000  # LeRobot's apply_rope; the text config's rope_theta is not used


@dataclass(frozen=True)
class SmolVLMTextSizes:
    """The SmolVLM text model (Llama layout); ``num_layers`` is what its config says, before
    SmolVLA keeps the first ``num_vlm_layers``."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    attention_bias: bool = False
    mlp_bias: bool = False


@dataclass(frozen=True)
class SmolVLMVisionSizes:
    """The SmolVLM vision transformer (SigLIP layout, NaViT position buckets)."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    image_size: int
    patch_size: int
    layer_norm_eps: float = 1e-6
    num_channels: int = 3

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size


@dataclass(frozen=True)
class SmolVLAConfig:
    """One SmolVLA policy: the backbone's sizes, the policy's settings and its features."""

    text: SmolVLMTextSizes
    vision: SmolVLMVisionSizes
    scale_factor: int
    cameras: tuple[str, ...]          # image features, in the order the prefix takes them
    state_dim: int
    action_dim: int
    chunk_size: int = 50
    n_action_steps: int = 50
    max_state_dim: int = 32
    max_action_dim: int = 32
    resize_imgs_with_padding: tuple[int, int] = (512, 512)   # (width, height), as LeRobot's
    tokenizer_max_length: int = 48
    num_steps: int = 10
    num_vlm_layers: int = 16
    self_attn_every_n_layers: int = 2
    expert_width_multiplier: float = 0.75
    attention_mode: str = "cross_attn"
    min_period: float = 4e-3
    max_period: float = 4.0
    normalization: tuple[tuple[str, str], ...] = (("VISUAL", "IDENTITY"), ("STATE", "MEAN_STD"),
                                                  ("ACTION", "MEAN_STD"))
    rtc: Optional[RtcSettings] = None  # the checkpoint's rtc_config (LeRobot's guided RTC)

    @property
    def num_layers(self) -> int:
        """Layers of the VLM that SmolVLA keeps, and of its expert."""
        n = self.num_vlm_layers
        return min(n, self.text.num_layers) if n > 0 else self.text.num_layers

    @property
    def expert_width(self) -> int:
        return int(self.text.hidden_size * self.expert_width_multiplier)

    @property
    def expert_mlp_width(self) -> int:
        """LeRobot's ``get_intermediate_size``: 2/3 of 4x the width, up to a multiple of 256."""
        hidden = int(4 * int(2 * self.expert_width / 3))
        return 256 * ((hidden + 255) // 256)

    def is_cross(self, layer: int) -> bool:
        """Whether expert layer ``layer`` cross-attends to the VLM's prefix K/V (its own
        ``k_proj``/``v_proj`` map them) instead of self-attending over [prefix; actions]."""
        n = self.self_attn_every_n_layers
        return "cross" in self.attention_mode and not (n > 0 and layer % n == 0)

    @property
    def image_side(self) -> int:
        return self.resize_imgs_with_padding[1]

    @property
    def tokens_per_image(self) -> int:
        side = self.image_side // self.vision.patch_size
        return side * side // (self.scale_factor ** 2)

    @property
    def max_prefix(self) -> int:
        return len(self.cameras) * self.tokens_per_image + self.tokenizer_max_length + 1

    def norm_mode(self, feature_type: str) -> str:
        return dict(self.normalization).get(feature_type, "IDENTITY")


def _sizes_text(raw: Any, source: str) -> SmolVLMTextSizes:
    c = ConfigFields(raw, source)
    kind = c.text("model_type", "llama")
    if kind != "llama":
        raise ValueError(f"{source} has model_type {kind!r}; SmolVLA's text model is a 'llama'")
    act = c.text("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"field 'hidden_act' of {source} is {act!r}; SmolVLA needs 'silu'")
    hidden, heads = c.integer("hidden_size", 4096), c.integer("num_attention_heads", 32)
    kv = c.integer("num_key_value_heads", heads)
    if heads % kv:
        raise ValueError(f"num_attention_heads {heads} in {source} is not a multiple of "
                         f"num_key_value_heads {kv}")
    return SmolVLMTextSizes(
        vocab_size=c.integer("vocab_size", 32000), hidden_size=hidden,
        intermediate_size=c.integer("intermediate_size", 11008),
        num_layers=c.integer("num_hidden_layers", 32, maximum=MAX_LAYERS), num_heads=heads,
        num_kv_heads=kv, head_dim=c.integer("head_dim", max(hidden // heads, 1)),
        rms_norm_eps=c.number("rms_norm_eps", 1e-5), attention_bias=c.flag("attention_bias", False),
        mlp_bias=c.flag("mlp_bias", False))


def _sizes_vision(raw: Any, source: str) -> SmolVLMVisionSizes:
    c = ConfigFields(raw, source)
    act = c.text("hidden_act", "gelu_pytorch_tanh")
    if act != "gelu_pytorch_tanh":
        raise ValueError(f"field 'hidden_act' of {source} is {act!r}; SmolVLM's vision model "
                         "uses 'gelu_pytorch_tanh'")
    hidden, heads = c.integer("hidden_size", 1152), c.integer("num_attention_heads", 16)
    if hidden % heads:
        raise ValueError(f"hidden_size {hidden} in {source} is not a multiple of "
                         f"num_attention_heads {heads}")
    v = SmolVLMVisionSizes(
        hidden_size=hidden, intermediate_size=c.integer("intermediate_size", 3072),
        num_layers=c.integer("num_hidden_layers", 12, maximum=MAX_LAYERS), num_heads=heads,
        image_size=c.integer("image_size", 224), patch_size=c.integer("patch_size", 32),
        layer_norm_eps=c.number("layer_norm_eps", 1e-6),
        num_channels=c.integer("num_channels", 3))
    if v.num_channels != 3:
        raise ValueError(f"field 'num_channels' of {source} is {v.num_channels}; cameras give RGB")
    return v


def _features(raw: Any, kind: str, source: str) -> dict[str, tuple[str, tuple[int, ...]]]:
    c = ConfigFields({kind: raw}, source)
    feats = c.mapping(kind)
    out = {}
    for key, f in feats.items():
        fc = ConfigFields(f, f"feature '{key}' of {source}")
        shape = f.get("shape") if isinstance(f, Mapping) else None
        if not (isinstance(shape, (list, tuple)) and all(type(s) is int and s > 0 for s in shape)):
            raise ValueError(f"feature '{key}' of {source} needs a 'shape' of positive integers")
        out[str(key)] = (fc.text("type"), tuple(shape))
    return out


def smolvla_config(policy: Mapping[str, Any], vlm: Mapping[str, Any], policy_source: str,
                   vlm_source: str) -> SmolVLAConfig:
    """The config of a LeRobot SmolVLA checkpoint (``policy``: its config.json) whose backbone
    is described by ``vlm`` (the SmolVLM folder's config.json)."""
    p = ConfigFields(policy, policy_source)
    if p.text("type", "smolvla") != "smolvla":
        raise ValueError(f"{policy_source} is a {policy.get('type')!r} policy, not 'smolvla'")
    for name in ("adapt_to_pi_aloha", "use_delta_joint_actions_aloha", "add_image_special_tokens"):
        if p.flag(name, False):
            raise ValueError(f"field '{name}' of {policy_source} is true; mstar_rt's SmolVLA "
                             "does not implement it (only the default, false)")
    rtc = rtc_settings(policy.get("rtc_config"), policy_source)
    if p.integer("n_obs_steps", 1) != 1:
        raise ValueError(f"field 'n_obs_steps' of {policy_source} must be 1")
    mode = p.text("attention_mode", "cross_attn")
    if mode not in ("cross_attn", "self_attn"):
        raise ValueError(f"field 'attention_mode' of {policy_source} is {mode!r}; LeRobot "
                         "knows 'cross_attn' and 'self_attn'")
    inputs = _features(policy.get("input_features", {}), "input_features", policy_source)
    outputs = _features(policy.get("output_features", {}), "output_features", policy_source)
    cameras = tuple(k for k, (t, _s) in inputs.items() if t == "VISUAL")
    if not cameras:
        raise ValueError(f"{policy_source} lists no VISUAL input feature; SmolVLA needs a camera")
    if STATE_KEY not in inputs or ACTION_KEY not in outputs:
        raise ValueError(f"{policy_source} needs input feature '{STATE_KEY}' and output feature "
                         f"'{ACTION_KEY}'")
    norm = p.mapping("normalization_mapping")
    for t, m in norm.items():
        if m not in NORM_MODES:
            raise ValueError(f"normalization_mapping['{t}'] of {policy_source} is {m!r}; "
                             f"known: {list(NORM_MODES)}")
    resize = policy.get("resize_imgs_with_padding", [512, 512])
    if not (isinstance(resize, (list, tuple)) and len(resize) == 2 and
            all(type(s) is int and s > 0 for s in resize)):
        raise ValueError(f"field 'resize_imgs_with_padding' of {policy_source} must be "
                         f"[width, height] (positive integers); got {resize!r}")
    experts = p.integer("num_expert_layers", -1, minimum=-1)
    v = ConfigFields(vlm, vlm_source)
    kind = v.text("model_type", "smolvlm")
    if kind not in ("smolvlm", "idefics3"):
        raise ValueError(f"{vlm_source} has model_type {kind!r}; SmolVLA's backbone is 'smolvlm'")
    config = SmolVLAConfig(
        text=_sizes_text(v.mapping("text_config"), f"text_config of {vlm_source}"),
        vision=_sizes_vision(v.mapping("vision_config"), f"vision_config of {vlm_source}"),
        scale_factor=v.integer("scale_factor", 2),
        cameras=cameras, state_dim=inputs[STATE_KEY][1][-1],
        action_dim=outputs[ACTION_KEY][1][-1],
        chunk_size=p.integer("chunk_size", 50), n_action_steps=p.integer("n_action_steps", 50),
        max_state_dim=p.integer("max_state_dim", 32),
        max_action_dim=p.integer("max_action_dim", 32),
        resize_imgs_with_padding=(resize[0], resize[1]),
        tokenizer_max_length=p.integer("tokenizer_max_length", 48),
        num_steps=p.integer("num_steps", 10),
        num_vlm_layers=p.integer("num_vlm_layers", 16, minimum=-1, maximum=MAX_LAYERS),
        self_attn_every_n_layers=p.integer("self_attn_every_n_layers", 2, minimum=-1),
        expert_width_multiplier=p.number("expert_width_multiplier", 0.75),
        attention_mode=mode,
        min_period=p.number("min_period", 4e-3), max_period=p.number("max_period", 4.0),
        normalization=tuple(sorted((str(k), str(m)) for k, m in norm.items())) or
        SmolVLAConfig.normalization, rtc=rtc)
    check_config(config, policy_source, experts)
    return config


def check_config(c: SmolVLAConfig, source: str, num_expert_layers: int = -1) -> None:
    """The rules between fields that LeRobot's modules would trip over later (or silently)."""
    if num_expert_layers > 0 and num_expert_layers != c.num_layers:
        raise ValueError(f"field 'num_expert_layers' of {source} is {num_expert_layers}; only an "
                         f"expert as deep as the kept VLM ({c.num_layers} layers, -1) is supported")
    if c.n_action_steps > c.chunk_size:
        raise ValueError(f"n_action_steps {c.n_action_steps} exceeds chunk_size {c.chunk_size} "
                         f"in {source}")
    if c.state_dim > c.max_state_dim or c.action_dim > c.max_action_dim:
        raise ValueError(f"{source}: state ({c.state_dim}) and action ({c.action_dim}) "
                         f"dimensions must fit max_state_dim {c.max_state_dim} and "
                         f"max_action_dim {c.max_action_dim}")
    w, h = c.resize_imgs_with_padding
    unit = c.vision.patch_size * c.scale_factor
    if w != h or h % unit:
        raise ValueError(f"resize_imgs_with_padding {[w, h]} in {source} must be square and a "
                         f"multiple of patch_size x scale_factor = {unit} (the connector's pixel "
                         "shuffle needs a square grid it can divide)")
    if h > c.vision.image_size:
        raise ValueError(f"resize_imgs_with_padding {h} in {source} exceeds the vision model's "
                         f"image_size {c.vision.image_size} (it has no position for the extra "
                         "patches)")
    if c.expert_width < 2 or c.expert_width % 2:
        raise ValueError(f"expert width {c.expert_width} (hidden_size x expert_width_multiplier) "
                         f"from {source} must be even (the time embedding is sine and cosine)")
    if c.text.head_dim % 2:
        raise ValueError(f"head_dim {c.text.head_dim} must be even (rotary embedding)")


def smolvla_base_config(cameras: tuple[str, ...] = ("observation.images.camera1",
                                                    "observation.images.camera2",
                                                    "observation.images.camera3"),
                        state_dim: int = 6, action_dim: int = 6) -> SmolVLAConfig:
    """``lerobot/smolvla_base``: LeRobot's defaults over SmolVLM2-500M-Video-Instruct (text:
    width 960, MLP 2560, 15 heads, 5 KV heads, head size 64, 32 layers of which 16 are kept;
    vision: width 768, MLP 3072, 12 layers, 12 heads, 16 px patches of 512 px images; pixel
    shuffle 4). Cameras and dimensions only shape the inputs, not the weights."""
    return SmolVLAConfig(
        text=SmolVLMTextSizes(vocab_size=49280, hidden_size=960, intermediate_size=2560,
                              num_layers=32, num_heads=15, num_kv_heads=5, head_dim=64),
        vision=SmolVLMVisionSizes(hidden_size=768, intermediate_size=3072, num_layers=12,
                                  num_heads=12, image_size=512, patch_size=16),
        scale_factor=4, cameras=tuple(cameras), state_dim=state_dim, action_dim=action_dim)

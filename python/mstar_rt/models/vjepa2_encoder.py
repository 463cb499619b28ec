"""The V-JEPA 2 video encoder as the world model's frame encoder.

The encoder is transformers' ``VJEPA2Encoder`` itself (the module behind ``VJEPA2Model``; the
``transformers`` package is needed at run time), so its features are transformers' to the last
bit. What this module adds is what the action-conditioned planner does with it (upstream's
``notebooks/utils/world_model_wrapper.py``): every camera image becomes its own clip of
``tubelet_size`` identical frames, so it yields one frame of ``(crop / patch)^2`` patch
features, layer-normed without affine (``normalize_reps``), the form the AC predictor reads and
predicts.

Checkpoints: a Hugging Face directory (``facebook/vjepa2-vitg-fpc64-256``, whose 1408-wide ViT-g
features the published AC predictor reads; ``VJEPA2Model`` or ``VJEPA2ForVideoClassification``
keys, whose predictor, pooler and classifier are skipped), or upstream's ``.pt``
(``vjepa2-ac-vitg.pt``: its ``encoder`` section, upstream key names, mapped here: one ``qkv``
becomes ``query`` / ``key`` / ``value``).
"""

from __future__ import annotations

import os
import re
import sys
from typing import Any, Optional, Union

import torch
import torch.nn.functional as F
from torch import nn

from mstar_rt.models.vjepa2_checkpoint import (TensorSource, check_state, describe_memory,
                                               open_section)

PathLike = Union[str, os.PathLike]
#: ImageNet statistics, which upstream's and transformers' V-JEPA 2 preprocessing normalize with.
IMAGE_MEAN = (0.485, 0.456, 0.406)
IMAGE_STD = (0.229, 0.224, 0.225)
#: What normalized pixels span (0 and 255 through the mean and std above), with a margin.
NORMALIZED_RANGE = (-2.2, 2.7)
#: Sections of a Hugging Face V-JEPA 2 checkpoint that are not the encoder.
NOT_ENCODER = ("predictor.", "pooler.", "classifier.")


def _transformers() -> Any:
    try:
        from transformers import VJEPA2Config
        from transformers.models.vjepa2.modeling_vjepa2 import VJEPA2Encoder
    except ImportError as e:
        raise ImportError("the V-JEPA 2 encoder is transformers' VJEPA2Encoder; install "
                          f"transformers>=4.53 ({e})") from None
    return VJEPA2Config, VJEPA2Encoder


def vitg_encoder_config(**overrides: Any) -> Any:
    """The ``VJEPA2Config`` of ``facebook/vjepa2-vitg-fpc64-256``: upstream's
    ``vit_giant_xformers`` (width 1408, 40 layers, 22 heads, MLP ratio 48/11) at 256 px."""
    config_cls, _ = _transformers()
    fields = dict(hidden_size=1408, num_hidden_layers=40, num_attention_heads=22,
                  mlp_ratio=48 / 11, crop_size=256, patch_size=16, frames_per_clip=64,
                  tubelet_size=2)
    fields.update(overrides)
    return config_cls(**fields)


class VJEPA2FrameEncoder(nn.Module):
    """transformers' ``VJEPA2Encoder`` (as ``self.encoder``, so the state-dict keys are those
    of ``VJEPA2Model``) with the planner's per-image use of it."""

    def __init__(self, config: Any, normalize_reps: bool = True) -> None:
        super().__init__()
        _, encoder_cls = _transformers()
        if getattr(config, "_attn_implementation", None) in (None, "eager"):
            config._attn_implementation = "sdpa"
        self.config, self.normalize_reps = config, normalize_reps
        self.encoder = encoder_cls(config)

    @property
    def device(self) -> torch.device:
        return self.encoder.layernorm.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.encoder.layernorm.weight.dtype

    @property
    def num_patches(self) -> int:
        return (self.config.crop_size // self.config.patch_size) ** 2

    @property
    def embed_dim(self) -> int:
        return self.config.hidden_size

    def encode_video(self, video: torch.Tensor) -> torch.Tensor:
        """``video [B, T, 3, H, W]`` (normalized pixels) -> ``[B, T / tubelet * N, D]``:
        ``VJEPA2Model.get_vision_features``."""
        video = video.to(device=self.device, dtype=self.dtype)
        return self.encoder(pixel_values_videos=video).last_hidden_state

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """``images [B, 3, H, W]`` (normalized pixels) -> per image ``[B, N, D]`` features,
        each image encoded alone as a still clip, layer-normed if ``normalize_reps``."""
        clips = images[:, None].expand(-1, self.config.tubelet_size, -1, -1, -1)
        h = self.encode_video(clips)
        return F.layer_norm(h, (h.shape[-1],)) if self.normalize_reps else h


def check_images(images: Any, crop: int, what: str = "images") -> torch.Tensor:
    """``images``: uint8 RGB ``[C, H, W, 3]`` (normalized here with the ImageNet statistics,
    as the V-JEPA 2 processors do) or already normalized float ``[C, 3, H, W]``; one image may
    drop the leading C. Returns float32 ``[C, 3, crop, crop]``; ValueError naming ``what``."""
    if images is None:
        raise ValueError(f"world model input '{what}' is missing")
    x = torch.as_tensor(images)
    if x.dim() == 3:
        x = x[None]
    if x.dim() != 4:
        raise ValueError(f"'{what}' must be uint8 [C, {crop}, {crop}, 3] or float "
                         f"[C, 3, {crop}, {crop}]; got {list(x.shape)}")
    if x.dtype == torch.uint8:
        if tuple(x.shape[1:]) != (crop, crop, 3):
            raise ValueError(f"uint8 '{what}' must be RGB [C, {crop}, {crop}, 3] (resize and "
                             f"crop to the encoder's {crop} px first); got {list(x.shape)}")
        mean = torch.tensor(IMAGE_MEAN).view(1, 3, 1, 1)
        std = torch.tensor(IMAGE_STD).view(1, 3, 1, 1)
        return (x.permute(0, 3, 1, 2).float() / 255.0 - mean) / std
    if not x.is_floating_point() or tuple(x.shape[1:]) != (3, crop, crop):
        raise ValueError(f"float '{what}' must be normalized pixels [C, 3, {crop}, {crop}]; "
                         f"got {x.dtype} {list(x.shape)}")
    if not bool(torch.isfinite(x).all()):
        raise ValueError(f"'{what}' holds NaN or infinite values; give finite numbers")
    # Normalized pixels lie within about [-2.2, 2.7]; 0-255 floats (or 0-1 ones of another
    # recipe, which stay in range) passed and predicted another frame.
    low, high = float(x.min()), float(x.max())
    if low < NORMALIZED_RANGE[0] or high > NORMALIZED_RANGE[1]:
        raise ValueError(f"float '{what}' must be normalized pixels ((x / 255 - mean) / std, "
                         f"within {list(NORMALIZED_RANGE)}); got values from {low:g} to "
                         f"{high:g}: give uint8 [C, {crop}, {crop}, 3] to have them normalized")
    return x.float()


# ---- checkpoints ------------------------------------------------------------------------------

_UPSTREAM = [  # upstream VisionTransformer key -> transformers VJEPA2Encoder key
    (r"patch_embed\.proj\.(weight|bias)", r"encoder.embeddings.patch_embeddings.proj.\1"),
    (r"blocks\.(\d+)\.(norm1|norm2)\.(weight|bias)", r"encoder.layer.\1.\2.\3"),
    (r"blocks\.(\d+)\.attn\.proj\.(weight|bias)", r"encoder.layer.\1.attention.proj.\2"),
    (r"blocks\.(\d+)\.mlp\.(fc1|fc2)\.(weight|bias)", r"encoder.layer.\1.mlp.\2.\3"),
    (r"norm\.(weight|bias)", r"encoder.layernorm.\1"),
]
_QKV = re.compile(r"blocks\.(\d+)\.attn\.qkv\.(weight|bias)")


def from_upstream_keys(found: TensorSource) -> TensorSource:
    """Upstream's encoder keys (``blocks.3.attn.qkv.weight``, ...) as transformers'
    (``encoder.layer.3.attention.query.weight``, ...); ``pos_embed`` (unused with RoPE, which
    upstream's hub also skips) is dropped, keys neither knows are kept as they are, so the
    check names them."""
    shapes, reads = {}, {}
    for key, (shape, dtype) in found.shapes.items():
        if key == "pos_embed":
            continue
        m = _QKV.fullmatch(key)
        if m:
            third = shape[0] // 3
            for i, part in enumerate(("query", "key", "value")):
                name = f"encoder.layer.{m[1]}.attention.{part}.{m[2]}"
                shapes[name] = ((third,) + tuple(shape[1:]), dtype)
                reads[name] = (key, slice(i * third, (i + 1) * third))
            continue
        name = key
        for pattern, repl in _UPSTREAM:
            if re.fullmatch(pattern, key):
                name = re.sub(pattern, repl, key)
                break
        shapes[name] = (shape, dtype)
        reads[name] = (key, None)

    def read(name: str) -> torch.Tensor:
        key, part = reads[name]
        t = found.read(key)
        return t if part is None else t[part]

    return TensorSource(found.source, shapes, read)


def _hf_encoder_only(found: TensorSource) -> TensorSource:
    shapes = {}
    for key, value in found.shapes.items():
        k = key[len("vjepa2."):] if key.startswith("vjepa2.") else key
        if not k.startswith(NOT_ENCODER):
            shapes[k] = value
    names = {(k[len("vjepa2."):] if k.startswith("vjepa2.") else k): k for k in found.shapes}
    return TensorSource(found.source, shapes, lambda name: found.read(names[name]))


def _checked_hf_config(fields: dict[str, Any], source: str) -> Any:
    """transformers' VJEPA2Config from config.json, after the checks it leaves out: its own
    errors are not all ValueErrors (StrictDataclassFieldValidationError), and a head count of
    0, an unknown activation or 100000 layers failed deep in the model's build, or after
    minutes of it."""
    from mstar_rt.models.checkpoint import MAX_LAYERS, ConfigFields

    c = ConfigFields(fields, source)
    for name in ("hidden_size", "num_attention_heads", "patch_size", "tubelet_size",
                 "crop_size", "frames_per_clip", "in_chans", "pred_hidden_size",
                 "pred_num_attention_heads"):
        if name in fields:
            c.integer(name)
    for name in ("num_hidden_layers", "pred_num_hidden_layers", "num_pooler_layers"):
        if name in fields:
            c.integer(name, maximum=MAX_LAYERS)
    for name in ("mlp_ratio", "pred_mlp_ratio", "layer_norm_eps"):
        if name in fields:
            c.number(name)
    for name in ("hidden_size", "pred_hidden_size"):
        heads = fields.get(name.replace("hidden_size", "num_attention_heads"))
        if name in fields and type(heads) is int and heads > 0 and fields[name] % heads:
            raise ValueError(f"{name} {fields[name]} in {source} is not a multiple of its "
                             f"attention heads ({heads})")
    act = fields.get("hidden_act", "gelu")
    from transformers.activations import ACT2FN

    if act not in ACT2FN:
        raise ValueError(f"hidden_act {act!r} in {source} is not an activation transformers "
                         f"knows")
    try:
        return _transformers()[0](**fields)
    except Exception as e:  # TypeError, ValueError, StrictDataclassFieldValidationError
        raise ValueError(f"{source} is not a V-JEPA 2 config: {type(e).__name__}: {e}") from None


def load_vjepa2_encoder(path: PathLike, config: Any = None, dtype: Optional[torch.dtype] = None,
                        device: str = "cpu", progress: bool = True,
                        normalize_reps: bool = True, section: str = "encoder"
                        ) -> VJEPA2FrameEncoder:
    """The encoder of a Hugging Face V-JEPA 2 directory (its config.json gives the sizes), or
    of upstream's ``.pt`` (its ``section``: ``encoder`` in ``vjepa2-ac-vitg.pt``,
    ``target_encoder`` in the pretraining checkpoints; ``config`` default
    :func:`vitg_encoder_config`, the one the published AC predictor reads). Keys and shapes are checked before anything is
    allocated; with ``progress`` the memory it takes per dtype is printed (stderr)."""
    path = os.fspath(path)
    dtype = dtype or torch.float32
    hf = os.path.isdir(path) and os.path.exists(os.path.join(path, "config.json"))
    if config is None:
        if hf:
            from mstar_rt.models.checkpoint import read_config

            fields = {k: v for k, v in read_config(path).items()
                      if k not in ("architectures", "model_type", "transformers_version")}
            source = os.path.join(path, "config.json")
            config = _checked_hf_config(fields, source)
        else:
            config = vitg_encoder_config()
    found = open_section(path, "" if hf else section)
    found = _hf_encoder_only(found) if hf else from_upstream_keys(found)
    try:
        with torch.device("meta"):
            meta = VJEPA2FrameEncoder(config, normalize_reps)
    except Exception as e:  # sizes transformers' modules cannot take (a head count of 0, ...)
        raise ValueError(f"the V-JEPA 2 config cannot build the encoder: {type(e).__name__}: "
                         f"{e}") from None
    check_state(meta, found, "V-JEPA 2 encoder", " (pass the VJEPA2Config it was trained with)")
    if progress:
        print(describe_memory(meta, "V-JEPA 2 encoder", dtype), file=sys.stderr)
    module = VJEPA2FrameEncoder(config, normalize_reps).to(device=device, dtype=dtype)
    with torch.no_grad():
        for key, target in module.state_dict().items():
            target.copy_(found.read(key).to(dtype))
    return module.eval()

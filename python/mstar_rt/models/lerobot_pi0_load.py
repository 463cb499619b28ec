"""Loading a pi0 / pi0.5 policy from the directory LeRobot's ``save_pretrained`` writes.

``load_lerobot_pi0(dir)`` reads ``config.json`` (``type``: ``pi0`` or ``pi05``), the safetensors
headers, the normalizer statistics and the tokenizer; checks every key and shape against the
layout the config and shapes give before allocating anything (a missing key, an unexpected one,
a wrong shape or integer weights are a ValueError naming the key); prints the memory the weights
take per dtype; then builds the module and copies the tensors in.

Key names are LeRobot's (``model.paligemma_with_expert.paligemma.model.{vision_tower.
vision_model, multi_modal_projector.linear, language_model}.*``, ``model.paligemma_with_expert.
gemma_expert.model.*``, ``model.{action_in_proj, action_out_proj, state_proj,
action_time_mlp_in/out | time_mlp_in/out}``). As LeRobot does on load, keys without the
``model.`` prefix (openpi's converted layout) are accepted with openpi's names fixed, and a
checkpoint without the text embedding uses the lm_head in its place. The lm_heads themselves are
checked but not kept (a policy never decodes text: 0.79 B parameters saved at full size).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Optional, Union

import torch

from mstar_rt.models.lerobot_pi0_config import (BACKBONE, LM_HEADS, PiConfig,
                                                checkpoint_layout, config_from_checkpoint)
from mstar_rt.models.lerobot_pi0_io import PiProcessor
from mstar_rt.models.lerobot_pi0_layers import (PiModule, lerobot_precision, make_rope,
                                                own_key, stays_float32)

PathLike = Union[str, os.PathLike]
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_ADARMS_NORM = re.compile(r"paligemma_with_expert\.gemma_expert\.model\.(layers\.\d+\."
                          r"(input_layernorm|post_attention_layernorm)|norm)\.weight$")


@dataclass
class LeRobotPi0:
    """A pi0 or pi0.5 policy read from a LeRobot directory: sizes, weights and processing.
    Serve it with :class:`~mstar_rt.models.lerobot_pi0.LeRobotPi0Policy`."""

    config: PiConfig
    module: PiModule
    processor: PiProcessor
    path: str


class _Headers:
    """Shapes and dtypes of every tensor in the checkpoint's safetensors files, by key, and the
    tensors themselves on demand."""

    def __init__(self, path: PathLike) -> None:
        from mstar_rt.models.checkpoint import check_once, checkpoint_files, open_safetensors

        self.files: dict[str, Any] = {}
        self.shapes: dict[str, tuple[tuple[int, ...], str]] = {}
        seen: dict[str, str] = {}
        for file in checkpoint_files(path):
            f, keys = open_safetensors(file)
            for key in keys:
                check_once(seen, key, file)
            try:
                for key in keys:
                    s = f.get_slice(key)
                    self.shapes[key] = (tuple(s.get_shape()), str(s.get_dtype()))
                    self.files[key] = f
            except Exception as e:  # SafetensorError, OSError: truncated, corrupt
                raise ValueError(f"{file} is not a readable safetensors file: "
                                 f"{type(e).__name__}: {e}") from None

    def tensor(self, key: str) -> torch.Tensor:
        try:
            return self.files[key].get_tensor(key)
        except Exception as e:
            raise ValueError(f"tensor '{key}' cannot be read: {type(e).__name__}: {e}") from None


def canonical_keys(keys: Iterable[str], family: str) -> dict[str, str]:
    """LeRobot key -> the key in the file holding it. Keys without ``model.`` get openpi's
    names fixed as LeRobot's loader does (``time_mlp_*`` <-> ``action_time_mlp_*``; pi0.5 drops
    ``state_proj`` and the plain expert norms its adaRMS replaces); without a text embedding
    the lm_head stands in."""
    out: dict[str, str] = {}
    for key in keys:
        name = key
        if not key.startswith("model."):
            if family == "pi0" and key.startswith(("time_mlp_in.", "time_mlp_out.")):
                name = "action_" + key
            if family == "pi05":
                if key.startswith(("state_proj.",)) or _ADARMS_NORM.match(key):
                    continue
                if key.startswith(("action_time_mlp_in.", "action_time_mlp_out.")):
                    name = key[len("action_"):]
            name = "model." + name
        if name in out:
            raise ValueError(f"the checkpoint holds '{name}' twice (as '{out[name]}' and "
                             f"'{key}')")
        out[name] = key
    embed = BACKBONE + "embed_tokens.weight"
    if embed not in out and LM_HEADS[0] in out:
        out[embed] = out[LM_HEADS[0]]
    return out


def _shown(keys: list[str]) -> str:
    return ", ".join(f"'{k}'" for k in keys[:6]) + (f" and {len(keys) - 6} more"
                                                    if len(keys) > 6 else "")


def check_layout(layout: Mapping[str, tuple], found: Mapping[str, tuple[tuple, str]],
                 source: str) -> None:
    """The checkpoint's (canonical) keys, shapes and dtypes against ``layout``; the lm_heads
    may be absent. ValueError naming the keys otherwise."""
    unexpected = sorted(k for k in found if k not in layout)
    if unexpected:
        raise ValueError(f"{source}: unexpected key {_shown(unexpected)}; the checkpoint is not "
                         "this pi0 / pi0.5 configuration (check config.json's 'type')")
    missing = [k for k in layout if k not in found and k not in LM_HEADS]
    if missing:
        raise ValueError(f"{source}: missing key {_shown(missing)}; the checkpoint is truncated "
                         "or from another model")
    for key, (shape, dtype) in found.items():
        if shape != layout[key]:
            raise ValueError(f"{source}: key '{key}' has shape {shape} but the configuration "
                             f"expects {layout[key]}")
        if not dtype.startswith(("F", "BF")):
            raise ValueError(f"{source}: key '{key}' holds {dtype}, not floating-point weights; "
                             "the file is corrupt or not this model's")


def _size(b: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if b >= scale:
            return f"{b / scale:.2f} {unit}"
    return f"{int(b)} B"


def describe_memory(config: PiConfig, kept: int, wide: int, dropped: int, dtype: torch.dtype,
                    device: str) -> str:
    """One line: parameters, weight memory per dtype, the KV cache per cached token. In
    bfloat16 / float16 the ``wide`` parameters (vision tower, projector, norms, heads) stay
    float32, as LeRobot keeps them."""
    b = config.backbone
    sizes = ", ".join(f"{_size(kept * 4 if n == 4 else (kept - wide) * n + wide * 4)} in {name}"
                      for name, n in (("float32", 4), ("bfloat16", 2), ("float16", 2)))
    elt = torch.empty((), dtype=dtype).element_size()
    kv = 2 * b.depth * b.num_kv_heads * b.head_dim * elt
    return (f"{config.family}: {kept:,} parameters ({dropped:,} more in the lm_heads, not kept); "
            f"weights take {sizes} (loading in {str(dtype).removeprefix('torch.')} on {device});"
            f" the KV cache takes {_size(kv)} per token, {_size(kv * config.max_prefix)} per "
            "request")


def load_lerobot_pi0(path: PathLike, tokenizer: Optional[PathLike] = None,
                     dtype: Optional[torch.dtype] = None, device: str = "cpu",
                     sizes: Optional[Mapping[str, int]] = None, verbose: bool = True
                     ) -> LeRobotPi0:
    """Reads a LeRobot pi0 / pi0.5 policy directory.

    ``tokenizer``: a folder with ``tokenizer.json`` (PaliGemma's; default ``path/tokenizer`` or
    ``path``). ``dtype``: default the config's ``dtype`` field. ``sizes``: head counts the
    weights cannot tell (see :mod:`~mstar_rt.models.lerobot_pi0_config`), e.g.
    ``{"vision_heads": 2}`` for a tiny test tower.
    """
    from mstar_rt.models.checkpoint import read_config

    path = os.fspath(path)
    source = os.path.join(path, "model.safetensors")
    raw = read_config(path)
    family = raw.get("type")
    headers = _Headers(path)
    keys = canonical_keys(headers.shapes, str(family))
    found = {k: headers.shapes[f] for k, f in keys.items()}
    config = config_from_checkpoint(raw, {k: v[0] for k, v in found.items()},
                                    os.path.join(path, "config.json"), sizes)
    check_layout(checkpoint_layout(config), found, source)
    if dtype is None:
        dtype = _DTYPES.get(config.checkpoint_dtype, torch.float32)
    processor = PiProcessor.from_dir(path, config, tokenizer)

    with torch.device("meta"):
        module = PiModule(config)
    kept = sum(p.numel() for p in module.state_dict().values())
    wide = sum(p.numel() for n, p in module.named_parameters() if stays_float32(n))
    dropped = sum(found[k][0][0] * found[k][0][1] for k in LM_HEADS if k in found)
    if verbose:
        print(describe_memory(config, kept, wide, dropped, dtype, device))
    module = lerobot_precision(module.to_empty(device=device), dtype)
    module.rope = make_rope(config.backbone.head_dim).to(device)  # a buffer to_empty left empty
    params = module.state_dict()
    with torch.no_grad():
        for key, file_key in keys.items():
            if key in LM_HEADS:
                continue
            own = own_key(key)
            assert own is not None  # check_layout admitted only the module's keys
            target = params[own]
            target.copy_(headers.tensor(file_key))  # into the parameter's dtype, rounded once
    return LeRobotPi0(config, module.eval(), processor, path)

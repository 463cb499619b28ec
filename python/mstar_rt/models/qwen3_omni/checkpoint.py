"""Loading a Qwen3-Omni checkpoint (the Hugging Face hub layout) into our modules.

One ``config.json`` (``thinker_config``, ``talker_config``, ``code2wav_config`` and the special
token ids) and safetensors whose keys start with the component they belong to:

==========================  =============================================================
``thinker.audio_tower.``    :class:`~.audio_encoder.AudioEncoder`
``thinker.visual.``         skipped: images and video are not supported (see :mod:`.text_lm`)
``thinker.``                :class:`~.thinker.ThinkerLM`
``talker.code_predictor.``  :class:`~.code_predictor.CodePredictor`
``talker.``                 :class:`~.talker.TalkerLM`
``code2wav.``               :class:`~.code2wav.Code2Wav`
==========================  =============================================================

The hub stores one tensor per expert (``...mlp.experts.{e}.gate_proj.weight``, ``up_proj``,
``down_proj``); ours are fused per layer, so those keys land in slices of
``...mlp.experts.gate_up_proj`` (gate rows, then up rows) and ``...down_proj`` (a checkpoint
holding the fused tensors loads too). Every key, shape and dtype is checked from the headers
before any weight is allocated; a key with no place, or a parameter no key fills, is a
ValueError naming the checkpoint key.
"""

from __future__ import annotations

import functools
import importlib
import os
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Union, cast

import torch
from torch import nn

from mstar_rt.distributed.split import WHOLE, TensorSplit
from mstar_rt.models.checkpoint import (
    ConfigFields, checkpoint_headers, checkpoint_tensors, meta_module, read_config)
from mstar_rt.models.qwen3_omni.talker import TalkerLM
from mstar_rt.models.qwen3_omni.text_lm import TextLMConfig
from mstar_rt.models.qwen3_omni.thinker import ThinkerLM

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
#: Checkpoint prefix -> component, most specific first; None: skipped (vision).
PREFIXES: tuple[tuple[str, Optional[str]], ...] = (
    ("thinker.audio_tower.", "audio_encoder"), ("thinker.visual.", None),
    ("thinker.", "thinker"), ("talker.code_predictor.", "code_predictor"),
    ("talker.", "talker"), ("code2wav.", "code2wav"))
#: transformers' defaults (Qwen3-Omni-30B-A3B's values) for fields a config.json leaves out.
_DEFAULTS = {
    "im_start_token_id": 151644, "im_end_token_id": 151645, "tts_pad_token_id": 151671,
    "tts_bos_token_id": 151672, "tts_eos_token_id": 151673, "system_token_id": 8948,
    "user_token_id": 872, "assistant_token_id": 77091,
    # thinker_config
    "audio_token_id": 151646, "audio_start_token_id": 151647,
    # talker_config
    "codec_pad_id": 4196, "codec_bos_id": 4197, "codec_eos_token_id": 4198,
    "codec_nothink_id": 4203, "codec_think_bos_id": 4204, "codec_think_eos_id": 4205,
    "accept_hidden_layer": 18, "num_code_groups": 32}
_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")


@dataclass(frozen=True)
class Qwen3OmniConfig:
    """What the runtime reads from the top-level ``config.json`` besides the modules' sizes;
    a field left out takes transformers' default, a wrong one is a ValueError naming it."""

    im_start: int
    im_end: int
    tts_pad: int
    tts_bos: int
    tts_eos: int
    system: int
    user: int
    assistant: int
    audio: int                      # the thinker's audio placeholder id
    audio_start: int
    thinker: TextLMConfig
    talker: Optional[TextLMConfig]  # None when enable_audio_output is false
    thinker_hidden_size: int
    accept_hidden_layer: int        # talker reads the thinker's hidden_states[this]
    num_code_groups: int
    codec: Mapping[str, int] = field(default_factory=dict)     # codec_pad_id, codec_bos_id, ...
    speaker_id: Mapping[str, int] = field(default_factory=dict)
    dtype: str = "float32"

    @staticmethod
    def from_hf(config: Mapping[str, Any], source: str = "config.json") -> "Qwen3OmniConfig":
        top = ConfigFields(config, source)
        thinker = ConfigFields(top.mapping("thinker_config"), f"thinker_config of {source}")
        text = TextLMConfig.from_hf(thinker.mapping("text_config"),
                                    f"thinker_config.text_config of {source}",
                                    tie_word_embeddings=thinker.flag("tie_word_embeddings", False))
        audio_out = top.flag("enable_audio_output", True)
        talker = ConfigFields(top.mapping("talker_config") if audio_out else {},
                              f"talker_config of {source}")

        def token(fields: ConfigFields, name: str) -> int:
            return fields.integer(name, _DEFAULTS[name], minimum=0)

        talker_text, codec, speakers = None, {}, {}
        layer, groups = text.num_hidden_layers, 0
        if audio_out:
            talker_text = TextLMConfig.from_hf(
                talker.mapping("text_config"), f"talker_config.text_config of {source}",
                talker=True, tie_word_embeddings=talker.flag("tie_word_embeddings", False))
            codec = {k: token(talker, k) for k in (
                "codec_pad_id", "codec_bos_id", "codec_eos_token_id", "codec_nothink_id",
                "codec_think_bos_id", "codec_think_eos_id")}
            speakers = dict(talker.mapping("speaker_id"))
            if not all(isinstance(k, str) and type(v) is int and v >= 0
                       for k, v in speakers.items()):
                raise ValueError(f"field 'speaker_id' of talker_config of {source} must map "
                                 "speaker names to codec ids")
            layer = talker.integer("accept_hidden_layer", _DEFAULTS["accept_hidden_layer"],
                                   minimum=0, maximum=text.num_hidden_layers)
            groups = talker.integer("num_code_groups", _DEFAULTS["num_code_groups"])
            width = talker.integer("thinker_hidden_size", text.hidden_size)
            if width != text.hidden_size:
                raise ValueError(f"field 'thinker_hidden_size' ({width}) of talker_config of "
                                 f"{source} differs from the thinker's hidden_size "
                                 f"({text.hidden_size})")
        return Qwen3OmniConfig(
            im_start=token(top, "im_start_token_id"), im_end=token(top, "im_end_token_id"),
            tts_pad=token(top, "tts_pad_token_id"), tts_bos=token(top, "tts_bos_token_id"),
            tts_eos=token(top, "tts_eos_token_id"), system=token(top, "system_token_id"),
            user=token(top, "user_token_id"), assistant=token(top, "assistant_token_id"),
            audio=token(thinker, "audio_token_id"),
            audio_start=token(thinker, "audio_start_token_id"),
            thinker=text, talker=talker_text, thinker_hidden_size=text.hidden_size,
            accept_hidden_layer=layer, num_code_groups=groups, codec=codec,
            speaker_id=speakers,
            dtype=str(config.get("dtype") or config.get("torch_dtype") or "float32"
                      ).removeprefix("torch."))


@dataclass
class Qwen3OmniWeights:
    """The loaded modules (eval mode). A component whose module this build lacks, or which the
    config disables (``enable_audio_output: false`` leaves out the talker, code predictor and
    code2wav), is None and its checkpoint prefix is listed in ``skipped``, after
    ``thinker.visual.`` (always skipped)."""

    config: Qwen3OmniConfig
    thinker: ThinkerLM
    talker: Optional[TalkerLM] = None
    audio_encoder: Optional[nn.Module] = None
    code_predictor: Optional[nn.Module] = None
    code2wav: Optional[nn.Module] = None
    skipped: tuple[str, ...] = ()


def load_qwen3_omni(path: Union[str, os.PathLike], dtype: Optional[torch.dtype] = None,
                    device: str = "cpu", progress: bool = True,
                    thinker: Optional[nn.Module] = None) -> Qwen3OmniWeights:
    """Every component of the checkpoint at ``path`` (``dtype`` defaults to the checkpoint's).
    ``thinker``: the thinker LM, loaded already (a tensor-parallel one, models/qwen3_omni/
    thinker_tp.py); its keys are then checked, not read."""
    config, raw, dtype = _read(path, dtype)
    modules, skipped = _load(path, raw, config, dtype, device, progress, thinker is None, WHOLE)
    return Qwen3OmniWeights(
        config, cast(ThinkerLM, thinker if thinker is not None else modules["thinker"]),
        cast(Optional[TalkerLM], modules.get("talker")), modules.get("audio_encoder"),
        modules.get("code_predictor"), modules.get("code2wav"), skipped)


def load_thinker(path: Union[str, os.PathLike], split: TensorSplit = WHOLE,
                 dtype: Optional[torch.dtype] = None, device: str = "cpu",
                 progress: bool = False) -> ThinkerLM:
    """The thinker LM alone, or ``split``'s share of it (every key of the checkpoint is checked
    as :func:`load_qwen3_omni` does; only the thinker's are read)."""
    config, raw, dtype = _read(path, dtype)
    modules, _ = _load(path, raw, config, dtype, device, progress, True, split,
                       only=("thinker",))
    return cast(ThinkerLM, modules["thinker"])


def checkpoint_dtype(path: Union[str, os.PathLike], dtype: Optional[torch.dtype] = None
                     ) -> torch.dtype:
    """``dtype``, or the checkpoint's when None (a ValueError naming the config if it has
    none this runtime loads)."""
    return _read(path, dtype)[2]


def _read(path: Union[str, os.PathLike], dtype: Optional[torch.dtype]
          ) -> tuple[Qwen3OmniConfig, Mapping[str, Any], torch.dtype]:
    source = os.path.join(path, "config.json")
    raw = read_config(path)
    config = Qwen3OmniConfig.from_hf(raw, source)
    if dtype is None:
        if config.dtype not in _DTYPES:
            raise ValueError(f"checkpoint dtype '{config.dtype}' in {source} is not one of "
                             f"{list(_DTYPES)}; pass dtype=")
        dtype = _DTYPES[config.dtype]
    return config, raw, dtype


def _load(path: Union[str, os.PathLike], raw: Mapping[str, Any], config: Qwen3OmniConfig,
          dtype: torch.dtype, device: str, progress: bool, with_thinker: bool,
          split: TensorSplit, only: Optional[tuple[str, ...]] = None
          ) -> tuple[dict[str, nn.Module], tuple[str, ...]]:
    """The components (``only`` those, if given; the thinker as ``split``'s share), every key
    checked against the whole model; and the checkpoint prefixes skipped."""
    source = os.path.join(path, "config.json")
    makers, skip = _makers(raw, config)
    if config.talker is None:  # enable_audio_output false: a full checkpoint loads the thinker
        skip |= {"talker", "code_predictor", "code2wav"}
    metas = {name: meta_module(make, source) for name, make in makers.items()}
    plan = _plan(path, metas, config, skip)  # the whole model's keys, whatever is read
    wanted = [n for n in metas if (only is None or n in only)
              and (with_thinker or n != "thinker")]
    if split.size > 1:
        makers["thinker"] = functools.partial(ThinkerLM, config.thinker, split)
        metas["thinker"] = meta_module(makers["thinker"], source)
    modules = {n: _materialize(makers[n], metas[n], device, dtype) for n in wanted}
    params = {name: dict(m.state_dict()) for name, m in modules.items()}
    keys = {k for k, slot in plan.items() if slot[0] in modules}
    shard = None
    if split.size > 1:
        from mstar_rt.models.qwen3_omni.thinker_tp import thinker_share as shard
    with torch.no_grad():
        for key, tensor in checkpoint_tensors(path, progress, keys):
            component, name, part = plan[key]
            if shard is not None and component == "thinker":
                tensor = shard(key[len("thinker."):], tensor, split)
                if tensor is None:  # an expert another rank holds (expert parallelism)
                    continue
                block = split.expert_block()
                if part is not None and block is not None:  # its index in this rank's block
                    part = (part[0], part[1] - block[0])
            _copy(params[component][name], part, tensor)
    skipped = ("thinker.visual.",) + tuple(p for p, c in PREFIXES if c in skip)
    for m in modules.values():
        m.eval()
    return modules, skipped


# ---- building --------------------------------------------------------------------------------

#: The components other modules of this package provide: (name = module, class).
_OTHERS = (("audio_encoder", "AudioEncoder"), ("code_predictor", "CodePredictor"),
           ("code2wav", "Code2Wav"))


def _makers(raw: Mapping[str, Any], config: Qwen3OmniConfig
            ) -> tuple[dict[str, Callable[[], nn.Module]], set[str]]:
    """How to build each component (on whatever device is current), and the components whose
    module this build lacks (their keys are then skipped)."""
    makers: dict[str, Callable[[], nn.Module]] = {
        "thinker": functools.partial(ThinkerLM, config.thinker)}
    sub_configs = {"audio_encoder": raw["thinker_config"].get("audio_config") or {}}
    if config.talker is not None:
        makers["talker"] = functools.partial(TalkerLM, config.talker, config.thinker_hidden_size)
        sub_configs["code_predictor"] = (raw["talker_config"].get("code_predictor_config")
                                         or {})
        sub_configs["code2wav"] = raw.get("code2wav_config") or {}
    unavailable: set[str] = set()
    for name, cls_name in _OTHERS:
        if name not in sub_configs:
            continue
        try:
            cls = getattr(importlib.import_module(f"mstar_rt.models.qwen3_omni.{name}"),
                          cls_name)
        except (ImportError, AttributeError):
            unavailable.add(name)
            continue
        makers[name] = functools.partial(cls.from_hf, sub_configs[name])
    return makers, unavailable


def _materialize(make: Callable[[], nn.Module], meta: nn.Module, device: str,
                 dtype: torch.dtype) -> nn.Module:
    """Real storage for ``meta``'s parameters (uninitialised: the checkpoint fills them).
    Buffers outside the checkpoint (rotary tables) come from the module's ``init_buffers``;
    a module with such buffers and no ``init_buffers`` is built again for real, keeping them."""
    transient = [n for n, _ in meta.named_buffers() if n not in meta.state_dict()]
    if hasattr(meta, "init_buffers") or not transient:
        module = meta.to(dtype).to_empty(device=device)  # cast first: no float32 copy
        init = getattr(module, "init_buffers", None)
        if callable(init):
            init()
        return module
    with torch.device(device):
        module = make()
    kept = {n: b.clone() for n, b in module.named_buffers() if n in transient}
    module.to(dtype)
    for n, b in kept.items():
        owner, _, leaf = n.rpartition(".")
        setattr(module.get_submodule(owner) if owner else module, leaf, b)
    return module


# ---- the key map -----------------------------------------------------------------------------

def _plan(path: Union[str, os.PathLike], metas: Mapping[str, nn.Module],
          config: Qwen3OmniConfig, skip: set[str]
          ) -> dict[str, tuple[str, str, Optional[tuple[str, int]]]]:
    """checkpoint key -> (component, parameter, None or (part, expert)), after checking every
    key's place, shape and dtype and that every parameter is filled."""
    targets = {name: dict(m.state_dict()) for name, m in metas.items()}
    tied = {"thinker": "lm_head.weight" if config.thinker.tie_word_embeddings else None,
            "talker": "codec_head.weight" if config.talker is not None
            and config.talker.tie_word_embeddings else None}
    plan: dict[str, tuple[str, str, Optional[tuple[str, int]]]] = {}
    for file, key, shape, dtype in checkpoint_headers(path):
        prefix, component = next(((p, c) for p, c in PREFIXES if key.startswith(p)),
                                 ("", "unknown"))
        if component is None or component in skip:
            continue  # vision, a component this build lacks, or audio output disabled
        local = key[len(prefix):]
        if local == tied.get(component):
            continue  # a tied head written out anyway
        slot, want = _place(targets.get(component, {}), local)
        if slot is None:
            raise ValueError(f"checkpoint key '{key}' in {file} has no place in the Qwen3-Omni "
                             f"model{_why(component, local, targets)}; the checkpoint is not "
                             "this model's or its config does not match")
        if shape != want:
            raise ValueError(f"checkpoint tensor '{key}' in {file} has shape {shape} but the "
                             f"config gives {want}; the config does not match the weights")
        if targets[component][slot[0]].is_floating_point() and not dtype.startswith(("F", "BF")):
            raise ValueError(f"checkpoint tensor '{key}' in {file} holds {dtype}, not "
                             "floating-point numbers")
        plan[key] = (component, *slot)
    _check_filled(plan, targets)
    return plan


def _place(params: Mapping[str, torch.Tensor], local: str
           ) -> tuple[Optional[tuple[str, Optional[tuple[str, int]]]], tuple[int, ...]]:
    """Where ``local`` goes in one component, and the shape it must have there."""
    if local in params:
        return (local, None), tuple(params[local].shape)
    m = _EXPERT.match(local)
    if m is None:
        return None, ()
    fused = f"{m[1]}.{'down_proj' if m[3] == 'down' else 'gate_up_proj'}"
    target, expert = params.get(fused), int(m[2])
    if target is None or expert >= target.shape[0]:
        return None, ()
    shape = tuple(target.shape)
    want = shape[1:] if m[3] == "down" else (shape[1] // 2, shape[2])
    return (fused, (m[3], expert)), want


def _why(component: str, local: str, targets: Mapping[str, Any]) -> str:
    if component == "unknown":
        return f" (no component has the prefix; known: {[p for p, _ in PREFIXES]})"
    m = _EXPERT.match(local)
    if m is not None:
        return f" (expert {m[2]} is past the config's num_experts, or the layer is dense)"
    return ""


def _check_filled(plan: Mapping[str, tuple],
                  targets: Mapping[str, Mapping[str, torch.Tensor]]) -> None:
    """Every parameter filled, whole or (fused experts) piece by piece; else a ValueError
    naming the missing checkpoint keys as the hub spells them."""
    prefix = {c: p for p, c in PREFIXES if c is not None}
    filled = {(c, p, s) for c, p, s in plan.values()}
    missing: list[str] = []
    for component, params in targets.items():
        for name, target in params.items():
            if (component, name, None) in filled:
                continue
            pieces = _expert_pieces(name, target.shape[0])
            if not pieces:
                missing.append(prefix[component] + name)
            layer = name.rpartition(".")[0]
            missing += [f"{prefix[component]}{layer}.{e}.{part}_proj.weight"
                        for part, e in pieces if (component, name, (part, e)) not in filled]
    if missing:
        shown = ", ".join(missing[:8]) + (" ..." if len(missing) > 8 else "")
        raise ValueError(f"{len(missing)} tensors missing from the checkpoint: {shown}")


def _expert_pieces(name: str, experts: int) -> list[tuple[str, int]]:
    """The hub tensors that fill fused parameter ``name`` (none for other parameters)."""
    if ".mlp.experts." not in name:
        return []
    if name.endswith(".down_proj"):
        return [("down", e) for e in range(experts)]
    return [(part, e) for e in range(experts) for part in ("gate", "up")]


def _copy(param: torch.Tensor, part: Optional[tuple[str, int]], tensor: torch.Tensor) -> None:
    if part is None:
        param.copy_(tensor)
        return
    kind, e = part
    half = param.shape[1] // 2
    target = {"gate": param[e, :half], "up": param[e, half:], "down": param[e]}[kind]
    target.copy_(tensor)

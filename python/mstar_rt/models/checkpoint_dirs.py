"""A checkpoint directory served as it is (``model: {checkpoint: DIR}`` in a config): which
loader serves it, and its ``args`` checked before anything loads -- a misspelled argument,
a dtype written as text, a CUDA device on a machine without one or a relative path are the
config's business, named at once, not after minutes of loading (or as a traceback after them).

* a LeRobot policy (``config.json`` with ``type`` pi0 / pi05 / smolvla): models/lerobot.py;
* a Qwen3-Omni directory (``model_type: qwen3_omni_moe``): ``Qwen3Omni``;
* else a Llama-architecture checkpoint: ``CausalLM``.
"""

from __future__ import annotations

import inspect
import json
import os
from pathlib import Path
from typing import Any, Callable, Mapping, Optional

import torch

#: Args that name files or folders: resolved from the config's folder, as the checkpoint is.
PATH_ARGS = ("tokenizer", "vlm_dir")
#: What each kind's loader supplies itself (never an arg).
SUPPLIED = {"self", "path", "policy", "weights", "module", "eos_token_ids", "tokenizer_file"}
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _config(path: Path) -> dict[str, Any]:
    """The directory's config.json ({} if there is none or it cannot be read: the loader that
    follows says what is wrong)."""
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}


def model_type(path: Path) -> Optional[str]:
    """``model_type`` of the directory's config.json (None if it has none)."""
    value = _config(path).get("model_type")
    return value if isinstance(value, str) else None


def _kind(path: Path) -> tuple[str, Callable[..., Any], tuple[Any, ...]]:
    """(what the directory holds, its loader, the callables that share the loader's args)."""
    from mstar_rt.models.lerobot import lerobot_family, load_lerobot_policy

    family = lerobot_family(path)
    if family in ("pi0", "pi05"):
        from mstar_rt.models.lerobot_pi0 import LeRobotPi0Policy

        return (f"a LeRobot {family} policy", load_lerobot_policy,
                (LeRobotPi0Policy.from_pretrained, LeRobotPi0Policy.__init__))
    if family == "smolvla":
        from mstar_rt.models.smolvla import SmolVLAPolicy
        from mstar_rt.models.smolvla_checkpoint import load_lerobot_smolvla

        return ("a LeRobot smolvla policy", load_lerobot_policy,
                (load_lerobot_smolvla, SmolVLAPolicy.__init__))
    lerobot_type = _config(path).get("type")
    if lerobot_type is not None or (path / "policy_preprocessor.json").exists():
        raise ValueError(f"{path} holds a LeRobot policy of type {lerobot_type!r} (config.json "
                         f"'type'); the policies served here are pi0, pi05 and smolvla")
    if model_type(path) == "qwen3_omni_moe":  # speech in, speech out
        from mstar_rt.models.qwen3_omni.omni import Qwen3Omni

        return "a Qwen3-Omni checkpoint", Qwen3Omni.from_pretrained, (
            Qwen3Omni.from_pretrained, signature_without(Qwen3Omni.__init__, "tokenizer"))
    from mstar_rt.models.causal_lm import CausalLM

    return "a Llama checkpoint", CausalLM.from_pretrained, (
        CausalLM.from_pretrained, CausalLM.__init__)


def signature_without(fn: Callable[..., Any], *supplied: str) -> inspect.Signature:
    """``fn``'s signature less the parameters its loader passes itself."""
    sig = inspect.signature(fn)
    return sig.replace(parameters=[p for n, p in sig.parameters.items() if n not in supplied])


def accepted_args(callables: tuple[Any, ...]) -> list[str]:
    """The named parameters a loader and the model it builds take from ``args``."""
    names: list[str] = []
    for fn in callables:
        sig = fn if isinstance(fn, inspect.Signature) else inspect.signature(fn)
        for p in sig.parameters.values():
            if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL) and p.name not in SUPPLIED \
                    and p.name not in names:
                names.append(p.name)
    return names


def checked_args(args: Mapping[str, Any], accepted: list[str], what: str,
                 base_dir: str = ".") -> dict[str, Any]:
    """``args`` with a text dtype made a torch dtype and path args resolved from ``base_dir``;
    a ValueError naming the arg for one ``what``'s loader does not take, a dtype it does not
    know, or a device this machine does not have."""
    unknown = [k for k in args if k not in accepted]
    if unknown:
        raise ValueError(f"model.args: {what} takes no {unknown}; it takes {accepted}")
    out = dict(args)
    dtype = out.get("dtype")
    if dtype is not None and not isinstance(dtype, torch.dtype):
        # 16 or a typo reached torch ("Cannot access accelerator device", "Invalid device")
        name = dtype.removeprefix("torch.") if isinstance(dtype, str) else None
        if name not in DTYPES:
            raise ValueError(f"model.args.dtype: {dtype!r} is not one of {list(DTYPES)}")
        out["dtype"] = DTYPES[name]
    device = out.get("device")
    if device is not None:
        if not isinstance(device, str):
            raise ValueError(f"model.args.device: {device!r} is not a device name ('cpu', "
                             "'cuda', 'cuda:1')")
        try:
            kind = torch.device(device).type
        except RuntimeError as e:
            raise ValueError(f"model.args.device: {device!r} is not a device ({e})") from None
        if kind == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"model.args.device: {device!r}, but torch sees no CUDA device "
                             "on this machine; use 'cpu'")
        if kind not in ("cpu", "cuda"):  # mps, xpu, meta: no loader here runs there
            raise ValueError(f"model.args.device: {device!r}; the checkpoints served here run "
                             "on 'cpu' or 'cuda'")
    for k in PATH_ARGS:
        if isinstance(out.get(k), str) and not os.path.isabs(out[k]):
            out[k] = str(Path(base_dir) / out[k])
    return out


def load_checkpoint_dir(path: Path, args: Mapping[str, Any], base_dir: str = ".") -> Any:
    """The walk model serving checkpoint directory ``path`` with ``args`` (checked first)."""
    what, load, callables = _kind(path)
    kwargs = checked_args(args, accepted_args(callables), what, base_dir)
    return load(str(path), **kwargs)


__all__ = ["accepted_args", "checked_args", "load_checkpoint_dir", "model_type",
           "signature_without"]

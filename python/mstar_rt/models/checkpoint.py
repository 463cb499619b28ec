"""Loading Hugging Face checkpoint directories: ``config.json`` plus safetensors, one file or
sharded with ``model.safetensors.index.json``."""

from __future__ import annotations

import json
import os
from typing import Optional, Union

import torch
from torch import nn


def checkpoint_files(path: Union[str, os.PathLike]) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(path, s) for s in shards]
    single = os.path.join(path, "model.safetensors")
    if os.path.exists(single):
        return [single]
    found = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not found:
        raise FileNotFoundError(f"{path} holds no .safetensors weights (expected model.safetensors "
                                "or model.safetensors.index.json and its shards)")
    return [os.path.join(path, f) for f in found]


def load_weights(module: nn.Module, path: Union[str, os.PathLike], progress: bool = True,
                 dtype: Optional[torch.dtype] = None, allow_missing: tuple[str, ...] = (),
                 ignore: tuple[str, ...] = ()) -> None:
    """Loads every tensor of the checkpoint at ``path`` into ``module`` (cast to ``dtype`` or to
    the parameter's dtype). Unknown keys and missing parameters are errors that list them;
    ``allow_missing`` names parameters the checkpoint may leave out, ``ignore`` keys to skip."""
    from safetensors import safe_open
    from tqdm.auto import tqdm

    params = dict(module.state_dict())
    seen: set[str] = set()
    unknown: list[str] = []
    files = checkpoint_files(path)
    with torch.no_grad():
        for file in tqdm(files, desc=f"loading {os.path.basename(os.fspath(path))}",
                         unit="shard", disable=not progress):
            with safe_open(file, framework="pt") as f:
                for key in f.keys():
                    if key in ignore:
                        continue
                    target = params.get(key)
                    if target is None:
                        unknown.append(key)
                        continue
                    tensor = f.get_tensor(key)
                    if tuple(tensor.shape) != tuple(target.shape):
                        raise ValueError(f"checkpoint tensor '{key}' has shape "
                                         f"{tuple(tensor.shape)} but the model expects "
                                         f"{tuple(target.shape)}; the config does not match "
                                         "the weights")
                    target.copy_(tensor.to(dtype or target.dtype))
                    seen.add(key)
    if unknown:
        shown = ", ".join(sorted(unknown)[:8]) + (" ..." if len(unknown) > 8 else "")
        raise ValueError(f"{len(unknown)} unknown checkpoint keys in {path}: {shown}; the "
                         f"checkpoint is not a {type(module).__name__} (or needs a key mapping)")
    missing = [k for k in params if k not in seen and k not in allow_missing]
    if missing:
        shown = ", ".join(missing[:8]) + (" ..." if len(missing) > 8 else "")
        raise ValueError(f"{len(missing)} parameters missing from the checkpoint at {path}: "
                         f"{shown}")


def save_checkpoint(module: nn.Module, config: dict, path: Union[str, os.PathLike]) -> None:
    """Writes ``config.json`` (``config``) and ``model.safetensors`` (the module's state)."""
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    save_file({k: v.contiguous() for k, v in module.state_dict().items()},
              os.path.join(path, "model.safetensors"))


def read_config(path: Union[str, os.PathLike]) -> dict:
    """The ``config.json`` of a checkpoint directory."""
    with open(os.path.join(path, "config.json")) as f:
        return json.load(f)

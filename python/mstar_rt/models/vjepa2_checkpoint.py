"""Reading V-JEPA 2 checkpoints as upstream writes them, checked before anything is allocated.

Upstream (facebookresearch/vjepa2) saves ``torch.save({"encoder": ..., "predictor": ...,
"target_encoder": ..., "opt": ..., ...})`` from DDP-wrapped modules, so keys may start with
``module.`` (and ``backbone.``); its hub strips both and loads the predictor strictly. This
module reads the same layouts: a ``.pt`` / ``.pth`` file (the whole training checkpoint or one
state dict), a ``.safetensors`` file (bare keys, or prefixed ``predictor.``), or a directory
of ``config.json`` + safetensors as :func:`save_vjepa2_predictor` writes it.

Every mismatch is a ValueError naming the key: a missing one, an unexpected one, a shape the
config does not give, an integer tensor where a weight belongs. The expected keys and shapes
come from the module built on the meta device, so nothing is allocated before the check.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Callable, Mapping, Optional, Union

import torch
from torch import nn

from mstar_rt.models.vjepa2_predictor import VJEPA2ACConfig, VJEPA2ACPredictor

PathLike = Union[str, os.PathLike]

#: Prefixes upstream's wrappers put in front of module keys (DDP, its backbone wrapper).
WRAPPER_PREFIXES = ("module.", "backbone.")
#: Bytes per element of the dtypes a memory estimate is given for.
ESTIMATE_DTYPES = {"float32": 4, "bfloat16": 2, "float16": 2}


class TensorSource:
    """The tensors of one checkpoint section by key: shape and dtype without reading the data
    (safetensors headers, or a memory-mapped torch file), the tensor itself on demand."""

    def __init__(self, source: str, shapes: dict[str, tuple[tuple[int, ...], torch.dtype]],
                 read: Callable[[str], torch.Tensor]) -> None:
        self.source, self.shapes, self.read = source, shapes, read


def strip_wrappers(key: str, section: str = "") -> str:
    """``module.predictor_blocks.0...`` -> ``predictor_blocks.0...`` (also a leading section
    name such as ``predictor.``, as a combined safetensors file has it)."""
    changed = True
    while changed:
        changed = False
        for p in WRAPPER_PREFIXES + ((section + ".",) if section else ()):
            if key.startswith(p):
                key, changed = key[len(p):], True
    return key


_ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
              "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32,
              "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}


def _safetensors_source(files: list[str], section: str, source: str) -> TensorSource:
    """The section's tensors in one safetensors file or the shards of a directory."""
    from mstar_rt.models.checkpoint import open_safetensors

    names: dict[str, tuple[Any, str]] = {}  # parameter -> (open file, key in it)
    shapes = {}
    for file in files:
        f, keys = open_safetensors(file)
        sections = {k.split(".", 1)[0] for k in keys}
        if section and section in sections and len(sections) > 1:  # a combined file: ours
            keys = [k for k in keys if k.startswith(section + ".")]
        for k in keys:
            name = strip_wrappers(k, section)
            if name in names:
                raise ValueError(f"{source} holds both '{names[name][1]}' and '{k}' ({file}), "
                                 f"which are the same parameter '{name}' once wrapper prefixes "
                                 "are removed")
            s = f.get_slice(k)
            kind = s.get_dtype()
            if kind not in _ST_DTYPES:  # F8_E4M3 read as uint8 before
                raise ValueError(f"{file}: key '{k}' holds {kind}, which this loader does not "
                                 "read (a quantized checkpoint?); give float weights")
            names[name] = (f, k)
            shapes[name] = (tuple(s.get_shape()), _ST_DTYPES[kind])
    return TensorSource(source, shapes, lambda name: names[name][0].get_tensor(names[name][1]))


def _torch_source(file: str, section: str) -> TensorSource:
    try:  # memory-mapped: a 1.2 GB predictor is not read twice
        obj = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
    except Exception:  # an old (non-zip) file cannot be memory-mapped; try it plainly
        try:
            obj = torch.load(file, map_location="cpu", weights_only=True)
        except Exception as e:
            raise ValueError(f"{file} is not a readable torch checkpoint: "
                             f"{type(e).__name__}: {str(e)[:300]}") from None
    where = file
    if isinstance(obj, Mapping) and section and section in obj:
        obj, where = obj[section], f"{file} ['{section}']"
    elif isinstance(obj, Mapping) and section and not any(
            isinstance(v, torch.Tensor) for v in obj.values()):
        raise ValueError(f"{file} holds no '{section}' state dict (its keys: "
                         f"{sorted(map(str, obj))[:8]}); give the checkpoint that has one")
    if not isinstance(obj, Mapping):
        raise ValueError(f"{where} is a {type(obj).__name__}, not a state dict")
    tensors: dict[str, torch.Tensor] = {}
    for k, v in obj.items():
        if not isinstance(v, torch.Tensor):
            raise ValueError(f"{where} entry '{k}' is a {type(v).__name__}, not a tensor")
        name = strip_wrappers(str(k))
        if name in tensors:
            raise ValueError(f"{where} holds '{name}' twice once wrapper prefixes are removed")
        tensors[name] = v
    shapes = {k: (tuple(v.shape), v.dtype) for k, v in tensors.items()}
    return TensorSource(where, shapes, tensors.__getitem__)


def open_section(path: PathLike, section: str) -> TensorSource:
    """The tensors of ``section`` (``"predictor"``, ``"encoder"``) in the checkpoint file or
    directory at ``path``."""
    path = os.fspath(path)
    if os.path.isdir(path):
        from mstar_rt.models.checkpoint import checkpoint_files

        files = checkpoint_files(path)  # one model.safetensors, or an index and its shards
        return _safetensors_source(files, section, files[0] if len(files) == 1 else path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path} does not exist; give upstream's .pt checkpoint, a "
                                ".safetensors file or a directory saved by save_vjepa2_predictor")
    if path.endswith(".safetensors"):
        return _safetensors_source([path], section, path)
    return _torch_source(path, section)


def _shown(keys: list[str]) -> str:
    return ", ".join(f"'{k}'" for k in keys[:6]) + (f" and {len(keys) - 6} more"
                                                    if len(keys) > 6 else "")


def check_state(module: nn.Module, found: TensorSource, what: str, hint: str = "") -> None:
    """The checkpoint's keys and shapes against ``module``'s (which may live on the meta
    device). ValueError naming the first wrong keys otherwise."""
    want = {k: tuple(v.shape) for k, v in module.state_dict().items()}
    unexpected = sorted(k for k in found.shapes if k not in want)
    missing = [k for k in want if k not in found.shapes]
    if unexpected:
        raise ValueError(f"{found.source}: unexpected key {_shown(unexpected)} in the {what} "
                         f"checkpoint; it is not this model's checkpoint{hint}")
    if missing:
        raise ValueError(f"{found.source}: missing key {_shown(missing)} in the {what} "
                         f"checkpoint; the file is truncated or from another model{hint}")
    for k, shape in want.items():
        got, dtype = found.shapes[k]
        if got != shape:
            raise ValueError(f"{found.source}: key '{k}' has shape {got} but this {what} "
                             f"config expects {shape}{hint}")
        if not dtype.is_floating_point:
            raise ValueError(f"{found.source}: key '{k}' holds {dtype}, not floating-point "
                             "weights; the file is corrupt or not this model's")


def memory_estimate(module: nn.Module) -> dict[str, int]:
    """Bytes of ``module``'s parameters and persistent buffers in each of float32, bfloat16
    and float16 (it may live on the meta device)."""
    n = sum(t.numel() for t in module.state_dict().values())
    return {name: n * size for name, size in ESTIMATE_DTYPES.items()}


def describe_memory(module: nn.Module, what: str, dtype: torch.dtype,
                    kv_bytes_per_frame: Optional[Callable[[int], int]] = None) -> str:
    """One line: parameter count, weight memory per dtype, and (for a predictor) the KV cache
    one frame block takes in the dtype it is loaded in."""
    n = sum(t.numel() for t in module.state_dict().values())
    sizes = ", ".join(f"{_size(b)} in {name}" for name, b in memory_estimate(module).items())
    line = f"{what}: {n:,} parameters; weights take {sizes} (loading in {_dtype_name(dtype)})"
    if kv_bytes_per_frame is not None:
        size = torch.empty((), dtype=dtype).element_size()
        line += f"; its KV cache takes {_size(kv_bytes_per_frame(size))} per frame"
    return line


def _size(b: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if b >= scale:
            return f"{b / scale:.2f} {unit}"
    return f"{b} B"


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def predictor_kv_bytes(config: VJEPA2ACConfig, element_size: int) -> int:
    """K and V of every layer for one frame block."""
    c = config
    return 2 * c.depth * c.block_tokens * c.hidden_size * element_size


def meta_predictor(config: VJEPA2ACConfig) -> VJEPA2ACPredictor:
    with torch.device("meta"):
        return VJEPA2ACPredictor(config)


def predictor_config_for(path: PathLike, config: Optional[VJEPA2ACConfig]
                         ) -> tuple[VJEPA2ACConfig, str]:
    """``config`` if given, else the ``config.json`` of a predictor directory, else the
    published V-JEPA 2-AC predictor's (upstream's .pt files carry no config); and a hint for
    a shape error: which fields the config.json left to the published values."""
    if config is not None:
        return config, " (pass the VJEPA2ACConfig it was trained with)"
    file = os.path.join(os.fspath(path), "config.json")
    if os.path.isdir(os.fspath(path)) and os.path.exists(file):
        from dataclasses import fields

        from mstar_rt.models.checkpoint import read_config

        raw = read_config(path)
        absent = [f.name for f in fields(VJEPA2ACConfig) if f.name not in raw]
        hint = (f" ({file} gives no {absent}: the published values were taken for them)"
                if absent else f" (check {file})")
        return VJEPA2ACConfig.from_dict(raw, file), hint
    return VJEPA2ACConfig(), " (pass the VJEPA2ACConfig it was trained with)"


def load_vjepa2_predictor(path: PathLike, config: Optional[VJEPA2ACConfig] = None,
                          dtype: Optional[torch.dtype] = None, device: str = "cpu",
                          progress: bool = True) -> VJEPA2ACPredictor:
    """The predictor of the checkpoint at ``path`` (see the module docstring for the layouts),
    built for ``config`` (default: the directory's config.json, else the published one).
    Keys and shapes are checked against the model built on the meta device before any weight
    is allocated; with ``progress`` the memory it takes per dtype is printed (stderr)."""
    config, hint = predictor_config_for(path, config)
    dtype = dtype or torch.float32
    meta = meta_predictor(config)
    found = open_section(path, "predictor")
    check_state(meta, found, "V-JEPA 2-AC predictor", hint)
    if progress:
        print(describe_memory(meta, "V-JEPA 2-AC predictor", dtype,
                              lambda size: predictor_kv_bytes(config, size)), file=sys.stderr)
    module = VJEPA2ACPredictor(config).to(device=device, dtype=dtype)
    params = module.state_dict()
    with torch.no_grad():
        for key, target in params.items():
            target.copy_(found.read(key).to(dtype))
    return module.eval()


def save_vjepa2_predictor(module: VJEPA2ACPredictor, path: PathLike) -> None:
    """Writes ``config.json`` and ``model.safetensors`` (upstream's key names, no prefix)."""
    from mstar_rt.models.checkpoint import save_checkpoint

    save_checkpoint(module, module.config.to_dict(), path)


def save_upstream_layout(path: PathLike, predictor: Optional[nn.Module] = None,
                         encoder: Optional[Mapping[str, torch.Tensor]] = None,
                         prefix: str = "module.") -> None:
    """A ``.pt`` laid out as upstream's training checkpoints: ``{"encoder", "predictor"}`` with
    DDP's ``module.`` prefix (for tests and conversions)."""
    out: dict[str, Any] = {}
    if predictor is not None:
        out["predictor"] = {prefix + k: v for k, v in predictor.state_dict().items()}
    if encoder is not None:
        out["encoder"] = {prefix + k: v for k, v in encoder.items()}
    torch.save(out, os.fspath(path))

"""Loading Hugging Face checkpoint directories: ``config.json`` plus safetensors, one file or
sharded with ``model.safetensors.index.json``.

Nothing here trusts the files: a config field of the wrong type or an absurd size, a truncated or
corrupt safetensors file, a tensor whose shape the config does not give -- each is a ValueError
naming the file and the field or key, raised before the model's weights are allocated (the
loaders build the model on the meta device first and check it against the safetensors headers).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import typing
from typing import Any, Callable, Container, Iterator, Mapping, Optional, Union

import torch
from torch import nn

#: The largest size a config may give (a width, a vocabulary, a count): beyond it a tensor of
#: two such sizes overflows what torch can address.
MAX_SIZE = 2**31 - 1
#: The most layers a config may ask for: building more modules than this takes minutes.
MAX_LAYERS = 1024

_REQUIRED = object()


def read_json(file: str, what: str) -> Any:
    """``file`` parsed; missing, unreadable or not JSON is an error naming it (``what``: what a
    checkpoint directory keeps there)."""
    try:
        with open(file) as f:
            return json.load(f)
    except FileNotFoundError:
        raise FileNotFoundError(f"{file} is missing; a checkpoint directory holds {what}") \
            from None
    except OSError as e:  # a directory, unreadable
        raise ValueError(f"{file} cannot be read ({e})") from None
    except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError are
        raise ValueError(f"{file} is not valid JSON ({type(e).__name__}: {e})") from None


def read_tokenizer(file: Union[str, os.PathLike]) -> Any:
    """A ``tokenizer.json`` read with the `tokenizers` package; a file it cannot read is a
    ValueError naming it (the package raises a bare Exception: 'key must be a string ...')."""
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(os.fspath(file))
    except Exception as e:
        raise ValueError(f"{os.fspath(file)} is not a readable tokenizer: {type(e).__name__}: "
                         f"{e}") from None


#: LeRobot's normalizer state files beside a policy's weights (``policy_preprocessor_step_5_...``)
PROCESSOR_FILES = ("policy_preprocessor", "policy_postprocessor")


def checkpoint_files(path: Union[str, os.PathLike]) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        found = read_json(index, "the shard index")
        weight_map = found.get("weight_map") if isinstance(found, dict) else None
        if not isinstance(weight_map, dict) or not weight_map or not all(
                isinstance(v, str) and v and os.sep not in v for v in weight_map.values()):
            raise ValueError(f"{index} needs a 'weight_map' of tensor names to shard file names "
                             "in the same directory")
        return [os.path.join(path, s) for s in sorted(set(weight_map.values()))]
    single = os.path.join(path, "model.safetensors")
    if os.path.exists(single):
        return [single]
    # a LeRobot policy's processor statistics are safetensors too, but never weights
    found = sorted(f for f in os.listdir(path) if f.endswith(".safetensors")
                   and not f.startswith(PROCESSOR_FILES))
    if not found:
        raise FileNotFoundError(f"{path} holds no .safetensors weights (expected model.safetensors "
                                "or model.safetensors.index.json and its shards)")
    return [os.path.join(path, f) for f in found]


def open_safetensors(file: str) -> tuple[Any, list[str]]:
    """(the open file, its keys); a truncated, corrupt or missing file is a ValueError naming
    it."""
    from safetensors import safe_open

    try:
        f = safe_open(file, framework="pt")
        return f, list(f.keys())
    except Exception as e:  # SafetensorError, OSError
        raise ValueError(f"{file} is not a readable safetensors file: "
                         f"{type(e).__name__}: {e}") from None


class _Shard:
    """One safetensors file opened for reading; every failure names the file (and key)."""

    def __init__(self, file: str) -> None:
        self.file = file
        self._f, self.keys = open_safetensors(file)

    def header(self, key: str) -> tuple[tuple[int, ...], str]:
        try:
            s = self._f.get_slice(key)
            return tuple(s.get_shape()), str(s.get_dtype())
        except Exception as e:
            raise ValueError(f"tensor '{key}' of {self.file} cannot be read: "
                             f"{type(e).__name__}: {e}") from None

    def tensor(self, key: str) -> torch.Tensor:
        try:
            return self._f.get_tensor(key)
        except Exception as e:
            raise ValueError(f"tensor '{key}' of {self.file} cannot be read: "
                             f"{type(e).__name__}: {e}") from None

    def close(self) -> None:
        self._f = None


def _shards(path: Union[str, os.PathLike]) -> Iterator[_Shard]:
    seen: dict[str, str] = {}  # key -> the file that holds it
    for file in checkpoint_files(path):
        shard = _Shard(file)
        try:
            for key in shard.keys:
                check_once(seen, key, file)
            yield shard
        finally:
            shard.close()


def check_once(seen: dict[str, str], key: str, file: str) -> None:
    """A key in two shards would load whichever came last without a word."""
    other = seen.setdefault(key, file)
    if other != file:
        raise ValueError(f"checkpoint tensor '{key}' is in both {other} and {file}; a "
                         "checkpoint holds each tensor once (a stale shard left beside the "
                         "others?)")


def _shown(keys: list[str]) -> str:
    return ", ".join(keys[:8]) + (" ..." if len(keys) > 8 else "")


def meta_module(make: Callable[[], nn.Module], source: str) -> nn.Module:
    """``make()`` on the meta device: the model as the config shapes it, with no memory behind
    it. Sizes that no tensor can have (their product overflows) are a ValueError naming
    ``source`` (the config file)."""
    try:
        with torch.device("meta"):
            return make()
    except (RuntimeError, OverflowError) as e:
        raise ValueError(f"{source} gives sizes that no model can have ({e}); check its "
                         "fields") from None


def check_weights(module: nn.Module, path: Union[str, os.PathLike],
                  allow_missing: tuple[str, ...] = (), ignore: tuple[str, ...] = ()) -> None:
    """Checks the checkpoint at ``path`` against ``module`` from the safetensors headers alone
    (no tensor is read, and ``module`` may live on the meta device): the same keys, the shapes
    the config gives, floating-point tensors where the module has them. ValueError naming the
    file and the keys otherwise."""
    params = {k: v for k, v in module.state_dict().items()}
    seen: set[str] = set()
    unknown: list[str] = []
    files: set[str] = set()  # those holding unknown keys
    for shard in _shards(path):
        for key in shard.keys:
            if key in ignore:
                continue
            target = params.get(key)
            if target is None:
                unknown.append(key)
                files.add(os.path.basename(shard.file))
                continue
            shape, dtype = shard.header(key)
            if shape != tuple(target.shape):
                raise ValueError(f"checkpoint tensor '{key}' in {shard.file} has shape {shape} "
                                 f"but the model expects {tuple(target.shape)}; the config does "
                                 "not match the weights")
            if target.is_floating_point() and not dtype.startswith(("F", "BF")):
                raise ValueError(f"checkpoint tensor '{key}' in {shard.file} holds {dtype}, not "
                                 "floating-point numbers; the file is corrupt or not this model's")
            seen.add(key)
    if unknown:
        raise ValueError(f"{len(unknown)} unknown checkpoint keys in {path} "
                         f"({', '.join(sorted(files))}): {_shown(sorted(unknown))}; the "
                         f"checkpoint is not a "
                         f"{type(module).__name__} (or needs a key mapping)")
    missing = [k for k in params if k not in seen and k not in allow_missing]
    if missing:
        raise ValueError(f"{len(missing)} parameters missing from the checkpoint at {path}: "
                         f"{_shown(missing)}")


def load_weights(module: nn.Module, path: Union[str, os.PathLike], progress: bool = True,
                 dtype: Optional[torch.dtype] = None, allow_missing: tuple[str, ...] = (),
                 ignore: tuple[str, ...] = ()) -> None:
    """Loads every tensor of the checkpoint at ``path`` into ``module`` (cast to ``dtype`` or to
    the parameter's dtype). Unknown keys, missing parameters and shapes that differ are errors
    that list them, found from the headers before anything is copied; ``allow_missing`` names
    parameters the checkpoint may leave out, ``ignore`` keys to skip."""
    from tqdm.auto import tqdm

    check_weights(module, path, allow_missing, ignore)
    params = dict(module.state_dict())
    files = checkpoint_files(path)
    with torch.no_grad():
        for shard in tqdm(_shards(path), total=len(files),
                          desc=f"loading {os.path.basename(os.fspath(path))}", unit="shard",
                          disable=not progress):
            for key in shard.keys:
                if key not in ignore:
                    target = params[key]
                    target.copy_(shard.tensor(key).to(dtype or target.dtype))


def save_checkpoint(module: nn.Module, config: dict, path: Union[str, os.PathLike]) -> None:
    """Writes ``config.json`` (``config``) and ``model.safetensors`` (the module's state)."""
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    save_file({k: v.contiguous() for k, v in module.state_dict().items()},
              os.path.join(path, "model.safetensors"))


def read_config(path: Union[str, os.PathLike]) -> dict:
    """The ``config.json`` of a checkpoint directory (a JSON object, else ValueError)."""
    file = os.path.join(path, "config.json")
    config = read_json(file, "config.json with the model's sizes")
    if not isinstance(config, dict):
        raise ValueError(f"{file} must hold a JSON object of fields, not a "
                         f"{type(config).__name__}")
    return config


# ---- config fields, checked --------------------------------------------------------------------

class ConfigFields:
    """Reads the fields of one ``config.json`` with their types and ranges checked, so a bad
    value is a ValueError naming the file and the field, not a TypeError deep in a layer (or an
    allocation of an absurd size)."""

    def __init__(self, config: Any, source: str) -> None:
        if not isinstance(config, Mapping):
            raise ValueError(f"{source} must hold a JSON object of fields, not a "
                             f"{type(config).__name__}")
        self.config, self.source = config, source

    def _get(self, name: str, default: Any) -> Any:
        if name in self.config and self.config[name] is not None:
            return self.config[name]
        if default is _REQUIRED:
            raise ValueError(f"{self.source} lacks the field '{name}'")
        return default

    def bad(self, name: str, value: Any, want: str) -> ValueError:
        """The ValueError for field ``name`` holding ``value`` where ``want`` was needed."""
        return self._bad(name, value, want)

    def _bad(self, name: str, value: Any, want: str) -> ValueError:
        shown = repr(value) if len(repr(value)) < 60 else repr(value)[:57] + "..."
        return ValueError(f"field '{name}' of {self.source} is {shown}; it must be {want}")

    def integer(self, name: str, default: Any = _REQUIRED, minimum: int = 1,
                maximum: int = MAX_SIZE) -> int:
        value = self._get(name, default)
        if isinstance(value, float) and value.is_integer():
            value = int(value)  # 4096.0: written by a float-only tool
        if type(value) is not int or not minimum <= value <= maximum:
            raise self._bad(name, value, f"an integer in [{minimum}, {maximum}]")
        return value

    def number(self, name: str, default: Any = _REQUIRED, positive: bool = True) -> float:
        value = self._get(name, default)
        try:
            number = float(value) if type(value) in (int, float) else math.nan
        except OverflowError:  # an integer beyond any float
            number = math.inf
        if not math.isfinite(number) or (positive and number <= 0):
            raise self._bad(name, value, "a finite number" + (" > 0" if positive else ""))
        return number

    def flag(self, name: str, default: Any = _REQUIRED) -> bool:
        value = self._get(name, default)
        if type(value) is not bool:
            raise self._bad(name, value, "true or false")
        return value

    def text(self, name: str, default: Any = _REQUIRED) -> str:
        value = self._get(name, default)
        if type(value) is not str:
            raise self._bad(name, value, "a string")
        return value

    def mapping(self, name: str) -> Mapping[str, Any]:
        value = self._get(name, {})
        if not isinstance(value, Mapping):
            raise self._bad(name, value, "a JSON object")
        return value


def dataclass_config(cls: type, config: Any, source: str, ignore: tuple[str, ...] = ()) -> Any:
    """``cls(**config)`` for a dataclass of sizes, after checking every field against its type:
    integers in [1, MAX_SIZE] ([0, ...] for "max_" counts; at most MAX_LAYERS for fields that
    count layers: "layers", "depth"), positive
    finite floats, bools, strings, tuples of such integers, optional ones, nested dataclasses.
    Unknown fields are errors; ``ignore`` names keys to skip."""
    fields = ConfigFields(config, source)
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(map(str, config)) - known - set(ignore))
    if unknown:
        raise ValueError(f"{source} has unknown fields {unknown}; known: {sorted(known)}")
    values = {}
    for name in known & set(config):
        values[name] = _field(fields, name, hints[name])
    try:
        return cls(**values)
    except (TypeError, ValueError) as e:  # a rule between fields (__post_init__)
        raise ValueError(f"{source}: {e}") from None


def _field(fields: ConfigFields, name: str, hint: Any) -> Any:
    value = fields.config[name]
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Union and type(None) in args:
        if value is None:
            return None
        hint = next(a for a in args if a is not type(None))
        origin, args = typing.get_origin(hint), typing.get_args(hint)
    elif value is None:
        raise fields._bad(name, value, f"a {getattr(hint, '__name__', hint)}, not null")
    # A "max_..." count may be 0 (a pi0 without a prompt: max_prompt_tokens=0); sizes may not.
    low = 0 if name.startswith("max_") else 1
    high = MAX_LAYERS if "layers" in name or name.endswith("depth") else MAX_SIZE
    if hint is int:
        return fields.integer(name, minimum=low, maximum=high)
    if hint is float:
        return fields.number(name)
    if hint is bool:
        return fields.flag(name)
    if hint is str:
        return fields.text(name)
    if origin is tuple:
        count = None if (len(args) == 2 and args[1] is Ellipsis) else len(args)
        if not (isinstance(value, (list, tuple)) and len(value) <= 64
                and (count is None or len(value) == count)
                and all(type(v) is int and low <= v <= high for v in value)):
            raise fields._bad(name, value, (f"a list of {count}" if count else "a list of")
                              + f" integers in [{low}, {high}]")
        return tuple(value)
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        if isinstance(value, hint):
            return value
        return dataclass_config(hint, value, f"field '{name}' of {fields.source}")
    return value


# ---- raw access, for loaders that map keys themselves -------------------------------------------

def checkpoint_headers(path: Union[str, os.PathLike]
                       ) -> Iterator[tuple[str, str, tuple[int, ...], str]]:
    """``(file, key, shape, dtype)`` of every tensor of the checkpoint at ``path``, read from
    the safetensors headers alone (nothing is loaded); unreadable files are ValueErrors naming
    them. For loaders whose modules' names differ from the checkpoint's (fused experts)."""
    for shard in _shards(path):
        for key in shard.keys:
            shape, dtype = shard.header(key)
            yield shard.file, key, shape, dtype


def checkpoint_tensors(path: Union[str, os.PathLike], progress: bool = True,
                       keys: Optional[Container[str]] = None
                       ) -> Iterator[tuple[str, torch.Tensor]]:
    """``(key, tensor)`` for every tensor of the checkpoint at ``path`` (those in ``keys`` only,
    if given: the others are not read), one shard open at a time (with a progress bar over the
    shards unless ``progress`` is False)."""
    from tqdm.auto import tqdm

    files = checkpoint_files(path)
    for shard in tqdm(_shards(path), total=len(files),
                      desc=f"loading {os.path.basename(os.fspath(path))}", unit="shard",
                      disable=not progress):
        for key in shard.keys:
            if keys is None or key in keys:
                yield key, shard.tensor(key)

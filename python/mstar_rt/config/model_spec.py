"""ModelSpec, the one way a config names a model, and the one resolver that builds it.

A factory is ``"module:Name"`` or ``"module:Class.method"``; the module is an importable dotted
name or a ``.py`` file (relative to the config's folder). The model is always built from the
spec, never shipped, so a worker process or an embedding C++ program builds the same one.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import re
import sys
import zlib
from pathlib import Path
from typing import Annotated, Any, Callable, ClassVar, Mapping, Optional, Sequence

from pydantic import AliasChoices, BeforeValidator, Field, field_validator, model_validator

from mstar_rt.config.base import JSONData, Name, Names, Section
from mstar_rt.config.errors import (ConfigError, FactoryImportError, FactoryNotFound, KeyProblem,
                                    ModelFileMissing, NotAModel)

_ATTR = r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*"
_FACTORY = re.compile(rf"^(?P<module>{_ATTR}|.+\.py|.*/.+):(?P<attr>{_ATTR})$")
_SPELLINGS = (("class", "factory"), ("args", "kwargs"))


def _path_list(v: Any) -> Any:
    return [v] if isinstance(v, str) else v


class ModelSpec(Section):
    """The model: ``factory`` (YAML ``class``, or its other spelling ``factory``) called with
    ``args`` (YAML ``args`` or ``kwargs``; JSON data, so every process can get them), or
    ``checkpoint``: a LeRobot policy directory (pi0, pi0.5, SmolVLA: served as that policy) or
    a Qwen3-Omni directory (``model_type: qwen3_omni_moe``, served as Qwen3Omni) or a Llama
    checkpoint directory (served as a CausalLM). ``parent_kwargs``
    override ``args`` in a placement parent that needs only the graph (e.g. ``{"device":
    "meta"}``). ``path``: folders put on sys.path first (relative to the config's folder).
    ``name``: the id clients see (default: the factory's name).

    ``ModelSpec("pkg.mod:build", {"size": 2})`` is the positional form."""

    noun: ClassVar[str] = "model"
    positional_fields: ClassVar[tuple[str, ...]] = ("factory", "args", "parent_kwargs")
    factory: Optional[str] = Field(None, validation_alias=AliasChoices("class", "factory"))
    args: JSONData = Field(default_factory=dict, validation_alias=AliasChoices("args", "kwargs"))
    parent_kwargs: JSONData = Field(default_factory=dict)
    checkpoint: Optional[Name] = None
    path: Annotated[Names, BeforeValidator(_path_list)] = ()
    name: Name = "model"

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, data: Any) -> Any:
        if isinstance(data, str):  # model: "pkg.mod:Name"
            data = {"class": data}
        if not isinstance(data, Mapping):
            return data
        for one, other in _SPELLINGS:
            if one in data and other in data:
                raise KeyProblem(other, f"give {one} or {other}, not both ({other} is another "
                                 f"spelling of {one})")
        factory = data.get("class", data.get("factory"))
        if "name" not in data and isinstance(factory, str) and ":" in factory:
            data = {**data, "name": factory.rpartition(":")[2]}
        elif "name" not in data and isinstance(data.get("checkpoint"), str):
            data = {**data, "name": checkpoint_name(data["checkpoint"])}
        return data

    @field_validator("factory", mode="before")
    @classmethod
    def _factory_form(cls, v: Any) -> Any:
        if v is not None and (not isinstance(v, str) or not _FACTORY.match(v)):
            raise ValueError(f"{v!r} is not 'package.module:Name' (or 'path/to/file.py:Name')")
        return v

    @model_validator(mode="after")
    def _one_source(self) -> "ModelSpec":
        if (self.factory is None) == (self.checkpoint is None):
            raise ValueError("give exactly one of 'class' ('package.module:Class', e.g. "
                             "'mstar_rt.models.orpheus:OrpheusTTS.tiny') or 'checkpoint' "
                             "(a directory)")
        return self

    def search_path(self, base_dir: str = ".") -> list[str]:
        """``path`` as absolute folders (ConfigError for one that is not a folder)."""
        out = []
        for p in self.path:
            full = (Path(base_dir) / p).resolve()
            if not full.is_dir():
                raise ConfigError(f"model.path: {p!r} ({full}) is not a directory")
            out.append(str(full))
        return out

    def build(self, overrides: Optional[Mapping[str, Any]] = None, base_dir: str = ".") -> Any:
        """The model, from the factory (``args`` updated by ``overrides``) or the checkpoint;
        relative paths start at ``base_dir``."""
        from mstar_rt.model import Model

        kwargs = {**self.args, **(overrides or {})}
        if self.checkpoint is not None:
            ckpt = Path(base_dir) / self.checkpoint
            if not ckpt.is_dir():
                raise ConfigError(f"model.checkpoint: {str(ckpt)!r} is not a directory")
            from mstar_rt.models.checkpoint_dirs import load_checkpoint_dir

            return load_checkpoint_dir(ckpt, kwargs, base_dir)
        assert self.factory is not None
        fn = resolve_factory(self.factory, base_dir, self.search_path(base_dir))
        try:  # a signature that refuses the args is the config's fault; a failure inside is not
            inspect.signature(fn).bind(**kwargs)
        except TypeError as e:
            raise NotAModel(f"model.args: {self.factory} rejected them: {e}") from None
        except ValueError:  # no signature to read (a builtin): let the call speak
            pass
        model = fn(**kwargs)
        if not isinstance(model, Model):
            raise NotAModel(f"model.class: {self.factory} returned {type(model).__name__}, not "
                            "an mstar_rt.Model")
        return model


def checkpoint_name(path: str) -> str:
    """The id clients see for a checkpoint directory: ``org/name`` inside a Hugging Face cache
    (``models--org--name/snapshots/<hash>``), ``run/step`` for a LeRobot training output
    (``<run>/checkpoints/<step>/pretrained_model``), else the folder's name."""
    parts = Path(path).parts
    hub = [p for p in parts if p.startswith("models--")]
    if hub:
        return hub[-1].removeprefix("models--").replace("--", "/")
    if len(parts) >= 4 and parts[-1] == "pretrained_model" and parts[-3] == "checkpoints":
        return f"{parts[-4]}/{parts[-2]}"
    return Path(path).name or "model"


def resolve_factory(factory: str, base_dir: str = ".",
                    search_path: Sequence[str] = ()) -> Callable[..., Any]:
    """``"module:Name"`` / ``"module:Class.method"`` / ``"file.py:Name"`` -> the callable, after
    putting ``search_path`` folders first on sys.path."""
    for folder in reversed(search_path):
        if folder not in sys.path:
            sys.path.insert(0, folder)
    module_name, _, attr = factory.rpartition(":")
    obj: Any = _import(module_name, base_dir)
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise FactoryNotFound(f"model.class: {module_name!r} has no attribute {attr!r}",
                                  module_name, attr)
        obj = getattr(obj, part)
    if not callable(obj):
        raise ConfigError(f"model.class: {factory!r} is not callable")
    return obj


def _import(module: str, base_dir: str) -> Any:
    if not (module.endswith(".py") or "/" in module):
        try:
            return importlib.import_module(module)
        except ImportError as e:
            raise FactoryImportError(f"model.class: cannot import module {module!r} ({e}); check "
                                     "the name, or add its folder to model.path") from None
        except SyntaxError as e:
            raise _syntax(module, e) from None
    path = (Path(base_dir) / module).resolve()
    if not path.is_file():
        raise ModelFileMissing(f"model.class: model module file {path} does not exist")
    if str(path.parent) not in sys.path:  # so the file's sibling imports work; last, so that a
        sys.path.append(str(path.parent))  # json.py beside it shadows no module (nor workers')
    name = path.stem
    loaded = sys.modules.get(name)
    if loaded is not None and getattr(loaded, "__file__", None) == str(path):
        return loaded
    if loaded is not None:  # another module has that name (json.py): never replace it
        name = f"mstar_model_{name}_{zlib.crc32(str(path).encode()):08x}"
        if name in sys.modules:
            return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    try:
        spec.loader.exec_module(mod)
    except SyntaxError as e:
        sys.modules.pop(name, None)
        raise _syntax(str(path), e) from None
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return mod


def _syntax(module: str, e: SyntaxError) -> FactoryImportError:
    return FactoryImportError(f"model.class: cannot import {module!r}: {e.filename}, line "
                              f"{e.lineno}: {e.msg}")


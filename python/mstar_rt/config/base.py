"""What every config section shares: frozen pydantic models that refuse unknown keys by name,
the field types whose messages say what to write, and reading a YAML file."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Annotated, Any, ClassVar, Mapping, Optional, Union

from pydantic import BaseModel, BeforeValidator, ConfigDict, ValidationError, model_validator

from mstar_rt.config.errors import ConfigError, KeyProblem, config_error


def accepted_keys(cls: type[BaseModel]) -> list[str]:
    """Every key a mapping for ``cls`` may hold: field names and their aliases."""
    keys: list[str] = []
    for name, field in cls.model_fields.items():
        alias = field.validation_alias
        choices = getattr(alias, "choices", None)
        if choices:
            keys += [c for c in choices if isinstance(c, str)]
        else:
            keys.append(alias if isinstance(alias, str) else name)
    return keys


class _Built(type(BaseModel)):  # type: ignore[misc]  # pydantic's metaclass
    """``Section(...)`` called from Python: positional arguments fill ``positional_fields``,
    a wrong value raises ConfigError naming the class and key, and ``check`` runs. Config files
    are validated with ``model_validate``, which does not pass here, so their ``check`` waits
    until the runtime is built and can name the key path (``node_groups[2]``)."""

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        names = cls.positional_fields  # type: ignore[attr-defined]
        if len(args) > len(names):
            raise TypeError(f"{cls.__name__} takes at most {len(names)} positional arguments "
                            f"({', '.join(names)}), not {len(args)}")
        twice = [n for n in names[:len(args)] if n in kwargs]
        if twice:
            raise TypeError(f"{cls.__name__} got {twice[0]!r} both by position and by name")
        kwargs.update(zip(names, args))
        try:
            obj = super().__call__(**kwargs)
        except ValidationError as e:
            raise config_error(e, cls.__name__) from None
        obj.check(cls.__name__)
        return obj


class Section(BaseModel, metaclass=_Built):
    """A config section. Unknown keys are errors that list the known ones (a typo must not be
    silently ignored)."""

    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True,
                              protected_namespaces=())
    noun: ClassVar[str] = ""           # "node group": the section's name in messages
    extra_keys: ClassVar[tuple[str, ...]] = ()  # keys a before-validator consumes
    positional_fields: ClassVar[tuple[str, ...]] = ()

    def check(self, where: str) -> None:
        """Refuses what cannot run, naming ``where``; beyond the schema (see _Built)."""

    @model_validator(mode="before")
    @classmethod
    def _known_keys(cls, data: Any) -> Any:
        if isinstance(data, Mapping):
            known = accepted_keys(cls) + list(cls.extra_keys)
            bad = [k for k in data if k not in known]
            if bad:
                noun = f"{cls.noun} " if cls.noun else ""
                raise KeyProblem(str(bad[0]), f"unknown key (unknown {noun}keys: {bad}); the "
                                 f"{noun}keys are {sorted(known)}")
        elif data is not None and not isinstance(data, BaseModel):
            raise ValueError(f"must be a mapping (key: value), not {type(data).__name__}")
        return data


# ---- field types -------------------------------------------------------------------------------
# Each checks its value itself rather than trusting pydantic's coercion: YAML's "8" for 8 or
# "yes" for true is a mistake to report, not a value to convert.


def _positive_int(v: Any) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
        raise ValueError(f"must be a positive integer, not {v!r}")
    return v


def _count(v: Any) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or v < 0:
        raise ValueError(f"must be an integer >= 0, not {v!r}")
    return v


MAX_SECONDS = 365 * 24 * 3600.0


def _positive_number(v: Any) -> float:
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not v > 0:
        raise ValueError(f"must be a positive number of seconds, not {v!r}")
    if not v <= MAX_SECONDS:  # inf: every wait on it overflowed time_t and failed its request
        raise ValueError(f"must be at most {MAX_SECONDS:.0f} seconds (a year), not {v!r}")
    return float(v)


def _flag(v: Any) -> bool:
    if not isinstance(v, bool):
        raise ValueError(f"must be true or false, not {v!r}")
    return v


def _name(v: Any) -> str:
    if not isinstance(v, str) or not v:
        raise ValueError(f"must be a non-empty string, not {v!r}")
    return v


def _names(v: Any) -> tuple[str, ...]:
    if isinstance(v, (str, bytes)) or not isinstance(v, (list, tuple)):
        raise ValueError(f"must be a list, not {type(v).__name__}")
    bad = [x for x in v if not isinstance(x, str) or not x]
    if bad:
        raise ValueError(f"must be a list of names; {bad!r} are not")
    return tuple(v)


def _mapping(v: Any) -> dict[str, Any]:
    if v is None:
        return {}
    if not isinstance(v, Mapping):
        raise ValueError(f"must be a mapping (key: value), not {type(v).__name__}")
    return dict(v)


def _json_data(v: Any) -> dict[str, Any]:
    v = _mapping(v)
    try:
        json.dumps(v, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise ValueError(f"must be JSON data (numbers, strings, lists, dicts) so every process "
                         f"can build the model from it: {e}; build other objects inside the "
                         "factory") from None
    return v


_DEVICE = re.compile(r"^(cpu|cuda(:\d+)?)$")


def _device(v: Any) -> str:
    if not isinstance(v, str) or not _DEVICE.match(v):
        raise ValueError(f"must be 'cpu', 'cuda' or 'cuda:N', not {v!r}")
    return v


PositiveInt = Annotated[int, BeforeValidator(_positive_int)]
Count = Annotated[int, BeforeValidator(_count)]
Seconds = Annotated[float, BeforeValidator(_positive_number)]
Flag = Annotated[bool, BeforeValidator(_flag)]
Name = Annotated[str, BeforeValidator(_name)]
Names = Annotated[tuple[str, ...], BeforeValidator(_names)]
KeyValues = Annotated[dict[str, Any], BeforeValidator(_mapping)]
JSONData = Annotated[dict[str, Any], BeforeValidator(_json_data)]
Device = Annotated[str, BeforeValidator(_device)]


# ---- files -------------------------------------------------------------------------------------


def _unique_keys_loader() -> type:
    """yaml's SafeLoader, refusing a key given twice in one mapping (two ``server:`` blocks:
    the last one won without a word)."""
    import yaml

    class UniqueKeys(yaml.SafeLoader):
        def construct_mapping(self, node: Any, deep: bool = False) -> Any:
            seen = set()
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=deep)
                try:
                    hash(key)
                except TypeError:  # a list as a key: SafeLoader's own error names it
                    continue
                if key in seen:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"the key {key!r} is given twice", key_node.start_mark)
                seen.add(key)
            return super().construct_mapping(node, deep)

    return UniqueKeys


def read_mapping(source: Union[str, os.PathLike, Mapping[str, Any]],
                 base_dir: Optional[str] = None) -> tuple[Mapping[str, Any], str]:
    """A parsed config and the folder its relative paths start from (the file's folder, or
    ``base_dir``, or the working directory for a mapping)."""
    if isinstance(source, Mapping):
        return source, base_dir or os.getcwd()
    import yaml

    path = Path(source)
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    try:
        raw = yaml.load(path.read_text(), Loader=_unique_keys_loader())
    except yaml.YAMLError as e:
        where = getattr(e, "problem_mark", None)
        line = f" (line {where.line + 1})" if where is not None else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"{path}: not valid YAML{line}: {problem}") from None
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{path}: the config must be a mapping with at least a 'model:' key")
    return raw, base_dir or str(path.resolve().parent)


def validate(cls: type[BaseModel], raw: Any, prefix: str = "") -> Any:
    """``cls.model_validate(raw)``, with errors as ConfigError naming the key (under
    ``prefix``, the section's own key, if any)."""
    try:
        return cls.model_validate(raw)
    except ValidationError as e:
        raise config_error(e, prefix) from None

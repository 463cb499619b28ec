"""ConfigError, and the translation of pydantic's ValidationError into one that names the key.

A config error reads ``node_groups[1].rank: must be an integer >= 0, not -1``: the key path as
the user wrote it, then what is wrong and what to write instead.
"""

from __future__ import annotations

from typing import Any, Sequence

from pydantic import ValidationError


class ConfigError(ValueError):
    """A config (YAML file, mapping or constructor call) is wrong; the message names the key."""


# Building the model can fail in ways callers tell apart by the builtin type (the C++ embed API
# and older callers catch these), so each is both a ConfigError and that builtin.
class FactoryImportError(ConfigError, ImportError):
    """The factory's module cannot be imported."""


class FactoryNotFound(ConfigError, AttributeError):
    """The factory's module has no such attribute."""

    def __init__(self, message: str, module: str, attr: str) -> None:
        super().__init__(message)
        self.module, self.attr = module, attr


class ModelFileMissing(ConfigError, FileNotFoundError):
    """The factory names a ``.py`` file that does not exist."""


class NotAModel(ConfigError, TypeError):
    """The factory returned something that is not an mstar_rt.Model, or refused its kwargs."""


class KeyProblem(ValueError):
    """Raised inside a validator to blame ``key`` under the validated section (pydantic only
    knows the section's own location there)."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(message)
        self.key = key


def key_path(loc: Sequence[Any]) -> str:
    """('node_groups', 1, 'rank') -> 'node_groups[1].rank'."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out


def error_message(error: Any, prefix: str = "") -> str:
    """One pydantic error (an item of ``ValidationError.errors()``) as 'key: problem'."""
    loc = [prefix] if prefix else []
    loc += list(error["loc"])
    cause = (error.get("ctx") or {}).get("error")
    if isinstance(cause, KeyProblem):
        loc.append(cause.key)
    if isinstance(cause, ValueError):
        message = str(cause)
    elif error["type"] == "missing":
        message = "missing; this key is required"
    else:
        message = error["msg"][:1].lower() + error["msg"][1:]
    where = key_path(loc)
    return f"{where}: {message}" if where else message


def config_error(e: ValidationError, prefix: str = "") -> ConfigError:
    """The first problem of ``e`` (pydantic reports them in key order) as a ConfigError."""
    errors = e.errors()
    more = f" (and {len(errors) - 1} more problem{'s' * (len(errors) > 2)})" if len(errors) > 1 \
        else ""
    return ConfigError(error_message(errors[0], prefix) + more)

"""The HTTP request bodies as pydantic models (as the config is): each field checks itself and
says what to send instead; :func:`parse` turns the first problem into a :class:`BadBody` naming
the field, which the app answers with a 400."""

from __future__ import annotations

from typing import Any, Mapping, Optional, TypeVar

from pydantic import (BaseModel, ConfigDict, Field, ValidationError, ValidationInfo,
                      field_validator, model_validator)

from mstar_rt.config.errors import KeyProblem

SPEECH_FORMATS = ("pcm", "wav")
_B = TypeVar("_B", bound="Body")


class BadBody(ValueError):
    """A request body field is wrong; ``param`` names it (OpenAI's error ``param``)."""

    def __init__(self, message: str, param: Optional[str]) -> None:
        super().__init__(message)
        self.param = param


class Body(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _known_fields(cls, data: Any) -> Any:
        if isinstance(data, Mapping):
            fields = list(cls.model_fields)
            unknown = [k for k in data if k not in fields]
            if unknown:
                raise KeyProblem(str(unknown[0]), f"unknown field {unknown[0]!r}; the fields are "
                                 f"{fields}")
        return data


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


class SpeechBody(Body):
    """OpenAI's ``/v1/audio/speech`` body; ``instructions`` is accepted and ignored."""

    model: Optional[str] = None
    input: str = Field(None, validate_default=True)  # type: ignore[assignment]
    voice: Optional[str] = None
    response_format: str = Field("pcm", validate_default=True)
    speed: float = 1.0
    instructions: Any = None
    stream_format: Optional[str] = "audio"

    @field_validator("model", mode="before")
    @classmethod
    def _model(cls, v: Any) -> Any:
        if v is not None and not isinstance(v, str):
            raise ValueError("'model' must be a string: the id /v1/models lists")
        return v

    @field_validator("input", mode="before")
    @classmethod
    def _input(cls, v: Any) -> Any:
        if not isinstance(v, str) or not v.strip():
            raise ValueError("'input' must be a non-empty string: the text to speak")
        return v

    @field_validator("voice", mode="before")
    @classmethod
    def _voice(cls, v: Any) -> Any:
        if v is not None and not isinstance(v, str):
            raise ValueError("'voice' must be a string")
        return v

    @field_validator("response_format", mode="before")
    @classmethod
    def _format(cls, v: Any) -> Any:
        v = v or "pcm"
        if v not in SPEECH_FORMATS:
            raise ValueError(f"response_format {v!r} is not served; use one of "
                             f"{list(SPEECH_FORMATS)}")
        return v

    @field_validator("speed", mode="before")
    @classmethod
    def _speed(cls, v: Any) -> Any:
        if not _number(v) or v != 1.0:
            raise ValueError("only speed 1.0 is served")
        return v

    @field_validator("stream_format", mode="before")
    @classmethod
    def _stream_format(cls, v: Any) -> Any:
        if v not in ("audio", None):
            raise ValueError("only stream_format 'audio' is served")
        return v


class GenerateBody(Body):
    """``/generate``: the model's inputs (arrays as ``{dtype, shape, data}``), the request's
    priority and deadline, and how output arrays are sent (``base64`` or ``list``). Parse with
    ``inputs=`` the model's input names, for the error message."""

    inputs: dict[str, Any] = Field(None, validate_default=True)  # type: ignore[assignment]
    deadline_s: Optional[float] = None
    priority: int = 0
    arrays: str = "base64"

    @field_validator("inputs", mode="before")
    @classmethod
    def _inputs(cls, v: Any, info: ValidationInfo) -> Any:
        if not isinstance(v, dict):
            names = list((info.context or {}).get("inputs", ()))
            raise ValueError("'inputs' must be an object mapping the model's input names to "
                             f"values; the model takes {names}")
        return v

    @field_validator("deadline_s", mode="before")
    @classmethod
    def _deadline(cls, v: Any) -> Any:
        if v is not None and (not _number(v) or v <= 0):
            raise ValueError("'deadline_s' must be a positive number of seconds")
        return v

    @field_validator("priority", mode="before")
    @classmethod
    def _priority(cls, v: Any) -> Any:
        if not isinstance(v, int) or isinstance(v, bool):
            raise ValueError("'priority' must be an integer")
        return v

    @field_validator("arrays", mode="before")
    @classmethod
    def _arrays(cls, v: Any) -> Any:
        if v not in ("base64", "list"):
            raise ValueError("'arrays' must be 'base64' or 'list'")
        return v


def parse(cls: type[_B], body: Mapping[str, Any], **context: Any) -> _B:
    """``body`` as a ``cls``, or BadBody with the first problem and the field it is in."""
    try:
        return cls.model_validate(body, context=context)
    except ValidationError as e:
        error = e.errors()[0]
        cause = (error.get("ctx") or {}).get("error")
        param = cause.key if isinstance(cause, KeyProblem) else (
            str(error["loc"][0]) if error["loc"] else None)
        message = str(cause) if isinstance(cause, ValueError) else f"{param}: {error['msg']}"
        raise BadBody(message, param) from None

"""The HTTP request bodies as pydantic models (as the config is): each field checks itself and
says what to send instead; :func:`parse` turns the first problem into a :class:`BadBody` naming
the field, which the app answers with a 400. The types and bounds also make the bodies' JSON
schemas, which the app's OpenAPI document publishes (see :func:`request_body`)."""

from __future__ import annotations

from typing import Any, Literal, Mapping, Optional, Sequence, TypeVar

from pydantic import (BaseModel, ConfigDict, Field, ValidationError, ValidationInfo,
                      field_validator, model_validator)

from mstar_rt.config.errors import KeyProblem
from mstar_rt.serve.wire import DTYPES, MAX_DIMS, whole_number

SPEECH_FORMATS = ("pcm", "wav")
MAX_DEADLINE_S = 365 * 86400.0  # a deadline further away orders nothing: leave it out
PRIORITIES = (-2**31, 2**31 - 1)  # the Conductor keeps a priority as an int32
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
            # A required field left out gets its own validator's message, as if sent as null.
            missing = {k: None for k, f in cls.model_fields.items()
                       if f.is_required() and k not in data}
            if missing:
                data = {**data, **missing}
        return data


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


#: The most characters of text one speech request may hold (OpenAI's documented limit).
MAX_SPEECH_INPUT = 4096


class SpeechBody(Body):
    """OpenAI's ``/v1/audio/speech`` body; ``instructions`` is accepted and ignored."""

    model: Optional[str] = None
    input: str = Field(min_length=1, max_length=MAX_SPEECH_INPUT,
                       json_schema_extra={"pattern": r"\S"})
    voice: Optional[str] = None
    response_format: Optional[Literal["pcm", "wav"]] = "pcm"  # null: pcm
    speed: float = Field(1.0, ge=1.0, le=1.0)
    instructions: Any = None
    stream_format: Optional[Literal["audio"]] = "audio"

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
        if len(v) > MAX_SPEECH_INPUT:
            raise ValueError(f"'input' holds {len(v)} characters; at most {MAX_SPEECH_INPUT} "
                             "(OpenAI's limit): send a longer text over several requests")
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
        if v is None:
            return "pcm"
        if not isinstance(v, str) or v not in SPEECH_FORMATS:
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

    @staticmethod
    def schema_for(model: str, voices: Sequence[str]) -> dict[str, Any]:
        """The body's JSON schema as a deployment serving ``model`` in ``voices`` (empty: any)
        accepts it."""
        schema = SpeechBody.model_json_schema()
        props = schema["properties"]
        props["model"] = {"anyOf": [{"enum": [model]}, {"type": "null"}], "default": None}
        if voices:
            props["voice"] = {"anyOf": [{"enum": list(voices)}, {"type": "null"}],
                              "default": None}
        return schema


class GenerateBody(Body):
    """``/generate``: the model's inputs (arrays as ``{dtype, shape, data}``), the request's
    priority and deadline, and how output arrays are sent (``base64`` or ``list``). Parse with
    ``inputs=`` the model's input names, for the error message."""

    inputs: dict[str, Any]
    deadline_s: Optional[float] = Field(None, gt=0, le=MAX_DEADLINE_S)
    priority: int = Field(0, ge=PRIORITIES[0], le=PRIORITIES[1])
    #: Keep ``deadline_s``: work that would start after it fails the request (504), and a
    #: request that cannot start in time is refused at once (503).
    fail_late: bool = False
    arrays: Literal["base64", "list"] = "base64"

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
        # Also refuses NaN and infinity, which the JSON parser lets through.
        if v is not None and (not _number(v) or not 0 < v <= MAX_DEADLINE_S):
            raise ValueError("'deadline_s' must be a positive number of seconds, at most "
                             f"{MAX_DEADLINE_S:.0f} (leave it out for no deadline)")
        return v

    @field_validator("priority", mode="before")
    @classmethod
    def _priority(cls, v: Any) -> Any:
        v = whole_number(v)
        if v is None or not PRIORITIES[0] <= v <= PRIORITIES[1]:
            raise ValueError(f"'priority' must be an integer in {PRIORITIES[0]}..{PRIORITIES[1]}")
        return v

    @field_validator("arrays", mode="before")
    @classmethod
    def _arrays(cls, v: Any) -> Any:
        if v not in ("base64", "list"):
            raise ValueError("'arrays' must be 'base64' or 'list'")
        return v

    @staticmethod
    def schema_for(inputs: Mapping[str, dict[str, Any]], required: Sequence[str]
                   ) -> dict[str, Any]:
        """The body's JSON schema for a model taking ``inputs`` (name -> the JSON schema of its
        value; ``{}`` = any), of which ``required`` have no default."""
        schema = GenerateBody.model_json_schema()
        schema["properties"]["inputs"] = {"type": "object", "properties": dict(inputs),
                                          "required": list(required),
                                          "additionalProperties": False}
        return schema


def array_schema() -> dict[str, Any]:
    """The JSON schema of an array input: ``{dtype, shape, data}``, data the base64 of the
    little-endian C-order bytes (see :func:`mstar_rt.serve.wire.decode_input`)."""
    return {"type": "object", "required": ["dtype", "shape", "data"],
            "additionalProperties": False,
            "properties": {"dtype": {"enum": sorted(DTYPES)},
                           "shape": {"type": "array", "maxItems": MAX_DIMS,
                                     "items": {"type": "integer", "minimum": 0}},
                           "data": {"type": "string", "contentEncoding": "base64"}}}


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: Optional[str] = None
    code: Optional[str] = None


class ErrorBody(BaseModel):
    """Every error answer: ``{"error": {message, type, param, code}}`` (OpenAI's shape)."""

    error: ErrorDetail


def request_body(schema: dict[str, Any]) -> dict[str, Any]:
    """OpenAPI ``openapi_extra`` documenting the JSON body of a route that reads it itself (to
    answer a bad one with a 400 naming the field, not FastAPI's 422)."""
    return {"requestBody": {"required": True,
                            "content": {"application/json": {"schema": schema}}}}


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

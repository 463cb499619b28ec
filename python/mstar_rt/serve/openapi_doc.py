"""The OpenAPI document's parts that say what each HTTP route answers: the success bodies, the
error statuses (each an :class:`~mstar_rt.serve.bodies.ErrorBody`) and the JSON schema of each
model input as far as the deployment knows it."""

from __future__ import annotations

from typing import Any, Optional

import numpy as np

from mstar_rt.serve.bodies import ErrorBody, array_schema
from mstar_rt.serve.deployment import Deployment

_BINARY = {"schema": {"type": "string", "format": "binary"}}
SPEECH_200 = {"description": "the speech as it is spoken: 16-bit mono PCM, or WAV (a streaming "
                              "header, then the same PCM)",
               "content": {"audio/pcm": _BINARY, "audio/wav": _BINARY},
               "headers": {"X-Sample-Rate": {"schema": {"type": "string"}}}}
GENERATE_200 = {"description": "one JSON line per output as the model EMITs it, then "
                                "{done, counts} (or an error line)",
                 "content": {"application/x-ndjson": {"schema": {"type": "string"}}}}
_ERRORS = {400: "the request is wrong; the message names the field to fix",
           401: "the API key is missing or wrong", 404: "no such model (or it does not speak)",
           429: "the server runs max_concurrent_requests requests; retry after Retry-After",
           500: "the model failed on this request", 503: "the request was cancelled",
           504: "the request ran past request_timeout_s"}


def input_schemas(d: Deployment) -> dict[str, dict[str, Any]]:
    """The JSON schema of each model input's value, as far as the deployment knows it: the
    speech text and voice; the policy's declared shapes and dtypes (nested lists, or an array
    as ``{dtype, shape, data}``); ``{}`` (any JSON, arrays included) otherwise."""
    out: dict[str, dict[str, Any]] = {name: {} for name in d.inputs}
    if d.speech is not None:
        out[d.speech.text_input] = {"type": "string"}
        if d.speech.voice_input is not None:
            voice = {"enum": list(d.speech.voices)} if d.speech.voices else {"type": "string"}
            out[d.speech.voice_input] = {"anyOf": [voice, {"type": "null"}]}
    for name, shape in d.policy.shapes.items():
        if name in out:
            out[name] = {"anyOf": [_nested_arrays(shape, d.policy.dtypes.get(name)),
                                   array_schema()]}
    return out


def _nested_arrays(shape: tuple, dtype: Optional[str]) -> dict[str, Any]:
    """Nested JSON arrays of ``shape`` (None = any size) holding ``dtype`` values."""
    kind = np.dtype(dtype).kind if dtype is not None else "f"
    item: dict[str, Any] = ({"type": "boolean"} if kind == "b" else {"type": "number"}
                            if kind in "fc" else {"type": "integer"})
    if kind in "iuf" and dtype is not None:  # a value past the dtype's range is refused
        info = (np.iinfo if kind in "iu" else np.finfo)(np.dtype(dtype))
        item.update(minimum=np.asarray(info.min).item(), maximum=np.asarray(info.max).item())
    for size in reversed(shape):
        item = {"type": "array", "items": item}
        if size is not None:
            item.update(minItems=size, maxItems=size)
    return item


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI ``responses`` for these error statuses, each an :class:`ErrorBody`."""
    return {s: {"model": ErrorBody, "description": _ERRORS[s]} for s in statuses}

"""The body of ``POST /v1/chat/completions`` (OpenAI's, as far as a speech-in, speech-out model
serves it): each field checks itself and names what to send instead (see
:mod:`mstar_rt.serve.bodies`). Messages are parsed by :func:`parse_messages`, so an error
names the part at fault (``messages[1].content[0].input_audio.format``)."""

from __future__ import annotations

from typing import Any, ClassVar, Literal, Mapping, Optional, Sequence

from pydantic import Field, field_validator, model_validator

from mstar_rt.config.errors import KeyProblem
from mstar_rt.models.qwen3_omni.chat import INPUT_AUDIO_FORMATS, ChatError, parse_messages
from mstar_rt.serve.bodies import Body
from mstar_rt.serve.wire import whole_number

CHAT_AUDIO_FORMATS = ("wav", "pcm16")
MAX_TOKENS = 32768
DEFAULT_MAX_TOKENS = 512


class ChatBody(Body):
    """OpenAI's chat completions body. Served: ``messages`` (system/developer, user with text
    and ``input_audio`` parts, assistant), ``modalities`` (``["text"]`` or ``["text",
    "audio"]``), ``audio`` {voice, format: wav | pcm16}, ``max_tokens`` /
    ``max_completion_tokens``, ``temperature``, ``top_p``, ``top_k``, ``stream``,
    ``stream_options.include_usage``, ``seed`` (an integer seeds the talker's sampling: the
    same request gives the same audio). ``user``, ``metadata``, ``store`` and
    ``parallel_tool_calls`` are accepted and ignored; the others are accepted only at their
    defaults (``n`` 1, no ``stop``, no ``tools``, no penalties, no ``logprobs``)."""

    #: field -> the values served besides null: what leaves the feature off
    only_default: ClassVar[dict[str, tuple]] = {
        "n": (1,), "stop": ([],), "tools": ([],), "tool_choice": ("none",), "functions": ([],),
        "function_call": ("none",), "logprobs": (False,), "top_logprobs": (0,),
        "logit_bias": ({},), "presence_penalty": (0,), "frequency_penalty": (0,),
        "response_format": ({"type": "text"},), "prediction": (), "reasoning_effort": (),
        "service_tier": ("auto", "default"), "web_search_options": ()}

    model: Optional[str] = None
    messages: Any
    modalities: tuple[Literal["text", "audio"], ...] = ("text",)
    audio: Optional[dict[str, str]] = None  # {voice: str | None, format}
    max_tokens: Optional[int] = Field(None, ge=1, le=MAX_TOKENS)
    max_completion_tokens: Optional[int] = Field(None, ge=1, le=MAX_TOKENS)
    temperature: Optional[float] = Field(None, ge=0, le=2)
    top_p: Optional[float] = Field(None, gt=0, le=1)
    top_k: Optional[int] = Field(None, ge=1)
    stream: Optional[bool] = False
    stream_options: Optional[dict[str, bool]] = None
    seed: Any = None
    user: Any = None
    metadata: Any = None
    store: Any = None
    parallel_tool_calls: Any = None
    n: Any = 1
    stop: Any = None
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    logprobs: Any = False
    top_logprobs: Any = None
    logit_bias: Any = None
    presence_penalty: Any = 0
    frequency_penalty: Any = 0
    response_format: Any = None
    prediction: Any = None
    reasoning_effort: Any = None
    service_tier: Any = None
    web_search_options: Any = None

    @property
    def wants_audio(self) -> bool:
        return "audio" in self.modalities

    @property
    def token_limit(self) -> int:
        return self.max_completion_tokens or self.max_tokens or DEFAULT_MAX_TOKENS

    @property
    def audio_format(self) -> str:
        """The requested audio format (default: pcm16 when streaming, else wav)."""
        return (self.audio or {}).get("format") or ("pcm16" if self.stream else "wav")

    @property
    def voice(self) -> Optional[str]:
        return (self.audio or {}).get("voice")

    @property
    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))

    def talker_sampling(self) -> Optional[dict[str, Any]]:
        """The talker's default sampling seeded with ``seed``; None (the model's default,
        unseeded) without an integer seed."""
        if type(self.seed) is not int:
            return None
        import dataclasses

        from mstar_rt.models.qwen3_omni.talker_node import TALKER_SAMPLING

        return dict(dataclasses.asdict(TALKER_SAMPLING), seed=self.seed)

    def thinker_sampling(self) -> Optional[dict[str, Any]]:
        """The text sampling asked for: None (greedy) when no temperature, top_p or top_k is
        given or temperature is 0; else {temperature (default 1), top_p, top_k}."""
        if self.temperature == 0 or (self.temperature is None and self.top_p is None
                                     and self.top_k is None):
            return None
        out: dict[str, Any] = {"temperature": 1.0 if self.temperature is None
                               else float(self.temperature)}
        if self.top_p is not None:
            out["top_p"] = float(self.top_p)
        if self.top_k is not None:
            out["top_k"] = int(self.top_k)
        return out

    @staticmethod
    def schema_for(model: str, voices: Sequence[str]) -> dict[str, Any]:
        """The body's JSON schema as a deployment serving ``model`` with ``voices`` accepts it
        (the message and part shapes are OpenAI's, as far as they are served)."""
        schema = ChatBody.model_json_schema()
        props = schema["properties"]
        props["model"] = {"anyOf": [{"enum": [model]}, {"type": "null"}], "default": None}
        props["messages"] = {"type": "array", "minItems": 1, "items": {"anyOf": _MESSAGES}}
        props["modalities"] = {"anyOf": [{"type": "array", "minItems": 1,
                                          "items": {"enum": ["text", "audio"]}},
                                         {"type": "null"}], "default": ["text"]}
        voice: dict[str, Any] = {"enum": list(voices)} if voices else {"type": "string"}
        props["audio"] = {"anyOf": [{"type": "object", "additionalProperties": False,
                                     "properties": {
                                         "voice": {"anyOf": [voice, _VOICE_ID, {"type": "null"}]},
                                         "format": {"enum": [*CHAT_AUDIO_FORMATS, None]}}},
                                    {"type": "null"}], "default": None}
        for k, served in ChatBody.only_default.items():
            props[k] = {"enum": [*served, None], "default": None}
        props["stream_options"] = {"anyOf": [{"type": "object", "additionalProperties": False,
                                              "properties": {
                                                  "include_usage": {"type": "boolean"},
                                                  "include_obfuscation": {"type": "boolean"}}},
                                             {"type": "null"}], "default": None}
        return schema

    @model_validator(mode="before")
    @classmethod
    def _defaults_only(cls, data: Any) -> Any:
        if isinstance(data, Mapping):
            for k, served in cls.only_default.items():
                v = data.get(k)
                if v is not None and not any(_same(v, x) for x in served):
                    only = f" (only {' or '.join(map(repr, served))})" if served else ""
                    raise KeyProblem(k, f"{k!r} is not served{only}; leave it out")
        return data

    @model_validator(mode="after")
    def _consistent(self) -> "ChatBody":
        if (self.max_tokens is not None and self.max_completion_tokens is not None
                and self.max_tokens != self.max_completion_tokens):
            raise KeyProblem("max_completion_tokens", "max_tokens and max_completion_tokens "
                             "differ; give one of them")
        if self.stream and self.wants_audio and self.audio_format != "pcm16":
            raise KeyProblem("audio.format", f"streamed audio is sent as pcm16, not "
                             f"{self.audio_format!r}; set audio.format to 'pcm16' or stream: "
                             "false")
        return self

    @field_validator("model", mode="before")
    @classmethod
    def _model(cls, v: Any) -> Any:
        if v is not None and not isinstance(v, str):
            raise ValueError("'model' must be a string: the id /v1/models lists")
        return v

    @field_validator("messages", mode="before")
    @classmethod
    def _messages(cls, v: Any) -> Any:
        try:
            return parse_messages(v)
        except ChatError as e:
            raise KeyProblem(e.param, str(e)) from None

    @field_validator("modalities", mode="before")
    @classmethod
    def _modalities(cls, v: Any) -> Any:
        if v is None:
            return ("text",)
        if (not isinstance(v, list) or not v
                or not all(isinstance(m, str) and m in ("text", "audio") for m in v)):
            raise ValueError(f"'modalities' must be [\"text\"] or [\"text\", \"audio\"], not "
                             f"{v!r:.80}")
        return tuple(v)

    @field_validator("audio", mode="before")
    @classmethod
    def _audio(cls, v: Any) -> Any:
        if v is None:
            return None
        if not isinstance(v, Mapping) or set(v) - {"voice", "format"}:
            raise KeyProblem("audio", "'audio' must be {\"voice\": \"<a voice /v1/models "
                             "lists>\", \"format\": \"wav\" | \"pcm16\"}")
        voice, fmt = v.get("voice"), v.get("format")
        if isinstance(voice, Mapping) and isinstance(voice.get("id"), str):
            voice = voice["id"]  # a custom voice reference {id}
        if voice is not None and not isinstance(voice, str):
            raise KeyProblem("audio.voice", "'audio.voice' must be a string")
        if fmt is not None and fmt not in CHAT_AUDIO_FORMATS:
            raise KeyProblem("audio.format", f"audio format {fmt!r} is not served; use one of "
                             f"{list(CHAT_AUDIO_FORMATS)}")
        return {k: x for k, x in (("voice", voice), ("format", fmt)) if x is not None}

    @field_validator("max_tokens", "max_completion_tokens", mode="before")
    @classmethod
    def _tokens(cls, v: Any) -> Any:
        if v is None:
            return None
        n = whole_number(v)
        if n is None or not 1 <= n <= MAX_TOKENS:
            raise ValueError(f"must be an integer in 1..{MAX_TOKENS}, not {v!r:.40}")
        return n

    @field_validator("temperature", mode="before")
    @classmethod
    def _temperature(cls, v: Any) -> Any:
        if v is not None and (not _is_number(v) or not 0 <= v <= 2):
            raise ValueError("'temperature' must be a number in 0..2 (0 = greedy)")
        return v

    @field_validator("top_p", mode="before")
    @classmethod
    def _top_p(cls, v: Any) -> Any:
        if v is not None and (not _is_number(v) or not 0 < v <= 1):
            raise ValueError("'top_p' must be a number in (0, 1]")
        return v

    @field_validator("top_k", mode="before")
    @classmethod
    def _top_k(cls, v: Any) -> Any:
        if v is None:
            return None
        k = whole_number(v)
        if k is None or k < 1:
            raise ValueError("'top_k' must be a positive integer")
        return k

    @field_validator("stream", mode="before")
    @classmethod
    def _stream(cls, v: Any) -> Any:
        if v is not None and not isinstance(v, bool):
            raise ValueError("'stream' must be true or false")
        return bool(v)

    @field_validator("stream_options", mode="before")
    @classmethod
    def _stream_options(cls, v: Any) -> Any:
        if v is None:
            return None
        if not isinstance(v, Mapping) or not all(
                isinstance(x, bool) for x in v.values()) or set(v) - {"include_usage",
                                                                         "include_obfuscation"}:
            raise ValueError("'stream_options' must be {\"include_usage\": true | false}")
        return dict(v)



def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _same(v: Any, x: Any) -> bool:
    """JSON equality: true is not 1, 1.0 is 1."""
    if isinstance(v, bool) or isinstance(x, bool):
        return v is x
    if _is_number(v) and _is_number(x):
        return v == x
    return type(v) is type(x) and v == x


def _part(kind: str, value: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "required": ["type", kind],
            "properties": {"type": {"const": kind}, kind: value}}


def _array(*parts: dict[str, Any]) -> dict[str, Any]:
    return {"type": "array", "items": {"anyOf": list(parts)}}


_TEXT = {"type": "string"}
_VOICE_ID = {"type": "object", "required": ["id"], "properties": {"id": _TEXT}}
_TEXT_PART = _part("text", _TEXT)
_AUDIO_PART = _part("input_audio", {
    "type": "object", "required": ["data", "format"],
    "properties": {"data": {"type": "string", "contentEncoding": "base64"},
                   "format": {"enum": list(INPUT_AUDIO_FORMATS)}}})
_MESSAGES = [
    {"type": "object", "required": ["role", "content"],
     "properties": {"role": {"enum": ["system", "developer"]},
                    "content": {"anyOf": [_TEXT, _array(_TEXT_PART)]}}},
    {"type": "object", "required": ["role", "content"],
     "properties": {"role": {"const": "user"},
                    "content": {"anyOf": [_TEXT, _array(_TEXT_PART, _AUDIO_PART)]}}},
    {"type": "object", "required": ["role"],
     "properties": {"role": {"const": "assistant"},
                    "content": {"anyOf": [_TEXT, {"type": "null"},
                                          _array(_TEXT_PART, _part("refusal", _TEXT))]},
                    "audio": {"anyOf": [{"type": "object", "required": ["id"],
                                         "properties": {"id": _TEXT, "transcript": _TEXT}},
                                        {"type": "null"}]}},
     # an earlier answer: its text, or its audio's id
     "anyOf": [{"required": ["content"], "properties": {"content": {"not": {"type": "null"}}}},
               {"required": ["audio"], "properties": {"audio": {"type": "object"}}}]}]

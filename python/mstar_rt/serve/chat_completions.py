"""``POST /v1/chat/completions`` on a speech-in, speech-out chat model (Qwen3-Omni), in OpenAI's
shapes: messages with text and ``input_audio`` parts in; text, or text and audio, out.

Non-streaming: ``choices[0].message`` holds ``content`` (text only) or ``audio`` {id, data (the
whole answer, base64 WAV or pcm16), transcript, expires_at} with ``content`` null. Streaming
(SSE, ``chat.completion.chunk``): a first delta with the role; then the text as ``content``
deltas, or with audio on as ``audio.transcript`` deltas interleaved with ``audio.data`` deltas
(base64 pcm16, 24 kHz mono) as the model EMITs them, the first carrying the audio ``id``; a last
audio delta with only ``expires_at``; a delta {} with ``finish_reason``; the usage chunk if
``stream_options.include_usage``; ``data: [DONE]``. A failure mid-stream is a ``data:
{"error": ...}`` event, which the openai client raises.

The model's request (see :class:`mstar_rt.models.qwen3_omni.chat.OmniChat`): ``prompt`` and
``audio_features`` from the messages, ``speaker`` from ``audio.voice``, ``return_audio`` from
``modalities``, ``max_tokens``, ``max_audio_frames`` (:data:`AUDIO_FRAMES_PER_TOKEN` per text
token), ``thinker_sampling`` from ``temperature`` / ``top_p`` / ``top_k``; the talker and code
predictor sample as the model does by default (None)."""

from __future__ import annotations

import base64
import contextlib
import json
import threading
import time
import uuid
from collections import OrderedDict
from typing import Any, AsyncIterator, Optional, Sequence

import anyio
import numpy as np
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from mstar_rt.models.qwen3_omni.chat import SPEAK_PROMPT, ChatError, Message, OmniChat
from mstar_rt.serve.bodies import request_body
from mstar_rt.serve.chat_bodies import ChatBody
from mstar_rt.serve.wire import as_array, pcm16, wav_header

ENDPOINT = "/v1/chat/completions"
OUTPUT_RATE = 24000  # OpenAI's pcm16
#: ``max_audio_frames`` per text token allowed (Qwen3-Omni's codec runs at 12.5 frames a second
#: of speech; a text token is rarely longer than half a second).
AUDIO_FRAMES_PER_TOKEN = 8
#: How long an answer's audio id can be sent back as an assistant turn (OpenAI keeps audio for
#: an hour); the server keeps only its transcript.
AUDIO_TTL_S = 3600


def add_chat_routes(app: Any, state: Any) -> None:
    """``POST /v1/chat/completions`` on ``app`` (a FastAPI app); a 404 unless the deployment's
    model is an omni chat model (``deployment.chat``)."""
    from mstar_rt.serve.app import ApiError, admit, json_body, parse_body, start_stream
    from mstar_rt.serve.openapi_doc import error_responses

    d = state.deployment
    transcripts = _Transcripts()
    keyed = (401,) if d.api_key is not None else ()
    schema = ChatBody.schema_for(d.name, d.chat.speakers if d.chat is not None else ())
    responses = {200: _CHAT_200, **error_responses(400, *keyed, 404, 429, 500, 503, 504)}

    # Only a chat deployment documents the route; the others answer it with a clear 404.
    @app.post(ENDPOINT, response_class=Response, include_in_schema=d.chat is not None,
              openapi_extra=request_body(schema), responses=responses)
    async def chat_completions(request: Request) -> Response:
        body = await json_body(request)
        chat: Optional[OmniChat] = d.chat
        if chat is None:
            raise ApiError(404, f"model {d.name!r} is not a chat model (a chat model takes "
                           "'prompt' and 'audio_features' and has a tokenizer); its endpoints "
                           "are /generate"
                           + (" and /v1/audio/speech" if d.speech is not None else ""),
                           code="not_chat_model")
        req = parse_body(ChatBody, body)
        if req.model is not None and req.model != d.name:
            raise ApiError(404, f"model {req.model!r} is not served here; use {d.name!r}",
                           param="model", code="model_not_found")
        try:
            speaker = chat.speaker(req.voice)
        except ValueError as e:
            raise ApiError(400, str(e), param="audio.voice") from None
        messages = transcripts.resolve(req.messages, ApiError)
        admit(state)  # a full server answers 429 before decoding audio it would not serve
        try:
            try:  # decoding and mel features: off the event loop
                prompt, features = await state.bridge.call(chat.prompt, messages)
            except ChatError as e:
                raise ApiError(400, str(e), param=e.param) from None
            inputs = {"prompt": prompt, "audio_features": features, "speaker": speaker,
                      "return_audio": req.wants_audio, "max_tokens": req.token_limit,
                      "max_audio_frames": AUDIO_FRAMES_PER_TOKEN * req.token_limit,
                      "thinker_sampling": req.thinker_sampling(),
                      "talker_sampling": req.talker_sampling(),
                      "code_predictor_sampling": None}
            answer = _Answer(chat, req, d.name, prompt)
        except BaseException:
            state.bridge.admission.leave()
            raise
        if req.stream:  # from here on, the slot is the request's to release
            return await start_stream(
                state, request, ENDPOINT, inputs, 0, None,
                lambda first, rest, t0: _sse(state, answer, transcripts, first, rest, t0),
                "text/event-stream", {"Cache-Control": "no-cache"}, errors_inline=_sse_error,
                admitted=True)
        outputs = await _collect(state, request, inputs, admitted=True)
        if outputs is None:
            return Response(status_code=499)  # the client left; nobody reads it
        pcm = [answer.take(name, value) for name, value in outputs]
        pcm.append(answer.end())
        if req.wants_audio:
            transcripts.add(answer)
        return JSONResponse(answer.completion(b"".join(p for _, p in pcm)))


def speech_inputs(chat: OmniChat, text: str, voice: Optional[str]) -> dict[str, Any]:
    """``/v1/audio/speech`` on an omni model: the text as the user's message, after a system
    prompt asking to read it aloud; ``voice`` is the speaker. A 400 (ApiError) for an unknown
    voice or text the chat format refuses."""
    from mstar_rt.serve.app import ApiError

    try:
        speaker = chat.speaker(voice)
        prompt, _ = chat.prompt([Message("system", (SPEAK_PROMPT,)), Message("user", (text,))])
    except ChatError as e:
        raise ApiError(400, f"input: {e}", param="input") from None
    except ValueError as e:
        raise ApiError(400, str(e), param="voice") from None
    limit = 2 * len(chat.encode(text)) + 16
    return {"prompt": prompt, "audio_features": [], "speaker": speaker,
            "return_audio": True, "max_tokens": limit,
            "max_audio_frames": AUDIO_FRAMES_PER_TOKEN * limit, "thinker_sampling": None,
            "talker_sampling": None, "code_predictor_sampling": None}


class _Answer:
    """One answer as it is made: text deltas from the tokens, pcm16 at 24 kHz from the audio,
    the counts for ``usage``, and the response objects."""

    def __init__(self, chat: OmniChat, req: ChatBody, model: str, prompt: Sequence[int]) -> None:
        from mstar_rt.audio.resample import Resampler

        self.req, self.model, self.chat = req, model, chat
        self.id = f"chatcmpl-{uuid.uuid4().hex}"
        self.audio_id = f"audio_{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.expires_at = self.created + AUDIO_TTL_S
        self.prompt_tokens = len(prompt)
        self.audio_tokens = sum(1 for t in prompt if t == chat.tokens.audio)
        self.text = chat.text_deltas()
        self.resampler = Resampler(chat.sample_rate, OUTPUT_RATE)
        self.tokens = 0
        self.ended_turn = False  # the model wrote <|im_end|>
        self.samples = 0

    def take(self, name: str, value: Any) -> tuple[str, bytes]:
        """One EMIT -> (the text it adds, the pcm16 bytes it adds)."""
        if name == "token":
            token = int(as_array(value))
            self.tokens += 1
            self.ended_turn |= token == self.chat.tokens.im_end
            return self.text.push(token), b""
        if name == "audio" and self.req.wants_audio:
            audio = np.asarray(as_array(value), np.float32).reshape(-1)
            return "", self._pcm(self.resampler.process(audio))
        return "", b""

    def end(self) -> tuple[str, bytes]:
        """What was held back: an incomplete character, the resampler's tail."""
        tail = self.resampler.process(np.zeros(0, np.float32), last=True)
        return self.text.flush(), self._pcm(tail) if self.req.wants_audio else b""

    def _pcm(self, audio: np.ndarray) -> bytes:
        self.samples += len(audio)
        return pcm16(audio) if len(audio) else b""

    @property
    def finish_reason(self) -> str:
        return "length" if not self.ended_turn and self.tokens >= self.req.token_limit else "stop"

    def usage(self) -> dict[str, Any]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.tokens,
                "total_tokens": self.prompt_tokens + self.tokens,
                "prompt_tokens_details": {"audio_tokens": self.audio_tokens, "cached_tokens": 0}}

    def completion(self, pcm: bytes) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": self.text.text,
                                   "refusal": None, "annotations": []}
        if self.req.wants_audio:
            data = (wav_header(OUTPUT_RATE, data_size=len(pcm)) + pcm
                    if self.req.audio_format == "wav" else pcm)
            message["content"] = None
            message["audio"] = {"id": self.audio_id, "data": base64.b64encode(data).decode(),
                                "expires_at": self.expires_at, "transcript": self.text.text}
        return {"id": self.id, "object": "chat.completion", "created": self.created,
                "model": self.model, "system_fingerprint": None,
                "choices": [{"index": 0, "message": message, "logprobs": None,
                             "finish_reason": self.finish_reason}],
                "usage": self.usage()}

    def chunk(self, delta: Optional[dict], finish_reason: Optional[str] = None) -> bytes:
        """One SSE event holding a ``chat.completion.chunk``; ``delta`` None: the usage chunk."""
        out: dict[str, Any] = {"id": self.id, "object": "chat.completion.chunk",
                               "created": self.created, "model": self.model,
                               "system_fingerprint": None,
                               "choices": [] if delta is None else [
                                   {"index": 0, "delta": delta, "logprobs": None,
                                    "finish_reason": finish_reason}]}
        if self.req.include_usage:
            out["usage"] = self.usage() if delta is None else None
        return b"data: " + json.dumps(out).encode() + b"\n\n"


async def _sse(state: Any, answer: _Answer, transcripts: "_Transcripts", first: Optional[tuple],
               rest: AsyncIterator, started: float) -> AsyncIterator[bytes]:
    audio_on = answer.req.wants_audio
    audio_id_sent = heard = False

    def deltas(text: str, pcm: bytes) -> list[dict[str, Any]]:
        nonlocal audio_id_sent, heard
        out: list[dict[str, Any]] = []
        if text:
            out.append({"audio": {"transcript": text}} if audio_on else {"content": text})
        if pcm:
            if not heard:
                heard = True
                state.metrics.ttfa.observe(time.monotonic() - started)
            out.append({"audio": {"data": base64.b64encode(pcm).decode()}})
        for d in out:
            if "audio" in d and not audio_id_sent:
                d["audio"] = {"id": answer.audio_id, **d["audio"]}
                audio_id_sent = True
        return out

    yield answer.chunk({"role": "assistant", "content": None if audio_on else ""})

    async def outputs() -> AsyncIterator[tuple[str, Any]]:
        if first is not None:
            yield first
        async for item in rest:
            yield item

    async for name, value in outputs():
        for d in deltas(*answer.take(name, value)):
            yield answer.chunk(d)
    for d in deltas(*answer.end()):
        yield answer.chunk(d)
    if audio_on:
        tail = {"expires_at": answer.expires_at}
        yield answer.chunk({"audio": tail if audio_id_sent else {"id": answer.audio_id, **tail}})
        transcripts.add(answer)
    yield answer.chunk({}, answer.finish_reason)
    if answer.req.include_usage:
        yield answer.chunk(None)
    yield b"data: [DONE]\n\n"


def _sse_error(e: BaseException) -> bytes:
    """A failure after the stream began, as the SSE error event the openai client raises."""
    from mstar_rt.serve.app import error_of

    err = error_of(e)
    return b"data: " + json.dumps({"error": {"message": err.message, "type": err.kind,
                                             "param": err.param, "code": err.code}}
                                  ).encode() + b"\n\n"


async def _collect(state: Any, request: Request, inputs: dict,
                   admitted: bool = False) -> Optional[list]:
    """Runs the request to its end and returns its outputs, or None if the client left first
    (the request is then cancelled). Errors are the same ApiErrors a stream's start gets.
    ``admitted``: the caller holds the request's slot, released here."""
    from mstar_rt.serve.app import ApiError, ClientGone, admit, error_of, unless_gone

    started = time.monotonic()
    bridge = state.bridge
    if not admitted:
        admit(state)
    outputs = None
    got: list = []
    try:
        try:
            handle = await bridge.submit(inputs)
        except (ValueError, TypeError) as e:
            raise ApiError(400, f"{type(e).__name__}: {e}") from None
        outputs = bridge.outputs(handle, started)

        async def drain() -> None:
            async for item in outputs:  # type: ignore[union-attr]
                if not got:
                    state.metrics.first_output.observe(time.monotonic() - started, ENDPOINT)
                got.append(item)

        try:
            await unless_gone(drain(), request)
        except ClientGone:
            state.metrics.requests.inc(ENDPOINT, "cancelled")
            return None
        except Exception as e:
            raise error_of(e) from None
    finally:
        bridge.admission.leave()
        if outputs is not None:
            with anyio.CancelScope(shield=True), contextlib.suppress(RuntimeError):
                await outputs.aclose()  # cancels the request if it is still running
    state.outcome(ENDPOINT, None)
    state.metrics.latency.observe(time.monotonic() - started, ENDPOINT)
    return got


class _Transcripts:
    """Transcripts of recent answers' audio by audio id, so that a client may send an earlier
    answer back as ``{"role": "assistant", "audio": {"id": ...}}`` (OpenAI's multi-turn
    audio). Bounded: the oldest go first, and none outlives its ``expires_at``."""

    def __init__(self, limit: int = 4096) -> None:
        self.limit = limit
        self._by_id: OrderedDict[str, tuple[str, int]] = OrderedDict()
        self._lock = threading.Lock()

    def add(self, answer: _Answer) -> None:
        with self._lock:
            self._by_id[answer.audio_id] = (answer.text.text, answer.expires_at)
            while len(self._by_id) > self.limit:
                self._by_id.popitem(last=False)

    def resolve(self, messages: Sequence[Message], error: Any) -> list[Message]:
        """``messages`` with each assistant turn given only by an audio id replaced by its
        transcript; ``error(400, ...)`` raised for an id not known (or expired)."""
        out = []
        now = time.time()
        for i, m in enumerate(messages):
            if m.audio_id is not None and not m.parts:
                with self._lock:
                    known = self._by_id.get(m.audio_id)
                if known is None or known[1] < now:
                    raise error(400, f"messages[{i}].audio.id: no answer of this server has "
                                f"audio {m.audio_id!r} (or it expired); send the transcript "
                                "as the message's content", param=f"messages[{i}].audio.id")
                m = Message(m.role, (known[0],), m.audio_id)
            out.append(m)
        return out


_CHAT_200 = {"description": "a chat.completion (JSON), or with stream: true a stream of "
                            "chat.completion.chunk server-sent events ending with [DONE]",
             "content": {"application/json": {"schema": {"type": "object"}},
                         # each event: its data is a chunk's JSON, or [DONE] at the end
                         "text/event-stream": {"schema": {
                             "type": "object", "required": ["data"],
                             "properties": {"data": {"type": "string"}}}}}}

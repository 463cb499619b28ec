"""The HTTP front-end (FastAPI): health, models, OpenAI-compatible speech, NDJSON generate,
Prometheus metrics — and the openpi policy websocket (``mstar_rt.serve.openpi``) on the same
port. Errors are JSON ``{"error": {"message", "type", "param", "code"}}`` (OpenAI's shape)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from typing import Any, AsyncIterator, Awaitable, Callable, Optional, TypeVar, Union

import anyio
import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException

from mstar_rt.runtime import DeadlineExceeded
from mstar_rt.serve.bodies import BadBody, Body, GenerateBody, SpeechBody, parse, request_body
from mstar_rt.serve.bridge import AtCapacity, Bridge, RequestTimeout
from mstar_rt.serve.deployment import Deployment
from mstar_rt.serve.metrics import ServerMetrics
from mstar_rt.serve.openapi_doc import GENERATE_200, SPEECH_200, error_responses, input_schemas
from mstar_rt.serve.requests_in import BodyProblem, json_object, key_error
from mstar_rt.serve.wire import as_array, decode_input, encode_value, pcm16, wav_header

_B = TypeVar("_B", bound=Body)
OPEN_PATHS = ("/health", "/healthz")  # for load balancers: no key needed
STALL_S = 60.0  # without request_timeout_s: how long a streamed response waits on its reader


class ApiError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error",
                 param: Optional[str] = None, code: Optional[str] = None) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = (status, message, kind,
                                                                       param, code)
        self.counted = False  # its request is in the metrics already

    def response(self) -> JSONResponse:
        return JSONResponse({"error": {"message": self.message, "type": self.kind, "param":
                                       self.param, "code": self.code}}, status_code=self.status,
                            headers={"Retry-After": "1"} if self.status in (429, 503) else None)


class _Stream(StreamingResponse):
    """A streaming response that watches for the client leaving while it waits for the model,
    and always closes its body and calls ``on_close`` (which ends the request) however the
    stream ends."""

    on_close: Any = None
    stall_s: Optional[float] = None  # a client that takes no bytes for this long is gone

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        async def bounded(message: Any) -> None:
            # A client that stopped reading held its request slot forever (every other client
            # got 429), past request_timeout_s: its send waited on a full socket.
            with anyio.fail_after(self.stall_s):
                await send(message)

        try:
            async with anyio.create_task_group() as tg:
                async def stream() -> None:
                    # the client went away mid-send, or stalled
                    with contextlib.suppress(OSError, TimeoutError):
                        await self.stream_response(bounded)
                    tg.cancel_scope.cancel()

                tg.start_soon(stream)
                await self.listen_for_disconnect(receive)
                tg.cancel_scope.cancel()
        except asyncio.CancelledError:
            # Only uvicorn cancels an app call: its shutdown grace ended with this stream still
            # going. The stream is cut (no clean end for the client) and the request ends
            # below; that is the shutdown, not an application error to log with a traceback.
            pass
        finally:
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()  # type: ignore[attr-defined]
                await self.on_close()


class _KeyCheck:
    """Plain ASGI middleware: HTTP requests outside OPEN_PATHS need the API key (the websocket
    checks it itself, to answer the handshake the openpi way)."""

    def __init__(self, app: Any, api_key: str, state: "ServeState") -> None:
        self.app, self.api_key, self.state = app, api_key, state

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            problem = key_error(Headers(scope=scope), self.api_key)
            if problem is not None:
                # a fixed label: one series per path a keyless client made up grew /metrics
                path = scope["path"] if scope["path"] in self.state.paths else "other"
                self.state.metrics.requests.inc(path, "unauthorized")
                await ApiError(401, problem, "authentication_error",
                               code="invalid_api_key").response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


class ServeState:
    """What the routes share: the deployment, the bridge to its runtime, the metrics."""

    def __init__(self, deployment: Deployment) -> None:
        self.deployment = deployment
        self.bridge = Bridge(deployment.runtime, deployment.max_concurrent_requests,
                             deployment.request_timeout_s)
        self.metrics = ServerMetrics(deployment.runtime, lambda: self.bridge.admission.in_flight)
        self.paths: frozenset[str] = frozenset()  # the app's routes (create_app)

    def close(self) -> None:
        self.bridge.close()

    def outcome(self, endpoint: str, error: Optional[BaseException]) -> str:
        """Records a finished request by the kind of its end; returns that kind."""
        from mstar_rt.runtime import RequestCancelled

        cancelled = (RequestCancelled, ClientGone, anyio.get_cancelled_exc_class())
        status = ("ok" if error is None else "timeout" if isinstance(error, RequestTimeout)
                  else "deadline" if isinstance(error, DeadlineExceeded)
                  else "cancelled" if isinstance(error, cancelled) else "failed")
        self.metrics.requests.inc(endpoint, status)
        return status


def create_app(deployment: Deployment) -> FastAPI:
    """The ASGI app serving ``deployment`` (``app.state.serve`` holds the shared state; call
    ``app.state.serve.close()`` after the server stops)."""
    from mstar_rt.serve.chat_completions import add_chat_routes
    from mstar_rt.serve.openpi import add_policy_routes, check_input

    app = FastAPI(title=f"mstar_rt: {deployment.name}", docs_url=None, redoc_url=None)
    state = ServeState(deployment)
    app.state.serve = state
    d = deployment

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        if not exc.counted:  # (a deadline refused at submit was counted twice)
            state.metrics.requests.inc(request.url.path, _status_word(exc.status, exc.code))
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        # 404 / 405 in the documented error shape too, not {"detail": ...}
        kind = "not_found" if exc.status_code == 404 else "invalid_request_error"
        return ApiError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}",
                        kind).response()

    if d.api_key is not None:
        app.add_middleware(_KeyCheck, api_key=d.api_key, state=state)

    @app.get("/health", responses={503: {"description": "the model cannot serve (`reason`)"}})
    async def health() -> Any:
        reason = await state.bridge.health()  # e.g. a tensor-parallel rank or a worker lost
        body = {"status": "ok" if reason is None else "unavailable", "model": d.name,
                "admitted": state.bridge.admission.in_flight, "max_concurrent_requests":
                d.max_concurrent_requests} | ({} if reason is None else {"reason": reason})
        return JSONResponse(body, 200 if reason is None else 503)

    # what load balancers probe (out of the schema: it has no body to document)
    app.add_api_route("/health", health, methods=["HEAD"], include_in_schema=False)

    keyed = (401,) if d.api_key is not None else ()

    @app.get("/v1/models", responses=error_responses(*keyed))
    async def models() -> dict:
        info = {"id": d.name, "object": "model", "created": d.created, "owned_by": "mstar_rt",
                "capabilities": d.capabilities, "inputs": list(d.inputs)} | (
                    {"voices": list(d.speech.voices or ())} if d.speech is not None else {})
        return {"object": "list", "data": [info]}

    @app.get("/metrics", response_class=PlainTextResponse, responses=error_responses(*keyed))
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(state.metrics.render(),
                                 media_type="text/plain; version=0.0.4; charset=utf-8")

    voices = (d.speech.voices if d.speech is not None else None) or ()

    @app.post("/v1/audio/speech", response_class=Response,
              openapi_extra=request_body(SpeechBody.schema_for(d.name, voices)),
              responses={200: SPEECH_200,
                         **error_responses(400, *keyed, 404, 429, 500, 503, 504)})
    async def speech(request: Request) -> Response:
        body = await json_body(request)
        inputs, fmt = _speech_inputs(d, body)
        return await start_stream(state, request, "/v1/audio/speech", inputs, 0, None,
                                  lambda first, rest, t0: _audio(state, fmt, first, rest, t0),
                                  "audio/wav" if fmt == "wav" else "audio/pcm",
                                  {"X-Sample-Rate": str(d.speech.output_rate)})  # type: ignore

    @app.post("/generate", response_class=Response,
              openapi_extra=request_body(GenerateBody.schema_for(
                  input_schemas(d), [k for k in d.inputs if k not in d.optional_inputs])),
              responses={200: GENERATE_200,
                         **error_responses(400, *keyed, 429, 500, 503, 504)})
    async def generate(request: Request) -> Response:
        body = parse_body(GenerateBody, await json_body(request), inputs=d.inputs)
        try:  # off the event loop, like the parse: other clients' round trips go on meanwhile
            inputs = await state.bridge.call(lambda: {
                k: check_input(d.policy, k, decode_input(v, f"inputs.{k}"), f"inputs.{k}")
                for k, v in body.inputs.items()})
        except ValueError as e:
            raise ApiError(400, str(e), param="inputs") from None
        return await start_stream(state, request, "/generate", inputs, body.priority,
                                  body.deadline_s,
                                  lambda first, rest, t0: _ndjson(first, rest, body.arrays),
                                  "application/x-ndjson", {}, errors_inline=True,
                                  fail_late=body.fail_late)

    add_policy_routes(app, state)
    add_chat_routes(app, state)
    state.paths = frozenset(getattr(r, "path", "") for r in app.routes)
    return app


# ---- speech ------------------------------------------------------------------------------------


def _speech_inputs(d: Deployment, body: dict) -> tuple[dict, str]:
    spec = d.speech
    if spec is None:
        raise ApiError(404, f"model {d.name!r} does not serve speech; its endpoints are "
                       "/generate and the policy websocket", code="not_speech_model")
    req = parse_body(SpeechBody, body)
    if req.model is not None and req.model != d.name:
        raise ApiError(404, f"model {req.model!r} is not served here; use {d.name!r}",
                       param="model", code="model_not_found")
    if d.chat is not None:  # an omni chat model: asked to read the text aloud
        from mstar_rt.serve.chat_completions import speech_inputs

        return speech_inputs(d.chat, req.input, req.voice), req.response_format
    if spec.voices and req.voice is not None and req.voice not in spec.voices:
        raise ApiError(400, f"unknown voice {req.voice!r}; this model speaks "
                       f"{list(spec.voices)}", param="voice")
    inputs = {**spec.inputs, spec.text_input: req.input}
    if spec.voice_input is not None and req.voice is not None:
        inputs[spec.voice_input] = req.voice
    return inputs, req.response_format


async def _audio(state: ServeState, fmt: str, first: Optional[tuple], rest: AsyncIterator,
                 started: float) -> AsyncIterator[bytes]:
    from mstar_rt.audio.resample import Resampler

    spec = state.deployment.speech
    assert spec is not None and spec.model_rate is not None
    resampler = Resampler(spec.model_rate, spec.output_rate)
    samples = 0
    if fmt == "wav":
        yield wav_header(spec.output_rate)

    async def chunks() -> AsyncIterator[tuple[str, Any]]:
        if first is not None:
            yield first
        async for item in rest:
            yield item
        yield spec.audio_output, None  # the end: the resampler lets out what it held back

    async for name, value in chunks():
        if name != spec.audio_output:
            continue
        last = value is None
        audio = np.asarray([] if last else as_array(value), np.float32).reshape(-1)
        if len(audio) or last:
            audio = resampler.process(audio, last=last)
        if len(audio):
            if samples == 0:
                state.metrics.ttfa.observe(time.monotonic() - started)
            samples += len(audio)
            yield pcm16(audio)
    if samples:
        state.metrics.rtf.observe((time.monotonic() - started) / (samples / spec.output_rate))


# ---- generate ----------------------------------------------------------------------------------


async def _ndjson(first: Optional[tuple], rest: AsyncIterator, arrays: str
                  ) -> AsyncIterator[bytes]:
    counts: dict[str, int] = {}

    def line(name: str, value: Any) -> bytes:
        i = counts.get(name, 0)
        counts[name] = i + 1
        try:  # a bare NaN token is no JSON: strict parsers (JSON.parse) failed on the line
            text = json.dumps({"output": name, "index": i, **encode_value(value, arrays)},
                              allow_nan=False)
        except ValueError:
            raise ValueError(f"output '{name}' [{i}] holds NaN or infinite values, which JSON "
                             "cannot carry; none were sent") from None
        return (text + "\n").encode()

    if first is not None:
        yield line(*first)
    async for name, value in rest:
        yield line(name, value)
    yield (json.dumps({"done": True, "counts": counts}) + "\n").encode()


# ---- the shared streaming path -----------------------------------------------------------------


def admit(state: ServeState) -> None:
    """Takes a request slot or answers 429 at once (before any work is spent on the request)."""
    try:
        state.bridge.admission.enter()
    except AtCapacity as e:
        raise ApiError(429, str(e), "rate_limit_error", code="max_concurrent_requests") from None


async def start_stream(state: ServeState, request: Request, endpoint: str, inputs: dict,
                       priority: int, deadline: Optional[float], render: Any, media_type: str,
                       headers: dict,
                       errors_inline: Union[bool, Callable[[BaseException], bytes]] = False,
                       fail_late: bool = False, admitted: bool = False) -> Response:
    """Admits and submits the request, waits for its first output (so a request that fails
    before producing anything gets a plain HTTP error), then streams the rest. A failure
    mid-stream breaks it off, or ends it with an error line (``errors_inline(error)``'s).
    ``admitted``: the caller already holds the request's slot (:func:`admit`), which this
    now releases however the request ends."""
    started = time.monotonic()
    bridge = state.bridge
    if not admitted:
        admit(state)
    outputs = None
    try:
        try:
            handle = await bridge.submit(inputs, deadline, priority, fail_late)
        except (ValueError, TypeError) as e:
            raise ApiError(400, f"{type(e).__name__}: {e}") from None
        except DeadlineExceeded as e:  # refused at submit: the queue ahead is too long
            state.metrics.requests.inc(endpoint, "deadline")
            error = error_of(e)
            error.counted = True
            raise error from None
        outputs = bridge.outputs(handle, started)
        try:
            first: Optional[tuple] = await _first(outputs, request)
        except StopAsyncIteration:
            first = None
        except ClientGone:
            raise
        except Exception as e:
            raise error_of(e) from None
    except BaseException as e:
        bridge.admission.leave()
        if outputs is not None:
            with anyio.CancelScope(shield=True):
                await outputs.aclose()
        if isinstance(e, ClientGone):
            state.metrics.requests.inc(endpoint, "cancelled")
            return Response(status_code=499)  # nobody reads it
        raise
    state.metrics.first_output.observe(time.monotonic() - started, endpoint)

    closed = False

    async def close(error: Optional[BaseException]) -> None:
        """Ends the request once, however the response ends (even if it never started)."""
        nonlocal closed
        if closed:
            return
        closed = True
        bridge.admission.leave()
        state.outcome(endpoint, error)
        if error is None:
            state.metrics.latency.observe(time.monotonic() - started, endpoint)
        with anyio.CancelScope(shield=True):  # even while the response task is cancelled
            await outputs.aclose()  # cancels the request if it is still running

    async def body() -> AsyncIterator[bytes]:
        try:
            async for data in render(first, outputs, started):
                yield data
        except Exception as e:
            await close(e)
            if not errors_inline:
                raise  # raw audio has no error frame: the client sees a broken stream
            if callable(errors_inline):
                yield errors_inline(e)
                return
            yield (json.dumps({"error": {"type": type(e).__name__, "message": str(e)}})
                   + "\n").encode()
            return
        except BaseException:  # closed or cancelled mid-stream: the client left
            await close(ClientGone())
            raise
        await close(None)

    response = _Stream(body(), media_type=media_type, headers=headers)
    response.on_close = lambda: close(ClientGone())
    response.stall_s = state.deployment.request_timeout_s or STALL_S
    return response


class ClientGone(Exception):
    """The client disconnected (its request is cancelled)."""


async def _first(outputs: AsyncIterator, request: Request) -> tuple:
    """The first output, unless the client leaves first (then the request is cancelled)."""
    return await unless_gone(outputs.__anext__(), request)


async def unless_gone(work: Awaitable[Any], request: Request) -> Any:
    """``work``'s result, unless the client leaves first: then ``work`` is cancelled and
    :class:`ClientGone` raised."""
    async def gone() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    nxt = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(gone())
    try:
        await asyncio.wait({nxt, watch}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        watch.cancel()
        nxt.cancel()
        raise
    watch.cancel()
    if not nxt.done():
        nxt.cancel()
        with contextlib.suppress(BaseException):
            await nxt
        raise ClientGone()
    return nxt.result()


def error_of(e: BaseException) -> ApiError:
    from mstar_rt.runtime import RequestCancelled, RequestFailed, RequestTooLarge

    if isinstance(e, DeadlineExceeded):  # 503: come back later; 504: it ran out of time
        return ApiError(503 if e.refused else 504, str(e), "server_error",
                        code="deadline_refused" if e.refused else "deadline_exceeded")
    if isinstance(e, RequestTimeout):
        return ApiError(504, str(e), "timeout_error", code="request_timeout")
    if isinstance(e, RequestCancelled):
        return ApiError(503, str(e), "server_error", code="cancelled")
    if isinstance(e, RequestTooLarge):  # the client's to fix (or the operator's num_pages)
        return ApiError(400, e.reason, code="kv_cache_too_small")
    if isinstance(e, RequestFailed):
        return ApiError(500, f"the model failed on this request: {e}", "server_error",
                        code="request_failed")
    return ApiError(500, f"{type(e).__name__}: {e}", "server_error")


# ---- small checks ------------------------------------------------------------------------------


async def json_body(request: Request) -> dict:
    """The request's JSON object: capped in size (413), parsed off the event loop (400)."""
    try:
        return await json_object(request, request.app.state.serve.bridge.call)
    except BodyProblem as e:
        raise ApiError(e.status, e.message) from None


def parse_body(cls: type[_B], body: dict, **context: Any) -> _B:
    try:
        return parse(cls, body, **context)
    except BadBody as e:
        raise ApiError(400, str(e), param=e.param) from None


def _status_word(status: int, code: Optional[str] = None) -> str:
    if code in ("deadline_refused", "deadline_exceeded"):  # (504 read as a timeout)
        return "deadline"
    return {400: "bad_request", 401: "unauthorized", 404: "bad_request", 413: "bad_request",
            429: "rejected", 500: "failed", 503: "cancelled", 504: "timeout"}.get(status,
                                                                                 str(status))

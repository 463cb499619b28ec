"""The openpi policy websocket: what ``openpi_client.websocket_client_policy`` talks to.

Protocol (openpi's ``WebsocketPolicyServer``): the client connects to ``ws://host:port/``
(optionally with ``Authorization: Api-Key <key>``); the server sends a msgpack metadata dict;
then each binary frame from the client is a msgpack observation dict, answered by a msgpack
dict with ``actions`` [H, A] and ``server_timing`` {``infer_ms``, ``prev_total_ms``}. Numpy
arrays travel as ``{b"__ndarray__": True, b"data": bytes, b"dtype": str, b"shape": list}``
(scalars as ``__npgeneric__``). An error is a text frame. ``GET /healthz`` answers ``OK``.

Unlike openpi's server, every connection submits to the shared runtime off the event loop, so
concurrent clients are batched by the runtime and never wait for each other's messages; and an
error frame leaves the connection open for the next observation.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from typing import Any, Mapping, Optional

import msgpack
import numpy as np
from fastapi import WebSocket, WebSocketDisconnect
from fastapi.responses import PlainTextResponse

from mstar_rt.request_errors import RequestTooLarge
from mstar_rt.serve.bridge import AtCapacity
from mstar_rt.serve.config import PolicySpec
from mstar_rt.serve.wire import MAX_DIMS, as_array


class ObservationError(ValueError):
    """The observation cannot be turned into the model's inputs; the message says why."""


# ---- msgpack with numpy, as openpi_client.msgpack_numpy encodes it ------------------------------

# What openpi_client refuses to send: objects and raw void records (a void scalar made from an
# integer would allocate that many bytes).
_REFUSED_KINDS = "VO"


def _pack_default(obj: Any) -> Any:
    obj = as_array(obj)
    if isinstance(obj, (np.ndarray, np.generic)) and obj.dtype.kind in ("V", "O", "c"):
        raise TypeError(f"cannot send an array of dtype {obj.dtype} over msgpack")
    if isinstance(obj, np.ndarray):
        a = np.ascontiguousarray(obj)
        return {b"__ndarray__": True, b"data": a.tobytes(), b"dtype": a.dtype.str,
                b"shape": a.shape}
    if isinstance(obj, np.generic):
        return {b"__npgeneric__": True, b"data": obj.item(), b"dtype": obj.dtype.str}
    raise TypeError(f"cannot send {type(obj).__name__} over msgpack")


# msgpack interns every str map key. A key that nothing else keeps leaves CPython's table of
# interned strings again with its message, and the slots it leaves behind make the table
# rebuild itself every ~10k messages, the first time at twice its size (+1.9 MB: a step in the
# policy server's RSS ~2 minutes into the soak benchmark). The first keys seen (a client's
# observation keys) are kept, so they stay interned; bounded, for clients that send any keys.
_KEPT_KEYS: dict[str, str] = {}
_MAX_KEPT_KEYS = 1024


def _unpack_hook(obj: dict) -> Any:
    if len(_KEPT_KEYS) < _MAX_KEPT_KEYS:
        for key in obj:
            if type(key) is str:
                _KEPT_KEYS.setdefault(key, key)
    if b"__ndarray__" in obj:
        dtype = _wire_dtype(obj.get(b"dtype"))
        shape, data = obj.get(b"shape"), obj.get(b"data")
        # the number of sizes first: multiplying millions of them would take minutes
        if not isinstance(shape, (list, tuple)) or len(shape) > MAX_DIMS or not all(
                isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
            raise ObservationError(f"an array's shape must be a list of at most {MAX_DIMS} "
                                   f"sizes >= 0, not {_brief(shape)}")
        if not isinstance(data, bytes):
            raise ObservationError(f"an array's data must be bytes, not {type(data).__name__}")
        need = math.prod(shape) * dtype.itemsize  # exact: a shape may claim more than memory
        if len(data) < need:
            raise ObservationError(f"an array of shape {tuple(shape)} and dtype {dtype} needs "
                                   f"{need} bytes, the message has {len(data)}")
        try:
            return np.ndarray(buffer=data, dtype=dtype, shape=tuple(shape))
        except (TypeError, ValueError) as e:  # an empty dtype, a shape past numpy's limits
            raise ObservationError(f"no array of shape {tuple(shape)} and dtype {dtype} "
                                   f"({e})") from None
    if b"__npgeneric__" in obj:
        dtype, data = _wire_dtype(obj.get(b"dtype")), obj.get(b"data")
        if dtype.kind in "US" and not isinstance(data, (str, bytes)):
            raise ObservationError(f"a {dtype} scalar holds a string, not {_brief(data)}")
        try:
            return dtype.type(data)
        except (TypeError, ValueError, OverflowError) as e:
            raise ObservationError(f"a {dtype} scalar cannot hold {_brief(data)} ({e})") from None
    return obj


def _wire_dtype(spec: Any) -> np.dtype:
    try:
        dtype = np.dtype(spec) if isinstance(spec, (str, bytes)) else None
    except (TypeError, ValueError):
        dtype = None
    if dtype is None or dtype.kind in _REFUSED_KINDS:
        raise ObservationError(f"{_brief(spec)} is not a dtype sent over the wire; send arrays of "
                               "numbers, booleans or strings (e.g. '<f4', '|u1')")
    return dtype


def _brief(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def packb(obj: Any) -> bytes:
    return msgpack.packb(obj, default=_pack_default)


def unpackb(data: bytes) -> Any:
    """Decodes a message; anything malformed becomes an :class:`ObservationError`."""
    try:
        return msgpack.unpackb(data, object_hook=_unpack_hook)
    except ObservationError:
        raise
    except Exception as e:  # msgpack raises several unrelated types for bad bytes
        raise ObservationError(f"the message is not msgpack with numpy arrays as openpi_client "
                               f"sends it ({type(e).__name__}: {e})") from None


# ---- observation -> inputs, outputs -> reply ---------------------------------------------------


class PolicyAdapter:
    """Maps observation dicts to model inputs and EMITted outputs to the reply (see
    :class:`~mstar_rt.serve.config.PolicySpec`)."""

    def __init__(self, spec: PolicySpec, model_inputs: tuple[str, ...], name: str,
                 model_defaults: tuple[str, ...] = ()) -> None:
        self.spec = spec
        unknown = [v for v in spec.observation.values() if v.split("/")[0] not in model_inputs]
        if unknown:
            raise ValueError(f"policy.observation maps to {unknown}, which are not inputs of the "
                             f"model; its inputs are {list(model_inputs)}")
        self.mapping = dict(spec.observation) or {k: k for k in model_inputs}
        stray = [k for k in spec.optional if k not in self.mapping]
        if stray:
            raise ValueError(f"policy.optional names {stray}, which are not observation keys; "
                             f"those are {list(self.mapping)}")
        # a dict input ("images/<camera>" keys) whose keys are all optional: one at least
        groups: dict[str, list[str]] = {}
        for key, inp in self.mapping.items():
            top, _, inner = inp.partition("/")
            if inner and top not in model_defaults:
                groups.setdefault(top, []).append(key)
        self.one_of = {top: keys for top, keys in groups.items()
                       if all(k in spec.optional for k in keys)}
        self.metadata = {"server": "mstar_rt", "model": name,
                         "observation": {k: {"input": v, "shape": _shape_text(spec.shapes.get(v)),
                                             "dtype": spec.dtypes.get(v),
                                             "optional": k in spec.optional}
                                         for k, v in self.mapping.items()},
                         "actions": spec.actions, **spec.metadata}

    def inputs(self, obs: Any) -> dict[str, Any]:
        if not isinstance(obs, Mapping):
            raise ObservationError(f"the observation must be a dict of named values, not "
                                   f"{type(obs).__name__}")
        out = {}
        for key, name in self.mapping.items():
            value = _lookup(obs, key)
            if value is None and key in self.spec.optional:
                continue
            if value is None:
                raise ObservationError(f"the observation has no {key!r} (model input {name!r}); "
                                       f"it has {sorted(map(str, obs))}")
            if key in self.spec.images:
                value = decode_image(value, key, self.spec.shapes.get(name))
            if isinstance(value, np.ndarray) and not value.flags.writeable:
                value = value.copy()  # msgpack's buffer is read-only; models may write
            value = check_input(self.spec, name, value, f"observation {key!r}")
            top, _, inner = name.partition("/")  # "images/<camera>": one entry of a dict input
            if inner:
                out.setdefault(top, {})[inner] = value
            else:
                out[name] = value
        for top, keys in self.one_of.items():
            if top not in out:
                raise ObservationError(f"the observation has none of {keys} (model input "
                                       f"{top!r}); send one at least")
        return out

    def reply(self, outputs: Mapping[str, list]) -> dict[str, Any]:
        if self.spec.actions not in outputs:
            raise RuntimeError(f"the policy EMITted {sorted(outputs)} but no "
                               f"{self.spec.actions!r} (set policy.actions)")
        actions = np.asarray(as_array(outputs[self.spec.actions][-1]))
        if actions.dtype.kind in "fc" and not np.isfinite(actions).all():
            bad = int(actions.size - np.isfinite(actions).sum())
            raise RuntimeError(f"the policy made {bad} NaN or infinite values in its "
                               f"{actions.size} actions; none were sent")
        reply = {"actions": actions}
        for name, key in self.spec.outputs.items():
            if name in outputs:
                reply[key] = as_array(outputs[name][-1])
        return reply


def check_input(spec: PolicySpec, name: str, value: Any, where: str) -> Any:
    """``value`` of model input ``name`` cast to the dtype and checked against the shape that
    ``spec`` declares for it (unchanged if it declares neither); an ObservationError naming
    ``where`` otherwise. The websocket and /generate both check, so a wrong input is the
    client's error and never reaches (and fails) a batch shared with other requests."""
    shape, dtype = spec.shapes.get(name), spec.dtypes.get(name)
    if shape is None and dtype is None:
        if isinstance(value, np.ndarray):
            _check_finite(value, where)
        return value
    if dtype == "str":  # text (an instruction), not an array of characters
        if not isinstance(value, str):
            raise ObservationError(f"{where} must be text (a string); got "
                                   f"{type(value).__name__}")
        return value
    try:
        if dtype is not None and np.dtype(dtype).kind != "c" and np.iscomplexobj(value):
            raise TypeError("complex values would lose their imaginary part")
        with np.errstate(over="raise"):  # 1e300 is no float32, as 300 is no uint8
            arr = np.asarray(value) if dtype is None else np.asarray(value, dtype)
    except (TypeError, ValueError, ArithmeticError) as e:
        raise ObservationError(f"{where}: cannot be read as {dtype or 'an array'} ({e})") from None
    if shape is not None and (arr.ndim != len(shape) or any(
            want is not None and got != want for got, want in zip(arr.shape, shape))):
        raise ObservationError(f"{where} has shape {tuple(arr.shape)}, but the policy takes "
                               f"{_shape_text(shape)}")
    _check_finite(arr, where)
    return arr


def _check_finite(arr: np.ndarray, where: str) -> None:
    if arr.dtype.kind in "fc" and not np.isfinite(arr).all():  # a policy would act on them
        raise ObservationError(f"{where} holds NaN or infinite values; send finite numbers")


def _lookup(obs: Mapping, key: str) -> Any:
    """``obs[key]``, or for ``a/b`` also the nested ``obs[a][b]``."""
    if key in obs:
        return obs[key]
    node: Any = obs
    for part in key.split("/"):
        if not isinstance(node, Mapping) or part not in node:
            return None
        node = node[part]
    return node


def _shape_text(shape: Optional[tuple]) -> Optional[str]:
    if shape is None:
        return None
    dims = ["*" if d is None else str(d) for d in shape]
    return "(" + ", ".join(dims) + ("," if len(dims) == 1 else "") + ")"


MAX_IMAGE_PIXELS = 4096 * 4096  # when the policy declares no image size: past 4K UHD


def decode_image(value: Any, key: str, shape: Optional[tuple] = None) -> Any:
    """Encoded image bytes (JPEG, PNG; or a 1-D uint8 array of them) -> uint8 RGB [H, W, 3];
    an image array passes through. The header's size is checked before decoding: a small PNG
    can claim 30000 x 30000 pixels, which would take gigabytes and seconds to decode."""
    if isinstance(value, np.ndarray) and not (value.ndim == 1 and value.dtype == np.uint8):
        return value
    if not isinstance(value, (bytes, bytearray, np.ndarray)):
        raise ObservationError(f"observation {key!r}: an image must be an array or encoded "
                               f"bytes (JPEG/PNG), not {type(value).__name__}")
    import cv2

    data = bytes(value)
    buf = np.frombuffer(data, np.uint8)
    size = image_size(data)
    if size is not None:
        h, w = size
        if shape is not None and len(shape) >= 2 and None not in shape[:2]:
            limit, takes = shape[0] * shape[1], f"{shape[1]} x {shape[0]}"
        else:
            limit, takes = MAX_IMAGE_PIXELS, f"{MAX_IMAGE_PIXELS} pixels at most"
        if h * w > limit:
            raise ObservationError(f"observation {key!r}: a {w} x {h} image is larger than the "
                                   f"policy takes ({takes})")
    img = cv2.imdecode(buf, cv2.IMREAD_COLOR) if size is not None else None
    if img is None:
        raise ObservationError(f"observation {key!r}: {len(buf)} bytes that OpenCV cannot "
                               "decode as an image (send JPEG or PNG bytes, or a uint8 array)")
    return cv2.cvtColor(img, cv2.COLOR_BGR2RGB)


def image_size(data: bytes) -> Optional[tuple[int, int]]:
    """(height, width) from the header of PNG or JPEG bytes (a JPEG's segments are skipped up
    to its frame header); None for anything else."""
    def u16(at: int) -> int:
        return int.from_bytes(data[at:at + 2], "big")

    if data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR" and len(data) >= 24:
        return int.from_bytes(data[20:24], "big"), int.from_bytes(data[16:20], "big")
    if data[:2] != b"\xff\xd8":
        return None
    i = 2
    while i + 9 <= len(data) and data[i] == 0xFF:
        marker = data[i + 1]
        if marker == 0xFF or marker == 0x01 or 0xD0 <= marker <= 0xD8:  # fill, no length
            i += 1 if marker == 0xFF else 2
        elif 0xC0 <= marker <= 0xCF and marker not in (0xC4, 0xC8, 0xCC):  # a frame header
            h, w = u16(i + 5), u16(i + 7)
            return (h, w) if h and w else None
        else:
            i += 2 + u16(i + 2)
    return None


# ---- the websocket route -----------------------------------------------------------------------


def add_policy_routes(app: Any, state: Any) -> None:
    """``GET /healthz`` and the websocket at ``/`` on ``app`` (a FastAPI app)."""
    from mstar_rt.serve.requests_in import key_error

    d = state.deployment
    adapter = PolicyAdapter(d.policy, d.inputs, d.name, d.optional_inputs)
    metadata = packb(adapter.metadata)
    bridge, metrics = state.bridge, state.metrics
    endpoint = "policy"

    @app.get("/healthz", response_class=PlainTextResponse)
    async def healthz() -> PlainTextResponse:
        reason = await bridge.health()
        return PlainTextResponse("OK\n" if reason is None else f"{reason}\n",
                                 200 if reason is None else 503)

    app.add_api_route("/healthz", healthz, methods=["HEAD"], include_in_schema=False)

    @app.websocket("/")
    async def policy(ws: WebSocket) -> None:
        problem = key_error(ws.headers, d.api_key)
        if problem is not None:
            metrics.requests.inc(endpoint, "unauthorized")
            await ws.close(code=1008, reason=problem[:120])  # before accept: HTTP 403
            return
        await ws.accept()
        prev_total: Optional[float] = None
        # Messages are read on a task of their own, one ahead at most, so a client that leaves
        # while its observation is served cancels it at once, even with its next one sent
        # already (that one held the only receive, and the leaving went unseen).
        inbox: asyncio.Queue = asyncio.Queue(maxsize=1)
        gone = asyncio.Event()
        reader = asyncio.ensure_future(_read_messages(ws, inbox, gone))
        serving: Optional[asyncio.Future] = None
        try:
            await ws.send_bytes(metadata)
            while True:
                message = await inbox.get()
                if message is None:
                    return
                t0 = time.monotonic()
                serving = asyncio.ensure_future(_serve_one(message, adapter, bridge, state))
                left = asyncio.ensure_future(gone.wait())
                await asyncio.wait({serving, left}, return_when=asyncio.FIRST_COMPLETED)
                left.cancel()
                if not serving.done():  # the client left
                    serving.cancel()
                    with contextlib.suppress(BaseException):
                        await serving
                    metrics.requests.inc(endpoint, "cancelled")
                    return
                reply, error = await serving
                if error is not None:
                    await ws.send_text(error)
                    continue
                infer = time.monotonic() - t0
                timing = {"infer_ms": infer * 1e3}
                if prev_total is not None:
                    timing["prev_total_ms"] = prev_total * 1e3
                reply["server_timing"] = timing
                try:
                    frame = packb(reply)
                except TypeError as e:  # an output msgpack cannot carry
                    await ws.send_text(f"error: the policy's reply cannot be sent: {e}")
                    continue
                await ws.send_bytes(frame)
                metrics.latency.observe(time.monotonic() - t0, endpoint)
                prev_total = time.monotonic() - t0
        except (WebSocketDisconnect, RuntimeError, OSError):
            return  # the client left, possibly while its observation was served
        finally:  # (the handler cancelled too, e.g. at shutdown: so is what it waits for)
            for task in (reader, serving):
                if task is not None and not task.done():
                    task.cancel()


async def _read_messages(ws: Any, inbox: asyncio.Queue, gone: asyncio.Event) -> None:
    """Puts the client's messages in ``inbox`` until it leaves (a receive that fails says so
    too); then sets ``gone`` and puts None."""
    try:
        while True:
            message = await ws.receive()
            if message["type"] == "websocket.disconnect":
                break
            await inbox.put(message)
    except Exception:
        pass
    finally:
        gone.set()
        with contextlib.suppress(asyncio.QueueFull):  # (the handler stopped reading)
            inbox.put_nowait(None)


async def _serve_one(message: dict, adapter: PolicyAdapter, bridge: Any, state: Any
                     ) -> tuple[Optional[dict], Optional[str]]:
    """One observation -> (reply, None) or (None, error text). Never raises for the request's
    own trouble, so the connection survives it."""
    endpoint = "policy"
    data = message.get("bytes")
    if data is None:
        state.metrics.requests.inc(endpoint, "bad_request")
        return None, ("error: send observations as binary msgpack frames (openpi_client's "
                      "WebsocketClientPolicy does); got a text frame")
    try:
        bridge.admission.enter()
    except AtCapacity as e:
        state.metrics.requests.inc(endpoint, "rejected")
        return None, f"error: {e}"
    try:
        # Decoding (JPEG included) runs off the event loop, with the submit and the wait.
        outputs = await bridge.run(data, lambda raw: adapter.inputs(unpackb(raw)))
        reply = adapter.reply(outputs)
    except (ValueError, TypeError) as e:  # ObservationError, validate_inputs, RequestTooLarge
        state.metrics.requests.inc(endpoint, "bad_request")
        return None, f"error: {e.reason if isinstance(e, RequestTooLarge) else e}"
    except Exception as e:  # RequestFailed, RequestTimeout, a reply without actions
        state.outcome(endpoint, e)
        return None, f"error: the policy failed on this observation: {type(e).__name__}: {e}"
    finally:
        bridge.admission.leave()
    state.outcome(endpoint, None)
    return reply, None

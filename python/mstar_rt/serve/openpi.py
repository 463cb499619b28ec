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

import time
from typing import Any, Mapping, Optional

import msgpack
import numpy as np
from fastapi import WebSocket, WebSocketDisconnect
from fastapi.responses import PlainTextResponse

from mstar_rt.serve.bridge import AtCapacity
from mstar_rt.serve.config import PolicySpec
from mstar_rt.serve.wire import as_array


class ObservationError(ValueError):
    """The observation cannot be turned into the model's inputs; the message says why."""


# ---- msgpack with numpy, as openpi_client.msgpack_numpy encodes it ------------------------------


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


def _unpack_hook(obj: dict) -> Any:
    if b"__ndarray__" in obj:
        dtype = np.dtype(obj[b"dtype"])
        if dtype.kind in ("V", "O"):
            raise ObservationError(f"arrays of dtype {dtype} are not accepted")
        shape = tuple(obj[b"shape"])
        try:
            return np.ndarray(buffer=obj[b"data"], dtype=dtype, shape=shape)
        except TypeError:
            raise ObservationError(f"an array of shape {shape} and dtype {dtype} needs "
                                   f"{int(np.prod(shape)) * dtype.itemsize} bytes, the message "
                                   f"has {len(obj[b'data'])}") from None
    if b"__npgeneric__" in obj:
        return np.dtype(obj[b"dtype"]).type(obj[b"data"])
    return obj


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

    def __init__(self, spec: PolicySpec, model_inputs: tuple[str, ...], name: str) -> None:
        self.spec = spec
        unknown = [v for v in spec.observation.values() if v not in model_inputs]
        if unknown:
            raise ValueError(f"policy.observation maps to {unknown}, which are not inputs of the "
                             f"model; its inputs are {list(model_inputs)}")
        self.mapping = dict(spec.observation) or {k: k for k in model_inputs}
        self.metadata = {"server": "mstar_rt", "model": name,
                         "observation": {k: {"input": v, "shape": _shape_text(spec.shapes.get(v)),
                                             "dtype": spec.dtypes.get(v)}
                                         for k, v in self.mapping.items()},
                         "actions": spec.actions, **spec.metadata}

    def inputs(self, obs: Any) -> dict[str, Any]:
        if not isinstance(obs, Mapping):
            raise ObservationError(f"the observation must be a dict of named values, not "
                                   f"{type(obs).__name__}")
        out = {}
        for key, name in self.mapping.items():
            value = _lookup(obs, key)
            if value is None:
                raise ObservationError(f"the observation has no {key!r} (model input {name!r}); "
                                       f"it has {sorted(map(str, obs))}")
            if key in self.spec.images:
                value = decode_image(value, key)
            elif isinstance(value, np.ndarray) and not value.flags.writeable:
                value = value.copy()  # msgpack's buffer is read-only; models may write
            out[name] = self._check(value, key, name)
        return out

    def _check(self, value: Any, key: str, name: str) -> Any:
        shape, dtype = self.spec.shapes.get(name), self.spec.dtypes.get(name)
        if shape is None and dtype is None:
            return value
        try:
            arr = np.asarray(value) if dtype is None else np.asarray(value, dtype)
        except (TypeError, ValueError) as e:
            raise ObservationError(f"observation {key!r}: cannot be read as {dtype or 'an array'}"
                                   f" ({e})") from None
        if shape is not None and (arr.ndim != len(shape) or any(
                want is not None and got != want for got, want in zip(arr.shape, shape))):
            raise ObservationError(f"observation {key!r} has shape {tuple(arr.shape)}, but the "
                                   f"policy takes {_shape_text(shape)}")
        return arr

    def reply(self, outputs: Mapping[str, list]) -> dict[str, Any]:
        if self.spec.actions not in outputs:
            raise RuntimeError(f"the policy EMITted {sorted(outputs)} but no "
                               f"{self.spec.actions!r} (set policy.actions)")
        reply = {"actions": np.asarray(as_array(outputs[self.spec.actions][-1]))}
        for name, key in self.spec.outputs.items():
            if name in outputs:
                reply[key] = as_array(outputs[name][-1])
        return reply


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


def decode_image(value: Any, key: str) -> Any:
    """Encoded image bytes (JPEG, PNG; or a 1-D uint8 array of them) -> uint8 RGB [H, W, 3];
    an image array passes through."""
    if isinstance(value, np.ndarray) and not (value.ndim == 1 and value.dtype == np.uint8):
        return value
    if not isinstance(value, (bytes, bytearray, np.ndarray)):
        raise ObservationError(f"observation {key!r}: an image must be an array or encoded "
                               f"bytes (JPEG/PNG), not {type(value).__name__}")
    import cv2

    buf = np.frombuffer(bytes(value), np.uint8)
    img = cv2.imdecode(buf, cv2.IMREAD_COLOR) if len(buf) else None
    if img is None:
        raise ObservationError(f"observation {key!r}: {len(buf)} bytes that OpenCV cannot "
                               "decode as an image (send JPEG or PNG bytes, or a uint8 array)")
    return cv2.cvtColor(img, cv2.COLOR_BGR2RGB)


# ---- the websocket route -----------------------------------------------------------------------


def add_policy_routes(app: Any, state: Any) -> None:
    """``GET /healthz`` and the websocket at ``/`` on ``app`` (a FastAPI app)."""
    from mstar_rt.serve.app import key_error

    d = state.deployment
    adapter = PolicyAdapter(d.policy, d.inputs, d.name)
    metadata = packb(adapter.metadata)
    bridge, metrics = state.bridge, state.metrics
    endpoint = "policy"

    @app.get("/healthz")
    async def healthz() -> PlainTextResponse:
        return PlainTextResponse("OK\n")

    @app.websocket("/")
    async def policy(ws: WebSocket) -> None:
        problem = key_error(ws.headers, d.api_key)
        if problem is not None:
            metrics.requests.inc(endpoint, "unauthorized")
            await ws.close(code=1008, reason=problem[:120])  # before accept: HTTP 403
            return
        await ws.accept()
        prev_total: Optional[float] = None
        try:
            await ws.send_bytes(metadata)
            while True:
                message = await ws.receive()
                if message["type"] == "websocket.disconnect":
                    return
                t0 = time.monotonic()
                reply, error = await _serve_one(message, adapter, bridge, state)
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
    except (ValueError, TypeError) as e:  # ObservationError, or the model's validate_inputs
        state.metrics.requests.inc(endpoint, "bad_request")
        return None, f"error: {e}"
    except Exception as e:  # RequestFailed, RequestTimeout, a reply without actions
        state.outcome(endpoint, e)
        return None, f"error: the policy failed on this observation: {type(e).__name__}: {e}"
    finally:
        bridge.admission.leave()
    state.outcome(endpoint, None)
    return reply, None

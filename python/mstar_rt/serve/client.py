"""A Python client for the HTTP API (httpx), streaming where the server streams.

    with MstarClient("http://127.0.0.1:8000", api_key=None) as c:
        c.health(); c.models(); print(c.metrics())
        for chunk in c.speech("Hello there.", voice="en-us", response_format="pcm"):
            play(chunk)                            # bytes: 16-bit mono PCM at c.sample_rate
        for name, value in c.generate({"text": "hi"}):
            ...                                    # numpy arrays decoded, plain values as sent
"""

from __future__ import annotations

import base64
import json
from typing import Any, Iterator, Mapping, Optional

import httpx
import numpy as np


class ServeError(RuntimeError):
    """The server answered with an error (HTTP status, or an error line in a stream)."""

    def __init__(self, message: str, status: Optional[int] = None) -> None:
        super().__init__(message if status is None else f"HTTP {status}: {message}")
        self.status = status


def encode_array(a: np.ndarray) -> dict[str, Any]:
    """A numpy array as the server reads array inputs."""
    a = np.ascontiguousarray(a)
    a = a.astype(a.dtype.newbyteorder("<"), copy=False)
    return {"dtype": a.dtype.name, "shape": list(a.shape),
            "data": base64.b64encode(a.tobytes()).decode("ascii")}


def decode_output(line: Mapping[str, Any]) -> Any:
    if "data" in line:
        dt = np.dtype(line["dtype"]).newbyteorder("<")
        return np.frombuffer(base64.b64decode(line["data"]), dt).reshape(line["shape"])
    if "dtype" in line and "shape" in line:  # arrays="list"
        return np.asarray(line["value"], line["dtype"]).reshape(line["shape"])
    return line["value"]


class MstarClient:
    """``base_url`` like ``http://127.0.0.1:8000``; ``api_key`` is sent as a Bearer token."""

    def __init__(self, base_url: str, api_key: Optional[str] = None,
                 timeout: float = 60.0) -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.Client(base_url=base_url, headers=headers, timeout=timeout)
        self.sample_rate: Optional[int] = None  # of the last speech() stream

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> "MstarClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def health(self) -> dict:
        return self._json(self._http.get("/health"))

    def models(self) -> list[dict]:
        return self._json(self._http.get("/v1/models"))["data"]

    def metrics(self) -> str:
        r = self._http.get("/metrics")
        self._check(r)
        return r.text

    def speech(self, text: str, voice: Optional[str] = None, model: Optional[str] = None,
               response_format: str = "pcm") -> Iterator[bytes]:
        """Streams the audio bytes as the server sends them (``pcm``: raw 16-bit LE mono at
        :attr:`sample_rate`; ``wav``: a streaming WAV, header first)."""
        body: dict[str, Any] = {"input": text, "response_format": response_format}
        if voice is not None:
            body["voice"] = voice
        if model is not None:
            body["model"] = model
        with self._http.stream("POST", "/v1/audio/speech", json=body) as r:
            if r.status_code != 200:
                r.read()
                self._check(r)
            self.sample_rate = int(r.headers.get("x-sample-rate", 0)) or None
            try:
                yield from r.iter_bytes()
            except httpx.HTTPError as e:  # the server broke the stream: the request failed
                raise ServeError(f"the speech stream broke off ({e})") from None

    def generate(self, inputs: Mapping[str, Any], priority: int = 0,
                 deadline_s: Optional[float] = None) -> Iterator[tuple[str, Any]]:
        """Submits ``inputs`` (numpy arrays are sent as arrays) and yields ``(name, value)`` as
        the model EMITs them; raises :class:`ServeError` if the request fails."""
        body: dict[str, Any] = {
            "inputs": {k: encode_array(v) if isinstance(v, np.ndarray) else v
                       for k, v in inputs.items()},
            "priority": priority}
        if deadline_s is not None:
            body["deadline_s"] = deadline_s
        with self._http.stream("POST", "/generate", json=body) as r:
            if r.status_code != 200:
                r.read()
                self._check(r)
            for raw in r.iter_lines():
                if not raw:
                    continue
                line = json.loads(raw)
                if "error" in line:
                    raise ServeError(f"{line['error']['type']}: {line['error']['message']}")
                if line.get("done"):
                    return
                yield line["output"], decode_output(line)
        raise ServeError("the stream ended without its 'done' line")

    # ---- helpers ---------------------------------------------------------------------------

    @staticmethod
    def _check(r: httpx.Response) -> None:
        if r.status_code >= 400:
            try:
                message = r.json()["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = r.text
            raise ServeError(message, r.status_code)

    def _json(self, r: httpx.Response) -> Any:
        self._check(r)
        return r.json()

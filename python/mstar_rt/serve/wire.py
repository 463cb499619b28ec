"""Wire formats of the HTTP API: arrays in JSON (base64 + dtype + shape, or nested lists),
16-bit PCM, and a WAV header for a stream whose length is not known yet."""

from __future__ import annotations

import base64
import math
import struct
from typing import Any, Mapping, Optional

import numpy as np

# What RIFF readers take as "until the end of the stream" (ffmpeg and OpenAI write it too).
STREAMING_SIZE = 0xFFFFFFFF
DTYPES = {"bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64",
          "float16", "float32", "float64"}
MAX_DIMS = 64  # numpy's limit


def as_array(value: Any) -> Any:
    """torch tensors as numpy arrays; anything else unchanged."""
    if type(value).__module__.startswith("torch") and hasattr(value, "detach"):
        return value.detach().cpu().numpy()
    return value


def encode_value(value: Any, arrays: str = "base64") -> dict[str, Any]:
    """One output value as JSON fields: ``{"value": ...}`` for plain values and lists, or
    ``{"dtype", "shape", "data"}`` (base64 of the C-order bytes, little endian) for arrays."""
    value = as_array(value)
    if isinstance(value, np.generic):
        return {"value": value.item()}
    if isinstance(value, np.ndarray):
        if arrays == "list":
            return {"value": value.tolist(), "dtype": value.dtype.name, "shape": list(value.shape)}
        a = np.ascontiguousarray(value)
        a = a.astype(a.dtype.newbyteorder("<"), copy=False)
        return {"dtype": a.dtype.name, "shape": list(a.shape),
                "data": base64.b64encode(a.tobytes()).decode("ascii")}
    if value is None or isinstance(value, (str, int, float, bool, list, dict)):
        return {"value": value}
    return {"value": repr(value), "type": type(value).__name__}


def whole_number(v: Any) -> Optional[int]:
    """``v`` as an int if it is a whole number (JSON Schema's integer: ``3`` or ``3.0``)."""
    if isinstance(v, float) and v.is_integer():
        return int(v)
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def decode_input(value: Any, where: str) -> Any:
    """A request input: ``{"dtype", "shape", "data"}`` becomes a numpy array; anything else is
    passed on as JSON gave it."""
    if not (isinstance(value, Mapping) and set(value) == {"dtype", "shape", "data"}):
        return value
    dtype, shape, data = value["dtype"], value["shape"], value["data"]
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise ValueError(f"{where}.dtype: {dtype!r:.40} is not one of {sorted(DTYPES)}")
    sizes = [whole_number(d) for d in shape] if isinstance(shape, list) else None
    if sizes is None or len(sizes) > MAX_DIMS or not all(d is not None and d >= 0 for d in sizes):
        raise ValueError(f"{where}.shape: must be a list of at most {MAX_DIMS} non-negative "
                         f"integers, not {shape!r:.80}")
    shape = sizes
    try:
        raw = base64.b64decode(data, validate=True)
    except (ValueError, TypeError):
        raise ValueError(f"{where}.data: not valid base64") from None
    dt = np.dtype(dtype).newbyteorder("<")
    n = math.prod(shape)  # exact, and cheap for MAX_DIMS sizes however large
    if len(raw) != n * dt.itemsize:
        raise ValueError(f"{where}: {len(raw)} bytes of data, but shape {shape} of {dtype} "
                         f"needs {n * dt.itemsize}")
    try:
        return np.frombuffer(raw, dt).reshape(shape).astype(dtype)
    except (ValueError, OverflowError) as e:  # no data, but sizes past numpy's
        raise ValueError(f"{where}.shape: {shape} ({e})") from None


def pcm16(audio: np.ndarray) -> bytes:
    """float samples in [-1, 1] -> 16-bit little-endian mono PCM (clipped)."""
    x = np.clip(np.asarray(audio, np.float32).reshape(-1), -1.0, 1.0)
    return (x * 32767.0).round().astype("<i2").tobytes()


def wav_header(sample_rate: int, channels: int = 1, bits: int = 16,
               data_size: Optional[int] = None) -> bytes:
    """A 44-byte PCM WAV header: for ``data_size`` bytes of samples, or for a stream (RIFF and
    data sizes 0xFFFFFFFF, unknown)."""
    block = channels * bits // 8
    riff = STREAMING_SIZE if data_size is None else 36 + data_size
    data = STREAMING_SIZE if data_size is None else data_size
    return (b"RIFF" + struct.pack("<I", riff) + b"WAVE"
            + b"fmt " + struct.pack("<IHHIIHH", 16, 1, channels, sample_rate,
                                    sample_rate * block, block, bits)
            + b"data" + struct.pack("<I", data))

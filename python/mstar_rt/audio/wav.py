"""Reading WAV bytes (as a client uploads them) into float samples: integer PCM of 8 to 32 bits
and IEEE float, plain or WAVE_FORMAT_EXTENSIBLE, any channel count (mixed down to mono). A data
chunk whose size is unknown (0xFFFFFFFF, as streaming writers and ``mstar-rt serve`` leave it)
or larger than what follows runs to the end of the bytes."""

from __future__ import annotations

import struct

import numpy as np

_PCM, _FLOAT, _EXTENSIBLE = 1, 3, 0xFFFE


class WavError(ValueError):
    """The bytes are not a WAV file this reader understands; the message says why."""


def read_wav(data: bytes) -> tuple[np.ndarray, int]:
    """``data`` (a whole WAV file) as (float32 mono samples in [-1, 1], sample rate)."""
    if len(data) < 12 or data[:4] != b"RIFF" or data[8:12] != b"WAVE":
        raise WavError("not a WAV file (no RIFF/WAVE header)")
    fmt = None
    pos = 12
    while pos + 8 <= len(data):
        cid, size = data[pos:pos + 4], struct.unpack_from("<I", data, pos + 4)[0]
        body = pos + 8
        if cid == b"fmt ":
            if size < 16 or body + 16 > len(data):
                raise WavError("the fmt chunk is too short")
            tag, channels, rate, _byte_rate, _align, bits = struct.unpack_from("<HHIIHH", data,
                                                                                  body)
            if tag == _EXTENSIBLE and size >= 40 and body + 26 <= len(data):
                tag = struct.unpack_from("<H", data, body + 24)[0]  # the subformat GUID's head
            fmt = (tag, channels, rate, bits)
        elif cid == b"data":
            if fmt is None:
                raise WavError("the data chunk comes before any fmt chunk")
            end = len(data) if size == 0xFFFFFFFF else min(len(data), body + size)
            return _samples(data[body:end], *fmt), fmt[2]
        pos = body + size + (size & 1)  # chunks are padded to an even size
    raise WavError("no data chunk" if fmt is not None else "no fmt chunk")


def _samples(raw: bytes, tag: int, channels: int, rate: int, bits: int) -> np.ndarray:
    if channels < 1 or rate < 1:
        raise WavError(f"{channels} channels at {rate} Hz is not audio")
    width = bits // 8
    if tag == _PCM and bits in (8, 16, 24, 32):
        usable = len(raw) - len(raw) % (width * channels)
        b = np.frombuffer(raw[:usable], np.uint8)
        if bits == 8:  # 8-bit WAV is unsigned
            x = (b.astype(np.float32) - 128.0) / 128.0
        elif bits == 24:
            b3 = b.reshape(-1, 3).astype(np.int32)
            v = b3[:, 0] | (b3[:, 1] << 8) | (b3[:, 2] << 16)
            x = (np.where(v >= 1 << 23, v - (1 << 24), v) / float(1 << 23)).astype(np.float32)
        else:
            x = (np.frombuffer(b.tobytes(), f"<i{width}").astype(np.float32)
                 / float(1 << (bits - 1)))
    elif tag == _FLOAT and bits in (32, 64):
        usable = len(raw) - len(raw) % (width * channels)
        x = np.frombuffer(raw[:usable], f"<f{width}").astype(np.float32)
        if not np.isfinite(x).all():  # a model fed NaN fails deep inside, for every request
            bad = int(np.flatnonzero(~np.isfinite(x))[0]) // channels
            raise WavError(f"float sample {bad} is NaN or infinite; send finite samples")
    else:
        raise WavError(f"WAV format tag {tag} with {bits} bits per sample is not read; send "
                       "integer PCM (8/16/24/32 bits) or float (32/64 bits)")
    return x.reshape(-1, channels).mean(axis=1, dtype=np.float32) if channels > 1 else x

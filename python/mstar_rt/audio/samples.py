"""Audio samples as the speech components take them: mono float32 in [-1, 1]. Integer PCM and
interleaved channels are refused by name; read as floats they were full-scale noise or one
signal at twice its length, and a VAD heard no speech or a recognizer returned ''.

Stream items are the exception: a microphone's frames carry its channels, which
:func:`mix_down` averages once the layout is declared (a flat item cannot show whether it
holds mono samples or interleaved frames, so the count is never guessed)."""

from __future__ import annotations

from typing import Any

import numpy as np


def _floats(samples: Any, what: str) -> np.ndarray:
    x = np.asarray(samples)
    if not np.issubdtype(x.dtype, np.floating):
        hint = (f"; divide {x.dtype} PCM by {2 ** (8 * x.dtype.itemsize - 1)}"
                if np.issubdtype(x.dtype, np.integer) else "")
        raise TypeError(f"{what} takes float samples in [-1, 1], got {x.dtype}{hint}")
    return x


def mono_float(samples: Any, what: str) -> np.ndarray:
    """``samples`` (``[n]``, or ``[n, 1]`` / ``[1, n]``) as float32 ``[n]``; TypeError for
    integer PCM, ValueError for several channels, each naming ``what`` took them."""
    x = _floats(samples, what)
    if x.ndim == 2 and 1 in x.shape:
        x = x.reshape(-1)
    if x.ndim != 1:
        raise ValueError(f"{what} takes mono audio, got shape {list(x.shape)}; mix the channels "
                         "down first (e.g. x.mean(axis=1))")
    return x.astype(np.float32, copy=False)


def mix_down(frames: Any, what: str, channels: int = 1) -> np.ndarray:
    """Audio frames of ``channels`` channels as mono float32 ``[k]``, the channels averaged:
    ``[k, channels]`` (channels last, as sounddevice and AudioInput deliver them) or flat
    ``[k * channels]`` interleaved; mono also as one sample. TypeError for integer PCM,
    ValueError for any other shape, naming ``what`` took it and what to pass."""
    x = _floats(frames, what)
    if x.ndim == 2 and x.shape[1] == channels:
        pass
    elif x.ndim == 1 and len(x) % channels == 0 or x.ndim == 0 and channels == 1:
        x = x.reshape(-1, channels)
    else:
        raise ValueError(_layout_error(list(x.shape), what, channels))
    x = x.astype(np.float32, copy=False)
    return x[:, 0] if channels == 1 else x.mean(axis=1, dtype=np.float32)


def _layout_error(shape: list[int], what: str, channels: int) -> str:
    if channels == 1:
        takes = "mono samples ([k], [k, 1] or one sample)"
    else:
        takes = (f"{channels}-channel frames ([k, {channels}], channels last, or [k * "
                 f"{channels}] interleaved)")
    if len(shape) == 2 and shape[0] == channels and channels > 1:
        hint = "transpose channels-first blocks (x.T)"
    elif len(shape) == 2:
        hint = (f"for {shape[1]}-channel frames pass channels={shape[1]} (they are averaged to "
                "mono) or mix them down first (x.mean(axis=1))")
        if shape[0] == 1 and channels == 1:
            hint += "; flatten a mono row (x.reshape(-1))"
    elif len(shape) <= 1:
        hint = f"an item holds whole frames of {channels} samples"
    else:
        hint = f"pass [frames, {channels}]"
    return f"{what} takes {takes}, got shape {shape}; {hint}"

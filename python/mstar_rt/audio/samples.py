"""Audio samples as the speech components take them: mono float32 in [-1, 1]. Integer PCM and
interleaved channels are refused by name; read as floats they were full-scale noise or one
signal at twice its length, and a VAD heard no speech or a recognizer returned ''."""

from __future__ import annotations

from typing import Any

import numpy as np


def mono_float(samples: Any, what: str) -> np.ndarray:
    """``samples`` (``[n]``, or ``[n, 1]`` / ``[1, n]``) as float32 ``[n]``; TypeError for
    integer PCM, ValueError for several channels, each naming ``what`` took them."""
    x = np.asarray(samples)
    if not np.issubdtype(x.dtype, np.floating):
        hint = (f"; divide {x.dtype} PCM by {2 ** (8 * x.dtype.itemsize - 1)}"
                if np.issubdtype(x.dtype, np.integer) else "")
        raise TypeError(f"{what} takes float samples in [-1, 1], got {x.dtype}{hint}")
    if x.ndim == 2 and 1 in x.shape:
        x = x.reshape(-1)
    if x.ndim != 1:
        raise ValueError(f"{what} takes mono audio, got shape {list(x.shape)}; mix the channels "
                         "down first (e.g. x.mean(axis=1))")
    return x.astype(np.float32, copy=False)

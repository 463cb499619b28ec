"""Streaming resampler on libsoxr: its state carries across chunks, so feeding a signal in any
chunking gives exactly the samples of feeding it whole."""

from __future__ import annotations

import numpy as np
import soxr

# "LQ" holds back 1-6 ms of output (45-100 samples at 16-48 kHz); "HQ" holds back 20-33 ms,
# which a live voice path would feel at both the microphone and the speaker. LQ is flat to
# ~0.75 of the lower Nyquist rate with aliases over 100 dB down: enough for speech.
DEFAULT_QUALITY = "LQ"
MIN_RATE, MAX_RATE = 1, 10_000_000  # Hz; 1e-9 asked soxr for a buffer it could not allocate


class Resampler:
    """``Resampler(in_rate, out_rate, channels=1)``; ``process(x)`` takes ``[n]`` or
    ``[n, channels]`` float samples and returns the output they complete. The output is aligned
    with the input (no leading delay); the last few samples of a signal come out only with
    ``process(x, last=True)``, which also readies the resampler for a new signal.

    Runs on the producer/consumer side, never in an audio callback: it allocates.
    """

    def __init__(self, in_rate: int, out_rate: int, channels: int = 1,
                 quality: str = DEFAULT_QUALITY) -> None:
        for rate in (in_rate, out_rate):  # NaN or inf hung inside soxr, deaf to Ctrl-C
            if not (isinstance(rate, (int, float, np.integer, np.floating))
                    and MIN_RATE <= rate <= MAX_RATE):
                raise ValueError(f"rates must be numbers of Hz from {MIN_RATE} to {MAX_RATE:g}, "
                                 f"got {in_rate!r} -> {out_rate!r}")
        if not (isinstance(channels, (int, np.integer)) and channels >= 1):
            raise ValueError(f"channels must be a count >= 1, got {channels!r}")
        self.in_rate, self.out_rate, self.channels = in_rate, out_rate, channels
        self._stream = soxr.ResampleStream(in_rate, out_rate, channels, dtype="float32",
                                           quality=quality)

    @property
    def passthrough(self) -> bool:
        return self.in_rate == self.out_rate

    def process(self, x: np.ndarray, last: bool = False) -> np.ndarray:
        x = np.asarray(x)
        if x.dtype.kind != "f":  # int16 PCM came out at full-scale values, 32767 for 1.0
            raise TypeError(f"Resampler.process takes float samples in [-1, 1], got {x.dtype}; "
                            "scale integer PCM by its full scale first (int16: x / 32768)")
        if x.ndim not in (1, 2):
            raise ValueError(f"Resampler.process takes [n] or [n, channels] samples, got shape "
                             f"{list(x.shape)}")
        x = x.astype(np.float32, copy=False)
        flat = x.ndim == 1
        x2 = np.ascontiguousarray(x.reshape(-1, 1) if flat else x)
        if x2.shape[1] != self.channels:
            raise ValueError(f"expected {self.channels} channels, got {x2.shape[1]}")
        if self.passthrough:
            y = x2.copy()
        else:
            y = self._stream.resample_chunk(x2, last=last)
            if last:
                self._stream.clear()
        return y[:, 0] if flat else y

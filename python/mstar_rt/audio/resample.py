"""Streaming rational resampler: windowed-sinc polyphase FIR whose state carries across chunks,
so feeding a signal in any chunking gives the same samples as feeding it whole."""

from __future__ import annotations

from math import gcd

import numpy as np


class Resampler:
    """``Resampler(in_rate, out_rate, channels=1, taps_per_phase=16)``; ``process(x)`` takes
    ``[n]`` or ``[n, channels]`` float samples and returns what those samples complete.

    Output sample k sits at input time ``k * in_rate / out_rate`` delayed by ``delay`` output
    samples (the filter's group delay). Runs on the producer/consumer side, never in an audio
    callback: it allocates.
    """

    def __init__(self, in_rate: int, out_rate: int, channels: int = 1, taps_per_phase: int = 16):
        if in_rate <= 0 or out_rate <= 0:
            raise ValueError(f"rates must be positive, got {in_rate} -> {out_rate}")
        g = gcd(in_rate, out_rate)
        self.up, self.down = out_rate // g, in_rate // g
        self.in_rate, self.out_rate, self.channels = in_rate, out_rate, channels
        taps = taps_per_phase * self.up
        # Low-pass at 0.45 of the lower Nyquist rate, expressed at the upsampled rate.
        cutoff = 0.45 / max(self.up, self.down)
        n = np.arange(taps) - (taps - 1) / 2
        proto = 2 * cutoff * np.sinc(2 * cutoff * n) * np.kaiser(taps, 8.0)
        proto *= self.up / proto.sum()
        # phases[p, j] multiplies input x[base - j] for outputs of phase p.
        self._phases = proto.reshape(taps_per_phase, self.up).T.astype(np.float32)
        self._width = taps_per_phase
        self.delay = (taps - 1) / 2 / self.down  # in output samples
        self._hist = np.zeros((taps_per_phase - 1, channels), np.float32)
        self._hist_start = -(taps_per_phase - 1)  # global input index of _hist[0]
        self._next_out = 0

    @property
    def passthrough(self) -> bool:
        return self.up == self.down

    def process(self, x: np.ndarray) -> np.ndarray:
        flat = x.ndim == 1
        x2 = np.asarray(x, np.float32).reshape(len(x), -1)
        if x2.shape[1] != self.channels:
            raise ValueError(f"expected {self.channels} channels, got {x2.shape[1]}")
        if self.passthrough:
            return x2[:, 0].copy() if flat else x2.copy()
        buf = np.concatenate([self._hist, x2])
        last = self._hist_start + len(buf) - 1  # global index of the newest input sample
        end = ((last + 1) * self.up - 1) // self.down + 1  # outputs whose newest tap has arrived
        k = np.arange(self._next_out, end)
        base = (k * self.down) // self.up - self._hist_start
        idx = base[:, None] - np.arange(self._width)[None, :]
        y = np.einsum("kjc,kj->kc", buf[idx], self._phases[(k * self.down) % self.up])
        self._next_out = end
        keep = self._width - 1
        self._hist = buf[len(buf) - keep:].copy()
        self._hist_start = last - keep + 1
        return y[:, 0] if flat else y

"""Measuring what was heard: :class:`Tap` records a PulseAudio source with timestamps and
:func:`speech_spans` finds the spoken stretches in a recording (tests and benchmarks)."""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np


class Tap:
    """Records a PulseAudio source (e.g. ``mstar_spk.monitor``) through an AudioInput on its own
    thread and maps recorded frames to time.monotonic(), so what was heard can be timed against
    what the agent logged. ``time_of`` uses the earliest delivery of each block (the callback's
    arrival time less the block's length), which excludes scheduling delays; the device's own
    capture latency is common to every Tap and cancels in differences between Taps."""

    def __init__(self, devices: Any, source: str, rate: int = 48000, blocksize: int = 480) -> None:
        self.rate = rate
        self.input = devices.AudioInput(rate, blocksize=blocksize, pulse_source=source,
                                        ring_seconds=8.0)
        self._parts: list[np.ndarray] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"tap-{source}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._parts.append(self.input.read(self.input.blocksize, timeout=0.5))
            except TimeoutError:
                pass

    @property
    def frames(self) -> int:
        return sum(map(len, self._parts))

    def wait_flowing(self, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while self.frames < self.rate // 10:
            if time.monotonic() > deadline:
                raise TimeoutError("the tap recorded nothing")
            time.sleep(0.01)

    def audio(self) -> np.ndarray:
        parts = list(self._parts)
        return np.concatenate(parts) if parts else np.zeros(0, np.float32)

    def _offset(self) -> float:
        ts = self.input.timestamps()  # (current, adc, position of first frame, monotonic)
        return float(np.min(ts[:, 3] - (ts[:, 2] + self.input.blocksize) / self.rate))

    def time_of(self, frame: float) -> float:
        return self._offset() + frame / self.rate

    def frame_at(self, t: float) -> int:
        return int(round((t - self._offset()) * self.rate))

    def close(self) -> np.ndarray:
        self._stop.set()
        self._thread.join(timeout=5)
        x = self.audio()
        self.input.close()
        return x


def speech_spans(x: np.ndarray, rate: int, threshold: float = 0.01, gap_s: float = 0.4,
                 hop_s: float = 0.01) -> list[tuple[int, int]]:
    """``(start, end)`` frames of stretches whose 10 ms RMS exceeds ``threshold``, merging
    gaps shorter than ``gap_s`` (pauses between words and sentences)."""
    hop = max(1, int(rate * hop_s))
    n = len(x) // hop
    if n == 0:
        return []
    rms = np.sqrt(np.mean(np.asarray(x[:n * hop], np.float64).reshape(n, hop) ** 2, axis=1))
    loud = np.nonzero(rms > threshold)[0]
    spans: list[list[int]] = []
    for i in loud:
        if spans and (i - spans[-1][1]) * hop_s <= gap_s:
            spans[-1][1] = i + 1
        else:
            spans.append([i, i + 1])
    return [(a * hop, b * hop) for a, b in spans]

"""Per-request speech streaming metrics, measured where a listener is: when audio chunks arrive.

>>> m = SpeechMetrics.from_events(0.0, [(0.1, [0.0, 0.5]), (0.15, [0.5, 0.5])], sample_rate=10)
>>> round(m.ttfa_s, 3), m.audio_s, round(m.rtf, 3), m.viable, round(m.worst_margin_s, 3)
(0.1, 0.4, 0.375, True, 0.15)
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Optional, Sequence, Union

import numpy as np

# A chunk's samples, or just how many there are (then they count as audible).
Samples = Union[np.ndarray, Sequence[float], int]


@dataclass
class SpeechMetrics:
    """``ttfa_s``: submit -> first chunk holding a sample with ``|x| > threshold`` (None if all
    was silent). ``rtf``: submit -> last audio chunk, over the audio's duration (< 1 = faster than
    real time). ``chunk_intervals_s``: gaps between consecutive audio chunks. ``viable``: with
    playback starting when the first audio arrives, every later chunk arrives before the audio
    received before it has played out; ``worst_margin_s`` is the smallest such lead (negative =
    an underrun; inf, and viable, when there is no later chunk). Chunks without samples carry
    no audio and are ignored."""

    ttfa_s: Optional[float]
    rtf: float
    audio_s: float
    chunk_intervals_s: list[float] = field(default_factory=list)
    viable: bool = True
    worst_margin_s: float = math.inf
    sample_rate: int = 24000

    @staticmethod
    def from_events(submit_t: float, events: Sequence[tuple[float, Samples]],
                    sample_rate: int = 24000, threshold: float = 1e-4) -> "SpeechMetrics":
        """From ``(arrival time, samples)`` per chunk, times on the clock ``submit_t`` is on."""
        return _metrics(submit_t, [_summary(t, s, threshold) for t, s in events], sample_rate)

    def summary(self) -> str:
        ttfa = "never" if self.ttfa_s is None else f"{self.ttfa_s * 1e3:.1f} ms"
        return (f"TTFA {ttfa}, RTF {self.rtf:.3f}, audio {self.audio_s:.2f} s in "
                f"{len(self.chunk_intervals_s) + (self.audio_s > 0)} chunks, "
                f"{'viable' if self.viable else 'NOT viable'} "
                f"(worst margin {self.worst_margin_s * 1e3:.1f} ms)")


class SpeechMeter:
    """Client-side recorder: ``start()`` at submit, ``add(samples)`` as each chunk arrives
    (timestamped here with ``time.perf_counter``), ``finish()`` for the metrics."""

    def __init__(self, sample_rate: int = 24000, threshold: float = 1e-4) -> None:
        self.sample_rate, self.threshold = sample_rate, threshold
        self._submit_t: Optional[float] = None
        self._chunks: list[tuple[float, int, bool]] = []  # (arrival, samples, audible)

    def start(self) -> None:
        self._submit_t = time.perf_counter()
        self._chunks = []

    def add(self, samples: Samples) -> None:
        t = time.perf_counter()
        if self._submit_t is None:
            raise RuntimeError("SpeechMeter.add before start(): call start() when submitting")
        self._chunks.append(_summary(t, samples, self.threshold))

    def finish(self) -> SpeechMetrics:
        if self._submit_t is None:
            raise RuntimeError("SpeechMeter.finish before start()")
        return _metrics(self._submit_t, self._chunks, self.sample_rate)


def _summary(t: float, samples: Samples, threshold: float) -> tuple[float, int, bool]:
    if isinstance(samples, (int, np.integer)):
        return float(t), int(samples), samples > 0
    x = np.asarray(samples).reshape(-1)
    return float(t), len(x), bool(len(x) and np.abs(x).max() > threshold)


def _metrics(submit_t: float, chunks: Sequence[tuple[float, int, bool]],
             sample_rate: int) -> SpeechMetrics:
    audio = [(t, n, loud) for t, n, loud in chunks if n > 0]
    total = sum(n for _, n, _ in audio)
    audio_s = total / sample_rate
    ttfa = next((t - submit_t for t, _, loud in audio if loud), None)
    rtf = (audio[-1][0] - submit_t) / audio_s if audio else math.inf
    intervals = [b[0] - a[0] for a, b in zip(audio, audio[1:])]
    worst, received = math.inf, 0
    for t, n, _ in audio:
        if received:  # playback began at audio[0]'s arrival and never stalled so far
            worst = min(worst, audio[0][0] + received / sample_rate - t)
        received += n
    return SpeechMetrics(ttfa, rtf, audio_s, intervals, worst >= 0, worst, sample_rate)

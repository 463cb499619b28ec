"""A voice turn's record and where its latency goes.

Voice-to-voice latency runs from the end of the user's speech (as the VAD saw it) to the first
reply sample at the DAC. :meth:`Turn.stages` cuts it into consecutive stages that add up to it
exactly, along the path the reply really took: with a preemptive reply, recognition, the reply
text and the first TTS audio may all be done before the endpoint is decided, and the stage
``endpoint_wait`` then holds what was left of the silence wait. :class:`VoiceStats` gives
p50 / p90 per stage over turns.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

#: The stages of :meth:`Turn.stages`, in order.
STAGES = ("pause_seen", "asr", "respond", "tts_first", "endpoint_wait", "write", "playout")

STAGE_DOC = {
    "pause_seen": "end of speech -> the reply's request submitted (preemptive: the VAD's first "
                  "quiet window; else the endpoint decided)",
    "asr": "-> recognition done",
    "respond": "-> reply text ready",
    "tts_first": "-> first TTS audio made",
    "endpoint_wait": "-> endpoint decided (0 when the endpoint came first)",
    "write": "-> first sample handed to the output ring",
    "playout": "-> first sample at the DAC",
}

NAN = float("nan")


@dataclass
class Turn:
    """One user utterance and the agent's reply; times are time.monotonic() seconds."""

    index: int
    speech_start: float
    speech_end: float  # the endpointer's last speech sample, mapped to wall time
    detected: float  # when the endpointer declared the end (speech_end + its silence wait)
    text: str = ""
    reply: str = ""
    partial: str = ""  # the streaming recognizer's last hypothesis at the endpoint
    submitted: float = NAN  # the reply's request submitted (at the pause when preemptive)
    preemptive: bool = False  # the reply was started at a pause, before the endpoint
    guessed: bool = False  # ... from the streaming recognizer's text, confirmed by the batch one
    recognized_at: float = NAN
    replied_at: float = NAN  # reply text ready
    first_audio: float = NAN  # first TTS chunk made
    first_write: float = NAN  # first reply sample handed to the output ring
    first_dac: float = NAN  # ... and when the device played it (PortAudio clock)
    written_frames: int = 0  # device-rate frames queued for this reply
    underruns: int = 0  # output underruns while this reply was queued or playing
    barged_in: bool = False
    barge_in_at: float = NAN
    flushed_frames: int = 0  # frames of this reply dropped by the barge-in flush
    wasted_preemptive_s: float = 0.0  # preemptive replies started and cancelled in this turn
    cancelled_preemptive: int = 0
    trace: Optional[dict] = field(default=None, repr=False)  # the reply walk's Chrome trace
    error: str = ""
    done: threading.Event = field(default_factory=threading.Event, repr=False)

    @property
    def latency_write(self) -> float:
        return self.first_write - self.speech_end

    @property
    def latency_dac(self) -> float:
        return self.first_dac - self.speech_end

    @property
    def endpoint_s(self) -> float:
        """The endpointer's silence wait (end of speech -> endpoint decided)."""
        return self.detected - self.speech_end

    def stages(self) -> dict[str, float]:
        """Seconds per stage (:data:`STAGES`); they sum to :attr:`latency_dac`. Each stage runs
        from the end of the one before to its own event, or takes 0 when that event came first
        (a reply started from the streaming recognizer's guess has its text and audio before
        the batch recognition; that overlap counts in ``asr``). NaN where the turn has no such
        time (no reply, not played)."""
        marks = [self.speech_end, self.submitted, self.recognized_at, self.replied_at,
                 self.first_audio, self.detected, self.first_write, self.first_dac]
        if any(math.isnan(m) for m in marks):
            return {s: NAN for s in STAGES}
        done = [marks[0]]
        for m in marks[1:]:
            done.append(max(done[-1], m))
        return {s: b - a for s, a, b in zip(STAGES, done, done[1:])}


def dac_time(output: Any, frame: int) -> float:
    """Monotonic time at which the output device plays device frame ``frame`` (counted like
    ``counters()["written"]``), from the callback log; NaN if not played (yet) or logged."""
    ts = output.timestamps()
    if not len(ts):
        return NAN
    # Idle callbacks keep the position: the block that played ``frame`` is the last one
    # starting at or before it, found through the first block that starts after it.
    later = np.nonzero(ts[:, 2] > frame)[0]
    if not len(later) or later[0] == 0:
        return NAN
    cur, dac, pos, mono = ts[later[0] - 1]
    return float(mono + (dac - cur) + (frame - pos) / output.samplerate)


class VoiceStats:
    """p50 / p90 per stage (ms) over the turns that were played, plus the voice-to-voice
    latency, the endpointer's wait and the preemptive work wasted per turn."""

    def __init__(self, turns: list[Turn]) -> None:
        self.turns = [t for t in turns if not math.isnan(t.latency_dac)]
        self.all = list(turns)

    def _pct(self, values: list[float], q: float) -> Optional[float]:
        v = np.array([x for x in values if not math.isnan(x)], float)
        return float(1e3 * np.percentile(v, q)) if len(v) else None

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {"turns": len(self.all), "turns_played": len(self.turns)}
        for q in (50, 90):
            out[f"v2v_p{q}_ms"] = self._pct([t.latency_dac for t in self.turns], q)
            out[f"endpoint_p{q}_ms"] = self._pct([t.endpoint_s for t in self.turns], q)
            for s in STAGES:
                out[f"{s}_p{q}_ms"] = self._pct([t.stages()[s] for t in self.turns], q)
        out["preemptive_share"] = (sum(t.preemptive for t in self.turns) / len(self.turns)
                                   if self.turns else None)
        out["guessed_share"] = (sum(t.guessed for t in self.turns) / len(self.turns)
                                if self.turns else None)
        out["wasted_preemptive_ms_per_turn"] = (
            1e3 * sum(t.wasted_preemptive_s for t in self.all) / len(self.all) if self.all else None)
        return out

    def table(self) -> str:
        """Per-stage p50 / p90 as text."""
        s = self.summary()
        rows = [f"{'stage':<15}{'p50 ms':>9}{'p90 ms':>9}  what"]
        for st in STAGES:
            rows.append(f"{st:<15}{_fmt(s[f'{st}_p50_ms'])}{_fmt(s[f'{st}_p90_ms'])}  "
                        f"{STAGE_DOC[st]}")
        rows.append(f"{'v2v':<15}{_fmt(s['v2v_p50_ms'])}{_fmt(s['v2v_p90_ms'])}  "
                    "end of speech -> first sample at the DAC")
        rows.append(f"{'(endpoint)':<15}{_fmt(s['endpoint_p50_ms'])}{_fmt(s['endpoint_p90_ms'])}"
                    "  the endpointer's silence wait, overlapped by preemptive replies")
        return "\n".join(rows)


def _fmt(x: Optional[float]) -> str:
    return f"{x:>9.0f}" if x is not None else f"{'-':>9}"

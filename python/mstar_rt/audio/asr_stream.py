"""Streaming recognition: PocketSphinx decodes an utterance while it is spoken, from the
endpointer's :class:`~mstar_rt.audio.vad.SpeechSegment` stream, and gives a partial hypothesis
after every segment.

Live decoding normalises the features with a running estimate, carried from one utterance to
the next as PocketSphinx does in live mode; the batch recognizer instead settles the estimate on
the whole utterance first, which is why it is the one that decides a turn's text. On the robot
commands (espeak-ng) the partials read right at the end of most utterances but not all, so the
agent uses them where an early guess pays and a wrong one costs little: adaptive endpointing
(a partial that is a whole command ends the turn sooner) and live captions.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Mapping, Optional

import numpy as np

from mstar_rt.audio.samples import mono_float
from mstar_rt.audio.vad import SpeechSegment
from mstar_rt.model import NodeSubmodule, RequestContext, WorkContext


@dataclass(frozen=True)
class Partial:
    utterance: int
    text: str  # the best hypothesis so far ("" before any word)
    position: int  # stream position up to which it has heard
    final: bool  # the utterance ended; this is the live decode's last word
    seconds: float  # decoding time this segment took


class PartialRecognizer:
    """``PartialRecognizer(grammar=None)``: one utterance at a time; :meth:`feed` takes the
    segments in stream order. Not thread-safe (one per stream)."""

    def __init__(self, grammar: Optional[str] = None, sample_rate: int = 16000) -> None:
        from pocketsphinx import Decoder

        if sample_rate != 16000:
            raise ValueError(f"the bundled en-us model is for 16 kHz audio, got {sample_rate}")
        opts: dict[str, Any] = dict(loglevel="FATAL", samprate=sample_rate)
        if grammar is None:
            self._decoder = Decoder(**opts)
        else:
            self._decoder = Decoder(lm=None, **opts)
            self._decoder.add_jsgf_string("grammar", grammar)
            self._decoder.activate_search("grammar")
        self.grammar = grammar
        self._utterance: Optional[int] = None
        self._rng = np.random.default_rng(0)

    def feed(self, seg: SpeechSegment) -> Partial:
        t0 = time.perf_counter()
        d = self._decoder
        if seg.utterance != self._utterance:
            if self._utterance is not None:  # the last one never said it ended
                d.end_utt()
            d.start_utt()
            self._utterance = seg.utterance
        if len(seg.audio):
            x = mono_float(seg.audio, "PartialRecognizer.feed")
            # the batch recognizer's dither: exact zeros otherwise derail the features
            noise = self._rng.random(len(x)) < 0.25
            d.process_raw(np.clip(np.round(x * 32767) + noise, -32768, 32767)
                          .astype(np.int16).tobytes())
        if seg.ended:
            d.end_utt()
            self._utterance = None
        hyp = d.hyp()
        return Partial(seg.utterance, hyp.hypstr if hyp is not None else "",
                       seg.start + len(seg.audio), seg.ended, time.perf_counter() - t0)

    def close(self) -> None:
        if self._utterance is not None:
            self._decoder.end_utt()
            self._utterance = None


def _segments(item: Any, name: str) -> list[SpeechSegment]:
    """A stream item as its segments; raw audio (iterated, rows of samples) is refused by name:
    the recognizer takes the endpointer's mono segments, never a microphone's frames."""
    if isinstance(item, (list, tuple)) and all(isinstance(s, SpeechSegment) for s in item):
        return list(item)
    shape = f" of shape {list(np.shape(item))}" if isinstance(item, np.ndarray) else ""
    raise TypeError(f"PartialASRNode input '{name}' takes items that are lists of "
                    "SpeechSegment (a VADNode's speech_name output), got "
                    f"{type(item).__name__}{shape}; stream audio into a VADNode(speech_name=...) "
                    "and that output on into this node")


class PartialASRNode(NodeSubmodule):
    """Walk-graph node over a stream of ``[SpeechSegment, ...]`` items (a VADNode's
    ``speech_name`` output) -> ``{partials_name: [Partial, ...]}`` per execution. ``recognizer``:
    a ready instance for the first request (an agent's session); later requests get their own."""

    max_batch = 1

    def __init__(self, recognizer: Optional[PartialRecognizer] = None,
                 grammar: Optional[str] = None, input_name: str = "speech",
                 partials_name: str = "partials") -> None:
        self.grammar = grammar if recognizer is None else recognizer.grammar
        self.input_name, self.partials_name = input_name, partials_name
        self._given = recognizer
        self._key = f"partial_asr:{id(self)}"

    def _recognizer(self, request: RequestContext) -> PartialRecognizer:
        r = request.state.get(self._key)
        if r is None:
            r, self._given = (self._given or PartialRecognizer(self.grammar)), None
            request.state[self._key] = r
        return r

    def prepare_inputs(self, ctx: WorkContext, inputs: dict[str, Any]) -> Any:
        name = self.input_name
        segments = [seg for item in inputs[name].new_items for seg in _segments(item, name)]
        return self._recognizer(ctx.request), segments

    def forward(self, batch: list[Any]) -> list[Mapping[str, Any]]:
        return [{self.partials_name: [r.feed(seg) for seg in segments]}
                for r, segments in batch]

    def end_stream(self, ctx: WorkContext) -> Mapping[str, Any]:
        return {self.partials_name: []}

    def cleanup(self, request: RequestContext) -> None:
        r = request.state.pop(self._key, None)
        if r is not None:
            r.close()

"""Sentence-by-sentence speech models to serve: Piper or espeak-ng (``mstar_rt.audio.tts``) as a
walk graph of one DynamicLoop, one sentence per iteration, each sentence EMITted as ``audio``
as soon as it is spoken. (The neural alternative is
:class:`mstar_rt.models.orpheus.OrpheusTTS`, which streams audio within a sentence.)"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

import numpy as np

from mstar_rt.audio.tts import TTS, EspeakTTS, PiperTTS, split_sentences
from mstar_rt.graph import EMIT, DynamicLoop, GraphEdge, GraphNode
from mstar_rt.model import Model, NodeSubmodule

ESPEAK_VOICES = ("en-us", "en-gb", "en-gb-scotland", "en-029")


class _SpeakNode(NodeSubmodule):
    """Iteration i speaks sentence i of ``text`` in ``voice``; stops after the last sentence, so
    a cancelled request stops at the next sentence."""

    max_batch = 1

    def __init__(self, voices: Mapping[str, TTS], default: str) -> None:
        self.voices, self.default = voices, default

    def prepare_inputs(self, ctx: Any, inputs: dict[str, Any]) -> Any:
        sentences = split_sentences(str(inputs["text"] or "")) or [""]
        return sentences, ctx.iteration, self.voices[inputs["voice"] or self.default]

    def forward(self, batch: list[Any]) -> list[dict[str, Any]]:
        out = []
        for sentences, i, tts in batch:
            s = sentences[min(i, len(sentences) - 1)]
            parts = list(tts.synthesize_stream(s)) if s else []
            out.append({"audio": np.concatenate(parts) if parts else np.zeros(0, np.float32)})
        return out

    def check_stop(self, batch: list[Any], outputs: list[Any]) -> list[tuple[str, ...]]:
        return [("speak",) if i + 1 >= len(sentences) else () for sentences, i, _ in batch]


class SentenceTTS(Model):
    """Inputs ``text`` and ``voice`` (None: the first voice); EMITs float32 ``audio`` at
    ``sample_rate``, one chunk per sentence.

    ``backend``: ``"piper"`` (the joe voice package; voice ``joe``) or ``"espeak"`` (espeak-ng;
    voices ``ESPEAK_VOICES`` or ``voices=``)."""

    inputs = ("text", "voice")
    input_defaults = {"voice": None}

    def __init__(self, backend: str = "espeak", voices: Optional[Sequence[str]] = None,
                 max_sentences: int = 256, speed: int = 175) -> None:
        if backend == "piper":
            engines: dict[str, TTS] = {"joe": PiperTTS()}
        elif backend == "espeak":
            engines = {v: EspeakTTS(v, speed=speed) for v in (voices or ESPEAK_VOICES)}
        else:
            raise ValueError(f"SentenceTTS backend {backend!r}: use 'piper' or 'espeak'")
        rates = {t.sample_rate for t in engines.values()}
        if len(rates) != 1:
            raise ValueError(f"the voices speak at different rates {sorted(rates)}")
        self.backend = backend
        self.voices = tuple(engines)
        self.sample_rate = rates.pop()
        self.nodes = [GraphNode("speak", ["text", "voice"], [GraphEdge(EMIT, "audio")])]
        self.walks = {"speak": DynamicLoop("speak", max_sentences, "speak")}
        self.submodules = {"speak": _SpeakNode(engines, self.voices[0])}

    def validate_inputs(self, inputs: Mapping[str, Any]) -> None:
        if not isinstance(inputs.get("text"), str):
            raise TypeError(f"'text' must be a string, not {type(inputs.get('text')).__name__}")
        voice = inputs.get("voice")
        if voice is not None and voice not in self.voices:
            raise ValueError(f"unknown voice {voice!r}; this model speaks {list(self.voices)}")

"""Sentence-by-sentence speech models to serve: Piper or espeak-ng (``mstar_rt.audio.tts``) as a
walk graph of one DynamicLoop, one sentence per iteration (a long one in pieces of at most
``PIECE_CHARS`` characters), each EMITted as ``audio`` as soon as it is spoken. (The neural alternative is
:class:`mstar_rt.models.orpheus.OrpheusTTS`, which streams audio within a sentence.)"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any, Mapping, Optional, Sequence

import numpy as np

from mstar_rt.audio.tts import TTS, EspeakTTS, PiperTTS, speech_pieces
from mstar_rt.graph import EMIT, DynamicLoop, GraphEdge, GraphNode
from mstar_rt.model import Model, NodeSubmodule

ESPEAK_VOICES = ("en-us", "en-gb", "en-gb-scotland", "en-029")


#: Characters one synthesis call speaks at most (audio/tts.speech_pieces): a long sentence is
#: cut so that no request holds a voice for long while others wait.
PIECE_CHARS = 200


def reply_pieces(text: str, max_pieces: int) -> list[str]:
    """The pieces iteration i speaks; more than ``max_pieces`` (many tiny sentences): neighbours
    are spoken together, so nothing past the loop's cap is dropped."""
    pieces = speech_pieces(text, PIECE_CHARS) or [""]
    if len(pieces) > max_pieces:
        per = -(-len(pieces) // max_pieces)
        pieces = [" ".join(pieces[i:i + per]) for i in range(0, len(pieces), per)]
    return pieces


class _SpeakNode(NodeSubmodule):
    """Iteration i speaks piece i of ``text`` in ``voice``; stops after the last piece, so a
    cancelled request stops at the next piece. Requests are batched, so each iteration speaks
    one piece of every request waiting (in turn, not one whole reply after another); voices
    whose calls may overlap (espeak-ng: a process each) speak the batch side by side."""

    max_batch = 8

    def __init__(self, voices: Mapping[str, TTS], default: str, max_pieces: int) -> None:
        self.voices, self.default, self.max_pieces = voices, default, max_pieces
        self._pool: Optional[ThreadPoolExecutor] = None

    def prepare_inputs(self, ctx: Any, inputs: dict[str, Any]) -> Any:
        pieces = reply_pieces(str(inputs["text"] or ""), self.max_pieces)
        return pieces, ctx.iteration, self.voices[inputs["voice"] or self.default]

    @staticmethod
    def _speak(item: Any) -> np.ndarray:
        pieces, i, tts = item
        s = pieces[min(i, len(pieces) - 1)]
        parts = list(tts.synthesize_stream(s)) if s else []
        return np.concatenate(parts) if parts else np.zeros(0, np.float32)

    def forward(self, batch: list[Any]) -> list[dict[str, Any]]:
        if len(batch) > 1 and all(getattr(tts, "threadsafe", False) for _p, _i, tts in batch):
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.max_batch, thread_name_prefix="mstar-tts")
            return [{"audio": a} for a in self._pool.map(self._speak, batch)]
        return [{"audio": self._speak(item)} for item in batch]

    def check_stop(self, batch: list[Any], outputs: list[Any]) -> list[tuple[str, ...]]:
        return [("speak",) if i + 1 >= len(pieces) else () for pieces, i, _ in batch]


class SentenceTTS(Model):
    """Inputs ``text`` and ``voice`` (None: the first voice); EMITs float32 ``audio`` at
    ``sample_rate``, one chunk per sentence (or piece of a long one).

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
        self.max_sentences = max_sentences
        self.submodules = {"speak": _SpeakNode(engines, self.voices[0], max_sentences)}

    def validate_inputs(self, inputs: Mapping[str, Any]) -> None:
        if not isinstance(inputs.get("text"), str):
            raise TypeError(f"'text' must be a string, not {type(inputs.get('text')).__name__}")
        longest = self.max_sentences * PIECE_CHARS
        if len(inputs["text"]) > longest:  # each iteration would speak a long stretch
            raise ValueError(f"'text' holds {len(inputs['text'])} characters; this model speaks "
                             f"at most {longest} (max_sentences {self.max_sentences} x "
                             f"{PIECE_CHARS}) in one request: split it")
        voice = inputs.get("voice")
        if voice is not None and voice not in self.voices:
            raise ValueError(f"unknown voice {voice!r}; this model speaks {list(self.voices)}")

"""The voice agent's reply as a walk graph: recognition, the responder (a command responder or
an LM walk) and the TTS speech loop, EMITting the text, the reply and audio chunks as they are
made (:class:`ReplyModel`)."""

from __future__ import annotations

from typing import Any, Callable, Optional

import numpy as np

from mstar_rt.audio.speak import SpeakNode
from mstar_rt.audio.tts import TTS
from mstar_rt.graph import (EMIT, DynamicLoop, GraphEdge, GraphNode, Parallel, Sequential,
                            StreamingGraphEdge)
from mstar_rt.model import Model, NodeSubmodule


class _Call(NodeSubmodule):
    """``out = fn(inp)`` per item, one item per forward (each is a whole utterance)."""

    max_batch = 1

    def __init__(self, fn: Callable[[Any], Any], inp: str, out: str) -> None:
        self.fn, self.inp, self.out = fn, inp, out

    def forward(self, batch: list[Any]) -> list[dict[str, Any]]:
        return [{self.out: self.fn(x[self.inp])} for x in batch]


class ReplyModel(Model):
    """Input ``audio`` (16 kHz float32 utterance); EMITs ``text`` (the recognition), ``reply``
    and the ``audio_out`` chunks at ``tts.sample_rate`` as they are made (one a sentence for
    Piper / espeak-ng). Cancelling the request stops it at the next chunk.

    With a deterministic ``responder`` the walk is ``asr -> respond -> DynamicLoop(tts)``. With
    an LM responder (:class:`~mstar_rt.audio.lm_responder.LMResponder`) the LM is part of the
    walk graph: ``reply = asr -> chat -> prefill``, then ``speak = Parallel(DynamicLoop(decode),
    split, DynamicLoop(tts))``, the decode node streaming tokens (also EMITted as ``token``)
    into the sentence splitter, which feeds the speech loop sentence by sentence and EMITs the
    ``reply`` so far; the KV pages are freed when the request ends, cancelled or not.
    ``max_sentences`` caps the speech loop's iterations (one a chunk).

    A ``guess`` input (the streaming recognizer's hypothesis; deterministic responders only)
    starts the walk ``guess = Parallel(asr, respond_guess -> DynamicLoop(tts))``: the reply to
    the guess is spoken while the batch recognition runs beside it (on its own engine) and
    EMITs ``text``, which the caller compares with the guess before playing anything. A
    ``text`` input (a recognition already made: the guess was wrong) starts the walk
    ``said = respond -> DynamicLoop(tts)``, which does not recognize again."""

    inputs = ("audio", "guess", "text")
    input_defaults = {"guess": None, "text": None}

    def __init__(self, asr: Any, responder: Callable[[str], str], tts: TTS,
                 max_sentences: int = 2**31 - 1) -> None:
        recognize = _Call(lambda a: asr.recognize(np.asarray(a, np.float32)).text, "audio", "text")
        if getattr(responder, "is_lm", False):
            self._lm_walks(recognize, responder, tts)
            return
        self.nodes = [
            GraphNode("asr", ["audio"], [GraphEdge(EMIT, "text")], submodule=recognize,
                      engine="asr"),
            GraphNode("respond", ["text"], [GraphEdge(EMIT, "reply")],
                      submodule=_Call(responder, "text", "reply")),
            GraphNode("respond_guess", ["guess"], [GraphEdge(EMIT, "reply")],
                      submodule=_Call(responder, "guess", "reply")),
            GraphNode("tts", ["reply"], [GraphEdge(EMIT, "audio_out")],
                      submodule=SpeakNode(tts, loop="speak", text="reply"), engine="tts")]
        self.walks = {"reply": Sequential("asr", "respond",
                                          DynamicLoop("tts", max_sentences, "speak")),
                      "guess": Parallel("asr", Sequential(
                          "respond_guess", DynamicLoop("tts", max_sentences, "speak"))),
                      "said": Sequential("respond", DynamicLoop("tts", max_sentences, "speak"))}

    def _lm_walks(self, asr: NodeSubmodule, lm: Any, tts: TTS) -> None:
        from mstar_rt.audio.lm_responder import ChatPrompt, SentenceSplitter
        from mstar_rt.models.causal_lm import LOOP
        from mstar_rt.streaming import Fixed

        node = lm.lm_node()
        self.nodes = [
            GraphNode("asr", ["audio"], [GraphEdge(EMIT, "text"), "text"], submodule=asr),
            GraphNode("chat", ["text"], ["prompt", "params"], submodule=ChatPrompt(lm)),
            GraphNode("prefill", ["prompt", "params"],
                      [GraphEdge("decode", "token", persist=True)], submodule=node, engine="lm"),
            GraphNode("decode", ["token"], [GraphEdge(EMIT, "token"), "token",
                                            StreamingGraphEdge("split", "token", Fixed(1))],
                      submodule=node, engine="lm"),
            GraphNode("split", ["token"], [GraphEdge(EMIT, "reply")],
                      submodule=SentenceSplitter(lm)),
            GraphNode("tts", [], [GraphEdge(EMIT, "audio_out")],
                      submodule=SpeakNode(tts, text=None), engine="tts"),
        ]
        self.walks = {"reply": Sequential("asr", "chat", "prefill"),
                      "speak": Parallel(DynamicLoop("decode", lm.max_seq_len, LOOP), "split",
                                        DynamicLoop("tts", 2**31 - 1, "speak"))}
        self.engine_specs = {"lm": lm.engine()}

    def initial_walk(self, request: Any) -> str:
        for walk in ("said", "guess"):
            if request.inputs.get("text" if walk == "said" else walk) is not None \
                    and walk in self.walks:
                return walk
        return "reply"

    def next_walk(self, request: Any, finished_walk: str, persisted: Any) -> Optional[str]:
        if finished_walk == "reply" and "speak" in self.walks:
            return "speak"
        return None

"""Speech recognition of whole utterances with PocketSphinx and its bundled en-us model.

Open vocabulary (the bundled n-gram LM) is poor on synthetic speech; a small JSGF command grammar
recognizes it exactly (a 2 s command: ~25 ms of search plus ~10 ms per normalization pass on an
idle 2-core machine), so :data:`ROBOT_COMMANDS_JSGF` is provided.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any, Mapping, Optional

import numpy as np

from mstar_rt.audio.samples import mono_float
from mstar_rt.model import NodeSubmodule, WorkContext

ROBOT_COMMANDS_JSGF = """#JSGF V1.0;
grammar robot;
public <command> = <action> the <object> [to the <direction>] | hello | stop | what time is it;
<action> = move | stop | open | close | pick up | put down;
<object> = arm | gripper | cup | box | light;
<direction> = left | right | up | down | forward | back;
"""

# The normalization passes only need the features, but PocketSphinx runs the active search over
# them at end_utt anyway; a one-word grammar makes that search almost free (passes 2.5x cheaper,
# the same 30/33 on a 33-command espeak-ng sweep as with the full grammar's passes).
_PASS_JSGF = "#JSGF V1.0;\ngrammar normalize;\npublic <w> = a;\n"
_TRIM_DB = -45.0  # quieter than this below the utterance's peak is treated as silence
_TRIM_MARGIN_S = 0.03


@dataclass(frozen=True)
class Recognition:
    text: str  # "" when nothing was recognized
    # Posterior probability of the hypothesis, 0..1, as PocketSphinx scores it; it may differ in
    # the third digit between decodes of the same audio (decoder state outside the CMN), the
    # text does not.
    confidence: float
    seconds: float  # wall time the decode took


def trim_silence(samples: np.ndarray, sample_rate: int) -> np.ndarray:
    """Cuts leading and trailing stretches far below the peak (keeping a short margin): the
    endpointer pads utterances with silence, and PocketSphinx's grammar search decodes clean
    speech better without long silent edges (measured on espeak-ng speech)."""
    if len(samples) == 0:
        return samples
    hop = max(1, sample_rate // 100)
    n = len(samples) // hop
    if n == 0:
        return samples
    energy = np.sqrt(np.mean(samples[:n * hop].reshape(n, hop) ** 2, axis=1) + 1e-12)
    loud = np.nonzero(20 * np.log10(energy / energy.max()) > _TRIM_DB)[0]
    margin = int(_TRIM_MARGIN_S * sample_rate)
    begin = max(0, loud[0] * hop - margin)
    end = min(len(samples), (loud[-1] + 1) * hop + margin)
    return samples[begin:end]


class PocketSphinxASR:
    """``PocketSphinxASR(grammar=None, sample_rate=16000, trim=True, cmn_passes=3)``: ``grammar``
    is JSGF text (None: the bundled open-vocabulary n-gram LM). One decoder per instance;
    :meth:`recognize` is thread-safe (calls on one instance run one at a time). ``trim`` cuts
    silent edges first; ``cmn_passes`` feature-only passes settle the normalization on each
    utterance (each costs about a third of a decode)."""

    def __init__(self, grammar: Optional[str] = None, sample_rate: int = 16000,
                 trim: bool = True, cmn_passes: int = 3) -> None:
        from pocketsphinx import Decoder  # loads the acoustic model: only when asked for

        if sample_rate != 16000:
            raise ValueError(f"the bundled en-us model is for 16 kHz audio, got {sample_rate}; "
                             "resample first (mstar_rt.audio.Resampler)")
        self.sample_rate, self.grammar, self.trim = sample_rate, grammar, trim
        self.cmn_passes = cmn_passes
        opts: dict[str, Any] = dict(loglevel="FATAL", samprate=sample_rate)
        if grammar is None:
            self._decoder = Decoder(**opts)
        else:
            self._decoder = Decoder(lm=None, **opts)  # skip loading the n-gram LM
            self._decoder.add_jsgf_string("grammar", grammar)  # ValueError on a bad grammar
            self._decoder.activate_search("grammar")
        self._search = self._decoder.current_search()
        self._decoder.add_jsgf_string("normalize", _PASS_JSGF)
        self._cmn0 = self._decoder.get_cmn()
        self._lock = threading.Lock()

    def recognize(self, samples: np.ndarray) -> Recognition:
        """Decodes one whole utterance of float samples in [-1, 1] at ``sample_rate``."""
        x = mono_float(samples, "PocketSphinxASR.recognize")
        if self.trim:
            x = trim_silence(x, self.sample_rate)
        # Dither: digital silence (exact zeros) otherwise derails the features. Seeded
        # per call, so the same audio always decodes the same (PocketSphinx's own dither draws
        # from one generator across calls, which makes scores vary from call to call).
        # Like PocketSphinx's: +1 on a random quarter of the samples.
        noise = np.random.default_rng(0).random(len(x)) < 0.25
        pcm = np.clip(np.round(x * 32767) + noise, -32768, 32767).astype(np.int16).tobytes()
        with self._lock:
            start = time.perf_counter()
            d = self._decoder
            # Cepstral mean normalization is estimated live and carried across utterances, so a
            # result would depend on what was decoded before (and a fresh decoder's default is
            # poor for synthetic voices). Start from the model's default every time and let three
            # feature-only passes settle the estimate on this utterance (measured on espeak-ng
            # commands: 11/11 exact, vs 8/11 on a fresh decoder and 5/11 with batch CMN).
            d.set_cmn(self._cmn0)
            if pcm and self.cmn_passes:
                d.activate_search("normalize")
                for _ in range(self.cmn_passes):
                    d.start_utt()
                    d.process_raw(pcm, no_search=True)
                    d.end_utt()
                d.activate_search(self._search)
            d.start_utt()
            if pcm:
                d.process_raw(pcm)
            d.end_utt()
            hyp = d.hyp()
            seconds = time.perf_counter() - start
        if hyp is None:
            return Recognition("", 0.0, seconds)
        return Recognition(hyp.hypstr, float(min(max(hyp.prob, 0.0), 1.0)), seconds)


class ASRNode(NodeSubmodule):
    """Walk-graph node: input ``utterance`` (float32 samples, or a VADEvent carrying them) ->
    ``{"text": str, "confidence": float}``. Decodes one utterance at a time (one decoder)."""

    max_batch = 1

    def __init__(self, asr: Optional[PocketSphinxASR] = None, input_name: str = "utterance",
                 text_name: str = "text", confidence_name: str = "confidence") -> None:
        self.asr = asr if asr is not None else PocketSphinxASR(ROBOT_COMMANDS_JSGF)
        self.input_name, self.text_name, self.confidence_name = (input_name, text_name,
                                                                 confidence_name)

    def prepare_inputs(self, ctx: WorkContext, inputs: dict[str, Any]) -> Any:
        x = inputs[self.input_name]
        return getattr(x, "audio", x)

    def forward(self, batch: list[Any]) -> list[Mapping[str, Any]]:
        out = []
        for samples in batch:
            r = self.asr.recognize(samples)
            out.append({self.text_name: r.text, self.confidence_name: r.confidence})
        return out

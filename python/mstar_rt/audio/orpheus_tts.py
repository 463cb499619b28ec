"""The Orpheus-style speech LM as the agent's TTS.

:class:`OrpheusSpeech` serves :class:`mstar_rt.models.orpheus.OrpheusTTS` (LM decode loop
streaming codec tokens into the SNAC decoder) on a Runtime of its own and implements the
:class:`~mstar_rt.audio.tts.TTS` protocol: ``synthesize_stream(text)`` submits one request per
sentence and yields each 24 kHz chunk the decoder EMITs (a SNAC frame, 85 ms, once the exact
window is full), so the agent's speech loop hands audio to the speaker ring while the LM is
still talking. Closing the iterator (barge-in, a cancelled reply) cancels the request, which
frees its KV pages. The agent's AudioOutput resamples 24 kHz to the device rate on write.

Why a Runtime of its own rather than nodes in the reply walk: one Orpheus request speaks one
text from a fresh KV sequence and a fresh codec stream, while the reply walk speaks several
sentences in one request.
"""

from __future__ import annotations

import os
import threading
from typing import Any, Iterator, Optional, Union

import numpy as np

from mstar_rt.audio.tts import split_sentences


class OrpheusSpeech:
    """``OrpheusSpeech(model, voice=None, params=None)``: ``model`` an OrpheusTTS; ``voice``
    prefixes the text as Orpheus' fine-tuned voices expect (e.g. ``"tara"``); ``params`` the
    SamplingParams (default: the model's, Orpheus' settings). ``sample_rate`` is the codec's."""

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

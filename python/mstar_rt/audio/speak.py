"""The speech loop of a reply walk: :class:`SpeakNode` EMITs one audio chunk per iteration from
the request's :class:`SpeechQueue` of sentences, filled all at once from a fixed reply or one by
one as an LM writes them."""

from __future__ import annotations

import threading
from collections import deque
from typing import Any, Iterator, Optional

import numpy as np

from mstar_rt.audio.tts import TTS, split_sentences
from mstar_rt.model import NodeSubmodule


class SpeechQueue:
    """The sentences one request's ``tts`` loop still has to speak, filled by the walk (all at
    once from a fixed reply, or one by one as an LM writes them), and the chunk iterator of the
    sentence being spoken. Thread-safe; :meth:`shutdown` (the request ended) wakes a waiting
    loop and closes the iterator, or, while a chunk is being made, calls the iterator's
    ``cancel()`` if it has one (thread-safe, e.g. OrpheusChunks) and leaves closing to its
    maker."""

    def __init__(self) -> None:
        self._sentences: deque[str] = deque()
        self._cv = threading.Condition()
        self.closed = False  # no more sentences will come
        self.ended = False  # the request is over
        self.chunks: Optional[Iterator[np.ndarray]] = None
        self._making = False

    def put(self, sentence: str) -> None:
        with self._cv:
            self._sentences.append(sentence)
            self._cv.notify_all()

    def close(self) -> None:
        with self._cv:
            self.closed = True
            self._cv.notify_all()

    def take(self, timeout: float) -> Optional[str]:
        """The next sentence, or None if none came within ``timeout`` (or none will)."""
        with self._cv:
            self._cv.wait_for(lambda: self._sentences or self.closed or self.ended, timeout)
            return self._sentences.popleft() if self._sentences and not self.ended else None

    @property
    def finished(self) -> bool:
        with self._cv:
            return self.ended or (self.closed and not self._sentences and self.chunks is None)

    def speak(self, chunks: Iterator[np.ndarray]) -> None:
        """Makes ``chunks`` (a sentence's) the current iterator; closed at once if ended."""
        with self._cv:
            if not self.ended:
                self.chunks = chunks
                return
        getattr(chunks, "close", lambda: None)()

    def next_chunk(self) -> Optional[np.ndarray]:
        """The current sentence's next chunk; None when it is spoken (or the request ended)."""
        with self._cv:
            if self.ended or self.chunks is None:
                return None
            self._making, chunks = True, self.chunks
        chunk = None
        try:
            chunk = next(chunks, None)
        finally:  # also when the TTS raised: the request fails with it, nothing stays "making"
            with self._cv:
                self._making = False
                close = chunk is None or self.ended
                if close:
                    self.chunks = None
        if close:
            getattr(chunks, "close", lambda: None)()
        return None if self.ended else chunk

    def shutdown(self) -> None:
        with self._cv:
            self.ended = True
            self._cv.notify_all()
            chunks, making = self.chunks, self._making
            self.chunks = None if not making else self.chunks  # else its maker closes it
        if chunks is None:
            return
        if not making:
            getattr(chunks, "close", lambda: None)()
        elif hasattr(chunks, "cancel"):  # wakes a maker blocked in a slow synthesis
            chunks.cancel()


_QUEUE = "_speech_queue"


def speech_queue(state: dict) -> SpeechQueue:
    """The request's :class:`SpeechQueue` (made on first use) in its ``request.state``."""
    q = state.get(_QUEUE)
    if q is None:
        q = state.setdefault(_QUEUE, SpeechQueue())
    return q


class SpeakNode(NodeSubmodule):
    """Body of the DynamicLoop ``loop``: each iteration EMITs the next ``audio`` chunk of the
    request's :class:`SpeechQueue` as ``tts.synthesize_stream`` makes it (Piper and espeak-ng:
    one chunk a sentence; Orpheus: one per decoded frame), or nothing after waiting up to
    ``wait_s`` for a sentence. With ``text`` set, the node reads that input and queues its
    sentences itself on the first iteration; without, another node fills the queue. A
    cancelled request stops at the next chunk and its iterator is closed (which cancels an
    Orpheus side request)."""

    max_batch = 1  # a chunk iterator runs on one thread; one request at a time

    def __init__(self, tts: TTS, loop: str = "speak", text: Optional[str] = "reply",
                 audio: str = "audio_out", wait_s: float = 0.2) -> None:
        self.tts, self.loop, self.text, self.audio, self.wait_s = tts, loop, text, audio, wait_s

    def prepare_inputs(self, ctx: Any, inputs: dict[str, Any]) -> Any:
        q = speech_queue(ctx.request.state)
        if self.text is not None and ctx.iteration == 0:
            for s in split_sentences(str(inputs[self.text] or "")):
                q.put(s)
            q.close()
        return q

    def forward(self, batch: list[SpeechQueue]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for q in batch:
            chunk = q.next_chunk()
            while chunk is None and not q.finished:
                sentence = q.take(self.wait_s)
                if sentence is None:
                    break
                q.speak(iter(self.tts.synthesize_stream(sentence)))
                chunk = q.next_chunk()
            out.append({} if chunk is None else {self.audio: np.asarray(chunk, np.float32)})
        return out

    def check_stop(self, batch: list[SpeechQueue], outputs: list[Any]) -> list[tuple[str, ...]]:
        return [(self.loop,) if q.finished else () for q in batch]

    def cleanup(self, request: Any) -> None:
        q = request.state.get(_QUEUE)
        if q is not None:
            q.shutdown()

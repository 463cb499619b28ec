"""A reply request's outputs, gathered as the Runtime makes them, with the time each stage
finished: the agent plays them later (a preemptive reply, started at a pause, waits for the
endpoint) or at once. Cancelling it stops the walk in the Conductor, frees its KV pages and
drops whatever it made; nothing of it has been played.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Any, Callable, Iterator, Optional

NAN = float("nan")
_END, _CANCELLED, _ERROR = object(), object(), object()


class ReplyStream:
    """``ReplyStream(handle, pause_sample=None, on_text=None, guess=None)``: one thread iterates
    the request
    and keeps its events; iterate the stream for ``(name, value)`` in order (it blocks for
    events still to come and raises what the request raised). ``on_text(stream, text)`` runs on
    that thread when the recognition is EMITted."""

    def __init__(self, handle: Any, pause_sample: Optional[int] = None,
                 on_text: Optional[Callable[["ReplyStream", str], None]] = None,
                 guess: Optional[str] = None) -> None:
        self.handle, self.pause_sample, self.on_text = handle, pause_sample, on_text
        self.guess = guess  # the text the reply was started from, before recognition confirms
        self.submitted = time.monotonic()
        self.recognized_at = self.replied_at = self.first_audio = self.cancelled_at = NAN
        self.text: Optional[str] = None
        self._events: "queue.Queue[tuple[Any, Any]]" = queue.Queue()
        self._thread = threading.Thread(target=self._watch, name="voice-reply-watch",
                                        daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        from mstar_rt.runtime import RequestCancelled

        try:
            for name, value in self.handle:
                now = time.monotonic()
                if name == "text":
                    self.text, self.recognized_at = value, now
                    if self.on_text is not None:
                        self.on_text(self, value)
                elif name == "reply" and self.replied_at != self.replied_at:  # first: NaN
                    self.replied_at = now
                elif name == "audio_out" and len(value) and self.first_audio != self.first_audio:
                    self.first_audio = now
                self._events.put((name, value))
        except RequestCancelled as e:
            self._events.put((_CANCELLED, e))
        except BaseException as e:  # handed to the reader, who knows the turn
            self._events.put((_ERROR, e))
        else:
            self._events.put((_END, None))

    def cancel(self) -> float:
        """Stops the request; returns the seconds it had been running (work wasted, when a
        preemptive reply is dropped)."""
        self.handle.cancel()
        self.cancelled_at = time.monotonic()
        return self.cancelled_at - self.submitted

    def __iter__(self) -> Iterator[tuple[str, Any]]:
        while True:
            name, value = self._events.get()
            if name is _END:
                self._events.put((name, value))  # a second reader ends too
                return
            if name is _CANCELLED or name is _ERROR:
                self._events.put((name, value))
                raise value
            yield name, value

    def join(self, timeout: Optional[float] = None) -> None:
        self._thread.join(timeout)

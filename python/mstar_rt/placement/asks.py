"""Questions the parent asks a worker (``stats``), each answered by a reply carrying its token."""

from __future__ import annotations

import itertools
import threading
import time
from typing import Any, Callable


class Asks:
    def __init__(self, rank: int) -> None:
        self.rank = rank
        self._waiters: dict[int, list] = {}
        self._tokens = itertools.count(1)

    def ask(self, post: Callable[[dict], None], kind: str, timeout: float) -> Any:
        """Posts ``{"kind": kind, "token": ...}`` until the answer comes (:meth:`answer`);
        TimeoutError after ``timeout`` seconds."""
        token = next(self._tokens)
        waiter: list = [threading.Event(), None]
        self._waiters[token] = waiter
        try:
            # Posted again until answered: a post is dropped while the socket still connects
            # (right after start), and answering twice is harmless.
            deadline = time.monotonic() + timeout
            while True:
                post({"kind": kind, "token": token})
                left = deadline - time.monotonic()
                if waiter[0].wait(max(0.0, min(0.2, left))):
                    return waiter[1]
                if left <= 0.2:
                    raise TimeoutError(f"worker process rank {self.rank} did not answer a "
                                       f"{kind} request within {timeout} s")
        finally:
            self._waiters.pop(token, None)

    def answer(self, token: int, value: Any) -> None:
        waiter = self._waiters.get(token)
        if waiter is not None:
            waiter[1] = value
            waiter[0].set()


__all__ = ["Asks"]

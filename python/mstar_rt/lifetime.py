"""Runtimes still open when the interpreter exits are closed first.

An engine thread is a daemon blocked in the Conductor (C++, GIL released). When the interpreter
finalizes with one still there, the thread is torn down as it takes the GIL back, inside a
pybind11 scope that may not unwind: std::terminate, "terminate called without an active
exception", and the process aborts (SIGABRT) -- a script that forgot ``close()``, or left by an
exception, crashed on its way out. ``atexit`` hooks run before that, while threads still run."""

from __future__ import annotations

import atexit
import threading
import time
import traceback
import weakref
from typing import Any, Optional

_LIVE: "weakref.WeakSet[Any]" = weakref.WeakSet()


def track(runtime: Any) -> None:
    """Closes ``runtime`` at exit unless it is gone or closed by then."""
    _LIVE.add(runtime)


class OwnThreadError(RuntimeError):
    """close() was called on a thread it would have to join."""


def refuse_own_thread(threads: list) -> None:
    """A close() from one of the threads it would join (a node, an output callback) is refused
    before anything is shut: a thread cannot join itself."""
    if threading.current_thread() in threads:
        raise OwnThreadError("close() was called on one of the runtime's own worker threads (from "
                           "a node or an output callback); close it from another thread")


def join_all(threads: list, timeout: Optional[float]) -> bool:
    """Joins ``threads`` within ``timeout`` seconds in all (None: forever); whether all ended."""
    end = None if timeout is None else time.monotonic() + timeout
    for t in threads:
        t.join(None if end is None else max(0.0, end - time.monotonic()))
    return not any(t.is_alive() for t in threads)


EXIT_WAIT_S = 10.0  # a node that never returns must not hold the exit forever


@atexit.register
def _close_all() -> None:
    runtimes = list(_LIVE)
    if runtimes:
        closer = threading.Thread(target=_close, args=(runtimes,), name="mstar-exit", daemon=True)
        closer.start()
        closer.join(EXIT_WAIT_S)


def _close(runtimes: list) -> None:
    for runtime in runtimes:
        try:
            runtime.close()
        except Exception:
            traceback.print_exc()


__all__ = ["OwnThreadError", "join_all", "refuse_own_thread", "track"]

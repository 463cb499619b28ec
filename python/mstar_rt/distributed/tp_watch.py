"""``restart="eager"``: a tensor-parallel group rebuilt as soon as it loses a rank, not at its
next step.

With ``"auto"`` the first step after a loss starts the new followers (about 2 s on a small
CPU), so the first request after the loss waits for them. Here a thread looks at the followers
every WATCH_S and, once one is gone, takes the group's step lock and rebuilds it (the same
rebuild a step would make: rank 0's weights and cache kept, the K/V built before marked lost,
at most ``max_restarts`` times; a rebuild that cannot start is tried again after a wait that
doubles up to BACKOFF_MAX_S). A step that comes meanwhile waits for the lock, as it would have
waited for its own rebuild. Opt-in: a server that counts restarts per step, or that would
rather not spend the CPU before anyone asks, keeps ``"auto"``.

The thread holds the model only weakly and ends with its :meth:`close` or its collection."""

from __future__ import annotations

import threading
import weakref
from typing import Any

WATCH_S = 0.2  # how often the followers are looked at (a process poll each: cheap)
BACKOFF_MAX_S = 5.0  # after failed rebuilds, the wait before the next (doubling up to this)


def watch_group(lm: Any) -> threading.Event:
    """Starts the watcher of ``lm`` (a TensorParallelLM); setting the event it returns stops it."""
    stop = threading.Event()
    ref = weakref.ref(lm)
    threading.Thread(target=_watch, args=(ref, stop), daemon=True,
                     name="mstar-tp-watch").start()
    return stop


def _watch(ref: "weakref.ref[Any]", stop: threading.Event) -> None:
    wait = WATCH_S
    while not stop.wait(wait):
        lm = ref()
        if lm is None:
            return
        try:
            lm.heal()
            wait = WATCH_S
        except Exception:  # a rebuild that could not start: the next look (or step) tries
            # again, later each time, so a lasting cause does not spend max_restarts at once
            wait = min(2 * wait, BACKOFF_MAX_S)
        del lm


__all__ = ["WATCH_S", "watch_group"]

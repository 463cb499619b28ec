"""glibc's allocator set for a process that allocates batch tensors from several threads: the
policy server (serve/cli.py) and every placement worker (placement/worker.py).

Each setting is applied unless its environment variable (which glibc reads itself) is set."""

from __future__ import annotations

import ctypes
import os
import sys

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_ARENA_MAX = -1, -3, -8
SETTINGS = (
    # glibc gives each thread that allocates under contention its own arena, up to eight per
    # core; a server with a thread per streaming request then grows for minutes as the arenas
    # fill (the soak benchmark saw +4-6 MB over the first minutes). Two, as gunicorn recommends
    # for threaded Python servers.
    (_M_ARENA_MAX, 2, "MALLOC_ARENA_MAX"),
    # By default glibc raises its mmap threshold to the largest block freed and then trims the
    # heap's top whenever twice that is free: a server whose batches allocate a few MB returns
    # and refaults them every few batches, its RSS swinging by +-3 MB from second to second
    # with nothing in use growing (the soak's 60 s RSS slope read up to 4.5 MB/min from the
    # swings alone), at three times the page faults; a worker copying a 1 MiB tensor out of
    # shared memory paid ~150 µs of page faults for a ~35 µs copy. Fixed: blocks under 4 MB
    # come from the heap, which keeps up to 64 MB free at its top; larger ones are mapped and
    # unmapped.
    (_M_MMAP_THRESHOLD, 4 << 20, "MALLOC_MMAP_THRESHOLD_"),
    (_M_TRIM_THRESHOLD, 64 << 20, "MALLOC_TRIM_THRESHOLD_"),
)


def tune_malloc(arenas: bool = True) -> None:
    """Applies :data:`SETTINGS` (Linux with glibc; elsewhere nothing); ``arenas=False`` leaves
    the number of arenas alone (a worker process: its RSS is not what is watched, and two
    arenas showed no gain for it)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):  # not glibc (musl): nothing to tune
        return
    for param, value, env in SETTINGS:
        if not os.environ.get(env) and (arenas or param != _M_ARENA_MAX):
            mallopt(param, value)


__all__ = ["SETTINGS", "tune_malloc"]

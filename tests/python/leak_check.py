"""What a test module may not leave behind: placement's shared-memory files (arenas, mailboxes)
named for this process, placement workers still running as its children, and serving threads (a
server's, or the thread pool of an app whose state was never closed). conftest.py checks after
every module, so a leak fails the module that made it, not a later sweep."""

from __future__ import annotations

import os
import threading
import time

SHM_DIR = "/dev/shm"


def shm_files() -> set[str]:
    """Our placement files in /dev/shm (placement/arena.py names them ``mstar_<pid>_...``)."""
    prefix = f"mstar_{os.getpid()}_"
    try:
        return {n for n in os.listdir(SHM_DIR) if n.startswith(prefix)}
    except OSError:
        return set()


def worker_children() -> set[int]:
    """Pids of our child processes that run a placement worker."""
    me, found = os.getpid(), set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
            ppid = int(stat[stat.rindex(")") + 2:].split()[1])
            if ppid != me or stat[stat.rindex(")") + 2] == "Z":
                continue
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if b"mstar_rt.placement.worker" in f.read():
                    found.add(int(entry))
        except (OSError, ValueError):
            continue
    return found


def serve_threads() -> set[str]:
    """Names of live serving threads (serve/bridge.py and serve/server.py name them
    ``mstar-serve...``)."""
    return {t.name for t in threading.enumerate() if t.name.startswith("mstar-serve")}


def leftovers(before: tuple[set[str], set[str]], grace_s: float = 5.0
              ) -> tuple[set[str], set[int], set[str]]:
    """(files, pids, threads) still there ``grace_s`` after a module ended that were not there
    at its start (``before``: ``shm_files()``, ``serve_threads()``): a closing runtime's workers
    and a closed pool's threads take a moment to exit."""
    deadline = time.monotonic() + grace_s
    while True:
        files, pids = shm_files() - before[0], worker_children()
        threads = serve_threads() - before[1]
        if not (files or pids or threads) or time.monotonic() > deadline:
            return files, pids, threads
        time.sleep(0.05)

"""Hang detection for a worker process: a worker that stops answering is as bad as a dead one.

The worker sends a heartbeat every ``heartbeat_s`` with what each of its engines is running
(node, seconds so far). The parent's :class:`Watchdog` declares the worker hung when heartbeats
stop for ``heartbeat_timeout_s`` (the process is stopped, or something holds the GIL), or when
one node has been running for longer than ``node_timeout_s`` (an endless loop in a node; None:
no limit, for models whose nodes may legitimately take long). It reports once; the link then
kills the process, and the usual death path fails its requests (naming rank and node) and, with
``restart="auto"``, starts a fresh one."""

from __future__ import annotations

import threading
import time
from typing import Callable, Optional, Sequence


def heartbeat_period(heartbeat_timeout_s: float) -> float:
    """How often a worker beats: four beats per timeout, so one late beat is not a hang."""
    return max(0.02, heartbeat_timeout_s / 4)


class Watchdog:
    def __init__(self, heartbeat_timeout_s: float, node_timeout_s: Optional[float],
                 on_hang: Callable[[str], None], name: str) -> None:
        if heartbeat_timeout_s <= 0:
            raise ValueError(f"heartbeat_timeout_s must be > 0 seconds, got {heartbeat_timeout_s}")
        if node_timeout_s is not None and node_timeout_s <= 0:
            raise ValueError(f"node_timeout_s must be > 0 seconds or None, got {node_timeout_s}")
        self.heartbeat_timeout_s, self.node_timeout_s = heartbeat_timeout_s, node_timeout_s
        self._on_hang = on_hang
        self._last = time.monotonic()
        self._busy: Sequence = ()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.beats = 0

    def start(self) -> None:
        self._last = time.monotonic()
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def beat(self, busy: Sequence) -> None:
        """A heartbeat arrived; ``busy``: [[node, seconds running], ...] per busy engine."""
        self._last = time.monotonic()
        self._busy = busy
        self.beats += 1

    def _run(self) -> None:
        period = min(0.05, self.heartbeat_timeout_s / 4)
        while not self._stop.wait(period):
            reason = self.hang()
            if reason is not None:
                self._stop.set()
                self._on_hang(reason)

    def hang(self) -> Optional[str]:
        """Why the worker counts as hung now, or None."""
        silent = time.monotonic() - self._last
        if silent > self.heartbeat_timeout_s:
            return (f"stopped answering (no heartbeat for {silent:.1f} s, heartbeat_timeout_s="
                    f"{self.heartbeat_timeout_s:g}: the process is stopped, or something holds "
                    "its GIL)")
        if self.node_timeout_s is not None:
            for node, seconds in self._busy:
                # The last beat's age counts too: the node has been running since that report.
                running = float(seconds) + silent
                if running > self.node_timeout_s:
                    return (f"hung in node '{node}' (running for {running:.1f} s, "
                            f"node_timeout_s={self.node_timeout_s:g})")
        return None

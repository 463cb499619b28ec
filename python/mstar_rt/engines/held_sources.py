"""An engine whose nodes are *source nodes*: each stands for a producer outside the runtime (the
caller's feed, feeds.py; a stream entering a placed segment, placement/stream_in.py). A source's
one work item per request is held in flight -- its streams open -- while someone else pushes the
stream's items (``Conductor.push_stream``), and completes when the stream is ended, which ends
the stream as a producer's end does."""

from __future__ import annotations

import threading
import traceback
from typing import Any

from mstar_rt.engines.base import Engine

#: Source items taken per batch: one per request whose walk reached the source.
SOURCE_BATCH = 64


class HeldSources(Engine):
    """Holds its nodes' work items until :meth:`end` (or the request's end, :meth:`release`).
    Subclasses may keep more per (request, source) state through :meth:`opened` and
    :meth:`forgotten`, which run under ``self.lock``."""

    def __init__(self) -> None:
        super().__init__()
        self.lock = threading.Lock()
        self._held: dict[tuple[int, int], int] = {}  # (request, source node) -> its item
        self._over: set[tuple[int, int]] = set()     # ended before its item was taken

    def serve(self) -> None:
        host = self.host
        assert host is not None
        while not host.closed:
            try:
                self._take(host.poll_s)
            except Exception:  # keep taking: a dead thread would hold every later stream open
                traceback.print_exc()

    def opened(self, key: tuple[int, int]) -> None:
        """A (request, source) item was taken and is held: its stream is open."""

    def forgotten(self, request_id: int) -> None:
        """The request ended: drop what a subclass keeps for it."""

    def _take(self, timeout: float) -> bool:
        """Takes a batch of source items -- held, or completed if their stream is over already
        -- and whether there was one."""
        host = self.host
        assert host is not None
        batch = host.queue.next_batch(self.engine_id, SOURCE_BATCH, timeout)
        if batch is None:
            return False
        node, _walk, items = batch
        ended = []
        with self.lock:
            for it in items:
                key = (it.request, node)
                if key in self._over:
                    self._over.discard(key)
                    ended.append(it.id)
                else:
                    self._held[key] = it.id
                    self.opened(key)
        if ended:
            host.report(host.queue.complete(node, ended, [{}] * len(ended)))
        # Held first, then checked: a request ending in between was released before the item
        # above was stored, and would keep it forever.
        self._forget_gone({it.request for it in items})
        return True

    def take_queued(self) -> None:
        """Takes every source item queued now, on the caller's thread: waiting for the engine's
        would hold a stream's state (and a consumer's last windows) back by a wake-up."""
        while self._take(0.0):
            pass

    def _forget_gone(self, requests: Any) -> bool:
        """Releases those of ``requests`` that have ended; whether any had."""
        host = self.host
        assert host is not None
        # knows(), not a bare get(): submit queues a request's items before it registers the
        # request, and a source item taken in between read as a request gone would end its
        # stream empty (the omni talker then spoke nothing: about 1 in 8,000 requests).
        gone = [r for r in requests if not host.requests.knows(r)]
        for r in gone:
            self.release(r)
        return bool(gone)

    def end(self, request_id: int, node: int) -> bool:
        """Source ``node``'s stream is over for the request: its item completes (one not taken
        yet, as it is taken). False if the request has ended, so there was nothing to end."""
        host = self.host
        assert host is not None
        key = (request_id, node)
        with self.lock:
            item = self._held.pop(key, None)
            if item is None:
                self._over.add(key)
        if item is None:
            self.take_queued()
        if self._forget_gone((request_id,)):
            if item is not None:  # popped above, so release() could not let it go
                host.report(host.queue.fail_items([item], "the request ended"))
            return False
        if item is not None:
            host.report(host.queue.complete(node, [item], [{}]))
        return True

    def release(self, request_id: int) -> None:
        """The request ended: its held items are let go, so that it can be reaped."""
        host = self.host
        assert host is not None
        with self.lock:
            keys = [k for k in self._held if k[0] == request_id]
            items = [self._held.pop(k) for k in keys]
            self._over = {k for k in self._over if k[0] != request_id}
            self.forgotten(request_id)
        if items:
            host.report(host.queue.fail_items(items, "the request ended"))

    @property
    def held(self) -> int:
        """Source items held or ended before they were taken, over all requests."""
        with self.lock:
            return len(self._held) + len(self._over)


__all__ = ["HeldSources", "SOURCE_BATCH"]

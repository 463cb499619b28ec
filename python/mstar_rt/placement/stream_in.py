"""Streams entering a segment (placement/segments.py): the parent's stand-in takes the stream
whole, one item per window, and each window crosses to the worker as it comes. In the worker's
segment Runtime a *source node* stands for the producer: its one work item stays in flight (its
stream open) while the windows' items are pushed into its stream (``Conductor.push_stream``),
and completes, ending the stream, when the parent's last window says the stream is over. The
consumer inside then reads its windows under its own chunk policy, as in one process.

The parent answers a window that is not the last itself, as it sends it (the worker has nothing
to say about it); the last window's answer is the run's end. A run that fails before its last
window fails its request by id (``failed`` with ``request``)."""

from __future__ import annotations

import threading
from typing import Any, Optional

from mstar_rt.engines.base import Engine
from mstar_rt.model import NodeSubmodule

STREAM_IN_ENGINE = "segment-stream-in"
SOURCE_BATCH = 64


def source_name(segment: str, stream: str) -> str:
    """The source node of stream ``stream`` entering segment ``segment``."""
    return f"{segment}<{stream}"


def window_lasts(chunk: Any) -> list[bool]:
    """Per stream of a stand-in's work item, whether its window is its stream's last: ``chunk``
    is one stream's window (begin, new_begin, end, last) or (windows, stream_end)."""
    if chunk is None:
        return []
    if type(chunk[0]) is int:
        return [bool(chunk[3])]
    windows, stream_end = chunk
    return [bool(stream_end or w[3]) for w in windows]


class SourceSubmodule(NodeSubmodule):
    """A source node's submodule: never called (StreamInEngine holds its item)."""

    max_batch = SOURCE_BATCH

    def forward(self, batch: list[Any]) -> list[Any]:
        raise RuntimeError("a stream's source node is held by its engine, never run")


class StreamInEngine(Engine):
    """Holds the source nodes' work items in flight until :meth:`end` (or the request's end)."""

    def __init__(self) -> None:
        super().__init__()
        self._lock = threading.Lock()
        self._held: dict[tuple[int, int], int] = {}  # (request, source node) -> its item
        self._over: set[tuple[int, int]] = set()     # ended before its item was taken

    def serve(self) -> None:
        host = self.host
        assert host is not None
        while not host.closed:
            self._take(host.poll_s)

    def _take(self, timeout: float) -> bool:
        """Takes a batch of source items (held, or completed if their stream is over already);
        whether there was one."""
        host = self.host
        assert host is not None
        batch = host.queue.next_batch(self.engine_id, SOURCE_BATCH, timeout)
        if batch is None:
            return False
        node, _walk, items = batch
        # knows(), not a bare get(): submit queues a run's items before it registers the run
        # (under the registry's lock), and a source item taken in between read as a request
        # gone, ending the stream empty -- the talker then spoke nothing and the request
        # "finished" without its audio (about 1 in 8,000 omni requests under load).
        gone = {it.request for it in items if not host.requests.knows(it.request)}
        ended = []
        with self._lock:
            for it in items:
                key = (it.request, node)
                if key in self._over or it.request in gone:
                    self._over.discard(key)
                    ended.append(it.id)
                else:
                    self._held[key] = it.id
        if ended:
            host.report(host.queue.complete(node, ended, [{}] * len(ended)))
        return True

    def end(self, request: int, node: int) -> None:
        """The stream of source ``node`` is over for ``request``: its item completes. One not
        taken yet is taken here (waiting for this engine's thread would hold the consumer's
        last windows back by a thread wake-up, up to a GIL switch interval)."""
        host = self.host
        assert host is not None
        key = (request, node)
        with self._lock:
            item = self._held.pop(key, None)
        if item is None:
            while self._take(0.0):
                pass
            live = host.requests.knows(request)  # (its lock is never taken under ours)
            with self._lock:
                item = self._held.pop(key, None)
                if item is None and live:
                    self._over.add(key)  # its item is still on the way: completed when taken
        if item is not None:
            host.report(host.queue.complete(node, [item], [{}]))

    def release(self, request_id: int) -> None:
        """The request ended: its held items are let go (the request can then be reaped). The
        segment runner calls it: a segment run borrows its cache id, so its Runtime does not."""
        host = self.host
        assert host is not None
        with self._lock:
            keys = [k for k in self._held if k[0] == request_id]
            items = [self._held.pop(k) for k in keys]
            self._over = {k for k in self._over if k[0] != request_id}
        if items:
            host.report(host.queue.fail_items(items, "the request ended"))

class Feed:
    """One run's entering streams in the worker: its sources' ids and which have ended."""

    __slots__ = ("sources", "ended", "result")

    def __init__(self, sources: list[tuple[int, int]]) -> None:
        self.sources = sources  # (source node id, stream name id), in the stand-in's order
        self.ended = [False] * len(sources)
        self.result: Optional[tuple] = None  # (error,) once the run ended before its last window


__all__ = ["Feed", "STREAM_IN_ENGINE", "SourceSubmodule", "StreamInEngine", "source_name",
           "window_lasts"]

"""Streams the caller feeds into a running request: a WebRTC track, a websocket, a robot's own
camera thread -- items the runtime does not make itself.

A model declares such a stream with :func:`StreamInput`: a *source node* that stands for the
producer, placed as a branch of its walk's root :class:`~mstar_rt.Parallel`. Its one work item
is held in flight by :class:`FeedEngine` (the engine :data:`FEED_ENGINE`, which the Runtime
makes itself) while ``RequestHandle.feed(name, item)`` appends items to the stream
(``Conductor.push_stream``, as a producer's executions would); ``RequestHandle.end_stream(name)``
completes the item, which ends the stream as a producer's end does, so the consumer gets its
last windows as its chunk policy cuts them. A request's end lets its held items go.
"""

from __future__ import annotations

import threading
import traceback
from typing import Any, Optional

from mstar_rt._core import StreamClosedError
from mstar_rt.engines.base import Engine
from mstar_rt.graph import GraphError, GraphNode, Loop, Parallel, Part, Sequential, \
    StreamingGraphEdge
from mstar_rt.model import NodeSubmodule

#: The engine that holds every StreamInput's source items (the Runtime makes it).
FEED_ENGINE = "fed-streams"
_BATCH = 64


class FeedSource(NodeSubmodule):
    """A StreamInput's submodule: never called, as its engine holds its item."""

    max_batch = _BATCH
    untimed = True  # its item's time in flight is the caller's stream, not a run (compiler.py)

    def __init__(self, streams: tuple[str, ...]) -> None:
        self.streams = streams

    def forward(self, batch: list[Any]) -> list[Any]:
        raise RuntimeError(f"a StreamInput of {list(self.streams)} ran as a node; its items come "
                           f"from RequestHandle.feed, on engine '{FEED_ENGINE}' (leave its engine "
                           "as StreamInput sets it)")


def StreamInput(node: str, *edges: StreamingGraphEdge) -> GraphNode:
    """A node ``node`` whose streams ``edges`` the caller feeds while the request runs
    (``handle.feed(edge.name, item)``, then ``handle.end_stream(edge.name)``). Put ``node`` in
    the walk as a branch of its root ``Parallel``, beside the section of the consumers:
    ``Parallel("mic", "asr")``."""
    if not edges or not all(isinstance(e, StreamingGraphEdge) for e in edges):
        raise GraphError(f"StreamInput '{node}' takes StreamingGraphEdge(to, name, chunk_policy) "
                         f"for each stream it feeds, got {list(edges)!r}")
    streams = tuple(dict.fromkeys(e.name for e in edges))
    return GraphNode(node, (), edges, submodule=FeedSource(streams), engine=FEED_ENGINE)


def _names_in(section: Any) -> list[str]:
    """Every node name in a section tree, once per place in it (a section object used in two
    places is read once: the compiler's own limits are not this check's business)."""
    out: list[str] = []
    todo, seen = [section], set()
    while todo:
        s = todo.pop()
        if isinstance(s, str):
            out.append(s)
        elif id(s) not in seen:
            seen.add(id(s))
            if isinstance(s, Sequential):
                todo.extend(s.parts)
            elif isinstance(s, Parallel):
                todo.extend(s.branches)
            elif isinstance(s, Loop):
                todo.append(s.section)
            elif isinstance(s, Part):
                todo.extend(s.walks.values())
    return out


class FeedEngine(Engine):
    """Holds each StreamInput's work item per request until its stream is ended (or the request
    ends); feeds and ends streams for :class:`~mstar_rt.RequestHandle`."""

    def __init__(self) -> None:
        super().__init__()
        self._lock = threading.Lock()
        self._held: dict[tuple[int, int], int] = {}  # (request, source node) -> its item
        self._over: set[tuple[int, int]] = set()     # ended before its item was taken
        self._ended: set[tuple[int, int]] = set()    # end_stream called (feed refuses then)
        self.streams: dict[str, tuple[int, int]] = {}  # stream -> (source node, name id)
        self.walks: dict[str, frozenset[str]] = {}  # stream -> the walks it is fed in

    def attach(self, host: Any, engine_id: int, name: str, nodes: Any) -> None:
        super().attach(host, engine_id, name, nodes)
        walks = host.model.walks
        for n in self.nodes:
            entry = host.nodes[n]
            if not isinstance(entry.submodule, FeedSource):
                raise GraphError(f"node '{entry.name}' runs on engine '{FEED_ENGINE}', which "
                                 "holds StreamInput sources only; give it another engine")
            mine: set[str] = set()
            for w, root in walks.items():
                top = isinstance(root, Parallel) and entry.name in root.branches
                if _names_in(root).count(entry.name) > top:
                    raise GraphError(f"StreamInput '{entry.name}' sits inside walk '{w}'; put "
                                     "it as a branch of the walk's root Parallel, e.g. "
                                     f"Parallel('{entry.name}', <the rest of the walk>)")
                if top:
                    mine.add(w)
            for stream in entry.submodule.streams:
                if stream in self.streams:
                    raise GraphError(f"two StreamInputs feed stream '{stream}'; feed each "
                                     "stream from one")
                self.streams[stream] = (n, host.graph.name_ids[stream])
                self.walks[stream] = frozenset(mine)

    def serve(self) -> None:
        host = self.host
        assert host is not None
        while not host.closed:
            try:
                self._take(host.poll_s)
            except Exception:  # keep taking: a dead thread would hold every later stream open
                traceback.print_exc()

    def _take(self, timeout: float) -> bool:
        """Takes a batch of source items: held, or completed if their stream is over already;
        whether there was one."""
        host = self.host
        assert host is not None
        batch = host.queue.next_batch(self.engine_id, _BATCH, timeout)
        if batch is None:
            return False
        node, _walk, items = batch
        ended = []
        with self._lock:
            for it in items:
                key = (it.request, node)
                if key in self._over:
                    self._over.discard(key)
                    ended.append(it.id)
                else:  # a new walk's stream: open again, if an earlier walk's was ended
                    self._held[key] = it.id
                    self._ended.discard(key)
        if ended:
            host.report(host.queue.complete(node, ended, [{}] * len(ended)))
        self._forget_gone({it.request for it in items})
        return True

    def _take_queued(self) -> None:
        """Takes every source item queued now, here rather than on the engine's thread."""
        while self._take(0.0):
            pass

    def _forget_gone(self, requests: Any) -> bool:
        """Releases those of ``requests`` that have ended: a request's end may have released it
        before this engine stored what it now holds for it. Whether any had ended."""
        host = self.host
        assert host is not None
        # knows(): submit queues a request's items before it registers the request
        gone = [r for r in requests if not host.requests.knows(r)]
        for r in gone:
            self.release(r)
        return bool(gone)

    def _stream(self, handle: Any, name: str, verb: str) -> Optional[tuple[int, int]]:
        """(source node, name id) of stream ``name`` for a running request; None once the
        request is over. ValueError for a stream no StreamInput feeds, RuntimeError for a walk
        that does not feed it."""
        found = self.streams.get(name) if isinstance(name, str) else None
        if found is None:
            raise ValueError(f"{verb}({name!r}): no StreamInput of the model feeds a stream of "
                             f"that name; its fed streams are {sorted(self.streams)}")
        if handle.done:
            return None
        walk = handle.context.walk
        if walk not in self.walks[name]:
            raise RuntimeError(f"{verb}({name!r}): request {handle.id} is in walk '{walk}', "
                               f"which does not feed '{name}'; it is fed in walks "
                               f"{sorted(self.walks[name])}")
        return found

    def feed(self, handle: Any, name: str, item: Any, error: Optional[BaseException]) -> None:
        """Appends ``item`` to stream ``name`` of ``handle``'s request."""
        found = self._stream(handle, name, "feed")
        if found is None:
            how = "has finished" if error is None else f"ended ({type(error).__name__}: {error})"
            raise StreamClosedError(f"feed({name!r}): request {handle.id} {how}; feed a "
                                    "request only while it runs")
        source, name_id = found
        self._take_queued()  # a next walk's item opens its stream again (clears _ended)
        with self._lock:
            ended = (handle.id, source) in self._ended
        if ended:
            raise StreamClosedError(f"feed({name!r}): the stream of request {handle.id} was "
                                    "ended by end_stream; feed before ending it (or, where a "
                                    "next walk feeds it again, once that walk has started)")
        host = self.host
        assert host is not None
        host.report(host.queue.push_stream(handle.id, source, name_id, item))

    def end_stream(self, handle: Any, name: str) -> bool:
        """Ends stream ``name`` of ``handle``'s request; False if it had ended already or the
        request is over."""
        found = self._stream(handle, name, "end_stream")
        if found is None:
            return False
        host = self.host
        assert host is not None
        key = (handle.id, found[0])
        self._take_queued()
        with self._lock:
            if key in self._ended:
                return False
            self._ended.add(key)
            item = self._held.pop(key, None)
            if item is None:
                self._over.add(key)  # not taken yet: completed as it is taken
        if item is None:
            # taken here, as waiting for the engine's thread would hold the consumer's last
            # windows back by a wake-up
            self._take_queued()
        if self._forget_gone((handle.id,)):  # it ended meanwhile: nothing left to end
            if item is not None:  # popped above, so release() could not let it go
                host.report(host.queue.fail_items([item], "the request ended"))
            return False
        if item is not None:
            host.report(host.queue.complete(found[0], [item], [{}]))
        return True

    def release(self, request_id: int) -> None:
        """The request ended: its held items are let go, so that it can be reaped."""
        host = self.host
        assert host is not None
        with self._lock:
            keys = [k for k in self._held if k[0] == request_id]
            items = [self._held.pop(k) for k in keys]
            self._over = {k for k in self._over if k[0] != request_id}
            self._ended = {k for k in self._ended if k[0] != request_id}
        if items:
            host.report(host.queue.fail_items(items, "the request ended"))

    @property
    def held(self) -> int:
        """Source items held, ended early or streams ended, over all requests (0 when idle)."""
        with self._lock:
            return len(self._held) + len(self._over) + len(self._ended)


def feeder(runtime: Any, verb: str, name: str) -> FeedEngine:
    """The runtime's :class:`FeedEngine`; ValueError naming what to add when it has none."""
    engine = runtime.engines.get(FEED_ENGINE)
    if not isinstance(engine, FeedEngine):
        raise ValueError(f"{verb}({name!r}): model {type(runtime.model).__name__} declares no "
                         f"StreamInput; add StreamInput('mic', StreamingGraphEdge(<consumer>, "
                         f"{name!r}, <chunk policy>)) to its nodes and as a branch of its "
                         "walk's root Parallel")
    return engine


__all__ = ["FEED_ENGINE", "FeedEngine", "FeedSource", "StreamInput", "feeder"]

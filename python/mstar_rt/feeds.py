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

from typing import Any, Optional

from mstar_rt._core import StreamClosedError
from mstar_rt.engines.held_sources import SOURCE_BATCH, HeldSources
from mstar_rt.graph import GraphError, GraphNode, Parallel, StreamingGraphEdge, node_places
from mstar_rt.model import NodeSubmodule

#: The engine that holds every StreamInput's source items (the Runtime makes it).
FEED_ENGINE = "fed-streams"


class FeedSource(NodeSubmodule):
    """A StreamInput's submodule: never called, as its engine holds its item."""

    max_batch = SOURCE_BATCH
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


class FeedEngine(HeldSources):
    """Holds each StreamInput's work item per request until its stream is ended (or the request
    ends); feeds and ends streams for :class:`~mstar_rt.RequestHandle`."""

    def __init__(self) -> None:
        super().__init__()
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
                if node_places(root).count(entry.name) > top:
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

    def opened(self, key: tuple[int, int]) -> None:
        self._ended.discard(key)  # a next walk's stream: open again, if an earlier one ended

    def forgotten(self, request_id: int) -> None:
        self._ended = {k for k in self._ended if k[0] != request_id}

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
        self.take_queued()  # a next walk's item opens its stream again (clears _ended)
        with self.lock:
            ended = (handle.id, source) in self._ended
        if ended:
            raise StreamClosedError(f"feed({name!r}): the stream of request {handle.id} was "
                                    "ended by end_stream; feed before ending it (or, where a "
                                    "next walk feeds it again, once that walk has started)")
        host = self.host
        assert host is not None
        taken, outcome = host.queue.push_stream(handle.id, source, name_id, item)
        host.report(outcome)
        if not taken:  # the request (or the stream) ended since the checks above
            raise StreamClosedError(f"feed({name!r}): request {handle.id} ended while the item "
                                    "was fed, so no stream took it; feed a request only while "
                                    "it runs")

    def end_stream(self, handle: Any, name: str) -> bool:
        """Ends stream ``name`` of ``handle``'s request; False if it had ended already or the
        request is over."""
        found = self._stream(handle, name, "end_stream")
        if found is None:
            return False
        key = (handle.id, found[0])
        self.take_queued()
        with self.lock:
            if key in self._ended:
                return False
            self._ended.add(key)
        return self.end(*key)

    @property
    def held(self) -> int:
        """Source items held, ended early or streams ended, over all requests (0 when idle)."""
        n = super().held  # (takes the lock itself)
        with self.lock:
            return n + len(self._ended)


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

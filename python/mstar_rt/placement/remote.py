"""The parent's side of a placed node: the model view the parent's Runtime serves, in which a
node placed in a worker has a stand-in submodule and a :class:`RemoteEngine` instead of its own
engine. The boundary is the engine: everything per node (prepare_inputs, forward, check_stop,
split_batch, cleanup) and per engine (batching, the KV cache) happens in the worker, so
request state such as KV pages lives there; the parent's Conductor only routes work items."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Mapping, Optional

from mstar_rt.engines.base import Engine
from mstar_rt.model import (Model, NodeSubmodule, RequestContext, hears_stream_end,
                            node_submodules)
from mstar_rt.placement.segments import SEGMENT_ENGINE, SegmentPlan, stand_in_nodes

if TYPE_CHECKING:
    from mstar_rt.placement.link import WorkerLink

SEGMENT_BATCH = 64  # segment runs handed to a worker in one message


class RemoteSubmodule(NodeSubmodule):
    """Stands in the parent for a node that runs in worker ``rank``; it is never called."""

    def __init__(self, node: str, rank: int, max_batch: int) -> None:
        self.node, self.rank, self.max_batch = node, rank, max_batch

    def forward(self, batch: list[Any]) -> list[Mapping[str, Any]]:
        raise RuntimeError(f"node '{self.node}' runs in worker process rank {self.rank}; the "
                           "parent never runs it")


class RemoteStreamEndSubmodule(RemoteSubmodule):
    """The stand-in of a node that hears the end of its stream (end_stream), so the parent's
    Conductor sends it the stream-end item; the worker calls the real end_stream."""

    def end_stream(self, ctx: Any) -> Mapping[str, Any]:
        return self.forward([])[0]


class PlacedModel(Model):
    """``model`` as the parent serves it: same graph, walks and state machine; placed nodes'
    submodules and engines swapped for stand-ins."""

    def __init__(self, model: Model, node_rank: Mapping[str, int], workers: set[int],
                 parent_engines: Mapping[str, str],
                 segments: Optional[SegmentPlan] = None) -> None:
        self.inner = model
        self.kv_moves: Any = None  # kv_moves.ParentMoves when a KV engine's walks are split
        # The nodes without the submodules they may carry: those below (stand-ins) run them here.
        self.nodes = [dataclasses.replace(n, submodule=None, engine=None) for n in model.nodes]
        self.walks = model.walks
        self.inputs = model.inputs
        self.input_defaults = model.input_defaults
        self.submodules = {
            n: (_stand_in(n, node_rank[n], s) if node_rank.get(n, 0) in workers else s)
            for n, s in node_submodules(model).items()}
        self.engines = dict(parent_engines)
        used = set(parent_engines.values())
        self.engine_specs = {e: spec for e, spec in model.engine_specs.items() if e in used}
        if segments is not None and segments.segments:
            # A stream into a segment goes to its stand-in, which takes it whole.
            self.nodes = [dataclasses.replace(n, outputs=tuple(segments.edge(o) for o in n.outputs))
                          if segments.redirect else n for n in self.nodes]
            # Appended: the model's own nodes keep their ids, which both processes share.
            self.nodes += stand_in_nodes(segments.segments)
            self.walks = segments.walks
            self.nodes_elsewhere = frozenset(n for seg in segments.segments for n in seg.nodes)
            for seg in segments.segments:
                # one taking streams hears their end: that last window answers for the run
                kind = RemoteStreamEndSubmodule if seg.takes else RemoteSubmodule
                self.submodules[seg.name] = kind(seg.name, seg.rank, SEGMENT_BATCH)
                self.engines[seg.name] = SEGMENT_ENGINE.format(rank=seg.rank)

    def validate_inputs(self, inputs: Mapping[str, Any]) -> None:
        self.inner.validate_inputs(inputs)

    def initial_walk(self, request: RequestContext) -> str:
        return self.inner.initial_walk(request)

    def next_walk(self, request: RequestContext, finished_walk: str,
                  persisted: Mapping[str, Any]) -> Optional[str]:
        walk = self.inner.next_walk(request, finished_walk, persisted)
        if self.kv_moves is not None:  # before the walk starts: its K/V may live elsewhere
            self.kv_moves.begin(request, finished_walk, walk)
        return walk

    def next_part_walk(self, request: RequestContext, part: str,
                       finished: Optional[str]) -> Optional[str]:
        return self.inner.next_part_walk(request, part, finished)


def _stand_in(node: str, rank: int, sub: NodeSubmodule) -> RemoteSubmodule:
    kind = RemoteStreamEndSubmodule if hears_stream_end(sub) else RemoteSubmodule
    return kind(node, rank, max(1, int(getattr(sub, "max_batch", 1))))


class RemoteEngine(Engine):
    """Feeds a worker's engine: pulls batches from the parent's Conductor in its usual order
    (deadline, priority, arrival) and hands them to the worker link at once, so the worker's
    engine sees everything ready (continuous batching works across the boundary). Results come
    back through the link's receiver, which reports them to the Conductor."""

    def __init__(self, link: "WorkerLink") -> None:
        super().__init__(None)
        self.link = link

    def serve(self) -> None:
        host = self.host
        assert host is not None
        queue, engine, poll = host.queue, self.engine_id, host.poll_s
        max_batch = self.max_batch
        while not host.closed:
            batch = queue.next_batch(engine, max_batch, poll)
            if batch is None:
                continue
            self.link.send_batch(*batch)
            del batch  # its values (a worker's exports among them) are not this thread's to keep

    def release(self, request_id: int) -> None:
        self.link.release(request_id)

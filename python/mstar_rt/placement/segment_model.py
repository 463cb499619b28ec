"""What a worker's segment Runtime serves (placement/segments.py, segment_runner.py): the nodes
of its segments with the worker's submodules, one walk per segment, and a source node per
stream entering one (placement/stream_in.py)."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Optional, Sequence

from mstar_rt.graph import EMIT, GraphEdge, GraphNode, Parallel, StreamingGraphEdge
from mstar_rt.model import Model, node_engines, node_submodules
from mstar_rt.placement.segments import Segment
from mstar_rt.placement.stream_in import (STREAM_IN_ENGINE, SourceSubmodule, StreamInEngine,
                                          source_name)


class SegmentModel(Model):
    """What a worker's in-process Runtime serves for its ``segments`` (one, or those sharing a
    stateful engine): their nodes (with the worker's submodules), one walk per segment (its
    section), their inputs (those a run does not read default to None).
    An edge to a node outside every segment of its node becomes a plain output.
    ``bind(request)`` runs in ``submit`` and returns the run's segment (it gives the run the
    worker's context of the request); ``capture(request, outputs)`` gets the segment's outputs
    at its end."""

    def __init__(self, model: Model, segments: Sequence[Segment],
                 bind: Callable[[Any], Segment], capture: Callable[[Any, dict], None]) -> None:
        subs, engines = node_submodules(model), node_engines(model)
        near = {n: set() for s in segments for n in s.nodes}  # node -> nodes it shares a run with
        for s in segments:
            for n in s.nodes:
                near[n] |= set(s.nodes)
        # What a run hands back must outlive its walk's end, which keeps persisted values
        # only: the segments' outputs are persisted here.
        keep = {o if isinstance(o, str) else o.name for s in segments for o in s.outputs}

        def edge(o: Any, node: str) -> Any:
            if isinstance(o, StreamingGraphEdge):  # leaving: each item goes out as made
                return o if o.to in near[node] else GraphEdge(EMIT, o.name)
            if not isinstance(o, str) and o.to == EMIT:
                return o
            name = o if isinstance(o, str) else o.name
            persist = name in keep or (not isinstance(o, str) and o.persist)
            if isinstance(o, str):
                return GraphEdge("", o, True) if persist else o
            return GraphEdge(o.to if o.to in near[node] else "", name, persist)

        self.nodes = [dataclasses.replace(
            n, outputs=tuple(dict.fromkeys(edge(o, n.name) for o in n.outputs)),
            submodule=subs[n.name], engine=engines[n.name])
            for n in model.nodes if n.name in near]
        # A stream entering a segment comes from a source node beside its section, which
        # stands for the producer (placement/stream_in.py).
        sources = {s.name: [GraphNode(source_name(s.name, e.name), (), (e,),
                                      submodule=SourceSubmodule(), engine=STREAM_IN_ENGINE)
                            for _, e in s.takes] for s in segments}
        self.nodes += [n for s in segments for n in sources[s.name]]
        # A run's walk has the parent's walk name (its errors then read as in one process),
        # unless two of these segments share it.
        walks = [s.walk for s in segments]
        self._walk = {s.name: s.walk if walks.count(s.walk) == 1 else s.name for s in segments}
        self.walks = {self._walk[s.name]: (Parallel(*(n.name for n in sources[s.name]), s.section)
                                           if s.takes else s.section) for s in segments}
        self.inputs = tuple(dict.fromkeys(x for s in segments for x in s.inputs))
        if len(segments) > 1:
            self.input_defaults = {x: None for x in self.inputs}
        self.engine_specs = {e: model.engine_specs[e] for s in segments for e in s.engines}
        if any(s.takes for s in segments):
            self.engine_specs[STREAM_IN_ENGINE] = StreamInEngine()
        self._bind, self._capture, self._model = bind, capture, model
        self._out_names = {self._walk[s.name]: {o if isinstance(o, str) else o.name
                                                for o in s.outputs} for s in segments}

    def initial_walk(self, request: Any) -> str:
        return self._walk[self._bind(request).name]

    def next_part_walk(self, request: Any, part: str, finished: Optional[str]) -> Optional[str]:
        """The model's own choice: a segment with Parts is a whole walk (its run keeps the
        walk's name) and its run's context is the request's (inputs, state)."""
        return self._model.next_part_walk(request, part, finished)

    def next_walk(self, request: Any, finished_walk: str, persisted: Mapping[str, Any]
                  ) -> Optional[str]:
        names = self._out_names[finished_walk]
        self._capture(request, {x: v for x, v in persisted.items() if x in names})
        return None


__all__ = ["SegmentModel"]

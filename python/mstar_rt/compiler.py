"""Lowers a model's graph and walks (the DSL of :mod:`mstar_rt.graph`) into the graph compiler.

The compiler is C++ (``mstar::GraphBuilder``, bound as ``_core.GraphBuilder``): it holds every rule
about a graph's structure and its message, and C++ models (``mstar::Model``) use the same one, so
a malformed graph fails with the same :class:`GraphError` in either language. What is left here is
turning Python objects into builder calls, and refusing the objects that cannot be turned into
one (something that is not a node or a section, a loop count that is not an integer).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

from mstar_rt import _core
from mstar_rt.graph import (
    DynamicLoop,
    GraphEdge,
    GraphError,
    GraphNode,
    Loop,
    Output,
    Parallel,
    SectionLike,
    Sequential,
    StreamingGraphEdge,
)


@dataclass
class CompiledGraph:
    """The IR the C++ Conductor takes (``spec``), and the id maps the runtime needs."""

    spec: _core.GraphSpec
    names: list[str]
    engines: list[str]
    nodes: list[tuple]  # (name, engine id, max_batch, input ids, output ids, on_stream_end)
    node_ids: dict[str, int]
    walk_ids: dict[str, int]
    name_ids: dict[str, int]
    node_outputs: list[tuple[str, ...]]
    node_inputs: list[tuple[str, ...]]

    @classmethod
    def of(cls, spec: _core.GraphSpec) -> "CompiledGraph":
        names = spec.names
        nodes = spec.nodes
        return cls(spec=spec, names=names, engines=spec.engines, nodes=nodes,
                   node_ids={n[0]: i for i, n in enumerate(nodes)},
                   walk_ids={w: i for i, w in enumerate(spec.walk_names)},
                   name_ids={x: i for i, x in enumerate(names)},
                   node_outputs=[tuple(spec.node_outputs(i)) for i in range(len(nodes))],
                   node_inputs=[tuple(spec.node_inputs(i)) for i in range(len(nodes))])


def _edge(out: Output) -> _core.Edge:
    if isinstance(out, StreamingGraphEdge):
        return _core.Edge.stream(out.to, out.name, out.chunk_policy)
    if isinstance(out, GraphEdge):
        return _core.Edge(out.to, out.name, out.persist)
    return _core.Edge.output(out)


def _section(s: SectionLike, walk: str) -> _core.Section:
    if isinstance(s, str):
        return _core.Section(s)
    if isinstance(s, Sequential):
        return _core.Section.seq([_section(p, walk) for p in s.parts])
    if isinstance(s, Parallel):
        return _core.Section.par([_section(b, walk) for b in s.branches])
    if isinstance(s, Loop):
        # The builder holds loop counts as C++ integers; a count that is not one cannot reach it.
        label = f"DynamicLoop '{s.name}'" if isinstance(s, DynamicLoop) else "Loop"
        if not isinstance(s.max_iters, int):
            raise GraphError(f"{label} in walk '{walk}' has max_iters={s.max_iters!r}; it must be "
                             "an integer")
        body = _section(s.section, walk)
        if isinstance(s, DynamicLoop):
            return _core.Section.dynamic_loop(s.name, body, s.max_iters, list(s.outputs),
                                              list(s.accumulated_outputs))
        return _core.Section.loop(body, s.max_iters, list(s.outputs), list(s.accumulated_outputs))
    raise GraphError(f"{s!r} is not a section; use a node name, Sequential, Parallel, Loop or "
                     "DynamicLoop")


def compile_graph(nodes: Sequence[GraphNode], walks: Mapping[str, SectionLike],
                  inputs: Sequence[str], engine_of: Mapping[str, str],
                  max_batch_of: Mapping[str, int],
                  stream_end_nodes: frozenset[str] = frozenset()) -> CompiledGraph:
    """Validates ``(G, W)`` and builds the IR. Raises :class:`GraphError` naming the problem.
    ``stream_end_nodes``: stream consumers told when their stream ends without a window marked
    last (:meth:`mstar_rt.NodeSubmodule.end_stream`)."""
    builder = _core.GraphBuilder()
    for x in inputs:
        builder.input(x)
    for n in nodes:
        if not isinstance(n, GraphNode):
            raise GraphError(f"{n!r} is not a GraphNode")
        builder.node(n.name, list(n.inputs), [_edge(o) for o in n.outputs],
                     engine_of.get(n.name, "default"), int(max_batch_of.get(n.name, 1)),
                     n.name in stream_end_nodes)
    for name, root in walks.items():
        builder.walk(name, _section(root, name))
    return CompiledGraph.of(builder.compile())

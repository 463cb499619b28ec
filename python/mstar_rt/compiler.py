"""Validates a model's graph and walks and compiles them into the C++ graph IR."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Sequence

from mstar_rt.graph import (
    EMIT,
    DynamicLoop,
    GraphEdge,
    GraphError,
    GraphNode,
    Loop,
    Parallel,
    SectionLike,
    Sequential,
    StreamingGraphEdge,
)


@dataclass
class CompiledGraph:
    """The IR lists the C++ Conductor takes, plus the id maps the runtime needs."""

    names: list[str]
    engines: list[str]
    nodes: list[tuple]
    walks: list[dict]
    node_ids: dict[str, int]
    walk_ids: dict[str, int]
    name_ids: dict[str, int]
    node_outputs: list[tuple[str, ...]] = field(default_factory=list)
    node_inputs: list[tuple[str, ...]] = field(default_factory=list)


class _Names:
    def __init__(self) -> None:
        self.ids: dict[str, int] = {}

    def __call__(self, name: str) -> int:
        if name not in self.ids:
            self.ids[name] = len(self.ids)
        return self.ids[name]


def _nodes_in(section: SectionLike) -> list[str]:
    if isinstance(section, str):
        return [section]
    if isinstance(section, Sequential):
        return [n for p in section.parts for n in _nodes_in(p)]
    if isinstance(section, Parallel):
        return [n for b in section.branches for n in _nodes_in(b)]
    if isinstance(section, Loop):
        return _nodes_in(section.section)
    raise GraphError(f"{section!r} is not a section; use a node name, Sequential, Parallel, Loop "
                     "or DynamicLoop")


def _loop_levels(section: SectionLike, loop: int = 0, counter: list[int] | None = None) -> dict[str, int]:
    """node -> an id of its innermost enclosing loop (0 outside loops)."""
    counter = counter if counter is not None else [0]
    if isinstance(section, str):
        return {section: loop}
    out: dict[str, int] = {}
    if isinstance(section, Loop):
        counter[0] += 1
        return _loop_levels(section.section, counter[0], counter)
    parts = section.parts if isinstance(section, Sequential) else section.branches  # type: ignore[union-attr]
    for p in parts:
        out.update(_loop_levels(p, loop, counter))
    return out


def _paths(section: SectionLike, prefix: tuple = ()) -> dict[str, tuple]:
    """node -> its path from the root: ((section id, kind, child index), ...)."""
    if isinstance(section, str):
        return {section: prefix}
    out: dict[str, tuple] = {}
    if isinstance(section, Loop):
        return _paths(section.section, prefix + ((id(section), "loop", 0),))
    kind = "sequential" if isinstance(section, Sequential) else "parallel"
    parts = section.parts if isinstance(section, Sequential) else section.branches  # type: ignore[union-attr]
    for i, p in enumerate(parts):
        out.update(_paths(p, prefix + ((id(section), kind, i),)))
    return out


def _check_stream_placement(walk: str, producer: str, consumer: str, root: SectionLike) -> None:
    """A consumer's windows can only run once the walk reaches it, and it ends with the stream:
    it must not come before its producer, nor sit inside the loop that feeds it."""
    paths = _paths(root)
    a, b = paths[producer], paths[consumer]
    common = 0
    while common < min(len(a), len(b)) and a[common] == b[common]:
        common += 1
    loops = [step[0] for step in a if step[1] == "loop"]
    if loops and any(step[0] == loops[-1] for step in b):
        raise GraphError(f"node '{consumer}' consumes the stream of '{producer}' inside the same "
                         f"Loop in walk '{walk}', but the stream ends only when that loop does; "
                         f"place '{consumer}' after the loop or in a Parallel with it")
    if common < min(len(a), len(b)):
        section_id, kind, i_prod = a[common]
        i_cons = b[common][2]
        if kind == "sequential" and i_cons < i_prod:
            raise GraphError(f"node '{consumer}' consumes the stream of '{producer}' but runs "
                             f"before it in walk '{walk}' and would wait forever; move it after "
                             f"'{producer}' or put both in a Parallel")


class _WalkCompiler:
    def __init__(self, walk: str, root: SectionLike, graph: Mapping[str, GraphNode],
                 inputs: Sequence[str], persisted: set[str], names: _Names,
                 node_ids: Mapping[str, int]) -> None:
        self.walk = walk
        self.node_ids = node_ids
        self.graph = graph
        self.names = names
        self.sections: list[dict] = []
        self.persisted = persisted
        self.loop_names: set[str] = set()
        members = _nodes_in(root)
        for n in members:
            if n not in graph:
                raise GraphError(f"walk '{walk}' runs node '{n}', which is not in the graph; add "
                                 f"GraphNode('{n}', ...) to the model's nodes or fix the name")
        seen: set[str] = set()
        for n in members:
            if n in seen:
                raise GraphError(f"node '{n}' appears twice in walk '{walk}'; a node runs at most "
                                 "once per place: use a Loop to repeat it")
            seen.add(n)
        self.members = seen
        # Who produces what in this walk. Two producers of one name are allowed only in different
        # loop levels (an initial value outside a loop, overwritten inside it every iteration).
        level = _loop_levels(root)
        self.producer: dict[str, str] = {}
        by_level: dict[tuple[str, int], str] = {}
        for n in members:
            for out in graph[n].output_names:
                other = by_level.get((out, level[n]))
                if other is not None:
                    raise GraphError(f"output '{out}' is produced by both '{other}' and '{n}' in "
                                     f"walk '{walk}'; rename one of them")
                by_level[(out, level[n])] = n
                self.producer.setdefault(out, n)
        # Streams: consumer -> the name it reads as windows.
        self.stream_input: dict[str, str] = {}
        self.streams: list[tuple[str, str, str, object]] = []
        for n in members:
            for out in graph[n].outputs:
                if isinstance(out, StreamingGraphEdge):
                    if out.to not in self.members:
                        raise GraphError(f"streaming edge '{out.name}' from '{n}' goes to "
                                         f"'{out.to}', which walk '{walk}' does not run; add "
                                         f"'{out.to}' to the walk")
                    if out.to in self.stream_input:
                        raise GraphError(f"node '{out.to}' consumes two streams in walk '{walk}'; "
                                         "a node reads at most one stream")
                    self.stream_input[out.to] = out.name
                    self.streams.append((n, out.name, out.to, out.chunk_policy))
                    _check_stream_placement(walk, n, out.to, root)
        self.scope_of: dict[str, int] = {}  # producer node -> section that ends its stream
        self.accumulated: set[str] = set()  # names some loop compiled so far accumulates
        self.kept_inside: dict[str, str] = {}  # name made inside a loop and dropped after it
        self.available0 = set(inputs) | persisted
        self.root = self._compile(root, set(self.available0), [], "walk")[0]

    # Each _compile returns (section index, names available after it).
    def _compile(self, s: SectionLike, available: set[str], loops: list[int],
                 where: str) -> tuple[int, set[str]]:
        if isinstance(s, str):
            return self._node(s, available, loops)
        index = len(self.sections)
        entry = dict(kind="", node=0, children=[], max_iters=1, dynamic=False, loop_name=0,
                     outputs=[], accumulated=[], scoped=[])
        self.sections.append(entry)
        if isinstance(s, Sequential):
            entry["kind"] = "sequential"
            avail = set(available)
            for part in s.parts:
                child, avail = self._compile(part, avail, loops, "Sequential")
                entry["children"].append(child)
            return index, avail
        if isinstance(s, Parallel):
            entry["kind"] = "parallel"
            after = set(available)
            for branch in s.branches:
                child, b_after = self._compile(branch, available, loops, "Parallel")
                entry["children"].append(child)
                after = (after - (available - b_after)) | (b_after - available)
            return index, after
        if isinstance(s, Loop):
            return self._loop(s, index, entry, available, loops)
        raise GraphError(f"walk '{self.walk}': {s!r} is not a section")

    def _loop(self, s: Loop, index: int, entry: dict, available: set[str],
              loops: list[int]) -> tuple[int, set[str]]:
        kind = "DynamicLoop" if isinstance(s, DynamicLoop) else "Loop"
        label = f"{kind} '{s.name}'" if isinstance(s, DynamicLoop) else kind
        if not isinstance(s.max_iters, int) or s.max_iters < 1:
            raise GraphError(f"{label} in walk '{self.walk}' has max_iters={s.max_iters!r}; it "
                             "must be an integer >= 1")
        both = set(s.outputs) & set(s.accumulated_outputs)
        if both:
            raise GraphError(f"{label} in walk '{self.walk}' lists {sorted(both)} as both an output "
                             "and an accumulated output; choose one (last value or every value)")
        inside = {o for n in _nodes_in(s.section) for o in self.graph[n].output_names}
        for name in [*s.outputs, *s.accumulated_outputs]:
            if name not in inside:
                raise GraphError(f"{label} in walk '{self.walk}' lists '{name}' as an output, but "
                                 "no node inside it produces that; fix the name or add the node")
        entry.update(kind="loop", max_iters=s.max_iters,
                     outputs=[self.names(n) for n in s.outputs],
                     accumulated=[self.names(n) for n in s.accumulated_outputs])
        if isinstance(s, DynamicLoop):
            if not s.name:
                raise GraphError(f"a DynamicLoop in walk '{self.walk}' needs a name: check_stop "
                                 "stops loops by name")
            if s.name in self.loop_names:
                raise GraphError(f"two DynamicLoops named '{s.name}' in walk '{self.walk}'; names "
                                 "must be unique within a walk")
            self.loop_names.add(s.name)
            entry.update(dynamic=True, loop_name=self.names(s.name))
        child, _ = self._compile(s.section, available, loops + [index], label)
        entry["children"] = [child]
        for name in s.accumulated_outputs:  # inner loops are compiled by now
            if name in self.accumulated:
                raise GraphError(f"{label} in walk '{self.walk}' accumulates '{name}', which an "
                                 "inner Loop already accumulates; nested accumulation is not "
                                 "supported: accumulate it in one of the two loops")
        self.accumulated |= set(s.accumulated_outputs)
        kept = set(s.outputs) | set(s.accumulated_outputs) | (inside & self.persisted)
        scoped = inside - kept
        for name in scoped:
            self.kept_inside.setdefault(name, label)
        entry["scoped"] = sorted(self.names(n) for n in scoped)
        return index, (available - scoped) | kept

    def _node(self, name: str, available: set[str], loops: list[int]) -> tuple[int, set[str]]:
        node = self.graph[name]
        index = len(self.sections)
        self.sections.append(dict(kind="node", node=self.node_ids[name], children=[], max_iters=1,
                                  dynamic=False,
                                  loop_name=0, outputs=[], accumulated=[], scoped=[]))
        self.scope_of[name] = loops[-1] if loops else index
        for x in node.inputs:
            if x == self.stream_input.get(name) or x in available:
                continue
            if x in self.kept_inside:
                raise GraphError(
                    f"node '{name}' in walk '{self.walk}' reads '{x}', which is made inside a "
                    f"{self.kept_inside[x]} and stays there; list '{x}' in that loop's outputs or "
                    "accumulated_outputs")
            p = self.producer.get(x)
            if p is not None and p != name:
                raise GraphError(
                    f"node '{name}' in walk '{self.walk}' reads '{x}', which '{p}' produces only "
                    f"later or in a parallel branch (a cycle outside a loop?); run '{p}' first, "
                    "or put both in a Loop")
            if p == name:
                raise GraphError(
                    f"node '{name}' in walk '{self.walk}' reads its own output '{x}' with no value "
                    "for the first run; give it one (a request input or an earlier node) and put "
                    "the node in a Loop")
            raise GraphError(f"node '{name}' in walk '{self.walk}' reads '{x}', which no node "
                             f"produces; add an edge named '{x}' or rename the input")
        return index, available | set(node.output_names)


def compile_graph(nodes: Sequence[GraphNode], walks: Mapping[str, SectionLike],
                  inputs: Sequence[str], engine_of: Mapping[str, str],
                  max_batch_of: Mapping[str, int],
                  stream_end_nodes: frozenset[str] = frozenset()) -> CompiledGraph:
    """Validates ``(G, W)`` and builds the IR. Raises :class:`GraphError` naming the problem.
    ``stream_end_nodes``: stream consumers told when their stream ends without a window marked
    last (:meth:`mstar_rt.NodeSubmodule.end_stream`)."""
    graph: dict[str, GraphNode] = {}
    for n in nodes:
        if not isinstance(n, GraphNode):
            raise GraphError(f"{n!r} is not a GraphNode")
        if n.name in graph:
            raise GraphError(f"two nodes are named '{n.name}'; node names must be unique")
        graph[n.name] = n
    if not walks:
        raise GraphError("the model has no walks; add at least one")
    for n in graph.values():
        for out in n.outputs:
            if isinstance(out, (GraphEdge, StreamingGraphEdge)) and out.to != EMIT:
                if out.to not in graph:
                    raise GraphError(f"edge '{out.name}' from '{n.name}' goes to '{out.to}', which "
                                     "is not a node; use an existing node or EMIT")
                if out.name not in graph[out.to].inputs:
                    raise GraphError(f"edge '{out.name}' from '{n.name}' goes to '{out.to}', which "
                                     f"does not read '{out.name}'; add it to {out.to}'s inputs")
            if isinstance(out, StreamingGraphEdge) and out.to == EMIT:
                raise GraphError(f"streaming edge '{out.name}' from '{n.name}' goes to EMIT; stream "
                                 "to a consumer node, or use GraphEdge(EMIT, ...) to emit each value")
    persisted = {o.name for n in graph.values() for o in n.outputs
                 if isinstance(o, GraphEdge) and o.persist}
    names = _Names()
    for x in inputs:
        names(x)
    for n in graph.values():
        for x in (*n.inputs, *n.output_names):
            names(x)
    engines: list[str] = []
    node_ids = {n: i for i, n in enumerate(graph)}
    ir_nodes = []
    for n in graph.values():
        engine = engine_of.get(n.name, "default")
        if engine not in engines:
            engines.append(engine)
        ir_nodes.append((n.name, engines.index(engine), int(max_batch_of.get(n.name, 1)),
                         [names(x) for x in n.inputs], [names(x) for x in n.output_names],
                         n.name in stream_end_nodes))
    ir_walks = []
    for wname, root in walks.items():
        wc = _WalkCompiler(wname, root, graph, inputs, persisted, names, node_ids)
        emits, persist = [], []
        for n in wc.members:
            for out in graph[n].outputs:
                if isinstance(out, GraphEdge) and out.to == EMIT:
                    emits.append((node_ids[n], names(out.name)))
                if isinstance(out, GraphEdge) and out.persist and names(out.name) not in persist:
                    persist.append(names(out.name))
        streams = [(node_ids[p], names(x), node_ids[c], policy, wc.scope_of[p])
                   for p, x, c, policy in wc.streams]
        ir_walks.append(dict(name=wname, root=wc.root, sections=wc.sections, emits=emits,
                             persist=persist, streams=streams))
    return CompiledGraph(
        names=list(names.ids), engines=engines, nodes=ir_nodes, walks=ir_walks,
        node_ids=node_ids, walk_ids={w: i for i, w in enumerate(walks)}, name_ids=dict(names.ids),
        node_outputs=[n.output_names for n in graph.values()],
        node_inputs=[tuple(n.inputs) for n in graph.values()])

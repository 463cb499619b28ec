"""Lowers a model's graph and walks (the DSL of :mod:`mstar_rt.graph`) into the graph compiler.

The compiler is C++ (``mstar::GraphBuilder``, bound as ``_core.GraphBuilder``): it holds every rule
about a graph's structure and its message, and C++ models (``mstar::Model``) use the same one, so
a malformed graph fails with the same :class:`GraphError` in either language. What is left here is
turning Python objects into builder calls, and refusing the objects that cannot be turned into
one (something that is not a node or a section, a loop count that is not an integer or does not
fit the builder's 64 bits, a max_batch outside its 32, a walk nested deeper than
:data:`~mstar_rt.graph.MAX_SECTION_DEPTH` or containing itself) with a :class:`GraphError` that
names the walk or node, where the bound builder would raise a TypeError that names neither.
Walks are lowered with an explicit stack, not recursion, so no walk raises RecursionError.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Optional, Sequence

from mstar_rt import _core
from mstar_rt.graph import (
    MAX_SECTION_DEPTH,
    MAX_WALK_SECTIONS,
    ChunkPolicy,
    DynamicLoop,
    GraphEdge,
    GraphError,
    GraphNode,
    Loop,
    Output,
    Parallel,
    Part,
    SectionLike,
    Sequential,
    StreamingGraphEdge,
)
from mstar_rt.model import Model, NodeSubmodule, hears_stream_end, node_engines, node_submodules


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
    #: (walk, Part name) -> the keys of its sub-walks, in declaration order (child indices)
    parts: dict[tuple[str, str], tuple[str, ...]] = field(default_factory=dict)

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


# What the builder's integer parameters hold (C++ std::int64_t max_iters, std::uint32_t max_batch).
_INT64_MIN, _INT64_MAX = -2**63, 2**63 - 1
_UINT32_MAX = 2**32 - 1


def _edge(out: Output, node: str) -> _core.Edge:
    if isinstance(out, StreamingGraphEdge):
        if not isinstance(out.chunk_policy, ChunkPolicy):
            raise GraphError(f"streaming edge '{out.name}' from '{node}' has chunk_policy "
                             f"{out.chunk_policy!r}; use Fixed, SlidingWindow, LeftContext or Ramp")
        if type(out.continue_after_done) is not bool:
            raise GraphError(f"streaming edge '{out.name}' from '{node}' has continue_after_done "
                             f"{out.continue_after_done!r}; use True or False")
        return _core.Edge.stream(out.to, out.name, out.chunk_policy, out.continue_after_done)
    if isinstance(out, GraphEdge):
        return _core.Edge(out.to, out.name, out.persist)
    return _core.Edge.output(out)


def _loop_count(s: Loop, label: str, walk: str) -> int:
    """``s.max_iters`` as an int the builder takes. An integer (any object with ``__index__``,
    but not a bool) within 64 bits goes as it is: the builder refuses one below 1 or above
    4294967295 itself, in its own words and in its order of checks; one beyond 64 bits cannot
    reach it, so it is refused here."""
    n = s.max_iters
    try:
        count = None if isinstance(n, bool) else operator.index(n)
    except TypeError:
        count = None
    if count is None:
        raise GraphError(f"{label} in walk '{walk}' has max_iters={n!r}; it must be an integer")
    if not _INT64_MIN <= count <= _INT64_MAX:
        raise GraphError(f"{label} in walk '{walk}' has max_iters={count}; it must be an integer "
                         f"from 1 to {_UINT32_MAX}")
    return count


def _loop_names(s: Loop, label: str, walk: str) -> None:
    """GraphError, naming the loop and walk, for a DynamicLoop name that is no string and for
    ``outputs`` / ``accumulated_outputs`` that are no list of names: a lone string would be read
    as its letters, and the builder's own TypeError names neither loop nor walk."""
    if isinstance(s, DynamicLoop) and not isinstance(s.name, str):
        raise GraphError(f"a DynamicLoop in walk '{walk}' is named {s.name!r}; name it with a "
                         "string (check_stop stops loops by name)")
    for key in ("outputs", "accumulated_outputs"):
        value = getattr(s, key)
        if isinstance(value, (str, bytes)):
            raise GraphError(f"{label} in walk '{walk}' has {key}={value!r}; give a list, even "
                             f"of one: {key}=[{value!r}]")
        if isinstance(value, (list, tuple)) and not all(isinstance(x, str) and x for x in value):
            raise GraphError(f"{label} in walk '{walk}' has {key}={value!r}; give a list of the "
                             "value names made inside the loop")


def _part_walks(s: Part, walk: str) -> tuple[tuple[str, ...], tuple[Any, ...]]:
    """A Part's keys and sub-walks; GraphError naming the Part and walk for what is not a
    non-empty map of str keys."""
    if not isinstance(s.name, str) or not s.name:
        raise GraphError(f"a Part in walk '{walk}' has name {s.name!r}; name it with a non-empty "
                         "str (the model's next_part_walk is asked by it)")
    if not isinstance(s.walks, Mapping):
        raise GraphError(f"Part '{s.name}' in walk '{walk}' has walks {s.walks!r}; give a dict "
                         "of sub-walks by name")
    if not s.walks:
        raise GraphError(f"Part '{s.name}' in walk '{walk}' has no walks; give it at least one")
    for k in s.walks:
        if not isinstance(k, str) or not k:
            raise GraphError(f"Part '{s.name}' in walk '{walk}' has a walk named {k!r}; name "
                             "each walk with a non-empty str")
    return tuple(s.walks), tuple(s.walks.values())


def _section(root: Any, walk: str,
             parts: Optional[dict[tuple[str, str], tuple[str, ...]]] = None) -> _core.Section:
    """Lowers one walk's section tree, depth first with an explicit stack: a section is built
    once its children are. A section object met again (used in two places) is built once, but
    counts once per place toward :data:`MAX_WALK_SECTIONS`, as the builder copies it to each."""
    parts_out = parts
    if isinstance(root, str):
        return _core.Section(root)
    built: dict[int, tuple[_core.Section, int, int]] = {}  # id -> (section, places, depth)
    path: set[int] = set()  # the sections between the root and the one being visited
    todo: list[tuple[Any, Any]] = [(root, None)]  # (section, None): visit; (section, how): build
    while todo:
        s, how = todo.pop()
        if how is not None:  # every child is built: build s
            path.discard(id(s))
            kind, children, count = how
            lowered = [(_core.Section(c), 1, 0) if isinstance(c, str) else built[id(c)]
                       for c in children]
            places = 1 + sum(c[1] for c in lowered)
            depth = 1 + max((c[2] for c in lowered), default=0)
            if places > MAX_WALK_SECTIONS:
                raise GraphError(f"walk '{walk}' has more than {MAX_WALK_SECTIONS} sections and "
                                 "node names, counting a section once per place it appears; a "
                                 "section object used in several places runs in each: build the "
                                 "walk so that it runs each node once")
            if depth > MAX_SECTION_DEPTH:
                raise _too_deep(walk)
            parts = [c[0] for c in lowered]
            if kind is Sequential:
                made = _core.Section.seq(parts)
            elif kind is Parallel:
                made = _core.Section.par(parts)
            elif kind is Part:
                keys = tuple(s.walks)
                made = _core.Section.part(s.name, list(zip(keys, parts)))
                if parts_out is not None:
                    parts_out[(walk, s.name)] = keys
            elif kind is DynamicLoop:
                made = _core.Section.dynamic_loop(s.name, parts[0], count, list(s.outputs),
                                                  list(s.accumulated_outputs))
            else:
                made = _core.Section.loop(parts[0], count, list(s.outputs),
                                          list(s.accumulated_outputs))
            built[id(s)] = (made, places, depth)
            continue
        if isinstance(s, str) or id(s) in built:
            continue
        if isinstance(s, Sequential):
            kind, children = Sequential, tuple(s.parts)
        elif isinstance(s, Parallel):
            kind, children = Parallel, tuple(s.branches)
        elif isinstance(s, Loop):
            kind, children = DynamicLoop if isinstance(s, DynamicLoop) else Loop, (s.section,)
        elif isinstance(s, Part):
            kind, children = Part, _part_walks(s, walk)[1]
        else:
            raise GraphError(f"{s!r} is not a section; use a node name, Sequential, Parallel, "
                             "Loop, DynamicLoop or Part")
        if id(s) in path:
            raise GraphError(f"walk '{walk}' has a {type(s).__name__} inside itself; a section "
                             "cannot contain itself")
        if len(path) >= MAX_SECTION_DEPTH:
            raise _too_deep(walk)
        count = 0
        if kind is Loop or kind is DynamicLoop:
            # The builder holds loop counts as C++ integers; what is not one cannot reach it.
            label = f"DynamicLoop '{s.name}'" if kind is DynamicLoop else "Loop"
            count = _loop_count(s, label, walk)
            _loop_names(s, label, walk)
        path.add(id(s))
        todo.append((s, (kind, children, count)))
        todo.extend((c, None) for c in reversed(children))
    return built[id(root)][0]


def _too_deep(walk: str) -> GraphError:
    return GraphError(f"walk '{walk}' nests sections more than {MAX_SECTION_DEPTH} deep, the most "
                      "allowed; flatten it: Sequential('a', 'b', 'c') runs what "
                      "Sequential(Sequential('a', 'b'), 'c') does")


def _max_batch(node: str, value: Any) -> int:
    """``value`` as the builder's max_batch (C++ std::uint32_t). 0 goes as it is: the builder
    refuses it in its own words."""
    try:
        count = int(value)
    except (TypeError, ValueError, OverflowError):
        count = -1
    if not 0 <= count <= _UINT32_MAX:
        raise GraphError(f"node '{node}' has max_batch {value!r}; it must be an integer from 1 "
                         f"to {_UINT32_MAX}")
    return count


def compile_graph(nodes: Sequence[GraphNode], walks: Mapping[str, SectionLike],
                  inputs: Sequence[str], engine_of: Mapping[str, str],
                  max_batch_of: Mapping[str, int],
                  stream_end_nodes: frozenset[str] = frozenset(),
                  untimed_nodes: frozenset[str] = frozenset(),
                  elsewhere: frozenset[str] = frozenset()) -> CompiledGraph:
    """Validates ``(G, W)`` and builds the IR. Raises :class:`GraphError` naming the problem.
    ``stream_end_nodes``: stream consumers told when their stream ends without a window marked
    last (:meth:`mstar_rt.NodeSubmodule.end_stream`); ``untimed_nodes``: nodes whose items are
    held open, not run (a StreamInput's source), which deadline estimates leave out;
    ``elsewhere``: nodes that run outside the walks (Model.nodes_elsewhere), which may sit in
    no walk."""
    if isinstance(inputs, (str, bytes)) or not isinstance(inputs, Iterable) or \
            not all(isinstance(x, str) and x for x in inputs):
        raise GraphError(f"the model's inputs are {inputs!r}; give a list of the value names a "
                         "request brings, e.g. inputs = ('image', 'prompt')")
    if not isinstance(walks, Mapping):
        raise GraphError(f"the model's walks are a {type(walks).__name__}; give a dict of walk "
                         "name -> section, e.g. walks = {'main': Sequential('a', 'b')}")
    for name in walks:
        if not isinstance(name, str) or not name:
            raise GraphError(f"the model has a walk named {name!r}; name each walk with a "
                             "non-empty string")
    builder = _core.GraphBuilder()
    for x in inputs:
        builder.input(x)
    for n in nodes:
        if not isinstance(n, GraphNode):
            raise GraphError(f"{n!r} is not a GraphNode")
        builder.node(n.name, list(n.inputs), [_edge(o, n.name) for o in n.outputs],
                     engine_of.get(n.name, "default"),
                     _max_batch(n.name, max_batch_of.get(n.name, 1)), n.name in stream_end_nodes,
                     n.name in untimed_nodes)
    parts: dict[tuple[str, str], tuple[str, ...]] = {}
    for name, root in walks.items():
        builder.walk(name, _section(root, name, parts))
    for n in elsewhere:
        builder.elsewhere(n)
    compiled = CompiledGraph.of(builder.compile())
    compiled.parts = parts
    return compiled


def _submodule_batch(sub: NodeSubmodule) -> Any:
    """A submodule's max_batch, below 1 taken for 1; what is no integer goes as it is, for
    compile_graph to refuse naming the node."""
    value = getattr(sub, "max_batch", 1)
    try:
        return max(1, int(value))
    except (TypeError, ValueError, OverflowError):
        return value


#: What the runtime calls on a node's submodule; NodeSubmodule has them all.
_SUBMODULE_METHODS = ("forward", "prepare_inputs", "check_stop", "split_batch", "end_stream",
                      "cleanup")


def _check_submodule(node: str, sub: Any) -> None:
    """GraphError, naming the node, for a submodule that cannot run: a class (its forward would
    be called unbound, failing every request) or an object without NodeSubmodule's methods."""
    if isinstance(sub, type):
        raise GraphError(f"node '{node}' has submodule {sub.__name__}, a class; pass an object: "
                         f"submodule={sub.__name__}(...)")
    lacking = [m for m in _SUBMODULE_METHODS if not callable(getattr(sub, m, None))]
    if lacking:
        raise GraphError(f"node '{node}' has submodule {sub!r}, which is not a NodeSubmodule "
                         f"(it has no {', '.join(lacking)}); subclass mstar_rt.NodeSubmodule "
                         "and override forward")


def compile_model(model: Model) -> CompiledGraph:
    """Validates the model's graph and walks (GraphError on problems) and builds the IR."""
    if isinstance(model, type):  # its methods would be called unbound, failing each request
        raise TypeError(f"{model.__name__} is a class; pass a model object: {model.__name__}()")
    if not isinstance(model, Model):
        raise TypeError(f"a {type(model).__name__} is not a model; subclass mstar_rt.Model")
    if isinstance(model.nodes, (GraphNode, str, bytes)) or not isinstance(model.nodes, Iterable):
        raise GraphError(f"{type(model).__name__}.nodes is a {type(model.nodes).__name__}; give "
                         "a list of GraphNodes")
    for n in model.nodes:
        if not isinstance(n, GraphNode):
            raise GraphError(f"{n!r} in {type(model).__name__}.nodes is not a GraphNode")
    subs = node_submodules(model)
    missing = [n.name for n in model.nodes if n.name not in subs]
    if missing:
        raise ValueError(f"model {type(model).__name__} has no submodule for nodes {missing}; "
                         "give each GraphNode its submodule (GraphNode(..., submodule=...))")
    for n in model.nodes:
        _check_submodule(n.name, subs[n.name])
    batch = {n: _submodule_batch(s) for n, s in subs.items()}
    batch.update({n.name: n.max_batch for n in model.nodes if n.max_batch is not None})
    return compile_graph(model.nodes, model.walks, model.inputs, node_engines(model), batch,
                         frozenset(n for n, s in subs.items() if hears_stream_end(s)),
                         frozenset(n for n, s in subs.items() if getattr(s, "untimed", False)),
                         frozenset(model.nodes_elsewhere))

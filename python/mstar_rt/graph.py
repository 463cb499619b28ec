"""The graph DSL: nodes, edges and the sections that make a walk.

A model is a graph ``G`` of :class:`GraphNode` s and a set ``W`` of named walks, each a section
tree over those nodes: :class:`Sequential`, :class:`Parallel`, :class:`Loop` and
:class:`DynamicLoop`, closed under nesting. Data flows by name: a node fires once every name it
reads has a value, and its outputs give names new values. :class:`GraphEdge` marks where an
output goes (another node, or :data:`EMIT` to stream it to the caller) and whether it persists
into the next walk; :class:`StreamingGraphEdge` turns an output into a stream that its consumer
reads in windows cut by a chunk policy.

A walk nests sections at most :data:`MAX_SECTION_DEPTH` deep (real models stay far below it);
the compiler refuses a deeper one, or a section that contains itself, with a :class:`GraphError`
naming the walk. Sections print and compare without recursion, so even such a walk can be shown.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any, Iterator, Mapping, Optional, Sequence, Union

# GraphError (a ValueError) is the graph compiler's (C++, mstar::GraphError): it raises it for a
# malformed graph or walk, and the DSL here for a malformed node.
from mstar_rt._core import ChunkPolicy, GraphError

EMIT = "EMIT"
"""Edge destination that streams an output to the caller (the request handle's iterator)."""

MAX_SECTION_DEPTH = 256
"""How deep a walk may nest sections (``Sequential(Sequential("a"))`` is 2 deep). Real models
nest fewer than 20; the compiler refuses a deeper walk with a :class:`GraphError`."""

MAX_WALK_SECTIONS = 1_000_000
"""How many sections and node names one walk may hold, counting a section object once per place
it appears: it bounds the work of compiling a walk whose sections share objects
(``s = Sequential(s, s)`` over and over doubles the walk each time)."""


@dataclass(frozen=True)
class GraphEdge:
    """Output ``name`` goes to node ``to`` (or :data:`EMIT`); ``persist`` keeps it for later walks."""

    to: str
    name: str
    persist: bool = False


@dataclass(frozen=True)
class StreamingGraphEdge:
    """Every execution of the producer appends output ``name`` as one item of a stream; node
    ``to`` runs on each window ``chunk_policy`` makes of it (and on the flushed tail).

    Where ``to`` sits says how it reads: outside any loop its producer is not in, one run of
    ``to`` takes every window of the stream as it comes; inside a loop its producer is not in
    (a decode loop fed by another loop), each run (each iteration) reads the next window,
    waiting for it. Such a consumer reading past the end of the stream fails the request,
    unless ``continue_after_done``: it then goes on with empty windows (marked ``last``), as
    Qwen3-Omni's talker goes on speaking after the thinker is done. A node may read several
    streams, each with its own policy: it runs when each has a window ready or is over."""

    to: str
    name: str
    chunk_policy: ChunkPolicy
    continue_after_done: bool = False


Output = Union[str, GraphEdge, StreamingGraphEdge]


@dataclass(frozen=True)
class GraphNode:
    """One component's forward pass: reads ``inputs`` by name, writes ``outputs``.

    A node is declared once, here: ``submodule`` runs it (a :class:`~mstar_rt.NodeSubmodule`),
    ``engine`` names the worker it runs on (default ``"default"``; nodes on one engine share its
    worker and state, e.g. prefill and decode on one KV cache) and ``max_batch`` caps its batches
    (default: the submodule's ``max_batch``, else 1). Older models give the first two as
    ``Model.submodules`` / ``Model.engines`` maps instead; both are read
    (:func:`mstar_rt.model.node_submodules`)."""

    name: str
    inputs: Sequence[str] = ()
    outputs: Sequence[Output] = ()
    submodule: Any = field(default=None, kw_only=True, compare=False)
    engine: Optional[str] = field(default=None, kw_only=True)
    max_batch: Optional[int] = field(default=None, kw_only=True)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str):
            raise GraphError(f"a node is named {self.name!r}; name it with a non-empty string")
        if not self.name or self.name == EMIT:
            raise GraphError(f"a node needs a name other than '' and {EMIT!r}")
        object.__setattr__(self, "inputs", _listed(self.name, "inputs", self.inputs))
        object.__setattr__(self, "outputs", _listed(self.name, "outputs", self.outputs))
        if self.engine is not None and (not isinstance(self.engine, str) or not self.engine):
            raise GraphError(f"node '{self.name}' has engine {self.engine!r}; name an engine "
                             "with a non-empty string")
        seen: set[str] = set()
        for x in self.inputs:
            if not isinstance(x, str) or not x:
                raise GraphError(f"node '{self.name}' reads {x!r}; inputs are value names "
                                 "(non-empty strings)")
            if x in seen:
                raise GraphError(f"node '{self.name}' reads '{x}' twice; list each input once")
            seen.add(x)
        for o in self.outputs:
            if not (isinstance(o, str) and o or isinstance(o, (GraphEdge, StreamingGraphEdge))):
                raise GraphError(f"node '{self.name}' has output {o!r}; an output is a value "
                                 "name (a string), a GraphEdge or a StreamingGraphEdge")

    @property
    def output_names(self) -> tuple[str, ...]:
        names: list[str] = []
        for o in self.outputs:
            n = o if isinstance(o, str) else o.name
            if n not in names:
                names.append(n)
        return tuple(names)


def _listed(node: str, what: str, value: Any) -> tuple:
    """A node's ``inputs`` or ``outputs`` as a tuple. A lone string would be read as its letters
    (``"image"`` as 'i', 'm', ...) and a lone edge is no list: both are refused, naming the fix."""
    if isinstance(value, (str, bytes, GraphEdge, StreamingGraphEdge)):
        raise GraphError(f"node '{node}' has {what}={value!r}; give a list, even of one: "
                         f"{what}=[{value!r}]")
    try:
        return tuple(value)
    except TypeError:
        raise GraphError(f"node '{node}' has {what}={value!r}; give a list of "
                         f"{'value names' if what == 'inputs' else 'outputs'}") from None


class Section:
    """Base of the section tree. Nodes appear in sections by name.

    Sections print and compare (``repr``, ``==``) as dataclasses do, but without recursion, so
    that a walk nested deeper than Python's recursion limit can still be shown and compared."""

    def __repr__(self) -> str:
        if not is_dataclass(self):  # a Section with no fields of its own
            return object.__repr__(self)
        return _section_repr(self)

    def __eq__(self, other: object) -> bool:
        if other.__class__ is not self.__class__:
            return NotImplemented
        if not is_dataclass(self):  # a Section with no fields of its own is equal only to itself
            return self is other
        return _sections_equal(self, other)

    __hash__ = None  # type: ignore[assignment]  # mutable, as the dataclasses below were


def _expands(x: Any, method: str) -> bool:
    """Whether ``x`` is a section whose ``repr`` / ``==`` is the one above, over its fields."""
    return isinstance(x, Section) and is_dataclass(x) and \
        getattr(type(x), method) is getattr(Section, method)


def _section_repr(root: Section) -> str:
    """``repr`` of a section tree, as the dataclass ``repr`` writes it (``...`` for a section
    inside itself), with an explicit stack instead of recursion."""
    out: list[str] = []
    inside: set[int] = set()  # the sections and lists being written (a cycle prints "...")
    todo: list[tuple[int, Any]] = [(1, root)]  # (0, text) | (1, value to write) | (2, id done)
    while todo:
        what, x = todo.pop()
        if what == 0:
            out.append(x)
        elif what == 2:
            inside.discard(x)
        elif _expands(x, "__repr__"):
            if id(x) in inside:
                out.append("...")
                continue
            inside.add(id(x))
            todo.append((2, id(x)))
            todo.append((0, ")"))
            shown = [(f.name, getattr(x, f.name)) for f in fields(x)  # type: ignore[arg-type]
                     if f.repr]
            for i in range(len(shown) - 1, -1, -1):
                todo.append((1, shown[i][1]))
                todo.append((0, (", " if i else "") + shown[i][0] + "="))
            todo.append((0, type(x).__qualname__ + "("))
        elif type(x) in (list, tuple) and any(isinstance(y, (Section, list, tuple)) for y in x):
            if id(x) in inside:
                out.append("[...]")
                continue
            inside.add(id(x))
            todo.append((2, id(x)))
            todo.append((0, ("]" if type(x) is list else ",)" if len(x) == 1 else ")")))
            for i in range(len(x) - 1, -1, -1):
                todo.append((1, x[i]))
                if i:
                    todo.append((0, ", "))
            todo.append((0, "[" if type(x) is list else "("))
        else:
            out.append(repr(x))
    return "".join(out)


def _sections_equal(a: Section, b: Section) -> bool:
    """``a == b`` as the dataclass ``==`` decides it (same class, equal fields), with an explicit
    stack instead of recursion; a pair met again inside itself counts as equal."""
    todo: list[tuple[Any, Any]] = [(a, b)]
    met: set[tuple[int, int]] = set()
    while todo:
        x, y = todo.pop()
        if x is y:
            continue
        if _expands(x, "__eq__") and y.__class__ is x.__class__:
            fx = tuple(getattr(x, f.name) for f in fields(x) if f.compare)
            fy = tuple(getattr(y, f.name) for f in fields(y) if f.compare)
        elif type(x) in (list, tuple) and type(y) is type(x) and \
                any(isinstance(v, (Section, list, tuple)) for v in (*x, *y)):
            if len(x) != len(y):
                return False
            fx, fy = x, y
        else:
            if not x == y:
                return False
            continue
        if (id(x), id(y)) in met:
            continue
        met.add((id(x), id(y)))
        todo.extend(zip(fx, fy))
    return True


@dataclass(repr=False, eq=False)
class Sequential(Section):
    """Runs its parts one after another; later parts see what earlier ones produced."""

    parts: list["SectionLike"]

    def __init__(self, *parts: "SectionLike") -> None:
        self.parts = list(parts)


@dataclass(repr=False, eq=False)
class Parallel(Section):
    """Runs its branches at the same time (fan-out), all seeing the same inputs; done when all are."""

    branches: list["SectionLike"]

    def __init__(self, *branches: "SectionLike") -> None:
        self.branches = list(branches)


@dataclass(repr=False, eq=False)
class Loop(Section):
    """Runs ``section`` ``max_iters`` times. Names it reads from outside are re-read every
    iteration; a name it both reads and produces carries over to the next iteration. Afterwards
    ``outputs`` hold their last iteration's value and ``accumulated_outputs`` the list of every
    iteration's values; other names made inside stay inside."""

    section: "SectionLike"
    max_iters: int
    outputs: Sequence[str] = field(default_factory=tuple)
    accumulated_outputs: Sequence[str] = field(default_factory=tuple)


@dataclass(repr=False, eq=False)
class DynamicLoop(Loop):
    """A :class:`Loop` that a node can stop for one request (``check_stop`` returns ``name``);
    the stop takes effect at the next iteration boundary."""

    name: str = ""

    def __init__(self, section: "SectionLike", max_iters: int, name: str,
                 outputs: Sequence[str] = (), accumulated_outputs: Sequence[str] = ()) -> None:
        super().__init__(section, max_iters, tuple(outputs), tuple(accumulated_outputs))
        self.name = name


@dataclass(repr=False, eq=False)
class Part(Section):
    """One part of a request that advances on its own: runs its ``walks`` (sub-walks by key) one
    after another, each chosen at run time by the model's
    :meth:`~mstar_rt.Model.next_part_walk` (default: each once, in the order given), and ends
    when the model chooses none. Parts in a :class:`Parallel` advance independently, e.g. a
    thinker running ``prefill`` then ``decode`` beside a talker running ``warmup`` then
    ``speak``, each with its own stop: ``Parallel(Part("thinker", {...}), Part("talker", {...}))``.

    A sub-walk may read what the walk had when the Part started, and anything any sub-walk of
    the Part makes (one that has not run yet fails the request, naming the name); after the
    Part, the walk sees what its sub-walks made. ``name`` must be unique within the walk."""

    name: str
    walks: Mapping[str, "SectionLike"]

    def __init__(self, name: str, walks: Mapping[str, "SectionLike"]) -> None:
        self.name = name
        self.walks = dict(walks) if isinstance(walks, Mapping) else walks


def _sections(*roots: "SectionLike") -> Iterator[Section]:
    """Every section of the trees ``roots``, each once."""
    todo: list[Any] = list(roots)
    seen: set[int] = set()
    while todo:
        s = todo.pop()
        if not isinstance(s, Section) or id(s) in seen:
            continue
        seen.add(id(s))
        yield s
        todo.extend(_children(s))


def node_places(*roots: "SectionLike") -> list[str]:
    """Every node name in the section trees ``roots``, once per place in them (a section object
    used in two places is read once)."""
    return [x for s in _sections(*roots) for x in _children(s) if isinstance(x, str)] + \
        [r for r in roots if isinstance(r, str)]


def _children(s: Section) -> tuple:
    if isinstance(s, Part):
        return tuple(s.walks.values()) if isinstance(s.walks, Mapping) else ()
    if isinstance(s, Sequential):
        return tuple(s.parts)
    if isinstance(s, Parallel):
        return tuple(s.branches)
    return (s.section,) if isinstance(s, Loop) else ()


def find_part(root: "SectionLike", name: str) -> Optional[Part]:
    """The :class:`Part` named ``name`` in the section tree ``root`` (None if none)."""
    return next((s for s in _sections(root) if isinstance(s, Part) and s.name == name), None)


def stop_names(name_ids: Mapping[str, int], model: Any,
               node_names: Sequence[Sequence[str]]) -> dict[str, int]:
    """The ids of the names a ``check_stop`` may give: the model's DynamicLoops, and names that
    are no value (``node_names``: each node's inputs and outputs; nor a model input)."""
    loops = {s.name for s in _sections(*model.walks.values()) if isinstance(s, DynamicLoop)}
    values = set(model.inputs).union(*node_names)
    return {n: i for n, i in name_ids.items() if n in loops or n not in values}


SectionLike = Union[Section, str]
"""A section, or a node's name (a walk of one node)."""

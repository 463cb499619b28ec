"""The graph DSL: nodes, edges and the sections that make a walk.

A model is a graph ``G`` of :class:`GraphNode` s and a set ``W`` of named walks, each a section
tree over those nodes: :class:`Sequential`, :class:`Parallel`, :class:`Loop` and
:class:`DynamicLoop`, closed under nesting. Data flows by name: a node fires once every name it
reads has a value, and its outputs give names new values. :class:`GraphEdge` marks where an
output goes (another node, or :data:`EMIT` to stream it to the caller) and whether it persists
into the next walk; :class:`StreamingGraphEdge` turns an output into a stream that its consumer
reads in windows cut by a chunk policy.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence, Union

# GraphError (a ValueError) is the graph compiler's (C++, mstar::GraphError): it raises it for a
# malformed graph or walk, and the DSL here for a malformed node.
from mstar_rt._core import ChunkPolicy, GraphError

EMIT = "EMIT"
"""Edge destination that streams an output to the caller (the request handle's iterator)."""


@dataclass(frozen=True)
class GraphEdge:
    """Output ``name`` goes to node ``to`` (or :data:`EMIT`); ``persist`` keeps it for later walks."""

    to: str
    name: str
    persist: bool = False


@dataclass(frozen=True)
class StreamingGraphEdge:
    """Every execution of the producer appends output ``name`` as one item of a stream; node
    ``to`` runs on each window ``chunk_policy`` makes of it (and on the flushed tail)."""

    to: str
    name: str
    chunk_policy: ChunkPolicy


Output = Union[str, GraphEdge, StreamingGraphEdge]


@dataclass(frozen=True)
class GraphNode:
    """One component's forward pass: reads ``inputs`` by name, writes ``outputs``."""

    name: str
    inputs: Sequence[str] = ()
    outputs: Sequence[Output] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "inputs", tuple(self.inputs))
        object.__setattr__(self, "outputs", tuple(self.outputs))
        if not self.name or self.name == EMIT:
            raise GraphError(f"a node needs a name other than '' and {EMIT!r}")
        seen: set[str] = set()
        for x in self.inputs:
            if x in seen:
                raise GraphError(f"node '{self.name}' reads '{x}' twice; list each input once")
            seen.add(x)

    @property
    def output_names(self) -> tuple[str, ...]:
        names: list[str] = []
        for o in self.outputs:
            n = o if isinstance(o, str) else o.name
            if n not in names:
                names.append(n)
        return tuple(names)


class Section:
    """Base of the section tree. Nodes appear in sections by name."""


@dataclass
class Sequential(Section):
    """Runs its parts one after another; later parts see what earlier ones produced."""

    parts: list["SectionLike"]

    def __init__(self, *parts: "SectionLike") -> None:
        self.parts = list(parts)


@dataclass
class Parallel(Section):
    """Runs its branches at the same time (fan-out), all seeing the same inputs; done when all are."""

    branches: list["SectionLike"]

    def __init__(self, *branches: "SectionLike") -> None:
        self.branches = list(branches)


@dataclass
class Loop(Section):
    """Runs ``section`` ``max_iters`` times. Names it reads from outside are re-read every
    iteration; a name it both reads and produces carries over to the next iteration. Afterwards
    ``outputs`` hold their last iteration's value and ``accumulated_outputs`` the list of every
    iteration's values; other names made inside stay inside."""

    section: "SectionLike"
    max_iters: int
    outputs: Sequence[str] = field(default_factory=tuple)
    accumulated_outputs: Sequence[str] = field(default_factory=tuple)


@dataclass
class DynamicLoop(Loop):
    """A :class:`Loop` that a node can stop for one request (``check_stop`` returns ``name``);
    the stop takes effect at the next iteration boundary."""

    name: str = ""

    def __init__(self, section: "SectionLike", max_iters: int, name: str,
                 outputs: Sequence[str] = (), accumulated_outputs: Sequence[str] = ()) -> None:
        super().__init__(section, max_iters, tuple(outputs), tuple(accumulated_outputs))
        self.name = name


SectionLike = Union[Section, str]
"""A section, or a node's name (a walk of one node)."""

"""Model and NodeSubmodule: what a model author writes; the runtime does the rest."""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Optional, Sequence

from mstar_rt import _core
from mstar_rt.graph import GraphError, GraphNode, SectionLike, find_part


#: A request's deadline when it has none (steady-clock nanoseconds, as the Conductor keeps them).
NO_DEADLINE = 2**63 - 1


@dataclass
class RequestContext:
    """One request as nodes and the state machine see it: ``deadline_ns`` (monotonic clock,
    :data:`NO_DEADLINE` if none) and ``priority`` are what it was submitted with; every process
    serving it orders its work by them."""

    id: int
    inputs: Mapping[str, Any]
    walk: str = ""
    state: dict = field(default_factory=dict)  # free for the model's own bookkeeping
    deadline_ns: int = NO_DEADLINE
    priority: int = 0
    #: The id engines keep this request's cached state under (its KV pages): its own ``id``,
    #: except in a placement worker's segment runs, which share the request's (-1 until the
    #: runtime sets it). Nodes that read an engine's cache by request use this id.
    cache_id: int = -1


@dataclass(frozen=True)
class StreamChunk:
    """What a stream consumer receives for its streamed input: the chunk's items (stream
    positions ``begin`` .. ``end``), of which ``items[new_begin - begin:]`` are new."""

    items: list
    begin: int
    new_begin: int
    end: int
    last: bool

    @property
    def new_items(self) -> list:
        return self.items[self.new_begin - self.begin:]


#: Per-execution facts a submodule may want besides the inputs: ``request`` (the
#: :class:`RequestContext`) and ``iteration`` (of the innermost enclosing loop, 0 outside loops).
#: ``WorkContext(request, iteration)``. A C type: the runtime makes one per prepared item.
WorkContext = _core.WorkContext


class NodeSubmodule(abc.ABC):
    """The module behind one node. Override :meth:`forward`; the rest has sensible defaults.

    A batch holds executions of this node for several requests (never two of one request).
    """

    #: The most executions one forward() may take; the engine never exceeds it.
    max_batch: int = 1

    def prepare_inputs(self, ctx: WorkContext, inputs: dict[str, Any]) -> Any:
        """Turns one execution's named inputs into whatever forward() takes per item."""
        return inputs

    @abc.abstractmethod
    def forward(self, batch: list[Any]) -> list[Mapping[str, Any]]:
        """Runs a batch; returns, per item, the node's outputs by name."""

    def check_stop(self, batch: list[Any], outputs: list[Mapping[str, Any]]) -> list[Iterable[str]]:
        """Per item, the names of the DynamicLoops to stop (at the next iteration boundary)."""
        return [() for _ in batch]

    def split_batch(self, batch: list[Any]) -> list[list[int]]:
        """Groups of item indices that may run in one forward(); refuse batching by splitting."""
        return [list(range(len(batch)))]

    def end_stream(self, ctx: WorkContext) -> Mapping[str, Any]:
        """A stream consumer's end of stream, when no chunk told it: the stream ended exactly
        where a chunk already sent (not marked ``last``) ended, or carried no items. Returns
        the node's outputs, as forward() does for one item (e.g. audio flushed from what the
        node held back). Called at most once per stream, never with a chunk; a node that does
        not override it is not called at all. Either way the chunks a consumer sees are
        exactly the chunk policy's, never an empty one."""
        return {}

    def cleanup(self, request: RequestContext) -> None:
        """Called once when a request ends (finished, failed or cancelled)."""

    #: True when the per-request state that :meth:`cleanup` drops lives in ``request.state`` or
    #: under ``request.cache_id``: a placement worker may then run the node inside a segment
    #: (placement/segments.py), calling ``cleanup`` once, when the request ends.
    cleanup_by_cache_id = False


def _given(model: "Model", name: str) -> Mapping[str, Any]:
    """The ``submodules`` / ``engines`` map a model sets the older way: on the instance (kept by
    the property's setter) or as a class attribute of a subclass (which hides the property)."""
    own = model.__dict__.get(f"_{name}_given")
    if own is not None:
        return own
    for cls in type(model).__mro__:
        value = cls.__dict__.get(name)
        if isinstance(value, property):
            break
        if value is not None:
            return value
    return {}


def node_submodules(model: "Model") -> dict[str, NodeSubmodule]:
    """Node name -> the submodule that runs it, as declared on the node
    (``GraphNode(submodule=...)``) or in ``model.submodules``. GraphError if a node has both and
    they differ."""
    out = dict(_given(model, "submodules"))
    seen: set[str] = set()
    for n in model.nodes:
        if n.name in seen:  # before any other message about the name (they would mislead)
            raise GraphError(f"two nodes are named '{n.name}'; node names must be unique")
        seen.add(n.name)
        sub = getattr(n, "submodule", None)
        if sub is None:
            continue
        if out.get(n.name, sub) is not sub:
            raise GraphError(f"node '{n.name}' has a submodule in its GraphNode and another in "
                             f"{type(model).__name__}.submodules; declare it once")
        out[n.name] = sub
    return out


def node_engines(model: "Model") -> dict[str, str]:
    """Node name -> engine name (``"default"`` unless the node or ``model.engines`` names one);
    names in ``model.engines`` that are not nodes stay, for the compiler to refuse."""
    out = dict(_given(model, "engines"))
    for n in model.nodes:
        engine = getattr(n, "engine", None)
        if engine is not None and out.get(n.name, engine) != engine:
            raise GraphError(f"node '{n.name}' runs on engine '{engine}' by its GraphNode but on "
                             f"'{out[n.name]}' by {type(model).__name__}.engines; declare it once")
        out[n.name] = engine or out.get(n.name, "default")
    return out


def hears_stream_end(sub: NodeSubmodule) -> bool:
    """Whether ``sub`` overrides :meth:`NodeSubmodule.end_stream` (in its class or on the
    instance): only then does the runtime tell it that its stream ended."""
    method = getattr(sub, "end_stream")
    return getattr(method, "__func__", method) is not NodeSubmodule.end_stream


class Model:
    """A model is (G, W) plus a state machine over walks.

    Subclasses set :attr:`nodes` (each declared once: ``GraphNode(name, inputs, outputs,
    submodule=..., engine=..., max_batch=...)``), :attr:`walks` and :attr:`inputs`, give
    stateful engines in :attr:`engine_specs` (made per model instance, in ``__init__``), and may
    override :meth:`initial_walk` and :meth:`next_walk`.
    """

    nodes: Sequence[GraphNode] = ()
    walks: Mapping[str, SectionLike] = {}
    #: Names a request brings; they stay visible in every walk of the request.
    inputs: Sequence[str] = ()
    #: Nodes that run outside the walks (placement: inside a worker's segment), which may sit
    #: in no walk; any other node in no walk is refused, as it would never run.
    nodes_elsewhere: frozenset[str] = frozenset()
    @property
    def submodules(self) -> Mapping[str, NodeSubmodule]:
        """Node name -> the submodule that runs it, for every node. Setting it (the older form,
        for nodes whose GraphNode carries none) is still accepted; a model declared only that
        way gets its own map back (changing it in place still works)."""
        if any(getattr(n, "submodule", None) is not None for n in self.nodes):
            return node_submodules(self)
        return _given(self, "submodules")

    @submodules.setter
    def submodules(self, value: Mapping[str, NodeSubmodule]) -> None:
        self.__dict__["_submodules_given"] = value

    @property
    def engines(self) -> Mapping[str, str]:
        """Node name -> engine name, for the nodes that name one (default "default"; each engine
        gets its own worker). Setting it (the older form) is still accepted; a model declared
        only that way gets its own map back."""
        if any(getattr(n, "engine", None) is not None for n in self.nodes):
            return node_engines(self)
        return _given(self, "engines")

    @engines.setter
    def engines(self, value: Mapping[str, str]) -> None:
        self.__dict__["_engines_given"] = value
    #: engine name -> Engine object (e.g. a KVCacheEngine); unnamed engines are stateless.
    engine_specs: Mapping[str, Any] = {}
    #: Values for declared inputs a request may leave out.
    input_defaults: Mapping[str, Any] = {}

    def validate_inputs(self, inputs: Mapping[str, Any]) -> None:
        """Raises ValueError (naming what to fix) for inputs the model cannot serve; called by
        ``submit`` before the request starts, so bad input never reaches an engine."""

    def health(self) -> Optional[str]:
        """None while the model can serve; else why it cannot, naming what to do (a
        tensor-parallel group that lost a rank must be loaded again). ``Runtime.health`` and a
        server's ``/health`` report it, so an orchestrator can replace what will not recover."""
        return None

    def initial_walk(self, request: RequestContext) -> str:
        """The first walk of a request (default: the first walk declared)."""
        return next(iter(self.walks))

    def next_walk(self, request: RequestContext, finished_walk: str,
                  persisted: Mapping[str, Any]) -> Optional[str]:
        """The walk after ``finished_walk``, or None when the request is done (default: done)."""
        return None

    def next_part_walk(self, request: RequestContext, part: str,
                       finished: Optional[str]) -> Optional[str]:
        """The next sub-walk of :class:`~mstar_rt.graph.Part` ``part`` (a key of its ``walks``)
        after ``finished`` (None as the Part starts), or None to end the Part; ``request.walk``
        is the walk the Part is in. Called where :meth:`next_walk` is (the thread that reports
        the outcome: an engine worker, or ``submit``'s caller), so two Parts of one request may
        be asked at the same time from two threads. An exception, or a key the Part does not
        have, fails this request only. Default: each sub-walk once, in the order the Part
        declares them."""
        found = find_part(self.walks[request.walk], part)
        keys = list(found.walks) if found is not None else []
        at = -1 if finished is None else keys.index(finished)
        return keys[at + 1] if at + 1 < len(keys) else None

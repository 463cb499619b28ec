"""The nodes a host runs, each declared once, and the one Python path that runs a batch of them:
prepare_inputs -> forward -> check_stop (and end_stream for a stream's end).

A :class:`NodeTable` is built from a model and its compiled graph; the in-process Runtime, a
placement worker and the parent of placed workers all hold one. A :class:`BatchRunner` turns a
batch of work items into per-item outputs and DynamicLoop stops; the host reports them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional, Sequence

from mstar_rt.compiler import CompiledGraph
from mstar_rt.graph import StreamingGraphEdge
from mstar_rt._core import WorkItem
from mstar_rt.model import (Model, NodeSubmodule, RequestContext, StreamChunk, WorkContext,
                            hears_stream_end, node_engines, node_submodules)


def overrides(obj: object, name: str, base: type) -> bool:
    """Whether obj's `name` (in its class or set on the instance) is not base's default."""
    method = getattr(obj, name)
    return getattr(method, "__func__", method) is not getattr(base, name)


def is_stream_end(chunk: Optional[tuple]) -> bool:
    """An empty chunk is the Conductor's end-of-stream item (NodeSubmodule.end_stream): a
    chunk always holds at least one new item."""
    return chunk is not None and chunk[0] == chunk[2]


@dataclass(frozen=True)
class NodeEntry:
    """One node as the runtime runs it: its submodule, its engine, its batch limit, the input its
    stream chunks arrive under (if it consumes a stream), and which optional hooks it has (the
    defaults are skipped)."""

    name: str
    submodule: NodeSubmodule
    engine: str
    max_batch: int
    stream_input: Optional[str]
    prepares: bool
    splits: bool
    stops: bool
    hears_stream_end: bool


class NodeTable:
    """Node id -> :class:`NodeEntry`, in the compiled graph's node order."""

    def __init__(self, model: Model, graph: CompiledGraph) -> None:
        stream_input: dict[str, str] = {}
        for n in model.nodes:
            for out in n.outputs:
                if isinstance(out, StreamingGraphEdge):
                    stream_input[out.to] = out.name
        self.entries: list[NodeEntry] = []
        subs, engines = node_submodules(model), node_engines(model)
        for name in graph.node_ids:
            sub = subs[name]
            self.entries.append(NodeEntry(
                name=name, submodule=sub, engine=engines[name],
                max_batch=graph.nodes[graph.node_ids[name]][2],
                stream_input=stream_input.get(name),
                prepares=overrides(sub, "prepare_inputs", NodeSubmodule),
                splits=overrides(sub, "split_batch", NodeSubmodule),
                stops=overrides(sub, "check_stop", NodeSubmodule),
                hears_stream_end=hears_stream_end(sub)))
        self.names = [e.name for e in self.entries]

    def __getitem__(self, node: int) -> NodeEntry:
        return self.entries[node]

    def __len__(self) -> int:
        return len(self.entries)

    def unique_submodules(self, nodes: Optional[Iterable[int]] = None) -> list[NodeSubmodule]:
        """The submodules of `nodes` (default: all), each once: one submodule may serve several
        nodes (one LM for prefill and decode)."""
        ids = range(len(self.entries)) if nodes is None else nodes
        return list({id(self.entries[i].submodule): self.entries[i].submodule
                     for i in ids}.values())


class BatchRunner:
    """Runs batches of work items (:class:`_core.WorkItem`: id, request, iteration, inputs,
    chunk).

    ``contexts(items)`` gives each item's :class:`RequestContext`; ``loop_id(name)`` maps a
    DynamicLoop name from check_stop to what the host's queue takes."""

    def __init__(self, nodes: NodeTable,
                 contexts: Callable[[Sequence[WorkItem]], list[RequestContext]],
                 loop_id: Callable[[str], Any]) -> None:
        self.nodes, self.contexts, self.loop_id = nodes, contexts, loop_id

    def run(self, node: int, items: Sequence[WorkItem]) -> tuple[list, list, Optional[list]]:
        """(item ids, outputs per item, stops per item or None), in one order."""
        if any(is_stream_end(item.chunk) for item in items):
            return self._run_with_ends(node, items)
        outputs, stops = self.forward(node, items)
        return [item.id for item in items], outputs, stops

    def forward(self, node: int, items: Sequence[WorkItem]) -> tuple[list, Optional[list]]:
        """prepare -> forward -> check_stop for a batch: (outputs, loop ids to stop | None)."""
        entry = self.nodes[node]
        sub = entry.submodule
        if entry.prepares or any(item.chunk is not None for item in items):
            prepared = self.prepare(node, items, entry.prepares)
        else:
            prepared = [item.inputs for item in items]
        if entry.splits:
            outputs: list = [None] * len(items)
            for group in sub.split_batch(prepared):
                result = sub.forward([prepared[i] for i in group])
                if len(result) != len(group):
                    raise RuntimeError(f"{type(sub).__name__}.forward returned {len(result)} "
                                       f"results for a batch of {len(group)}")
                for i, r in zip(group, result):
                    outputs[i] = r
        else:
            outputs = list(sub.forward(prepared))
            if len(outputs) != len(items):
                raise RuntimeError(f"{type(sub).__name__}.forward returned {len(outputs)} results "
                                   f"for a batch of {len(items)}")
        stops = None
        if entry.stops:
            stops = [[self.loop_id(s) for s in stop] for stop in sub.check_stop(prepared, outputs)]
        return outputs, stops

    def prepare(self, node: int, items: Sequence[WorkItem], call_prepare: bool) -> list:
        """Each item's inputs as forward() takes them: stream chunks made, prepare_inputs run."""
        entry = self.nodes[node]
        stream_input = entry.stream_input
        contexts = self.contexts(items) if call_prepare else ()
        prepared = []
        for n, (_id, _rid, iteration, values, chunk) in enumerate(items):
            if chunk is not None:
                values = {**values, stream_input: StreamChunk(values[stream_input], *chunk)}
            if call_prepare:
                values = entry.submodule.prepare_inputs(WorkContext(contexts[n], iteration), values)
            prepared.append(values)
        return prepared

    def _run_with_ends(self, node: int, items: Sequence[WorkItem]) -> tuple[list, list, Optional[list]]:
        """A batch holding stream ends: those go to end_stream, the chunks to forward."""
        sub = self.nodes[node].submodule
        chunks = [item for item in items if not is_stream_end(item.chunk)]
        ends = [item for item in items if is_stream_end(item.chunk)]
        outputs, stops = self.forward(node, chunks) if chunks else ([], None)
        for item, ctx in zip(ends, self.contexts(ends)):
            outputs.append(sub.end_stream(WorkContext(ctx, item.iteration)))
        if stops is not None:
            stops += [[] for _ in ends]
        return [item.id for item in chunks] + [item.id for item in ends], outputs, stops

"""The nodes a host runs, each declared once, and the one path that runs a batch of them:
prepare_inputs -> forward -> check_stop (and end_stream for a stream's end).

A :class:`NodeTable` is built from a model and its compiled graph; the in-process Runtime, a
placement worker and the parent of placed workers all hold one. A :class:`NodeRunner` (C++,
``mstar_rt._core``) built over the table turns a batch of work items into per-item outputs and
DynamicLoop stops: the Conductor's ``run_batch`` calls it without leaving C++, a placement
worker and the KV engine through Python; the host reports what it made."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional, Union

from mstar_rt._core import NodeRunner
from mstar_rt.compiler import CompiledGraph
from mstar_rt.graph import StreamingGraphEdge
from mstar_rt.model import (Model, NodeSubmodule, hears_stream_end, node_engines,
                            node_submodules)

__all__ = ["NodeEntry", "NodeRunner", "NodeTable", "overrides"]


def overrides(obj: object, name: str, base: type) -> bool:
    """Whether obj's `name` (in its class or set on the instance) is not base's default."""
    method = getattr(obj, name)
    return getattr(method, "__func__", method) is not getattr(base, name)


@dataclass(frozen=True)
class NodeEntry:
    """One node as the runtime runs it: its submodule, its engine, its batch limit, the input its
    stream chunks arrive under (if it consumes a stream), and which optional hooks it has (the
    defaults are skipped). :class:`NodeRunner` reads submodule, stream_input, prepares, splits
    and stops."""

    name: str
    submodule: NodeSubmodule
    engine: str
    max_batch: int
    stream_input: Optional[Union[str, tuple[str, ...]]]  # several: a node reading several streams
    prepares: bool
    splits: bool
    stops: bool
    hears_stream_end: bool


class NodeTable:
    """Node id -> :class:`NodeEntry`, in the compiled graph's node order."""

    def __init__(self, model: Model, graph: CompiledGraph) -> None:
        streams: dict[str, set[str]] = {}
        for n in model.nodes:
            for out in n.outputs:
                if isinstance(out, StreamingGraphEdge):
                    streams.setdefault(out.to, set()).add(out.name)
        # In the order of the node's inputs, as the Conductor sends one window per stream.
        stream_input: dict[str, Union[str, tuple[str, ...]]] = {}
        for n in model.nodes:
            mine = tuple(x for x in n.inputs if x in streams.get(n.name, ()))
            if mine:
                stream_input[n.name] = mine[0] if len(mine) == 1 else mine
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

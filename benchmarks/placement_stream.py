"""The stream section of benchmarks/placement.py (its workers import the model,
``placement_stream:frames``): a producer on worker 1 streams 1 MiB items to a consumer on
worker 2, each item through the parent or worker to worker (its handle through the parent, the
bytes from the producer's export arena; placement/direct.py). Both ends run as segments: the
producer's Loop inside worker 1, the consumer's run reading the stream window by window.

``into_segment``: the consumer is a loop of two nodes (a talker's shape), one segment the
stream enters window by window (placement/stream_in.py), and a request streams LONG items --
three times the 16 MiB export arena: every item crosses worker to worker only because the
reader acknowledges each window it copied (``read``), freeing its bytes before the request
ends (``stream_in_items_exported`` counts them)."""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench_common import alternate, use_source_tree  # noqa: E402

use_source_tree()

import torch  # noqa: E402

from mstar_rt import (EMIT, Fixed, GraphEdge, GraphNode, Loop, Model,  # noqa: E402
                      NodeSubmodule, Parallel, Sequential, StreamingGraphEdge)
from mstar_rt.placement import NodeGroup, PlacedRuntime  # noqa: E402

ITEMS = 16  # stream items per request
LONG = 48   # ... into a segment: 48 MiB through a 16 MiB export arena
NBYTES = 1 << 20


class Produce(NodeSubmodule):
    """One new 1 MiB item per step (a clone, as a real node would make)."""

    def forward(self, batch: list[dict]) -> list[dict]:
        return [{"x": b["x"], "item": b["x"].clone()} for b in batch]


class Consume(NodeSubmodule):
    """Each window's items -> the first element of each, EMITted (reads every item)."""

    def forward(self, batch: list[dict]) -> list[dict]:
        return [{"y": torch.stack([t[0] for t in b["item"].new_items])} for b in batch]


class Frames(Model):
    inputs = ("x",)

    def __init__(self) -> None:
        self.nodes = [GraphNode("produce", ["x"], ["x", StreamingGraphEdge("consume", "item",
                                                                           Fixed(1))],
                                submodule=Produce()),
                      GraphNode("consume", ["item"], [GraphEdge(EMIT, "y")],
                                submodule=Consume())]
        self.walks = {"main": Parallel(Loop("produce", ITEMS), "consume")}


def frames() -> Frames:
    return Frames()


class Look(NodeSubmodule):
    """A talker-like step: its window (one item, or none past the stream's end) -> y."""

    def forward(self, batch: list[dict]) -> list[dict]:
        return [{"y": b["item"].items[0][0] if b["item"].items else torch.zeros(())}
                for b in batch]


class Say(NodeSubmodule):
    def forward(self, batch: list[dict]) -> list[dict]:
        return [{"said": b["y"]} for b in batch]


class IntoSegment(Model):
    inputs = ("x",)

    def __init__(self) -> None:
        self.nodes = [GraphNode("produce", ["x"], ["x", StreamingGraphEdge(
                          "look", "item", Fixed(1), continue_after_done=True)],
                                submodule=Produce()),
                      GraphNode("look", ["item"], ["y"], submodule=Look()),
                      GraphNode("say", ["y"], [GraphEdge(EMIT, "said")], submodule=Say())]
        self.walks = {"main": Parallel(Loop("produce", LONG),
                                       Loop(Sequential("look", "say"), LONG))}


def into_segment() -> IntoSegment:
    return IntoSegment()


def stream_direct_vs_star(reps: int, segment: bool = False) -> dict[str, float]:
    """µs per 1 MiB stream item from worker 1 to worker 2, through the parent (star) and
    worker to worker (direct), the two runtimes alternating request by request; ``segment``:
    LONG items into a two-node loop segment (the module doc)."""
    spec, reader, items, arena = (("placement_stream:into_segment", ["look", "say"], LONG, 16)
                                  if segment else
                                  ("placement_stream:frames", ["consume"], ITEMS, 64))
    groups = [NodeGroup(["produce"], rank=1), NodeGroup(reader, rank=2)]
    rts = {mode: PlacedRuntime(spec, groups, progress=False, shm_bytes=arena << 20,
                               direct_bytes=bytes_)
           for mode, bytes_ in (("star", None), ("direct", 64 << 10))}
    x = torch.randn(NBYTES // 4)
    try:
        assert rts["direct"].workers[1]["direct"] == ["item"]
        for rt in rts.values():  # a lap of every arena: no timed item faults a fresh page
            for _ in range((arena << 20) // (items * NBYTES) + 4):
                list(rt.submit({"x": x}))
        before = rts["direct"].workers[1]["exports"]

        def one(rt: Any) -> float:
            t0 = time.perf_counter()
            out = list(rt.submit({"x": x}))
            assert len(out) == items
            return time.perf_counter() - t0

        t = alternate([(mode, lambda rt=rt: one(rt)) for mode, rt in rts.items()], reps,
                      "1 MiB stream items" + " into a segment" * segment)
        exported = rts["direct"].workers[1]["exports"] - before
    finally:
        for rt in rts.values():
            rt.close()
    tag = "stream_in" if segment else "stream"
    out = {f"{tag}_{mode}_us_per_item_1mib": statistics.median(v) / items * 1e6
           for mode, v in t.items()}
    out[f"{tag}_items_exported"] = float(exported)
    out[f"{tag}_items_timed"] = float(items * reps)
    return out

"""The stream section of benchmarks/placement.py (its workers import the model,
``placement_stream:frames``): a producer on worker 1 streams 1 MiB items to a consumer on
worker 2, each item through the parent or worker to worker (its handle through the parent, the
bytes from the producer's export arena; placement/direct.py). Both ends run as segments: the
producer's Loop inside worker 1, the consumer's run reading the stream window by window."""

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
                      NodeSubmodule, Parallel, StreamingGraphEdge)
from mstar_rt.placement import NodeGroup, PlacedRuntime  # noqa: E402

ITEMS = 16  # stream items per request
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


def stream_direct_vs_star(reps: int) -> dict[str, float]:
    """µs per 1 MiB stream item from worker 1 to worker 2, through the parent (star) and
    worker to worker (direct), the two runtimes alternating request by request."""
    groups = [NodeGroup(["produce"], rank=1), NodeGroup(["consume"], rank=2)]
    rts = {mode: PlacedRuntime("placement_stream:frames", groups, progress=False,
                               shm_bytes=64 << 20, direct_bytes=bytes_)
           for mode, bytes_ in (("star", None), ("direct", 64 << 10))}
    x = torch.randn(NBYTES // 4)
    try:
        assert rts["direct"].workers[1]["direct"] == ["item"]
        for rt in rts.values():  # a lap of every arena: no timed item faults a fresh page
            for _ in range((64 << 20) // (ITEMS * NBYTES) + 4):
                list(rt.submit({"x": x}))

        def one(rt: Any) -> float:
            t0 = time.perf_counter()
            out = list(rt.submit({"x": x}))
            assert len(out) == ITEMS
            return time.perf_counter() - t0

        t = alternate([(mode, lambda rt=rt: one(rt)) for mode, rt in rts.items()], reps,
                      "1 MiB stream items")
        exported = rts["direct"].workers[1]["exports"]
    finally:
        for rt in rts.values():
            rt.close()
    out = {f"stream_{mode}_us_per_item_1mib": statistics.median(v) / ITEMS * 1e6
           for mode, v in t.items()}
    out["stream_items_exported"] = float(exported)
    return out

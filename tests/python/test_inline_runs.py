"""InlineRuns (placement/inline_runs.py): a short run goes start to end on the thread that got
it, with the engine thread asleep; a run past the budget, one that did not come alone, and a
segment whose batches are slow go on (or stay) on the engine thread; nothing is lost."""

from __future__ import annotations

import threading
import time

import torch

from mstar_rt import EMIT, GraphEdge, GraphNode, Model, NodeSubmodule, Runtime, Sequential
from mstar_rt.placement import inline_runs
from mstar_rt.placement.inline_runs import InlineRuns

from placement_support import T

CHAIN = 6


class Step(NodeSubmodule):
    """``dst = src + 1``, noting the thread that ran it (and sleeping ``pause`` seconds)."""

    def __init__(self, src: str, dst: str, seen: list) -> None:
        self.src, self.dst, self.seen = src, dst, seen

    def forward(self, batch: list[dict]) -> list[dict]:
        self.seen.append(threading.get_ident())
        for item in batch:
            if item["pause"]:
                time.sleep(item["pause"])
        return [{self.dst: item[self.src] + 1} for item in batch]


class Chain(Model):
    inputs = ("x", "pause")

    def __init__(self) -> None:
        self.seen: list[int] = []
        names = [f"n{i}" for i in range(CHAIN)]
        src = ["x"] + [f"v{i}" for i in range(1, CHAIN)]
        dst = src[1:] + ["y"]
        self.nodes = [GraphNode(n, [a, "pause"], [GraphEdge(EMIT, b) if b == "y" else b],
                                submodule=Step(a, b, self.seen))
                      for n, a, b in zip(names, src, dst)]
        self.walks = {"main": Sequential(*names)}


def run(rt: Runtime, inline: InlineRuns, alone: bool, pause: float = 0.0) -> torch.Tensor:
    driving = inline.begin(alone)
    try:
        handle = rt.submit({"x": torch.zeros(1), "pause": pause})
        if driving:
            inline.drive()
    finally:
        inline.end(driving)
    return handle.result(T)["y"][0]


def test_a_short_run_that_came_alone_runs_on_this_thread():
    model = Chain()
    with Runtime(model) as rt:
        inline = InlineRuns(rt)
        assert run(rt, inline, alone=True) == CHAIN
        assert model.seen == [threading.get_ident()] * CHAIN
        model.seen.clear()
        assert run(rt, inline, alone=False) == CHAIN  # woken by end(): not lost
        assert threading.get_ident() not in model.seen and len(model.seen) == CHAIN
        assert rt.live["queued"] == rt.live["inflight"] == 0


def test_a_run_past_the_budget_goes_on_on_the_engine_thread():
    model = Chain()
    with Runtime(model) as rt:
        inline = InlineRuns(rt)
        assert run(rt, inline, alone=True, pause=inline_runs.INLINE_BUDGET_S / 2) == CHAIN
        here = model.seen.count(threading.get_ident())
        assert 1 <= here < CHAIN  # the rest ran on the engine thread
        # batches slower than INLINE_MAX_S: after a few such runs, none is inline any more
        inline_runs_seen = []
        for _ in range(8):
            model.seen.clear()
            assert run(rt, inline, alone=True, pause=2 * inline_runs.INLINE_MAX_S) == CHAIN
            inline_runs_seen.append(threading.get_ident() in model.seen)
        assert inline_runs_seen[0] and not any(inline_runs_seen[-3:])
        assert inline.batch_s > inline_runs.INLINE_MAX_S
        # measured again every RETRY_EVERY runs: a segment that got quick comes back (from just
        # over the limit: one quick measurement brings it under)
        inline.batch_s = 1.2 * inline_runs.INLINE_MAX_S
        tried = []
        for _ in range(inline_runs.RETRY_EVERY + 1):
            model.seen.clear()
            run(rt, inline, alone=True)
            tried.append(threading.get_ident() in model.seen)
        assert tried[0] is False and tried[-1] is True

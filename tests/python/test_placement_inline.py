"""A worker runs a quick node's batch on the thread that received it when the node's engine is
idle (placement/host.py: WorkerHost.dispatch), a slow node's on its engine thread, and never two
batches of one engine at once; a check_stop failing for one item of a batch fails it alone."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from mstar_rt import EMIT, DynamicLoop, GraphEdge, GraphNode, Model, NodeSubmodule, RequestFailed
from mstar_rt.placement import NodeGroup, PlacedRuntime

from walk_models import wait_until

T = 30.0


class WhereRan(NodeSubmodule):
    """Returns ``x + 1`` and the thread it ran on; counts overlapping calls (``overlap``)."""

    def __init__(self, sleep_s: float) -> None:
        self.sleep_s = sleep_s
        self.active = 0
        self.lock = threading.Lock()

    def forward(self, batch: list[dict]) -> list[dict]:
        with self.lock:
            self.active += 1
            overlap = self.active
        try:
            time.sleep(self.sleep_s)
            name = threading.current_thread().name
            return [{"y": b["x"] + 1, "thread": name, "overlap": overlap} for b in batch]
        finally:
            with self.lock:
                self.active -= 1


class Judge(NodeSubmodule):
    """A DynamicLoop body whose check_stop refuses x == 3; counts its forward calls per item
    (``calls``) and gives the size of the batch it ran in. x == 0 holds the node 50 ms, so the
    requests sent meanwhile meet in one batch."""

    max_batch = 8

    def __init__(self) -> None:
        self.calls: dict[tuple[int, int], int] = {}

    def prepare_inputs(self, ctx, inputs: dict) -> tuple:
        return inputs["x"], (ctx.request.id, ctx.iteration)

    def forward(self, batch: list) -> list[dict]:
        if any(x.item() == 0 for x, _ in batch):
            time.sleep(0.05)
        for _, key in batch:
            self.calls[key] = self.calls.get(key, 0) + 1
        return [{"calls": self.calls[key], "batch": len(batch)} for _, key in batch]

    def check_stop(self, batch: list, outputs: list) -> list:
        if any(x.item() == 3 for x, _ in batch):
            raise ValueError("cannot judge 3")
        return [("judge",)] * len(batch)


class Threads(Model):
    inputs = ("x", "walk")

    def __init__(self) -> None:
        outs = [GraphEdge(EMIT, "y"), GraphEdge(EMIT, "thread"), GraphEdge(EMIT, "overlap")]
        self.nodes = [GraphNode("quick", ["x"], outs, submodule=WhereRan(0.0), max_batch=4),
                      GraphNode("slow", ["x"], outs, submodule=WhereRan(0.005)),
                      GraphNode("judge", ["x"], [GraphEdge(EMIT, "calls"),
                                                 GraphEdge(EMIT, "batch")], submodule=Judge())]
        self.walks = {"quick": "quick", "slow": "slow", "judge": DynamicLoop("judge", 3, "judge")}

    def initial_walk(self, request) -> str:
        return request.inputs["walk"]


def threads() -> Threads:
    return Threads()


@pytest.fixture(scope="module")
def placed():
    rt = PlacedRuntime("test_placement_inline:threads",
                       [NodeGroup(["quick", "slow", "judge"], rank=1)],
                       progress=False, segments=False)
    yield rt
    rt.close()


def run(rt: PlacedRuntime, walk: str, x: float = 1.0) -> dict:
    return rt.submit({"x": torch.tensor([x]), "walk": walk}).result(T)


def test_quick_node_runs_on_the_receiving_thread(placed):
    for _ in range(5):
        out = run(placed, "quick")
    assert out["thread"] == ["MainThread"]  # the worker's receiving loop
    assert torch.equal(out["y"][0], torch.tensor([2.0]))


def test_slow_node_runs_on_its_engine_thread(placed):
    threads_seen = [run(placed, "slow")["thread"][0] for _ in range(4)]
    # the first runs may go inline (the first is not counted); once measured, its engine's thread
    assert threads_seen[-1].startswith("mstar-engine-"), threads_seen


def test_one_batch_per_engine_at_a_time_under_load(placed):
    """Bursts: a request that came alone to an idle worker runs inline, the rest of a burst
    queues for the engine thread (how many arrive together depends on the machine's load, so
    each wave starts with a lone one); the node never sees two calls at once, and every
    request gets its own answer."""
    outs = []
    for wave in range(10):
        lone = placed.submit({"x": torch.tensor([wave * 20.0]), "walk": "quick"}).result(T)
        handles = [placed.submit({"x": torch.tensor([wave * 20.0 + i]), "walk": "quick"})
                   for i in range(1, 20)]
        outs += [lone] + [h.result(T) for h in handles]
    assert [o["y"][0].item() for o in outs] == [i + 1.0 for i in range(200)]
    assert {o["overlap"][0] for o in outs} == {1}
    threads_used = {o["thread"][0] for o in outs}
    assert "MainThread" in threads_used
    assert wait_until(lambda: placed.worker_stats(1)["live_requests"] == 0, T)  # all released



def test_a_check_stop_raising_for_one_item_of_a_batch_fails_it_alone_without_a_rerun(placed):
    handles = {x: placed.submit({"x": torch.tensor([float(x)]), "walk": "judge"})
               for x in range(10)}
    with pytest.raises(RequestFailed, match=r"node 'judge'.*ValueError: cannot judge 3"):
        handles.pop(3).result(T)
    outs = [h.result(T) for h in handles.values()]
    # forward ran once per item: a rerun to find the culprit repeated it for the whole batch
    assert [o["calls"] for o in outs] == [[1]] * 9
    assert max(o["batch"][0] for o in outs) > 1  # they did share a batch
    assert wait_until(lambda: placed.worker_stats(1)["live_requests"] == 0, T)

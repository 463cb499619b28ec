"""The Conductor's own batch path (Conductor.run_batch): nodes it prepares, runs and completes
without the Python worker loop, and requests it finishes itself when the model has no next_walk.
The same behaviour as the Python path: exact results, EMIT order, failure isolation with the
node named, timelines, and nothing left behind."""

import gc
import random
import threading

import pytest

import mstar_rt
from mstar_rt import EMIT, DynamicLoop, GraphEdge, GraphNode, Loop, RequestFailed, Sequential
from mstar_rt.model import RequestContext, WorkContext

from walk_models import ZERO_LIVE, settled, wait_until

T = 5.0


class Add(mstar_rt.NodeSubmodule):
    """y = x + k; raises for inputs in `bad`; may return a tuple instead of a list."""

    def __init__(self, out: str, k: int, bad=(), as_tuple=False, max_batch=16) -> None:
        self.out, self.k, self.bad, self.as_tuple = out, k, set(bad), as_tuple
        self.max_batch = max_batch
        self.batches: list[int] = []

    def forward(self, batch):
        self.batches.append(len(batch))
        for d in batch:
            if next(iter(d.values())) in self.bad:
                raise ValueError(f"bad value {next(iter(d.values()))}")
        outs = [{self.out: next(iter(d.values())) + self.k} for d in batch]
        return tuple(outs) if self.as_tuple else outs


class Count(mstar_rt.NodeSubmodule):
    """A DynamicLoop body on the hooks: prepare reads the iteration, check_stop ends the loop
    after `x` iterations (x from the request's inputs)."""

    max_batch = 16

    def __init__(self, bad_prepare=None, bad_stop=False) -> None:
        self.bad_prepare, self.bad_stop = bad_prepare, bad_stop

    def prepare_inputs(self, ctx, inputs):
        assert isinstance(ctx, WorkContext)
        if ctx.request.inputs["x"] == self.bad_prepare:
            raise KeyError("prepare refused")
        return (ctx.request.inputs["x"], ctx.iteration)

    def forward(self, batch):
        return [{"tok": it} for _x, it in batch]

    def check_stop(self, batch, outputs):
        stops = [("gen",) if it + 1 >= x else () for x, it in batch]
        return stops[:-1] if self.bad_stop and len(batch) > 1 else stops


def chain(subs) -> mstar_rt.Model:
    class Chain(mstar_rt.Model):  # no next_walk: the Conductor finishes requests itself
        inputs = ("x",)
        nodes = [GraphNode("a", ["x"], ["y"]), GraphNode("b", ["y"], [GraphEdge(EMIT, "z")])]
        walks = {"main": Sequential("a", "b")}
        submodules = subs
    return Chain()


def counter(sub) -> mstar_rt.Model:
    class Counter(mstar_rt.Model):
        inputs = ("x",)
        nodes = [GraphNode("gen", ["x"], [GraphEdge(EMIT, "tok")])]
        walks = {"decode": DynamicLoop("gen", 100, "gen")}
        submodules = {"gen": sub}
    return Counter()


def test_a_model_without_next_walk_is_finished_by_the_conductor_with_its_timeline():
    with mstar_rt.Runtime(chain({"a": Add("y", 1), "b": Add("z", 10)})) as rt:
        assert not rt._has_next_walk  # the path under test
        hs = [rt.submit({"x": x}) for x in range(40)]
        for x, h in enumerate(hs):
            assert h.result(timeout=T) == {"z": [x + 11]}
            stats = h.stats()
            assert [s["node"] for s in stats] == ["a", "b"]
            assert all(s["walk"] == "main" and s["queued"] <= s["started"] <= s["finished"]
                       for s in stats)
        assert h.chrome_trace()["traceEvents"][1]["name"] == "b"
        assert settled(rt) == ZERO_LIVE


def test_a_failing_forward_fails_only_its_request_and_names_the_node():
    a = Add("y", 1, bad={3}, as_tuple=True)  # a tuple of results is accepted too
    gate = threading.Event()
    b = Add("z", 10)
    b_forward = b.forward
    b.forward = lambda batch: (gate.wait(T), b_forward(batch))[1]  # let the batch fill up
    with mstar_rt.Runtime(chain({"a": a, "b": b})) as rt:
        hs = {x: rt.submit({"x": x}) for x in range(6)}
        gate.set()
        with pytest.raises(RequestFailed, match=r"node 'a'.*ValueError: bad value 3"):
            hs[3].result(timeout=T)
        for x in (0, 1, 2, 4, 5):
            assert hs[x].result(timeout=T) == {"z": [x + 11]}
        assert max(a.batches) > 1  # the failure came in a batch, and only x=3 failed
        assert settled(rt) == ZERO_LIVE


def test_a_batch_with_the_wrong_number_of_results_is_rerun_item_by_item():
    class FirstOnly(Add):
        def forward(self, batch):
            return super().forward(batch)[:1]  # right for one item, wrong for more

    a, b, gate = FirstOnly("y", 1), Add("z", 10), threading.Event()
    b_forward = b.forward
    b.forward = lambda batch: (gate.wait(T), b_forward(batch))[1]
    with mstar_rt.Runtime(chain({"a": a, "b": b})) as rt:
        first = rt.submit({"x": 100})  # holds the worker in b while the rest queue at a
        assert wait_until(lambda: a.batches == [1])
        hs = [rt.submit({"x": x}) for x in range(5)]
        gate.set()
        assert first.result(timeout=T) == {"z": [111]}
        for x, h in enumerate(hs):
            assert h.result(timeout=T) == {"z": [x + 11]}
        assert a.batches[1:7] == [5, 1, 1, 1, 1, 1]  # the batch, then each item alone
        assert settled(rt) == ZERO_LIVE


@pytest.mark.parametrize("fault", ["none", "prepare", "stop"])
def test_hooks_run_by_the_conductor_stop_each_request_at_its_own_iteration(fault):
    sub = Count(bad_prepare=5 if fault == "prepare" else None, bad_stop=fault == "stop")
    with mstar_rt.Runtime(counter(sub)) as rt:
        xs = [random.Random(i).randint(1, 30) for i in range(24)] + [5]
        hs = [rt.submit({"x": x}) for x in xs]
        for x, h in zip(xs, hs):
            if fault == "prepare" and x == 5:
                with pytest.raises(RequestFailed, match="KeyError: 'prepare refused'"):
                    h.result(timeout=T)
                continue
            # A check_stop answering for too few items is rerun one by one: still exact.
            assert h.result(timeout=T) == {"tok": list(range(x))}
        assert settled(rt) == ZERO_LIVE


def test_loops_and_many_requests_with_cancellation_leave_nothing_behind():
    class Looped(mstar_rt.Model):
        inputs = ("x",)
        nodes = [GraphNode("step", ["x"], ["x"])]
        walks = {"loop": Loop("step", 50, outputs=["x"])}
        submodules = {"step": Add("x", 1, max_batch=64)}

    rng = random.Random(0)
    with mstar_rt.Runtime(Looped()) as rt:
        hs = [rt.submit({"x": i}) for i in range(2000)]
        cancelled = {i for i in range(2000) if rng.random() < 0.3 and hs[i].cancel()}
        for i, h in enumerate(hs):
            if i not in cancelled:
                h.result(timeout=30)
        assert settled(rt, timeout=10) == ZERO_LIVE


def test_work_context_is_a_small_c_type_that_behaves_like_the_python_class():
    req = RequestContext(7, {"x": 1})
    ctx = WorkContext(req, 3)
    assert ctx.request is req and ctx.iteration == 3
    assert repr(ctx) == "WorkContext(request=7, iteration=3)"
    assert WorkContext(request=req).iteration == 0
    ctx.iteration = 4
    assert ctx.iteration == 4
    with pytest.raises(TypeError):
        WorkContext()
    with pytest.raises(TypeError):
        WorkContext(req, "three")
    # It holds the request alive and takes part in garbage collection (cycles are freed).
    req.state["self"] = WorkContext(req, 0)
    del ctx, req
    gc.collect()
    assert mstar_rt.WorkContext is WorkContext


def test_a_forward_replaced_while_serving_is_the_one_called():
    a = Add("y", 1)
    with mstar_rt.Runtime(chain({"a": a, "b": Add("z", 10)})) as rt:
        assert rt.submit({"x": 1}).result(timeout=T) == {"z": [12]}
        a.forward = lambda batch: [{"y": -d["x"]} for d in batch]  # e.g. a test's spy
        assert rt.submit({"x": 1}).result(timeout=T) == {"z": [9]}

"""The in-process Runtime over the C++ Conductor: request lifecycle. Cancellation, deadline and
priority order, many concurrent requests without leaks, close, per-request cleanup and the Chrome
trace."""

import json
import random
import threading
import time
from collections import Counter

import pytest

import mstar_rt
from mstar_rt import (
    EMIT,
    GraphEdge,
    GraphNode,
    Loop,
    Parallel,
    RequestCancelled,
    RequestFailed,
    Runtime,
    Sequential,
    StreamingGraphEdge,
)

from walk_models import (
    ZERO_LIVE,
    CtxFn,
    Fn,
    Gate,
    WalkModel,
    close_within,
    drain,
    engine_threads,
    settled,
    wait_until,
)

T = 5.0  # seconds: the longest any single wait in this file may take


# ---- cancellation ---------------------------------------------------------------------------------

def _slow_counter(reached: threading.Event, at: int, delay: float):
    """+1 per iteration; sets ``reached`` at iteration ``at``; slow only for request input x=0."""
    def step(d, ctx):
        if ctx.iteration == at:
            reached.set()
        if ctx.request.inputs["x"] == 0:
            time.sleep(delay)
        return {"s": d["s"] + 1}
    return CtxFn(step)


def test_cancel_mid_loop_raises_request_cancelled_and_frees_everything(serve):
    reached = threading.Event()
    nodes = [GraphNode("init", ["x"], ["s"]), GraphNode("step", ["s"], [GraphEdge(EMIT, "s")])]
    rt = serve(WalkModel(nodes, {"w": Sequential("init", Loop("step", 1000))},
                         {"init": Fn(lambda d: {"s": d["x"]}), "step": _slow_counter(reached, 5, 0.002)}))
    h = rt.submit({"x": 0})
    assert reached.wait(T)
    assert h.cancel() is True
    with pytest.raises(RequestCancelled):
        h.result(timeout=T)
    events, error = drain(h, T)
    assert isinstance(error, RequestCancelled) and events == []  # what it made is dropped
    assert h.cancel() is False  # already over
    assert settled(rt) == ZERO_LIVE
    # the runtime goes on serving
    assert rt.submit({"x": 1000}).result(timeout=T)["s"] == list(range(1001, 2001))


def test_cancel_mid_stream_raises_request_cancelled_and_frees_everything(serve):
    windows = threading.Event()
    nodes = [GraphNode("gen", ["x"], [StreamingGraphEdge("snac", "tok", mstar_rt.SlidingWindow(4, 2))]),
             GraphNode("snac", ["tok"], [GraphEdge(EMIT, "audio")])]

    def snac(d):
        windows.set()
        return {"audio": sum(d["tok"].new_items)}

    def gen(d, ctx):
        time.sleep(0.001)
        return {"tok": ctx.iteration}

    rt = serve(WalkModel(nodes, {"w": Parallel(Loop("gen", 5000), "snac")},
                         {"gen": CtxFn(gen), "snac": Fn(snac)}))
    h = rt.submit({"x": 0})
    assert windows.wait(T)
    it = iter(h)
    assert next(it) == ("audio", 0 + 1 + 2 + 3)
    time.sleep(0.05)  # more windows queue up, not yet taken
    assert h.cancel() is True
    # A barge-in: what was queued is dropped, never yielded (a voice agent played it on).
    with pytest.raises(RequestCancelled):
        next(it)
    events, error = drain(h, T)
    assert isinstance(error, RequestCancelled) and events == []
    assert settled(rt) == ZERO_LIVE


def test_cancel_of_a_queued_request_drops_it_before_it_runs(serve):
    gate = Gate(lambda d: {"y": d["x"]})
    nodes = [GraphNode("g", ["x"], ["y"]), GraphNode("b", ["y"], [GraphEdge(EMIT, "z")])]
    b = Fn(lambda d: {"z": d["y"] + 1})
    rt = serve(WalkModel(nodes, {"w": Sequential("g", "b")}, {"g": gate, "b": b}))
    first = rt.submit({"x": 1})
    gate.wait_entered()
    queued = rt.submit({"x": 2})
    assert rt.live["queued"] == 1
    assert queued.cancel() is True
    assert rt.live["queued"] == 0
    gate.open()
    assert first.result(timeout=T) == {"z": [2]}
    with pytest.raises(RequestCancelled):
        queued.result(timeout=T)
    assert queued.stats() == []
    assert b.batches == [1]  # only the first request ever reached b
    assert settled(rt) == ZERO_LIVE


def test_cancel_while_next_walk_runs_does_not_stall_requests_of_the_same_batch(serve):
    release_first, in_next_walk, release_next_walk = (threading.Event() for _ in range(3))

    def next_walk(req, finished, persisted):
        if finished != "w1":
            return None
        if req.inputs["x"] == 0:  # the blocker: holds the engine while the others queue
            release_first.wait(T)
            return None
        if req.inputs["x"] == 1:  # cancelled while we are in here
            in_next_walk.set()
            release_next_walk.wait(T)
        return "w2"

    a = Fn(lambda d: {"y": d["x"]}, max_batch=4)
    nodes = [GraphNode("a", ["x"], [GraphEdge(EMIT, "y")]),
             GraphNode("b", ["x"], [GraphEdge(EMIT, "z")])]
    rt = serve(WalkModel(nodes, {"w1": "a", "w2": "b"},
                         {"a": a, "b": Fn(lambda d: {"z": d["x"] * 10})}, next_walk=next_walk))
    h0 = rt.submit({"x": 0})
    assert wait_until(lambda: a.batches == [1], T)
    h1, h2 = rt.submit({"x": 1}), rt.submit({"x": 2})
    release_first.set()
    assert in_next_walk.wait(T)
    assert h1.cancel() is True
    release_next_walk.set()
    assert h0.result(timeout=T) == {"y": [0]}
    with pytest.raises(RequestCancelled):
        h1.result(timeout=T)
    assert h2.result(timeout=1) == {"y": [2], "z": [20]}
    assert a.batches == [1, 2]  # forward ran once per batch
    assert settled(rt) == ZERO_LIVE


# ---- scheduling order -----------------------------------------------------------------------------

def _order(handles: dict) -> list:
    """(label, node) of every execution across requests, in the order they started."""
    recs = [(r["started"], label, r["node"]) for label, h in handles.items() for r in h.stats()]
    return [(label, node) for _, label, node in sorted(recs)]

def _gated_two_step(max_batch=1):
    gate = Gate(lambda d: {"y": d["x"]}, max_batch=max_batch)
    nodes = [GraphNode("g", ["x"], ["y"]), GraphNode("w", ["y"], [GraphEdge(EMIT, "z")])]
    model = WalkModel(nodes, {"main": Sequential("g", "w")},
                      {"g": gate, "w": Fn(lambda d: {"z": d["y"] * 2}, max_batch=max_batch)})
    return gate, model


def _interleaved(labels):
    return [(label, node) for label in labels for node in ("g", "w")]


def test_urgent_deadline_submitted_last_overtakes_queued_requests(serve):
    gate, model = _gated_two_step()
    rt = serve(model)
    handles = {"r0": rt.submit({"x": 0})}
    gate.wait_entered()  # r0 holds the only engine; the rest queue
    for i in range(1, 7):
        handles[f"r{i}"] = rt.submit({"x": i})
    handles["urgent"] = rt.submit({"x": 99}, deadline=0.001)
    gate.open()
    for label, h in handles.items():
        x = 99 if label == "urgent" else int(label[1:])
        assert h.result(timeout=T) == {"z": [2 * x]}
    assert _order(handles) == ([("r0", "g"), ("urgent", "g"), ("urgent", "w"), ("r0", "w")]
                               + _interleaved(f"r{i}" for i in range(1, 7)))


def test_earlier_deadline_goes_first_and_beats_priority(serve):
    gate, model = _gated_two_step()
    rt = serve(model)
    handles = {"r0": rt.submit({"x": 0})}
    gate.wait_entered()
    handles["late"] = rt.submit({"x": 1}, deadline=60.0)
    handles["vip"] = rt.submit({"x": 2}, priority=100)  # no deadline: after every deadline
    handles["soon"] = rt.submit({"x": 3}, deadline=30.0)
    gate.open()
    for h in handles.values():
        h.result(timeout=T)
    assert _order(handles) == ([("r0", "g")] + _interleaved(["soon", "late"])
                               + [("vip", "g"), ("vip", "w"), ("r0", "w")])


def test_higher_priority_submitted_last_overtakes_and_ties_keep_submission_order(serve):
    gate, model = _gated_two_step()
    rt = serve(model)
    handles = {"r0": rt.submit({"x": 0})}
    gate.wait_entered()
    handles["low"] = rt.submit({"x": 1}, priority=-3)
    for i in range(2, 6):
        handles[f"r{i}"] = rt.submit({"x": i})
    handles["vip"] = rt.submit({"x": 9}, priority=5)
    gate.open()
    for h in handles.values():
        h.result(timeout=T)
    assert _order(handles) == ([("r0", "g"), ("vip", "g"), ("vip", "w"), ("r0", "w")]
                               + _interleaved([f"r{i}" for i in range(2, 6)] + ["low"]))


# ---- scale ----------------------------------------------------------------------------------------

def _busy_model(max_batch=64):
    nodes = [GraphNode("a", ["x"], ["h"]),
             GraphNode("l", ["h"], ["l"]), GraphNode("r", ["h"], ["r"]),
             GraphNode("j", ["l", "r"], ["s"]),
             GraphNode("step", ["s"], ["s"]),
             GraphNode("out", ["s"], [GraphEdge(EMIT, "y")])]
    subs = {"a": Fn(lambda d: {"h": d["x"] * 3}, max_batch),
            "l": Fn(lambda d: {"l": d["h"] + 1}, max_batch),
            "r": Fn(lambda d: {"r": d["h"] - 1}, max_batch),
            "j": Fn(lambda d: {"s": d["l"] * d["r"]}, max_batch),
            "step": Fn(lambda d: {"s": d["s"] + 1}, max_batch),
            "out": Fn(lambda d: {"y": d["s"]}, max_batch)}
    walk = Sequential("a", Parallel("l", "r"), "j", Loop("step", 3, outputs=["s"]), "out")
    return WalkModel(nodes, {"w": walk}, subs)


def test_a_thousand_concurrent_requests_all_get_their_own_exact_result(serve):
    rt = serve(_busy_model())
    handles = {}
    lock = threading.Lock()

    def submitter(xs):
        for x in xs:
            h = rt.submit({"x": x})
            with lock:
                handles[x] = h

    threads = [threading.Thread(target=submitter, args=(range(k, 1000, 4),)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(T)
    assert len(handles) == 1000
    for x, h in handles.items():
        assert h.result(timeout=30) == {"y": [9 * x * x - 1 + 3]}
    assert max(r["batch_size"] for h in handles.values() for r in h.stats()) > 1
    assert settled(rt) == ZERO_LIVE


def test_ten_thousand_requests_with_random_cancellation_leave_nothing_behind():
    rng = random.Random(1234)
    nodes = [GraphNode("a", ["x"], ["y"]), GraphNode("b", ["y"], [GraphEdge(EMIT, "z")])]
    subs = {"a": Fn(lambda d: {"y": d["x"] + 1}, 64), "b": Fn(lambda d: {"z": d["y"] * 2}, 64)}
    rt = Runtime(WalkModel(nodes, {"w": Sequential("a", "b")}, subs))
    try:
        handles, cancelled = [], set()
        for x in range(10_000):
            handles.append(rt.submit({"x": x}))
            if rng.random() < 0.1 and handles[-1].cancel():  # right away
                cancelled.add(x)
            if rng.random() < 0.2:  # some earlier request, queued, running or done
                y = rng.randrange(len(handles))
                if handles[y].cancel():
                    cancelled.add(y)
        assert len(cancelled) > 500
        for x, h in enumerate(handles):
            if x in cancelled:
                with pytest.raises(RequestCancelled):
                    h.result(timeout=T)
            else:
                assert h.result(timeout=T) == {"z": [2 * x + 2]}
        assert settled(rt) == ZERO_LIVE
    finally:
        close_within(rt)
    assert engine_threads() == []
    assert rt.live == ZERO_LIVE

# ---- lifecycle ------------------------------------------------------------------------------------

def test_close_with_requests_in_flight_returns_cancels_them_and_joins_the_workers():
    def step(d):
        time.sleep(0.005)
        return {"s": d["s"] + 1}

    nodes = [GraphNode("init", ["x"], ["s"]), GraphNode("step", ["s"], [GraphEdge(EMIT, "s")])]
    rt = Runtime(WalkModel(nodes, {"w": Sequential("init", Loop("step", 500))},
                           {"init": Fn(lambda d: {"s": d["x"]}, 4), "step": Fn(step, 4)}),
                 poll_s=0.05)
    hs = [rt.submit({"x": x}) for x in range(10)]
    assert wait_until(lambda: any(r["node"] == "step" for r in hs[0].stats()), T)
    assert engine_threads()
    took = close_within(rt, timeout=T)
    assert took < 2.0
    assert engine_threads() == []
    for h in hs:
        assert h.done
        with pytest.raises(RequestCancelled):
            h.result(timeout=0)
    assert rt.live == ZERO_LIVE
    with pytest.raises(RuntimeError, match="closed"):
        rt.submit({"x": 0})
    close_within(rt)  # a second close is a no-op


def test_close_with_a_timeout_returns_while_a_node_never_returns():
    # It joined the engine threads forever: a stop of `mstar-rt serve` hung on one stuck node.
    entered, release = threading.Event(), threading.Event()

    def stuck(d):
        entered.set()
        release.wait(T)
        return {"y": d["x"]}

    nodes = [GraphNode("a", ["x"], [GraphEdge(EMIT, "y")])]
    rt = Runtime(WalkModel(nodes, {"w": "a"}, {"a": Fn(stuck)}))
    h = rt.submit({"x": 1})
    assert entered.wait(T)
    t0 = time.monotonic()
    assert rt.close(timeout=0.2) is False
    assert time.monotonic() - t0 < 1.0
    with pytest.raises(RequestCancelled):
        h.result(timeout=0)
    release.set()
    assert rt.close(timeout=T) is True
    assert engine_threads() == []


def test_runtime_as_context_manager_closes_on_exit():
    nodes = [GraphNode("a", ["x"], [GraphEdge(EMIT, "y")])]
    with Runtime(WalkModel(nodes, {"w": "a"}, {"a": Fn(lambda d: {"y": -d["x"]})})) as rt:
        assert rt.submit({"x": 2}).result(timeout=T) == {"y": [-2]}
        assert engine_threads()
    assert engine_threads() == []


def test_cleanup_runs_once_per_submodule_for_finished_failed_and_cancelled_requests(serve):
    class Tracked(Fn):
        def __init__(self, fn):
            super().__init__(fn)
            self.cleaned = []

        def cleanup(self, request):
            self.cleaned.append(request.id)

    gate = Gate(lambda d: {"y": d["x"]})
    gate.cleaned = []
    gate.cleanup = lambda request: gate.cleaned.append(request.id)

    def fn(d):
        if d["y"] == 1:
            raise ValueError("nope")
        return {"z": d["y"]}

    b = Tracked(fn)
    nodes = [GraphNode("g", ["x"], ["y"]), GraphNode("b", ["y"], [GraphEdge(EMIT, "z")])]
    rt = serve(WalkModel(nodes, {"w": Sequential("g", "b")}, {"g": gate, "b": b}))
    ok = rt.submit({"x": 0})
    gate.wait_entered()
    failed, cancelled = rt.submit({"x": 1}), rt.submit({"x": 2})
    cancelled.cancel()
    gate.open()
    ok.result(timeout=T)
    with pytest.raises(RequestFailed):
        failed.result(timeout=T)
    ids = sorted([ok.id, failed.id, cancelled.id])
    assert sorted(b.cleaned) == ids and sorted(gate.cleaned) == ids


def test_cleanup_runs_once_per_request_for_a_submodule_shared_by_two_nodes(serve):
    class Shared(mstar_rt.NodeSubmodule):
        def __init__(self):
            self.cleaned = []

        def forward(self, batch):
            return [{"h": d["x"] + 1} if "x" in d else {"o": d["h"] * 2} for d in batch]

        def cleanup(self, request):
            self.cleaned.append(request.id)

    lm = Shared()
    nodes = [GraphNode("prefill", ["x"], ["h"]), GraphNode("decode", ["h"], [GraphEdge(EMIT, "o")])]
    rt = serve(WalkModel(nodes, {"w": Sequential("prefill", "decode")},
                         {"prefill": lm, "decode": lm}))
    h = rt.submit({"x": 1})
    assert h.result(timeout=T) == {"o": [4]}
    assert lm.cleaned == [h.id]


def test_chrome_trace_is_json_with_one_complete_event_per_node_execution(serve, tmp_path):
    nodes = [GraphNode("a", ["x"], ["y"]), GraphNode("b", ["y"], ["y"]),
             GraphNode("c", ["y"], [GraphEdge(EMIT, "c")]), GraphNode("d", ["y"], [GraphEdge(EMIT, "d")])]
    subs = {"a": Fn(lambda d: {"y": d["x"]}), "b": Fn(lambda d: {"y": d["y"] + 1}),
            "c": Fn(lambda d: {"c": d["y"]}), "d": Fn(lambda d: {"d": -d["y"]})}
    walk = Sequential("a", Loop("b", 3, outputs=["y"]), Parallel("c", "d"))
    rt = serve(WalkModel(nodes, {"w": walk}, subs, engines={"d": "side"}))
    h = rt.submit({"x": 1})
    assert h.result(timeout=T) == {"c": [4], "d": [-4]}
    trace = json.loads(json.dumps(h.chrome_trace()))
    events = trace["traceEvents"]
    assert len(events) == len(h.stats()) == 6
    assert all(e["ph"] == "X" for e in events)
    assert Counter(e["name"] for e in events) == {"a": 1, "b": 3, "c": 1, "d": 1}
    for e in events:
        assert e["cat"] == "w" and e["pid"] == h.id and e["dur"] >= 0 and e["ts"] > 0
        assert e["tid"] == ("side" if e["name"] == "d" else "default")
    assert [e["args"]["iteration"] for e in events if e["name"] == "b"] == [0, 1, 2]
    path = tmp_path / "trace.json"
    h.save_chrome_trace(str(path))
    assert json.loads(path.read_text()) == trace

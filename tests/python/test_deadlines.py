"""Deadlines that are kept (``fail_late``): work that would start late fails its request with
DeadlineExceeded naming the node, submit refuses a request the queue ahead cannot serve in time,
an idle worker clears late work before taking a batch, nothing is left behind, and without the
option a deadline only orders work. Over HTTP: 504 for a late request, 503 for a refused one."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from mstar_rt import DeadlineExceeded, EMIT, GraphEdge, GraphNode, RequestFailed, Sequential, _core
from mstar_rt.runtime import compile_model

from test_serve_support import Counter, serving
from test_serve_support import settled as server_settled
from walk_models import ZERO_LIVE, Fn, Gate, WalkModel, settled

T = 5.0


def _gated_two_step():
    gate = Gate(lambda d: {"y": d["x"]})
    nodes = [GraphNode("g", ["x"], ["y"]), GraphNode("w", ["y"], [GraphEdge(EMIT, "z")])]
    return gate, WalkModel(nodes, {"main": Sequential("g", "w")},
                           {"g": gate, "w": Fn(lambda d: {"z": d["y"] * 2})})


def _slow_two_step(seconds: float):
    def slow(d):
        time.sleep(seconds)
        return {"y": d["x"]}
    nodes = [GraphNode("slow", ["x"], ["y"]), GraphNode("w", ["y"], [GraphEdge(EMIT, "z")])]
    return WalkModel(nodes, {"main": Sequential("slow", "w")},
                     {"slow": Fn(slow), "w": Fn(lambda d: {"z": d["y"] * 2})})


def test_work_that_would_start_late_fails_with_deadline_exceeded_naming_the_node(serve):
    gate, model = _gated_two_step()
    rt = serve(model)
    first = rt.submit({"x": 0})
    gate.wait_entered()  # the only engine is busy: the next request queues
    kept = rt.submit({"x": 1}, deadline=0.02, fail_late=True)
    time.sleep(0.06)
    gate.open()
    with pytest.raises(DeadlineExceeded) as e:
        kept.result(timeout=T)
    assert e.value.node == "g" and not e.value.refused and e.value.late_s > 0.02
    assert "deadline exceeded: node 'g' in walk 'main'" in str(e.value)
    assert isinstance(e.value, RequestFailed)  # code that catches RequestFailed still works
    assert gate.batches == [1]  # the late request never ran
    assert first.result(timeout=T) == {"z": [0]}
    assert settled(rt) == ZERO_LIVE


def test_without_fail_late_a_deadline_only_orders_work(serve):
    gate, model = _gated_two_step()
    rt = serve(model)
    first = rt.submit({"x": 0})
    gate.wait_entered()
    late = rt.submit({"x": 1}, deadline=0.02)
    time.sleep(0.06)
    gate.open()
    assert late.result(timeout=T) == {"z": [2]}
    assert first.result(timeout=T) == {"z": [0]}
    assert settled(rt) == ZERO_LIVE


def test_submit_refuses_a_request_the_queue_ahead_cannot_serve_in_time(serve):
    rt = serve(_slow_two_step(0.02))
    rt.submit({"x": 0}).result(timeout=T)  # the runtime learns "slow" takes ~20 ms
    ahead = [rt.submit({"x": k}, deadline=0.1) for k in range(10)]  # ~200 ms of work
    with pytest.raises(DeadlineExceeded) as e:
        rt.submit({"x": 99}, deadline=0.101, fail_late=True)
    assert e.value.refused and e.value.node == "slow" and e.value.late_s > 0.03
    assert "deadline cannot be met" in str(e.value) and "refused at submit" in str(e.value)
    # Room left, or ahead of the queue by its deadline: admitted.
    later = rt.submit({"x": 7}, deadline=30.0, fail_late=True)
    for k, h in enumerate(ahead):
        assert h.result(timeout=T) == {"z": [2 * k]}
    assert later.result(timeout=T) == {"z": [14]}
    assert settled(rt) == ZERO_LIVE


def test_the_runtime_default_applies_and_submit_overrides_it(serve):
    rt = serve(_slow_two_step(0.0), fail_late=True)
    with pytest.raises(DeadlineExceeded) as e:
        rt.submit({"x": 1}, deadline=1e-9)  # passed before the Conductor saw it
    assert e.value.refused and "the deadline passed" in str(e.value)
    assert rt.submit({"x": 1}, deadline=1e-9, fail_late=False).result(timeout=T) == {"z": [2]}
    assert rt.submit({"x": 2}).result(timeout=T) == {"z": [4]}  # no deadline: nothing to keep
    assert settled(rt) == ZERO_LIVE


def test_a_worker_clears_late_work_before_it_takes_a_batch_and_reports_it():
    _, model = _gated_two_step()
    c = _core.Conductor(compile_model(model).spec)
    reports = []
    c.set_reporter(reports.append)
    rid, outcome = c.submit(0, {0: 5}, time.monotonic_ns() + 10_000_000, 0, True)
    assert not outcome.failed
    time.sleep(0.03)
    assert c.next_batch(0, 8, 0.05) is None  # the late item is not handed out...
    (report,) = reports  # ...but failed and reported
    assert [r for r, _ in report.failed] == [rid]
    (request, node, refused, late_s), = report.expired
    assert (request, node, refused) == (rid, "g", False) and late_s >= 0.02
    assert (c.live_requests, c.live_handles, c.stored, c.queued_items) == (0, 0, 0, 0)


def test_many_kept_requests_under_overload_all_end_and_leave_nothing(serve):
    rt = serve(_slow_two_step(0.002))
    outcomes = {"ok": 0, "late": 0, "refused": 0}
    handles = []
    for k in range(200):
        try:
            handles.append(rt.submit({"x": k}, deadline=0.01 + (k % 7) * 0.005, fail_late=True))
        except DeadlineExceeded as e:
            assert e.refused
            outcomes["refused"] += 1
    for h in handles:
        try:
            h.result(timeout=T)
            outcomes["ok"] += 1
        except DeadlineExceeded as e:
            assert not e.refused
            outcomes["late"] += 1
    assert sum(outcomes.values()) == 200
    assert outcomes["ok"] > 0 and outcomes["late"] + outcomes["refused"] > 0, outcomes
    assert settled(rt) == ZERO_LIVE


# ---- over HTTP ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def counter():
    model = Counter()
    with serving(model, name="counter", max_concurrent_requests=4) as s:
        s.model = model
        yield s


def test_generate_answers_503_for_a_refused_request_and_504_for_a_late_one(counter):
    r = httpx.post(counter.url + "/generate",
                   json={"inputs": {"n": 1}, "deadline_s": 1e-9, "fail_late": True})
    assert r.status_code == 503, r.text
    assert r.json()["error"]["code"] == "deadline_refused"
    node = counter.model.node
    node.release.clear()
    held = threading.Thread(target=lambda: httpx.post(
        counter.url + "/generate", json={"inputs": {"n": 1, "hold": True}}, timeout=T))
    held.start()
    try:
        deadline = time.monotonic() + T
        while node.holding == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        answer = {}
        late = threading.Thread(target=lambda: answer.update(r=httpx.post(
            counter.url + "/generate",
            json={"inputs": {"n": 1}, "deadline_s": 0.05, "fail_late": True}, timeout=T)))
        late.start()
        time.sleep(0.2)
    finally:
        node.release.set()
    held.join(T)
    late.join(T)
    node.release.clear()
    node.holding = 0
    assert answer["r"].status_code == 504, answer["r"].text
    assert answer["r"].json()["error"]["code"] == "deadline_exceeded"
    assert "node 'count'" in answer["r"].json()["error"]["message"]
    assert server_settled(counter) == ZERO_LIVE
    metrics = httpx.get(counter.url + "/metrics").text
    assert 'status="deadline"' in metrics

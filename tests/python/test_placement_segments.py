"""Segments (issue 17, item 0): consecutive nodes of a walk on one worker run inside it, with one
parent round trip per segment. Outputs equal the in-process Runtime's (EMITs streamed in order,
state mirrored for next_walk, persisted values across walks); a failure, a cancel, a deadline
and a dying worker fail exactly their requests and leave nothing held; where a segment would be
unsafe (streams, a KV engine split over workers without moving K/V or inside a Part, loops run
by the parent) the per-node path stays (a KV engine on one worker: test_placement_kv_segments.py)."""

from __future__ import annotations

import time

import pytest
import torch

from mstar_rt import (EMIT, Fixed, GraphEdge, GraphNode, Loop, Model, Parallel, Part,
                      RequestCancelled, RequestFailed, Runtime, Sequential, StreamingGraphEdge)
from mstar_rt.placement import NodeGroup, PlacedRuntime
from mstar_rt.placement.segments import find_segments

import placement_models as pm
import placement_segment_models as sm
from placement_support import T, kill_mid_run, pipeline_inputs, same
from walk_models import settled, wait_until


@pytest.fixture(scope="module")
def placed():
    rt = PlacedRuntime("placement_segment_models:segmented", [NodeGroup(sm.GROUP, rank=1)],
                       progress=False, shm_bytes=1 << 20)
    yield rt
    rt.close()


def inputs(i: int, **kw) -> dict:
    return {"x": torch.linspace(-1, 1, 4) * (i + 1), "n": 3 + i % 5, **kw}


def worker_idle(rt: PlacedRuntime, rank: int = 1) -> dict:
    want = dict(requests=0, handles=0, stored=0, queued=0, inflight=0)
    assert wait_until(lambda: (s := rt.worker_stats(rank))["live_requests"] == 0
                      and s["segment_runs"] == 0 and s["segment_live"] == want, T)
    return rt.worker_stats(rank)


def test_walks_become_segments_and_outputs_equal_in_process(placed):
    assert [n for n in placed.node_names if n.startswith("segment:")] == \
        ["segment:main:0", "segment:again:0"]
    cases = [inputs(i, again=bool(i % 2)) for i in range(6)]
    with Runtime(sm.segmented()) as local:
        want = [local.submit(c).result(T) for c in cases]
    one_by_one = [placed.submit(c).result(T) for c in cases]
    handles = [placed.submit(c) for c in cases]  # several runs batched into one message
    together = [h.result(T) for h in handles]
    for w, a, b in zip(want, one_by_one, together):
        assert same(a, w) and same(b, w)
        assert len(w["tok"]) >= 3
    with Runtime(sm.segmented()) as local:
        tokens = local.submit(inputs(0, n=6)).result(T)["tok"]
    streamed = list(placed.submit(inputs(0, n=6)))  # EMITs arrive in order, before the end
    assert [v for k, v in streamed if k == "tok"] == tokens
    assert streamed[-1][0] == "y"
    assert settled(placed) == dict(requests=0, handles=0, stored=0, queued=0, inflight=0)
    assert worker_idle(placed)["kv_pages_in_use"] == 0


def test_a_failing_node_inside_a_segment_fails_only_its_request(placed):
    bad = placed.submit(inputs(1, fail=True))
    good = placed.submit(inputs(2))
    with pytest.raises(RequestFailed, match="b fails on purpose"):
        bad.result(T)
    assert len(good.result(T)["y"]) == 1
    worker_idle(placed)


def test_cancel_and_timeout_inside_a_segment_free_the_run(placed):
    slow = placed.submit(inputs(0, n=60, pause=0.05))
    assert wait_until(lambda: placed.worker_stats(1)["segment_runs"] == 1, T)
    seen = next(iter(slow))  # a token streamed while the loop still runs
    assert seen[0] == "tok"
    slow.cancel()
    with pytest.raises(RequestCancelled):
        slow.result(T)
    late = placed.submit(inputs(0, n=60, pause=0.05), deadline=0.3, fail_late=True)
    with pytest.raises(RequestFailed):  # the parent's deadline ends it; the run is cancelled
        late.result(T)
    idle = worker_idle(placed)
    assert idle["segment_live"]["stored"] == 0
    assert placed.submit(inputs(3)).result(T)["y"]


def test_a_worker_dying_mid_segment_fails_its_requests_and_restarts():
    with PlacedRuntime("placement_segment_models:segmented", [NodeGroup(sm.GROUP, rank=1)],
                       progress=False, shm_bytes=1 << 20) as rt:
        kill_mid_run(rt, 1, rt.submit(inputs(0, n=60, pause=0.05)))
        assert len(rt.submit(inputs(1)).result(T)["tok"]) == 4
        assert settled(rt) == dict(requests=0, handles=0, stored=0, queued=0, inflight=0)


def test_segments_are_not_made_where_they_would_change_what_nodes_see():
    # A stream (backbone -> collect) with both ends on one worker is its segment's own; with
    # its consumer elsewhere it leaves the producer's loop item by item (pushes); entering a
    # section from outside, it enters through the stand-in (takes: test_placement_stream_in.py);
    # single nodes keep the per-node path.
    walk = pm.pipeline()
    ranks = {"encoder": 1, "embed": 0, "backbone": 2, "collect": 2, "head": 0}
    assert [s.nodes for s in find_segments(walk, ranks, {1, 2}).segments] == \
        [("backbone", "collect")] * 2
    assert "tok" not in find_segments(walk, ranks, {1, 2}).segments[0].inputs
    apart = find_segments(walk, dict(ranks, collect=1), {1, 2}).segments
    assert [(s.nodes, s.pushes) for s in apart] == [(("backbone",), ("tok",))] * 2
    assert "tok" in [getattr(o, "name", o) for o in apart[0].outputs]  # the stand-in streams it
    assert find_segments(walk, dict(ranks, collect=1, head=1), {1, 2}).segments == apart
    entering = Model()
    entering.nodes = [GraphNode("p", ["x"], ["x", StreamingGraphEdge("c", "s", Fixed(1))],
                                submodule=sm.Affine("x", "x", 1.0, 1.0)),
                      GraphNode("c", ["s"], ["y"], submodule=sm.Affine("s", "y", 1.0, 0.0)),
                      GraphNode("d", ["y"], [GraphEdge(EMIT, "z")],
                                submodule=sm.Affine("y", "z", 1.0, 0.0))]
    entering.inputs = ("x",)
    entering.walks = {"main": Parallel(Loop("p", 3), Sequential("c", "d"))}
    assert [(s.nodes, [e.name for _, e in s.takes]) for s in
            find_segments(entering, {"p": 0, "c": 1, "d": 1}, {1}).segments] == [(("c", "d"),
                                                                                   ["s"])]
    # the same stream leaving the producer's loop on a worker for the consumer's section
    assert [s.pushes for s in find_segments(entering, {"p": 1, "c": 0, "d": 0},
                                            {1}).segments] == [("s",)]
    # A loop the parent runs keeps its iterations there: nothing inside it is a segment.
    model = sm.segmented()
    model.walks = {"main": sm.DynamicLoop(sm.Sequential("a", "b", "post"), 4, "gen"),
                   "again": model.walks["again"]}
    plan = find_segments(model, {"pre": 0, "a": 1, "b": 1, "gen": 1, "post": 0, "c": 1,
                                 "d": 1}, {1})
    assert [s.walk for s in plan.segments] == ["again"]
    # A KV engine's nodes join segments only when all of them can (its pages live in one
    # Runtime): not split over two workers -- unless its requests' K/V move between them at
    # the walk change (test_placement_disagg.py).
    lm = pm.tiny_llama()
    assert find_segments(lm, {"prefill": 1, "decode": 2}, {1, 2}).segments == []
    moving = find_segments(lm, {"prefill": 1, "decode": 2}, {1, 2}, moving={"lm"}).segments
    assert [(s.walk, s.rank, s.nodes) for s in moving] == [("prefill", 1, ("prefill",)),
                                                          ("decode", 2, ("decode",))]
    lm.walks = {"prefill": "prefill", "decode": Part("p", {"d": lm.walks["decode"]})}
    lm.nodes.append(sm.GraphNode("pre", ["x"], ["x2"], submodule=sm.Affine("x", "x2", 1.0, 0.0)))
    lm.inputs = (*lm.inputs, "x")
    on_one = {n.name: 1 for n in lm.nodes}
    plan = find_segments(lm, on_one, {1})  # a walk with Parts, whole on one worker: one segment
    assert [(s.walk, s.nodes) for s in plan.segments] == [("prefill", ("prefill",)),
                                                          ("decode", ("decode",))]
    # "pre" in the parent: the Part stays the parent's, its sub-walk (the decode loop) is a
    # section like any, here a segment; a Loop inside a loop the parent runs is not, unless
    # fixed and free of stops (test_a_fixed_loop_inside_a_parent_loop_runs_as_one_segment)
    lm.walks["decode"] = sm.Sequential("pre", lm.walks["decode"])
    plan = find_segments(lm, dict(on_one, pre=0), {1})
    assert [(s.walk, s.section) for s in plan.segments] == [("prefill", "prefill"),
                                                            ("decode", lm.walks["decode"].parts[1]
                                                             .walks["d"])]
    lm.walks["decode"] = sm.DynamicLoop(sm.Sequential("pre", lm.walks["decode"].parts[1]
                                                      .walks["d"]), 8, "outer")
    assert find_segments(lm, dict(on_one, pre=0), {1}).segments == []


@pytest.mark.parametrize("consumer", [1, 0])
def test_a_stream_leaving_a_segment_crosses_item_by_item(consumer):
    # backbone's loop on worker 2 streams tok to collect on worker 1 (or in the parent): the
    # loop is one segment run per request, its items pushed to the parent's stream as made.
    ranks = {"encoder": 1, "embed": 1, "backbone": 2, "collect": consumer, "head": 0}
    groups = [NodeGroup([n for n, r in ranks.items() if r == rank], rank=rank)
              for rank in (1, 2)]
    reqs = [dict(r, steps=8) for r in pipeline_inputs(6)]
    with Runtime(pm.pipeline()) as local:
        want = [local.submit(r).result(T) for r in reqs]
    with PlacedRuntime("placement_models:pipeline", groups, progress=False,
                       shm_bytes=1 << 20) as rt:
        assert [s for s in rt.node_names if s.startswith("segment:")] == \
            ["segment:full:0", "segment:direct:0"]
        before = rt.worker_stats(2)["messages"]
        handles = [rt.submit(r) for r in reqs]
        assert same([h.result(T) for h in handles], want)
        # a batch and a release per request at most (and a stats call), not one per step
        steps = sum(len(w["h"]) for w in want)
        assert rt.worker_stats(2)["messages"] - before <= 2 * len(reqs) + 1 < steps
        slow = rt.submit(dict(reqs[0], steps=8, pause=0.05))  # cancelled mid-stream
        assert next(iter(slow))[0] in ("meta", "h", "window")
        slow.cancel()
        for rank in (1, 2):
            assert worker_idle(rt, rank)["segment_runs"] == 0
        assert same(rt.submit(reqs[1]).result(T), want[1])


def test_a_walk_of_parts_on_one_worker_is_one_segment_and_the_model_picks_its_sub_walks():
    """The worker asks the model's next_part_walk for the request, as one process does: equal
    outputs either way the model picks, one run per request. With a sub-walk in the parent
    the parent picks the sub-walks, each sub-walk whole on the worker its own segment."""
    nodes = [n.name for n in sm.parted().nodes]
    plan = find_segments(sm.parted(), {n: 1 for n in nodes}, {1})
    assert [(s.walk, s.nodes) for s in plan.segments] == \
        [("main", ("a", "b", "c", "d", "post", "pre"))]
    split = find_segments(sm.parted(), {**{n: 1 for n in nodes}, "post": 0}, {1}).segments
    assert [s.nodes for s in split] == [("a", "b", "pre"), ("c", "d")]
    with Runtime(sm.parted()) as local, \
            PlacedRuntime("placement_segment_models:parted", [NodeGroup(nodes, rank=1)],
                          progress=False, shm_bytes=1 << 20) as rt, \
            PlacedRuntime("placement_segment_models:parted",
                          [NodeGroup([n for n in nodes if n != "post"], rank=1)],
                          progress=False, shm_bytes=1 << 20) as parted:
        assert [n for n in rt.node_names if n.startswith("segment:")] == ["segment:main:0"]
        assert [n for n in parted.node_names if n.startswith("segment:")] == \
            ["segment:main:0", "segment:main:1"]
        before = rt.worker_stats(1)["messages"]
        for i in range(4):
            c = inputs(i, again=bool(i % 2))
            want = local.submit(c).result(T)
            assert same(rt.submit(c).result(T), want)
            assert same(parted.submit(c).result(T), want)
        # a batch per request (a release may go on its own) and the stats call; node by node
        # each request would take four or five
        assert rt.worker_stats(1)["messages"] - before <= 9


def test_a_segments_plain_outputs_reach_the_parent():
    """A segment's outputs that no edge persists (``b``'s ``k``, read by the parent's ``c``)
    outlive the segment run's walk end and reach the parent."""
    x = torch.arange(4.0)
    with Runtime(sm.chain()) as local, \
            PlacedRuntime("placement_segment_models:chain", [NodeGroup(["a", "b"], rank=1)],
                          progress=False, shm_bytes=1 << 20) as rt:
        assert [n for n in rt.node_names if n.startswith("segment:")] == ["segment:w:0"]
        for i in range(3):
            assert same(rt.submit({"x": x + i}).result(T), local.submit({"x": x + i}).result(T))


def test_a_fixed_loop_inside_a_parent_loop_runs_as_one_segment():
    """The inner fixed Loop (a code predictor's steps) on a worker, inside a DynamicLoop the
    parent runs (a talker's): one segment run per outer iteration, its nodes seeing their own
    iterations and the request's state; outputs equal in-process and node by node."""
    plan = find_segments(sm.nested(), {"head": 0, "inner": 1}, {1})
    assert [(s.nodes, s.inputs, s.outputs) for s in plan.segments] == [(("inner",), ("z",),
                                                                        ("w",))]
    group = [NodeGroup(["inner"], rank=1)]
    with Runtime(sm.nested()) as local, \
            PlacedRuntime("placement_segment_models:nested", group, progress=False,
                          shm_bytes=1 << 20) as rt, \
            PlacedRuntime("placement_segment_models:nested", group, progress=False,
                          shm_bytes=1 << 20, segments=False) as per_node:
        assert [n for n in rt.node_names if n.startswith("segment:")] == ["segment:main:0"]
        counts = []
        for i, n in enumerate((1, 4, 6)):
            c = {"x": torch.linspace(-1, 1, 3) * (i + 1), "n": n}
            want = [v for _k, v in local.submit(c)]
            assert len(want) == n
            for placed in (rt, per_node):
                before = placed.worker_stats(1)["messages"]
                got = [v for _k, v in placed.submit(c)]
                counts.append(placed.worker_stats(1)["messages"] - before)
                assert len(got) == n and all(torch.equal(a, b) for a, b in zip(got, want))
        # 6 outer iterations: one message per inner loop (and a release, the stats call)
        # instead of one per inner step
        assert counts[-2] <= 6 + 2 and counts[-1] >= 6 * sm.Inner.steps
        # concurrent requests (their inner runs batched in the worker), and one cancelled
        # between iterations: equal outputs, nothing left held
        cases = [{"x": torch.linspace(0, 1, 3) - i, "n": 3 + i} for i in range(4)]
        handles = [rt.submit(c) for c in cases]
        doomed = rt.submit({"x": torch.ones(3), "n": 16})
        next(iter(doomed))
        doomed.cancel()
        for c, h in zip(cases, handles):
            want = [v for _k, v in local.submit(c)]
            assert all(torch.equal(a, b) for a, b in zip([v for _k, v in h], want, strict=True))
        with pytest.raises(RequestCancelled):
            doomed.result(T)
        assert worker_idle(rt)["segment_runs"] == 0 and settled(rt) == settled(local)


def test_segments_can_be_turned_off_and_give_the_same_outputs(placed):
    with PlacedRuntime("placement_segment_models:segmented", [NodeGroup(sm.GROUP, rank=1)],
                       progress=False, shm_bytes=1 << 20, segments=False) as rt:
        assert not any(n.startswith("segment:") for n in rt.node_names)
        for i in range(3):
            c = inputs(i, again=True)
            assert same(rt.submit(c).result(T), placed.submit(c).result(T))


def test_a_node_hung_inside_a_segment_is_seen_by_node_timeout():
    with PlacedRuntime("placement_segment_models:segmented", [NodeGroup(sm.GROUP, rank=1)],
                       progress=False, shm_bytes=1 << 20, restart="auto",
                       heartbeat_timeout_s=2.0, node_timeout_s=1.0) as rt:
        t0 = time.monotonic()
        stuck = rt.submit(inputs(0, n=3, pause=30.0))
        with pytest.raises(RequestFailed, match=r"hung in node 'gen'.*node_timeout_s=1"):
            stuck.result(T)
        assert time.monotonic() - t0 < 1.0 + 2.5
        assert wait_until(lambda: rt.workers[1]["state"] == "up", T)
        assert len(rt.submit(inputs(1)).result(T)["tok"]) == 4


def test_replies_queued_together_coalesce_up_to_a_bound_of_tensor_bytes():
    """A segment's replies queued while its sender was busy leave as one message -- tokens of
    a fast loop -- but large tensors only up to COALESCE_BYTES a message: twenty 1 MiB stream
    items in one message outgrew a 16 MiB arena and failed their request."""
    from mstar_rt.placement.segment_runner import COALESCE_BYTES, coalesce

    tokens = [("emit", {"emits": [[7, "tok", torch.tensor(i)]], "items": [1]}) for i in range(50)]
    (one,) = coalesce(tokens)
    assert [float(e[2]) for e in one[1]["emits"]] == list(range(50))
    frames = [("emit", {"emits": [[7, "f", torch.zeros(1 << 18)]], "items": [1]})
              for _ in range(20)]
    out = coalesce(frames)
    assert sum(len(m[1]["emits"]) for m in out) == 20
    assert all(sum(e[2].nbytes for e in m[1]["emits"]) <= COALESCE_BYTES for m in out)
    assert len(out) == 20 * (1 << 20) // COALESCE_BYTES
    big = [("done", {"node": 3, "items": [i], "outputs": [{"y": torch.zeros(1 << 21)}],
                     "states": {}, "stops": None}) for i in range(3)]  # 8 MiB each: alone
    assert [m[1]["items"] for m in coalesce(big)] == [[0], [1], [2]]

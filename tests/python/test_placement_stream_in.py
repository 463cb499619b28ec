"""Streams entering a segment (placement/stream_in.py): a talker-like loop on a worker reading
a thinker's streams from outside runs as one segment, its windows crossing one item each as they
are made, instead of one parent round trip per node and iteration. Outputs equal in-process
(the consumer's own windows, continuing after the stream ends, stopping before it does); a
failure before or after the last window fails exactly its request, naming the node; a cancel
mid-stream leaves nothing held; where entering would change what a node sees, the per-node path
stays."""

from __future__ import annotations

import time

import pytest
import torch

from mstar_rt import (EMIT, DynamicLoop, Fixed, GraphEdge, GraphNode, Loop, Model, Parallel,
                      RequestFailed, Runtime, Sequential, StreamingGraphEdge)
from mstar_rt.model import RequestContext
from mstar_rt.placement import NodeGroup, PlacedRuntime
from mstar_rt.placement.segment_runner import SegmentRunner
from mstar_rt.placement.segments import find_segments

import placement_segment_models as sm
from placement_support import T, kill_mid_run
from walk_models import wait_until

TALKER = {"talk": 2, "voice": 2}


def cases() -> list[dict]:
    """Talker shorter than, equal to and longer than the thinker, and a one-step thinker."""
    return [dict(x=torch.tensor(0.1 * (i + 1)), **kw) for i, kw in enumerate(
        [{}, dict(m=3), dict(n=1, m=4), dict(n=8, m=8), dict(n=6, m=11), dict(m=1)])]


def by_name(outputs: list) -> dict:
    """Each output name's values in order (names interleave by timing, each in its order)."""
    out: dict = {}
    for name, value in outputs:
        out.setdefault(name, []).append(round(float(value), 6))
    return out


def idle(rt: PlacedRuntime, rank: int) -> dict:
    want = dict(requests=0, handles=0, stored=0, queued=0, inflight=0)
    assert wait_until(lambda: (s := rt.worker_stats(rank))["live_requests"] == 0
                      and s["segment_runs"] == 0 and s["segment_live"] == want, T)
    return rt.worker_stats(rank)


def test_entering_streams_make_the_talker_loop_one_segment():
    plan = find_segments(sm.fed(), {"prefill": 0, "think": 0, **TALKER, "sink": 0}, {2})
    (seg,) = plan.segments
    assert seg.nodes == ("talk", "voice") and seg.pushes == ("frames",)
    assert [(p, e.name) for p, e in seg.takes] == [("prefill", "prompt"), ("think", "reply")]
    assert seg.reads == seg.inputs + ("prompt", "reply")  # its windows come in this order
    assert plan.walks["speak"].branches[1] == seg.name  # in no Loop: one run reads it whole
    assert plan.redirect == {("talk", "prompt"): seg.name, ("talk", "reply"): seg.name}
    # A thinker on a worker of its own streams from its decode loop's stand-in to the
    # talker's. Its prefill is no segment with the loop: the prompt's stream would end only
    # when the loop does, holding the talker back meanwhile (it stays node by node).
    both = find_segments(sm.fed(), {"prefill": 1, "think": 1, **TALKER, "sink": 0}, {1, 2})
    thinker, talker = both.segments
    assert thinker.nodes == ("think",) and talker.nodes == ("talk", "voice")
    assert [(o.to, o.name, repr(o.chunk_policy)) for o in thinker.outputs
            if isinstance(o, StreamingGraphEdge)] == [(talker.name, "reply", "Fixed(1)")]
    assert both.redirect == {("talk", "prompt"): talker.name, ("talk", "reply"): talker.name}


def test_entering_stays_per_node_where_it_would_change_what_nodes_see():
    # Inside a loop the parent runs, a stand-in would read one window per iteration.
    looped = sm.fed()
    looped.walks = {"speak": Parallel(Sequential("prefill", DynamicLoop("think", 8, "think")),
                                      DynamicLoop(Sequential("talk", Loop("voice", 1)), 8,
                                                  "talk"), "sink")}
    assert all(s.nodes != ("voice",) or not s.takes for s in
               find_segments(looped, {"voice": 2}, {2}).segments)
    # A producer that runs in another walk too: its edge cannot go to one walk's stand-in.
    shared = sm.fed()
    shared.walks = {**shared.walks, "think_only": Sequential("prefill",
                                                             DynamicLoop("think", 8, "think"),
                                                             "talk", "voice", "sink")}
    assert not any(s.takes for s in find_segments(shared, TALKER, {2}).segments)
    # A node inside reading the stream's name plainly would see a window instead.
    entering = Model()
    entering.nodes = [GraphNode("p", ["x"], ["x", StreamingGraphEdge("c", "s", Fixed(1))],
                                submodule=sm.Affine("x", "x", 1.0, 1.0)),
                      GraphNode("c", ["s"], ["y"], submodule=sm.Affine("s", "y", 1.0, 0.0)),
                      GraphNode("d", ["y", "s"], [GraphEdge(EMIT, "z")],
                                submodule=sm.Affine("y", "z", 1.0, 0.0))]
    entering.inputs = ("x",)
    entering.walks = {"main": Parallel(Loop("p", 3), Sequential("c", "d"))}
    assert find_segments(entering, {"p": 0, "c": 1, "d": 1}, {1}).segments == []


@pytest.mark.parametrize("thinker,sink", [(0, 0), (1, 0), (1, 2)])
def test_a_stream_entering_a_segment_crosses_window_by_window(thinker, sink):
    ranks = {"prefill": thinker, "think": thinker, **TALKER, "sink": sink}
    groups = [NodeGroup([n for n, r in ranks.items() if r == rank], rank=rank)
              for rank in sorted(set(ranks.values()) - {0})]
    reqs = cases()
    with Runtime(sm.fed()) as local:
        want = [by_name(local.submit(r)) for r in reqs]
    with PlacedRuntime("placement_segment_models:fed", groups, progress=False,
                       shm_bytes=1 << 20) as rt, \
            PlacedRuntime("placement_segment_models:fed", groups, progress=False,
                          shm_bytes=1 << 20, segments=False) as per_node:
        talker = [s for s in rt.node_names if s.startswith("segment:")][-1]
        assert rt.segments_enabled and talker not in per_node.node_names
        counts = []
        for r in (rt, per_node):
            before = r.worker_stats(2)["messages"]
            assert [by_name(r.submit(c)) for c in reqs] == want
            handles = [r.submit(c) for c in reqs]  # at once: windows of several requests
            assert [by_name(h) for h in handles] == want
            counts.append(r.worker_stats(2)["messages"] - before)
        # per request: a message per window of the thinker's streams (n, and the stream end),
        # a release, and the sink's windows when the sink runs there; not one per talker node
        # and step (node by node: 118-132 here, against 53-89)
        windows = sum(c.get("n", 5) + 2 + (sink == 2) * -(-c.get("m", 7) // 2) for c in reqs)
        assert counts[0] <= 2 * windows + 2 and counts[0] < counts[1]
        idle(rt, 2)


def test_a_failing_talker_fails_its_request_before_the_stream_ends():
    groups = [NodeGroup(list(TALKER), rank=2)]
    with PlacedRuntime("placement_segment_models:fed", groups, progress=False,
                       shm_bytes=1 << 20) as rt:
        assert any(s.startswith("segment:") for s in rt.node_names)
        # the thinker streams for 2 s; voice fails at its second step, long before
        t0 = time.monotonic()
        h = rt.submit(dict(x=torch.tensor(0.3), n=40, m=60, pause=0.05, fail_at=1))
        with pytest.raises(RequestFailed, match="node 'voice' in walk 'speak' failed: "
                                                "ValueError: voice fails on purpose"):
            h.result(T)
        assert time.monotonic() - t0 < 1.5
        # after the last window (the talker outlives the thinker), and at its first step
        for fail_at in (6, 0):
            with pytest.raises(RequestFailed, match="voice fails on purpose"):
                rt.submit(dict(x=torch.tensor(0.3), n=2, m=9, fail_at=fail_at)).result(T)
        idle(rt, 2)
        with Runtime(sm.fed()) as local:
            c = dict(x=torch.tensor(0.2), n=3)
            assert by_name(rt.submit(c)) == by_name(local.submit(c))


def test_a_cancel_mid_stream_leaves_nothing_held():
    groups = [NodeGroup(["prefill", "think"], rank=1), NodeGroup(list(TALKER), rank=2)]
    with PlacedRuntime("placement_segment_models:fed", groups, progress=False,
                       shm_bytes=1 << 20) as rt:
        slow = [rt.submit(dict(x=torch.tensor(0.1 * i), n=30, m=40, pause=0.02))
                for i in range(3)]
        for h in slow:
            assert next(iter(h))[0] in ("tok", "audio", "wave")
            h.cancel()
        for rank in (1, 2):
            idle(rt, rank)
        assert rt.live == dict(requests=0, handles=0, stored=0, queued=0, inflight=0)
        with Runtime(sm.fed()) as local:
            c = dict(x=torch.tensor(0.4), n=4, m=6)
            assert by_name(rt.submit(c)) == by_name(local.submit(c))


def test_the_talker_speaks_while_the_thinker_on_another_worker_still_thinks():
    """Each stream entering the talker's segment ends when its producer's scope does, as in one
    process: the prompt's (one prefill item) long before the thinker's decode loop ends, so the
    talker reads on past its first window while the thinker still streams."""
    groups = [NodeGroup(["prefill", "think"], rank=1), NodeGroup(list(TALKER), rank=2)]
    with PlacedRuntime("placement_segment_models:fed", groups, progress=False,
                       shm_bytes=1 << 20) as rt:
        names = [name for name, _ in rt.submit(dict(x=torch.tensor(0.5), n=12, m=12,
                                                    pause=0.03))]
        audio = [i for i, n in enumerate(names) if n == "audio"]
        last_token = max(i for i, n in enumerate(names) if n == "tok")
        assert len(audio) == 12 and audio[3] < last_token, names


def test_a_talker_worker_dying_mid_stream_fails_its_request_and_restarts():
    """The parent answered the windows already sent; the worker still held the request, so
    its death fails it (not a window it is waiting for), and a deadline likewise."""
    with PlacedRuntime("placement_segment_models:fed", [NodeGroup(list(TALKER), rank=2)],
                       progress=False, shm_bytes=1 << 20) as rt:
        kill_mid_run(rt, 2, rt.submit(dict(x=torch.tensor(0.3), n=60, m=80, pause=0.05)))
        late = rt.submit(dict(x=torch.tensor(0.3), n=60, m=80, pause=0.05), deadline=0.4,
                         fail_late=True)
        with pytest.raises(RequestFailed):
            late.result(T)
        idle(rt, 2)
        with Runtime(sm.fed()) as local:
            c = dict(x=torch.tensor(0.2), n=4, m=6)
            assert by_name(rt.submit(c)) == by_name(local.submit(c))


def test_the_worker_side_takes_windows_and_answers_the_last():
    """SegmentRunner alone, fed as the parent feeds it: the first window starts the run, each
    is pushed into its source, the run's outputs leave as made and its end answers the item of
    the last window; a malformed window fails its request by id; nothing is held after."""
    model = sm.fed()
    (seg,) = find_segments(model, TALKER, {2}).segments
    assert seg.reads == ("frame", "m", "fail_at", "prompt", "reply")
    contexts = {7: RequestContext(7, {}), 8: RequestContext(8, {})}
    replies: list = []
    node = len(model.nodes)
    runner = SegmentRunner(model, [seg], node, 2, contexts.get,
                           lambda kind, **fields: replies.append((kind, fields)))
    plain = {"frame": torch.zeros(()), "m": 3, "fail_at": -1}
    # what the thinker of a request x = 0.5, n = 2 streams: its prompt, then two replies
    one = torch.tensor(1.0)
    first = torch.tanh(torch.tensor(0.5)) * 0.9 + 0.1
    second = first * 0.9 + 0.1
    try:
        assert runner.submit(node, [(1, 7, {**plain, "prompt": [one], "reply": [first]},
                                     (((0, 0, 1, True), (0, 0, 1, False)), False))]) == []
        assert runner.submit(node, [(2, 7, {**plain, "prompt": [], "reply": [second]},
                                     (((1, 1, 1, True), (1, 1, 2, True)), False))]) == []
        assert wait_until(lambda: any(k == "done" for k, _ in replies), T)
        done = [f for k, f in replies if k == "done"]
        assert [d["items"] for d in done] == [[2]]  # the last window's item, once
        with Runtime(sm.fed()) as local:
            want = by_name(local.submit(dict(x=torch.tensor(0.5), n=2, m=3)))
        emitted = [(e[1], e[2]) for k, f in replies if k in ("emit", "done")
                   for e in f.get("emits", []) if len(e) == 3]
        assert by_name(emitted)["audio"] == want["audio"]
        # a window that is not a list of values fails its request at once, by id
        runner.submit(node, [(3, 8, {**plain, "prompt": one, "reply": [first]},
                              (((0, 0, 1, False), (0, 0, 1, False)), False))])
        failed = [f for k, f in replies if k == "failed"]
        assert failed and failed[-1]["request"] == 8 and "one window" in failed[-1]["message"]
        assert wait_until(lambda: runner.stats()["segment_runs"] == 0, T)
        assert not any(runner.stats()["segment_live"].values())
    finally:
        runner.close()


def test_many_requests_at_once_some_failing_some_cancelled_equal_one_process():
    """40 requests of random lengths at once, some failing in the talker, a third cancelled at
    random moments: each other one equals one process (its outputs or its failure), and both
    workers hold nothing after."""
    import random

    rnd = random.Random(7)
    reqs = [dict(x=torch.tensor(rnd.uniform(-1, 1)), n=rnd.randint(1, 12), m=rnd.randint(1, 14),
                 pause=rnd.choice([0.0, 0.0, 0.002]), fail_at=rnd.choice([-1] * 6 + [0, 2, 5]))
            for _ in range(40)]

    def result(handle) -> object:
        try:
            return by_name(handle)
        except RequestFailed as e:
            return str(e)

    with Runtime(sm.fed()) as local:
        want = [result(local.submit(c)) for c in reqs]
    assert sum(isinstance(w, str) for w in want) >= 3  # some fail
    groups = [NodeGroup(["prefill", "think"], rank=1), NodeGroup(list(TALKER), rank=2)]
    with PlacedRuntime("placement_segment_models:fed", groups, progress=False,
                       shm_bytes=1 << 20) as rt:
        handles = [rt.submit(c) for c in reqs]
        cancelled = set(rnd.sample(range(len(reqs)), len(reqs) // 3))
        for i in sorted(cancelled):
            time.sleep(rnd.uniform(0, 0.003))
            handles[i].cancel()
        for i, h in enumerate(handles):
            if i not in cancelled:
                assert result(h) == want[i], (i, reqs[i])
        for rank in (1, 2):
            idle(rt, rank)


def test_a_source_item_taken_before_its_run_is_registered_waits_for_it():
    """Runtime.submit queues a run's first items before it registers the run (under the
    registry's lock). The stream-in engine's thread taking the source item in between must
    wait for the registration, not read the run as gone and end its stream empty (the talker
    of a split Qwen3-Omni then spoke nothing, and the request finished without audio)."""
    import threading
    from types import SimpleNamespace

    from mstar_rt.placement.stream_in import StreamInEngine
    from mstar_rt.registry import RequestRegistry

    completed: list = []
    batches = [(5, 0, [SimpleNamespace(request=7, id=70)])]
    queue = SimpleNamespace(
        next_batch=lambda engine, n, timeout: batches.pop() if batches else None,
        complete=lambda node, ids, outs: [(node, i) for i in ids])
    host = SimpleNamespace(queue=queue, requests=RequestRegistry(), report=completed.extend,
                           closed=False, poll_s=0.01)
    engine = StreamInEngine()
    engine.host = host  # type: ignore[assignment]
    with host.requests.lock:  # submit: the item is queued, the run not registered yet
        taker = threading.Thread(target=engine._take, args=(0.0,))
        taker.start()
        time.sleep(0.05)
        assert not completed  # without the wait, the item completed here: its stream ended
        host.requests.add(7, SimpleNamespace(context=RequestContext(7, {})))
    taker.join(T)
    assert not completed  # held: its stream is open
    engine.end(7, 5)  # the last window came
    assert completed == [(5, 70)]

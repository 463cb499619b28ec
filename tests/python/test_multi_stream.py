"""Graph semantics Qwen3-Omni needs (M*'s): a node reading several streams, each under its own
chunk policy; a consumer in its own loop reading one window per iteration; and
``continue_after_done``, which lets that consumer go on after its producer has finished."""

from __future__ import annotations

import itertools

import pytest

import mstar_rt
from mstar_rt import Runtime

import multi_stream_models as msm
import stream_models as sm

SPECS = [("Fixed", (1,)), ("Fixed", (3,)), ("SlidingWindow", (4, 2)), ("LeftContext", (2, 3)),
         ("Ramp", ((1, 2), 4, 1))]


def _windows(spec, n: int) -> list[tuple]:
    """The windows one consumer of one stream gets under ``spec`` (the single-stream path)."""
    model = sm.StreamModel({"w": (spec[0], spec[1], "parallel")}, end_aware=False)
    with Runtime(model) as rt:
        got = [v for k, v in rt.submit({"walk": "w", "n": n, "pd": [], "cd": []}) if k == "win"]
    return [w[1:] for w in got]


@pytest.mark.parametrize("a,b", list(itertools.product(SPECS, SPECS[:3])))
def test_a_node_reads_two_streams_each_under_its_policy(a, b):
    model = msm.TwoStreams(a, b)
    with Runtime(model) as rt:
        # different lengths and timings: one stream ends while the other still flows
        reqs = [{"na": 7, "nb": 3, "da": [0.002] * 7}, {"na": 2, "nb": 9, "db": [0.002] * 9},
                {"na": 0, "nb": 5}]
        handles = [rt.submit(r) for r in reqs]
        results = [[v for k, v in h if k == "win"] for h in handles]
    for r, got in zip(reqs, results):
        for side, spec, n, base in ((0, a, r["na"], 100), (1, b, r["nb"], 200)):
            # the non-empty windows; `last` depends on whether the end was known when the window
            # was cut, a matter of timing, so it is left out
            seen = [w[side][:3] + w[side][4:] for w in got if w[side][2] > w[side][0]]
            expected = [(b0, nb, e, [x - sm.ITEM0 + base for x in items])
                        for b0, nb, e, last, items in _windows(spec, n)]
            assert seen == expected, (side, spec, r)
            for w in got:  # an empty window: this stream was over when the other had one
                if w[side][2] == w[side][0]:
                    assert w[side][3] is True and w[side][4] == []
        assert got, "the consumer ran"


def _steps(rt, **inputs):
    return [v for k, v in rt.submit(inputs) if k == "step"]


@pytest.mark.parametrize("delays", [[], [0.01] * 6, [0, 0, 0.03, 0, 0.03]])
def test_a_loop_reads_one_window_per_iteration_and_goes_on_after_the_producer(delays):
    with Runtime(msm.TalkerShape()) as rt:
        steps = _steps(rt, n=5, steps=9, delays=delays)
    assert [s[0] for s in steps] == list(range(9))
    for k, (_, tok, emb) in enumerate(steps):
        if k < 5:  # item k, waited for when the thinker was slower
            assert tok == (k, k, k + 1, k == 4 and tok[3], [k]) and emb[4] == [k / 2]
        else:  # the thinker is done: empty windows marked last
            assert tok[2] == tok[0] == 5 and tok[3] is True and tok[4] == [] and emb[4] == []


def test_per_iteration_windows_follow_the_policy():
    model = msm.TalkerShape(tok=("Fixed", (2,)), emb=("LeftContext", (1, 2)))
    with Runtime(model) as rt:
        steps = _steps(rt, n=5, steps=4)
    assert [s[1][4] for s in steps] == [[0, 1], [2, 3], [4], []]
    assert [s[2][4] for s in steps] == [[0.0, 0.5], [0.5, 1.0, 1.5], [1.5, 2.0], []]


def test_reading_past_the_end_without_continue_after_done_fails_only_that_request():
    with Runtime(msm.TalkerShape(continue_after_done=False)) as rt:
        ok = rt.submit({"n": 5, "steps": 5})
        bad = rt.submit({"n": 2, "steps": 4})
        assert len([v for k, v in ok if k == "step"]) == 5
        with pytest.raises(RuntimeError) as info:
            list(bad)
    msg = str(info.value)
    for part in ("'talk'", "'tok'", "'think'", "continue_after_done=True"):
        assert part in msg, msg


def test_concurrent_requests_keep_their_own_windows():
    with Runtime(msm.TalkerShape()) as rt:
        hs = [rt.submit({"n": n, "steps": s, "delays": [0.001 * n] * n})
              for n, s in ((3, 6), (8, 8), (1, 3), (6, 2))]
        got = [[v for k, v in h if k == "step"] for h in hs]
    for (n, s), steps in zip(((3, 6), (8, 8), (1, 3), (6, 2)), got):
        assert [t[1][4] for t in steps] == [[k] if k < n else [] for k in range(s)]


def test_continue_after_done_must_be_a_bool():
    from mstar_rt import GraphNode, StreamingGraphEdge

    class M(msm.TalkerShape):
        def __init__(self):
            super().__init__()
            n = self.nodes[0]
            self.nodes[0] = GraphNode(n.name, n.inputs, [
                StreamingGraphEdge("talk", "tok", mstar_rt.Fixed(1), continue_after_done="yes"),
                StreamingGraphEdge("talk", "emb", mstar_rt.Fixed(1))],
                submodule=n.submodule, engine=n.engine)

    with pytest.raises(mstar_rt.GraphError, match="continue_after_done"):
        Runtime(M())


def test_windows_reach_a_placed_worker_as_in_process():
    from mstar_rt.placement import NodeGroup, PlacedRuntime

    rt = PlacedRuntime("multi_stream_models:talker_shape", [NodeGroup(["talk"], rank=1)],
                       progress=False)
    try:
        placed = _steps(rt, n=3, steps=5, delays=[0.01] * 3)
    finally:
        rt.close()
    with Runtime(msm.TalkerShape()) as local:
        local_steps = _steps(local, n=3, steps=5)

    def windows(steps):  # `last` on the final item's window depends on timing: left out
        return [(k, tuple(tok)[:3] + tuple(tok)[4:], tuple(emb)[:3] + tuple(emb)[4:])
                for k, tok, emb in steps]

    assert windows(placed) == windows(local_steps)

"""The in-process Runtime over the C++ Conductor: streaming edges. A consumer sees exactly the
windows its policy defines, the flushed tail included, for fixed and dynamic producer loops."""

from collections import Counter

import pytest

import mstar_rt
from mstar_rt import (
    EMIT,
    DynamicLoop,
    GraphEdge,
    GraphError,
    GraphNode,
    Loop,
    Parallel,
    Sequential,
    StreamingGraphEdge,
    StreamChunk,
)

from walk_models import ZERO_LIVE, CtxFn, Fn, WalkModel, settled

T = 5.0  # seconds: the longest any single wait in this file may take


# ---- streams --------------------------------------------------------------------------------------

def _stream_model(policy, n_items, walk_kind="parallel"):
    nodes = [GraphNode("gen", ["x"], [StreamingGraphEdge("snac", "tok", policy)]),
             GraphNode("snac", ["tok", "x"], [GraphEdge(EMIT, "win")])]

    def window(d):
        w = d["tok"]
        assert isinstance(w, StreamChunk)
        return {"win": (w.begin, w.new_begin, w.end, w.last, list(w.items), list(w.new_items),
                        d["x"])}

    subs = {"gen": CtxFn(lambda d, c: {"tok": 100 + c.iteration}), "snac": Fn(window)}
    loop = Loop("gen", n_items)
    walk = Parallel(loop, "snac") if walk_kind == "parallel" else Sequential(loop, "snac")
    return WalkModel(nodes, {"decode": walk}, subs)


STREAM_CASES = {
    # policy, items produced, the (begin, new_begin, end, last) windows it defines
    "Fixed(3)": (lambda: mstar_rt.Fixed(3), 7,
                 [(0, 0, 3, False), (3, 3, 6, False), (6, 6, 7, True)]),
    "SlidingWindow(4,2)": (lambda: mstar_rt.SlidingWindow(4, 2), 9,
                           [(0, 0, 4, False), (2, 4, 6, False), (4, 6, 8, False), (6, 8, 9, True)]),
    "LeftContext(2,3)": (lambda: mstar_rt.LeftContext(2, 3), 7,
                         [(0, 0, 3, False), (1, 3, 6, False), (4, 6, 7, True)]),
    "Ramp([1,2],4)": (lambda: mstar_rt.Ramp([1, 2], 4), 12,
                      [(0, 0, 1, False), (1, 1, 3, False), (3, 3, 7, False), (7, 7, 11, False),
                       (11, 11, 12, True)]),
    "Ramp([1,2],3,context=1)": (lambda: mstar_rt.Ramp([1, 2], 3, context=1), 8,
                                [(0, 0, 1, False), (0, 1, 3, False), (2, 3, 6, False),
                                 (5, 6, 8, True)]),
}


@pytest.mark.parametrize("case", list(STREAM_CASES))
@pytest.mark.parametrize("walk_kind", ["parallel", "sequential"])
def test_stream_consumer_sees_exactly_the_policys_windows_including_the_flushed_tail(
        serve, case, walk_kind):
    make_policy, n, expected = STREAM_CASES[case]
    rt = serve(_stream_model(make_policy(), n, walk_kind))
    hs = [rt.submit({"x": x}) for x in range(3)]
    for x, h in enumerate(hs):
        got = h.result(timeout=T)["win"]
        assert [w[:4] for w in got] == expected
        for begin, new_begin, end, last, items, new_items, x_seen in got:
            assert items == [100 + p for p in range(begin, end)]
            assert new_items == [100 + p for p in range(new_begin, end)]
            assert x_seen == x
        assert sum(len(w[5]) for w in got) == n  # every item is new in exactly one window
        assert Counter(r["node"] for r in h.stats()) == {"gen": n, "snac": len(expected)}
    assert settled(rt) == ZERO_LIVE


def test_stream_consumer_also_reading_an_accumulated_list_gets_a_plain_list(serve):
    nodes = [GraphNode("pre", ["x"], ["ctx"]),
             GraphNode("gen", ["x"], [StreamingGraphEdge("snac", "tok", mstar_rt.Fixed(2))]),
             GraphNode("snac", ["tok", "ctx"], [GraphEdge(EMIT, "o")])]
    subs = {"pre": CtxFn(lambda d, c: {"ctx": c.iteration}),
            "gen": CtxFn(lambda d, c: {"tok": c.iteration}),
            "snac": Fn(lambda d: {"o": (type(d["ctx"]).__name__, d["ctx"], d["tok"].items)})}
    walk = Sequential(Loop("pre", 3, accumulated_outputs=["ctx"]), Parallel(Loop("gen", 4), "snac"))
    rt = serve(WalkModel(nodes, {"w": walk}, subs))
    # The stream ends on a chunk boundary: the policy's two windows, no empty one after them.
    assert rt.submit({"x": 0}).result(timeout=T) == {
        "o": [("list", [0, 1, 2], [0, 1]), ("list", [0, 1, 2], [2, 3])]}


class _CountTo(mstar_rt.NodeSubmodule):
    """DynamicLoop body producing its iteration as a stream item; stops after ``x`` items."""

    max_batch = 4

    def prepare_inputs(self, ctx, inputs):
        return (inputs, ctx)

    def forward(self, batch):
        return [{"tok": ctx.iteration} for _, ctx in batch]

    def check_stop(self, batch, outputs):
        return [("gen",) if ctx.iteration + 1 >= d["x"] else () for d, ctx in batch]


def _dynamic_stream_model(policy):
    nodes = [GraphNode("gen", ["x"], [StreamingGraphEdge("snac", "tok", policy)]),
             GraphNode("snac", ["tok"], [GraphEdge(EMIT, "win")])]
    snac = Fn(lambda d: {"win": (d["tok"].begin, d["tok"].new_begin, d["tok"].end, d["tok"].last,
                                 d["tok"].items)})
    return WalkModel(nodes, {"decode": Parallel(DynamicLoop("gen", 100, "gen"), "snac")},
                     {"gen": _CountTo(), "snac": snac})


def test_stream_from_a_dynamic_loop_ends_and_flushes_where_each_request_stopped(serve):
    rt = serve(_dynamic_stream_model(mstar_rt.Fixed(3)))
    hs = {n: rt.submit({"x": n}) for n in (1, 4, 7, 8)}
    expected = {1: [(0, 0, 1, True, [0])],
                4: [(0, 0, 3, False, [0, 1, 2]), (3, 3, 4, True, [3])],
                7: [(0, 0, 3, False, [0, 1, 2]), (3, 3, 6, False, [3, 4, 5]), (6, 6, 7, True, [6])],
                8: [(0, 0, 3, False, [0, 1, 2]), (3, 3, 6, False, [3, 4, 5]),
                    (6, 6, 8, True, [6, 7])]}
    for n, h in hs.items():
        assert h.result(timeout=T) == {"win": expected[n]}
    assert settled(rt) == ZERO_LIVE


class _EndAware(mstar_rt.NodeSubmodule):
    """A consumer recording its windows and hearing the end of its stream (end_stream)."""

    def forward(self, batch):
        return [{"win": ("window", d["tok"].begin, d["tok"].end, d["tok"].last, d["tok"].items)}
                for d in batch]

    def end_stream(self, ctx):
        return {"win": ("end",)}


def test_stream_ending_on_a_chunk_boundary_makes_no_empty_window(serve):
    rt = serve(_dynamic_stream_model(mstar_rt.Fixed(3)))
    got = rt.submit({"x": 6}).result(timeout=T)["win"]
    assert [w[4] for w in got] == [[0, 1, 2], [3, 4, 5]]  # the policy's windows, nothing more
    assert all(w[1] < w[2] for w in got)


def test_stream_ending_on_a_chunk_boundary_tells_an_end_stream_consumer_once(serve):
    model = _dynamic_stream_model(mstar_rt.Fixed(3))
    model.submodules = {**model.submodules, "snac": _EndAware()}
    rt = serve(model)
    for n in (3, 4, 6):
        got = rt.submit({"x": n}).result(timeout=T)["win"]
        windows = [w for w in got if w[0] == "window"]
        assert [w[4] for w in windows] == [list(range(b, min(b + 3, n))) for b in range(0, n, 3)]
        ends = [w for w in got if w[0] == "end"] + [w for w in windows if w[3]]
        assert len(ends) == 1, got  # the last window said it, or end_stream did, never both
        assert got[-1] == ends[0]  # and nothing came after it
    assert settled(rt) == ZERO_LIVE


def test_stream_consumer_placed_after_a_node_it_reads_waits_for_that_node(serve):
    nodes = [GraphNode("gen", ["x"], [StreamingGraphEdge("snac", "tok", mstar_rt.Fixed(2))]),
             GraphNode("mk", ["x"], ["scale"]),
             GraphNode("snac", ["tok", "scale"], [GraphEdge(EMIT, "o")])]
    subs = {"gen": CtxFn(lambda d, c: {"tok": c.iteration}), "mk": Fn(lambda d: {"scale": 10}),
            "snac": Fn(lambda d: {"o": [t * d["scale"] for t in d["tok"].items]})}
    rt = serve(WalkModel(nodes, {"w": Sequential(Loop("gen", 4), "mk", "snac")}, subs))
    assert rt.submit({"x": 0}).result(timeout=T) == {"o": [[0, 10], [20, 30]]}


def test_stream_consumer_inside_its_producers_loop_either_is_rejected_or_runs_per_window(serve):
    nodes = [GraphNode("gen", ["x"], [StreamingGraphEdge("snac", "tok", mstar_rt.Fixed(1))]),
             GraphNode("snac", ["tok"], [GraphEdge(EMIT, "o")])]
    subs = {"gen": CtxFn(lambda d, c: {"tok": c.iteration}),
            "snac": Fn(lambda d: {"o": d["tok"].items})}
    try:
        rt = serve(WalkModel(nodes, {"w": Loop(Sequential("gen", "snac"), 3)}, subs))
    except GraphError:
        return
    assert rt.submit({"x": 0}).result(timeout=1) == {"o": [[0], [1], [2]]}

"""Streams the caller feeds into a running request (mstar_rt/feeds.py): a StreamInput's items come
from RequestHandle.feed, not from a node, and reach the consumer in the windows its chunk policy
cuts; end_stream lets the last partial window through; cancel drops what was fed; errors name
what to fix; nothing is left held."""

import queue
import threading

import numpy as np
import pytest

import mstar_rt
from mstar_rt import (EMIT, GraphEdge, GraphError, GraphNode, NodeSubmodule, Parallel,
                      RequestCancelled, RequestFailed, Sequential, StreamClosedError,
                      StreamingGraphEdge, StreamInput)
from mstar_rt.feeds import FEED_ENGINE

from walk_models import ZERO_LIVE, Fn, Gate, WalkModel, settled, wait_until

T = 5.0  # seconds: the longest any single wait in this file may take
FRAME = 4  # samples per fed audio frame


def frame(p: int) -> np.ndarray:
    """The audio frame fed at stream position ``p``."""
    return np.full(FRAME, p, dtype=np.int16)


class SumWindows(NodeSubmodule):
    """Sums the samples of each window's new frames; records where the window sits."""

    max_batch = 4

    def __init__(self, fail_on: int = -1) -> None:
        self.fail_on = fail_on
        self.ends = 0

    def forward(self, batch):
        out = []
        for x in batch:
            w = x["audio"]
            if any(int(f[0]) == self.fail_on for f in w.new_items):
                raise ValueError(f"frame {self.fail_on} is bad")
            samples = np.concatenate(w.new_items) if w.new_items else np.zeros(0, np.int16)
            out.append({"sum": (int(samples.sum(dtype=np.int64)), w.begin, w.new_begin, w.end,
                                w.last, [int(f[0]) for f in w.items])})
        return out


class HearsEnd(SumWindows):
    def end_stream(self, ctx):
        self.ends += 1
        return {"sum": ("end",)}


def fed_model(policy, consumer=None, walks=None, extra=(), next_walk=None, initial_walk=None):
    nodes = [StreamInput("mic", StreamingGraphEdge("sum", "audio", policy)),
             GraphNode("sum", ["audio"], [GraphEdge(EMIT, "sum")]), *extra]
    subs = {"sum": consumer or SumWindows()}
    subs.update({n.name: n.submodule for n in extra if n.submodule is not None})
    return WalkModel(nodes, walks or {"main": Parallel("mic", "sum")}, subs, inputs=(),
                     next_walk=next_walk, initial_walk=initial_walk)


def idle(rt) -> dict:
    """What the runtime and its feed engine still hold, once in-flight work has come back."""
    wait_until(lambda: rt.engines[FEED_ENGINE].held == 0)
    return dict(settled(rt), fed=rt.engines[FEED_ENGINE].held)


IDLE = dict(ZERO_LIVE, fed=0)


def reader(handle) -> "queue.Queue":
    """The handle's outputs as they come, read on a helper thread (a test never blocks)."""
    got: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [got.put(e) for e in handle], daemon=True).start()
    return got


CASES = {
    # policy, frames fed, the (begin, new_begin, end, last) windows it defines
    "Fixed(3)": (lambda: mstar_rt.Fixed(3), 7,
                 [(0, 0, 3, False), (3, 3, 6, False), (6, 6, 7, True)]),
    "SlidingWindow(4,2)": (lambda: mstar_rt.SlidingWindow(4, 2), 9,
                           [(0, 0, 4, False), (2, 4, 6, False), (4, 6, 8, False), (6, 8, 9, True)]),
    "LeftContext(2,3)": (lambda: mstar_rt.LeftContext(2, 3), 7,
                         [(0, 0, 3, False), (1, 3, 6, False), (4, 6, 7, True)]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_fed_frames_reach_the_consumer_in_the_policys_windows_and_end_flushes_the_tail(
        serve, case):
    make_policy, n, expected = CASES[case]
    rt = serve(fed_model(make_policy()))
    h = rt.submit({})
    for p in range(n):
        h.feed("audio", frame(p))
    assert h.end_stream("audio")
    got = h.result(timeout=T)["sum"]
    assert [w[1:5] for w in got] == expected
    for total, begin, new_begin, end, _last, items in got:
        assert items == list(range(begin, end))
        assert total == FRAME * sum(range(new_begin, end))
    assert sum(w[0] for w in got) == FRAME * sum(range(n))  # every frame summed exactly once
    assert idle(rt) == IDLE


def test_windows_come_out_while_the_stream_is_still_open(serve):
    rt = serve(fed_model(mstar_rt.Fixed(3)))
    h = rt.submit({})
    got = reader(h)
    for p in range(3):
        h.feed("audio", frame(p))
    assert got.get(timeout=T) == ("sum", (FRAME * 3, 0, 0, 3, False, [0, 1, 2]))
    assert not h.done  # the stream is open: the request waits for more
    h.feed("audio", frame(3))
    h.end_stream("audio")
    assert got.get(timeout=T) == ("sum", (FRAME * 3, 3, 3, 4, True, [3]))
    h.result(timeout=T)
    assert idle(rt) == IDLE


def test_producer_threads_feed_their_own_requests_at_once(serve):
    """Three threads (a WebRTC track, a websocket, a camera thread) each feed one request."""
    rt = serve(fed_model(mstar_rt.Fixed(16)))
    n = 500
    handles = [rt.submit({}) for _ in range(3)]

    def produce(k, h):
        for p in range(n):
            h.feed("audio", frame(p) * (k + 1))
        h.end_stream("audio")

    threads = [threading.Thread(target=produce, args=(k, h)) for k, h in enumerate(handles)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(T)
    for k, h in enumerate(handles):
        got = h.result(timeout=T)["sum"]
        assert sum(w[0] for w in got) == (k + 1) * FRAME * sum(range(n))
        assert [w[2] for w in got] == list(range(0, n, 16))  # in order, none lost or doubled
        assert [w[4] for w in got] == [False] * (len(got) - 1) + [True]
    assert idle(rt) == IDLE


def test_frames_fed_before_the_walk_reaches_the_consumer_wait_for_it(serve):
    gate = Gate(lambda x: {"ready": 1})
    prep = GraphNode("prep", [], ["ready"], submodule=gate)
    model = fed_model(mstar_rt.Fixed(2), extra=[prep],
                      walks={"main": Parallel("mic", Sequential("prep", "sum"))})
    rt = serve(model)
    h = rt.submit({})
    gate.wait_entered()
    for p in range(5):
        h.feed("audio", frame(p))
    h.end_stream("audio")
    gate.open()
    got = h.result(timeout=T)["sum"]
    assert [w[1:5] for w in got] == [(0, 0, 2, False), (2, 2, 4, False), (4, 4, 5, True)]
    assert idle(rt) == IDLE


@pytest.mark.parametrize("n", [0, 6])
def test_a_stream_ended_on_a_window_boundary_or_empty_calls_end_stream_once(serve, n):
    consumer = HearsEnd()
    rt = serve(fed_model(mstar_rt.Fixed(3), consumer=consumer))
    h = rt.submit({})
    got = reader(h)
    for p in range(n):
        h.feed("audio", frame(p))
    # each window out before the end: cut while the stream was open, so none says last
    windows = [got.get(timeout=T)[1][1:5] for _ in range(n // 3)]
    assert windows == [(0, 0, 3, False), (3, 3, 6, False)][:n // 3]
    assert h.end_stream("audio")
    assert not h.end_stream("audio")  # ended already
    assert got.get(timeout=T) == ("sum", ("end",))
    h.result(timeout=T)
    assert consumer.ends == 1
    assert not h.end_stream("audio")  # the request is over
    assert idle(rt) == IDLE


def test_feeding_an_ended_stream_a_finished_or_a_cancelled_request_raises(serve):
    gate = Gate(lambda x: {"held": 1})  # keeps the request running after its stream ended
    hold = GraphNode("hold", [], ["held"], submodule=gate)
    rt = serve(fed_model(mstar_rt.Fixed(100), extra=[hold],
                         walks={"main": Parallel("mic", "sum", "hold")}))
    h = rt.submit({})
    h.feed("audio", frame(0))
    h.end_stream("audio")
    with pytest.raises(StreamClosedError, match=r"feed\('audio'\).*ended by end_stream"):
        h.feed("audio", frame(1))
    gate.open()
    assert h.result(timeout=T)["sum"] == [(0, 0, 0, 1, True, [0])]
    with pytest.raises(StreamClosedError, match=rf"request {h.id} has finished"):
        h.feed("audio", frame(1))
    c = rt.submit({})
    c.cancel()
    with pytest.raises(StreamClosedError, match="RequestCancelled: .* was cancelled"):
        c.feed("audio", frame(1))
    assert idle(rt) == IDLE


def test_a_feed_racing_its_requests_end_raises_rather_than_dropping_the_item(serve):
    """The handle's checks pass (it reads running), then the request ends before the item
    reaches the stream: the Conductor answers that no stream took it, and feed says so."""
    from types import SimpleNamespace

    rt = serve(fed_model(mstar_rt.Fixed(2)))
    h = rt.submit({})
    h.feed("audio", frame(0))
    h.end_stream("audio")
    assert [w[0] for w in h.result(timeout=T)["sum"]] == [0]
    stale = SimpleNamespace(id=h.id, done=False, context=h.context)  # a view from before
    with pytest.raises(StreamClosedError, match=rf"request {h.id} ended while the item was "
                                                "fed, so no stream took it"):
        rt.engines[FEED_ENGINE].feed(stale, "audio", frame(1), None)
    assert idle(rt) == IDLE


def test_undeclared_stream_names_raise_naming_the_fed_streams(serve):
    rt = serve(fed_model(mstar_rt.Fixed(2)))
    h = rt.submit({})
    with pytest.raises(ValueError, match=r"feed\('video'\): no StreamInput .* \['audio'\]"):
        h.feed("video", frame(0))
    with pytest.raises(ValueError, match=r"end_stream\('sum'\): no StreamInput"):
        h.end_stream("sum")
    h.feed("audio", frame(0))  # the request is unharmed
    h.end_stream("audio")
    assert h.result(timeout=T)["sum"][0][1:5] == (0, 0, 1, True)
    plain = serve(WalkModel([GraphNode("a", ["x"], ["y"])], {"w": "a"},
                            {"a": Fn(lambda x: {"y": 1})}))
    p = plain.submit({"x": 0})
    with pytest.raises(ValueError, match=r"feed\('audio'\): model WalkModel declares no "
                                         r"StreamInput; add StreamInput"):
        p.feed("audio", frame(0))
    p.result(timeout=T)
    assert idle(rt) == IDLE


def test_cancel_drops_what_was_fed_and_frees_it(serve):
    rt = serve(fed_model(mstar_rt.Fixed(100)))
    h = rt.submit({})
    for p in range(10):
        h.feed("audio", frame(p))
    assert rt.live["stored"] >= 10  # the fed frames wait in the stream for a full window
    assert h.cancel()
    seen = []
    with pytest.raises(RequestCancelled):
        for event in h:
            seen.append(event)
    assert seen == []
    assert idle(rt) == IDLE
    assert h.end_stream("audio") is False


def test_a_failing_consumer_fails_its_request_only_and_lets_its_stream_go(serve):
    rt = serve(fed_model(mstar_rt.Fixed(2), consumer=SumWindows(fail_on=13)))
    bad, good = rt.submit({}), rt.submit({})
    for p in range(12, 16):
        bad.feed("audio", frame(p))
        good.feed("audio", frame(p - 12))
    with pytest.raises(RequestFailed, match="frame 13 is bad"):
        bad.result(timeout=T)
    with pytest.raises(StreamClosedError, match="RequestFailed"):
        bad.feed("audio", frame(0))
    good.end_stream("audio")
    assert sum(w[0] for w in good.result(timeout=T)["sum"]) == FRAME * 6
    assert idle(rt) == IDLE


def test_a_stream_fed_in_a_later_walk_refuses_feeds_before_it(serve):
    gate = Gate(lambda x: {"hello": 1})
    greet = GraphNode("greet", [], [GraphEdge(EMIT, "hello")], submodule=gate)
    model = fed_model(mstar_rt.Fixed(2), extra=[greet],
                      walks={"greet": "greet", "listen": Parallel("mic", "sum")},
                      next_walk=lambda r, w, p: "listen" if w == "greet" else None)
    rt = serve(model)
    h = rt.submit({})
    gate.wait_entered()
    with pytest.raises(RuntimeError, match=r"in walk 'greet', which does not feed 'audio'; "
                                           r"it is fed in walks \['listen'\]"):
        h.feed("audio", frame(0))
    gate.open()
    assert wait_until(lambda: h.context.walk == "listen", T)
    h.feed("audio", frame(0))
    h.end_stream("audio")
    assert h.result(timeout=T) == {"hello": [1], "sum": [(0, 0, 0, 1, True, [0])]}
    assert idle(rt) == IDLE


def test_a_stream_input_must_be_a_branch_of_its_walks_root_parallel():
    edge = StreamingGraphEdge("sum", "audio", mstar_rt.Fixed(2))
    nested = fed_model(mstar_rt.Fixed(2), walks={"main": Sequential(Parallel("mic", "sum"))})
    with pytest.raises(GraphError, match=r"StreamInput 'mic' sits inside walk 'main'; put it "
                                         r"as a branch of the walk's root Parallel"):
        mstar_rt.Runtime(nested)
    twice = fed_model(mstar_rt.Fixed(2), extra=[StreamInput("mic2", edge)],
                      walks={"a": Parallel("mic", "sum"), "b": Parallel("mic2", "sum")})
    with pytest.raises(GraphError, match="two StreamInputs feed stream 'audio'"):
        mstar_rt.Runtime(twice)
    with pytest.raises(GraphError, match="StreamInput 'mic' takes StreamingGraphEdge"):
        StreamInput("mic", GraphEdge("sum", "audio"))
    with pytest.raises(GraphError, match="StreamInput 'mic' takes StreamingGraphEdge"):
        StreamInput("mic")


def test_a_walk_run_again_feeds_a_new_stream_right_after_the_last_was_ended(serve):
    """Turn by turn: each turn is the same walk again. Ending turn 1's stream must not refuse
    turn 2's feeds, nor make its end_stream a no-op (the request then never ended)."""
    turns = []

    def next_walk(r, w, p):
        turns.append(w)
        return "listen" if len(turns) < 3 else None

    rt = serve(fed_model(mstar_rt.Fixed(2), walks={"listen": Parallel("mic", "sum")},
                         next_walk=next_walk))
    h = rt.submit({})
    for turn in range(3):
        assert wait_until(lambda: len(turns) == turn, T)
        for p in range(3):
            h.feed("audio", frame(10 * turn + p))
        assert h.end_stream("audio")
    got = h.result(timeout=T)["sum"]
    assert [w[5] for w in got] == [[0, 1], [2], [10, 11], [12], [20, 21], [22]]
    assert idle(rt) == IDLE


def test_a_long_open_stream_does_not_make_fail_late_requests_refused(serve):
    """The source item stays in flight as long as the caller streams; counted as the node's
    run time it made deadline admission refuse every later fail_late request ("node 'mic'
    would run about 300 ms")."""
    import time

    rt = serve(fed_model(mstar_rt.Fixed(2)))
    h = rt.submit({})
    h.feed("audio", frame(0))
    time.sleep(0.3)
    h.end_stream("audio")
    h.result(timeout=T)
    h = rt.submit({}, deadline=0.1, fail_late=True)  # was: DeadlineExceeded, refused
    h.feed("audio", frame(1))
    h.end_stream("audio")
    assert h.result(timeout=T)["sum"] == [(FRAME, 0, 0, 1, True, [1])]
    assert idle(rt) == IDLE

"""Parts of one request that advance independently (``Part``): each runs sub-walks chosen per
request by the model's ``next_part_walk``, a thinker and a talker in a Parallel streaming to one
another, the default order, a Part inside a Loop, and failures that stay with their request."""

from __future__ import annotations

import threading
import time

import pytest

import mstar_rt
from mstar_rt import (EMIT, DynamicLoop, GraphEdge, GraphError, GraphNode, Loop, Model,
                      NodeSubmodule, Parallel, Part, Runtime, StreamingGraphEdge)
from mstar_rt.compiler import compile_graph


class Fn(NodeSubmodule):
    """Runs ``fn(inputs, iteration)`` per item; stops ``loop`` when ``stop(inputs, i)``."""

    max_batch = 4

    def __init__(self, fn, loop=None, stop=None, delay=0.0):
        self.fn, self.loop, self.stop, self.delay = fn, loop, stop, delay

    def prepare_inputs(self, ctx, inputs):
        return inputs, ctx.iteration

    def forward(self, batch):
        if self.delay:
            time.sleep(self.delay)
        return [self.fn(x, i) for x, i in batch]

    def check_stop(self, batch, outputs):
        if self.loop is None:
            return [() for _ in batch]
        return [(self.loop,) if self.stop(x, i) else () for x, i in batch]


def _items(w):
    return list(w.items)


class ThinkTalk(Model):
    """A thinker Part (prefill, then decode) streams tokens to a talker Part (a warm-up, then
    ``speak`` or ``whisper`` as the request's ``voice`` says), each loop with its own stop."""

    inputs = ("prompt", "n", "voice", "steps", "trouble")
    input_defaults = {"trouble": None, "voice": "loud", "steps": 4}

    def __init__(self, hold: threading.Event | None = None):
        self.hold = hold
        self.asked: list[tuple] = []
        decode = Fn(lambda x, i: {"tok": x["h"] + i}, "think", lambda x, i: i + 1 >= x["n"],
                    delay=0.002)
        self.nodes = [
            GraphNode("prefill", ["prompt"], [GraphEdge(EMIT, "pre"), "h"],
                      submodule=Fn(lambda x, i: {"pre": x["prompt"], "h": 10 * x["prompt"]}),
                      engine="thinker"),
            GraphNode("decode", ["h", "n"],
                      [GraphEdge(EMIT, "tok"),
                       StreamingGraphEdge("talk", "tok", mstar_rt.Fixed(1), continue_after_done=True),
                       StreamingGraphEdge("whisper", "tok", mstar_rt.Fixed(1),
                                          continue_after_done=True)],
                      submodule=decode, engine="thinker"),
            GraphNode("warm", ["voice"], [GraphEdge(EMIT, "warmed"), "spk"],
                      submodule=Fn(lambda x, i: {"warmed": x["voice"], "spk": "spk-" + x["voice"]}),
                      engine="talker"),
            GraphNode("talk", ["tok", "spk", "steps"], [GraphEdge(EMIT, "said")],
                      submodule=Fn(lambda x, i: {"said": (i, _items(x["tok"]), x["spk"])}, "talk",
                                   lambda x, i: i + 1 >= x["steps"]), engine="talker"),
            GraphNode("whisper", ["tok", "spk", "steps"], [GraphEdge(EMIT, "whispered")],
                      submodule=Fn(lambda x, i: {"whispered": (i, _items(x["tok"]), x["spk"])},
                                   "whisper", lambda x, i: i + 1 >= x["steps"]), engine="talker")]
        self.walks = {"main": Parallel(
            Part("thinker", {"prefill": "prefill", "decode": DynamicLoop("decode", 64, "think")}),
            Part("talker", {"warmup": "warm", "speak": DynamicLoop("talk", 64, "talk"),
                            "whisper": DynamicLoop("whisper", 64, "whisper")}))}

    def next_part_walk(self, request, part, finished):
        self.asked.append((request.id, part, finished))
        trouble = request.inputs["trouble"]
        if part == "thinker":
            if trouble == "mute" and finished == "prefill":
                return None  # decode never runs: its stream ends with the Part
            return {None: "prefill", "prefill": "decode", "decode": None}[finished]
        if finished is None:
            return "warmup"
        if finished == "warmup":
            if trouble == "raise":
                raise RuntimeError("no voice today")
            if trouble == "bogus":
                return "sing"
            if trouble == "hold":
                self.hold.wait(5)
            return "speak" if request.inputs["voice"] == "loud" else "whisper"
        return None


def _assert_empty(rt):
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and any(rt.live.values()):
        time.sleep(0.01)
    assert rt.live == dict(requests=0, handles=0, stored=0, queued=0, inflight=0)


def test_two_parts_each_run_the_walks_their_state_machine_chooses():
    model = ThinkTalk()
    with Runtime(model) as rt:
        loud = rt.submit({"prompt": 1, "n": 3, "voice": "loud", "steps": 5})
        quiet = rt.submit({"prompt": 2, "n": 2, "voice": "soft", "steps": 3})
        a, b = loud.result(5), quiet.result(5)
        _assert_empty(rt)
    assert a["pre"] == [1] and a["tok"] == [10, 11, 12] and a["warmed"] == ["loud"]
    assert "whispered" not in a and "said" not in b
    # one window per talker iteration; past the thinker's end, empty ones (continue_after_done)
    assert a["said"] == [(0, [10], "spk-loud"), (1, [11], "spk-loud"), (2, [12], "spk-loud"),
                         (3, [], "spk-loud"), (4, [], "spk-loud")]
    assert b["tok"] == [20, 21]
    assert b["whispered"] == [(0, [20], "spk-soft"), (1, [21], "spk-soft"), (2, [], "spk-soft")]
    for rid in (loud.id, quiet.id):
        asked = [(p, f) for r, p, f in model.asked if r == rid]
        assert [f for p, f in asked if p == "thinker"] == [None, "prefill", "decode"]
        talker = [f for p, f in asked if p == "talker"]
        assert talker[:2] == [None, "warmup"] and talker[2] in ("speak", "whisper")


def test_a_part_that_never_runs_a_producer_ends_its_stream():
    with Runtime(ThinkTalk()) as rt:
        h = rt.submit({"prompt": 1, "n": 3, "steps": 3, "trouble": "mute"})
        out = h.result(5)
        _assert_empty(rt)
    assert "tok" not in out
    assert out["said"] == [(0, [], "spk-loud"), (1, [], "spk-loud"), (2, [], "spk-loud")]


class Plain(Model):
    """No next_part_walk: each Part runs its walks once, in order; one Part inside a Loop."""

    inputs = ("x",)

    def __init__(self):
        rec = lambda tag: Fn(lambda x, i: {tag: (tag, i)})  # noqa: E731
        self.nodes = [GraphNode(t, ["x"], [GraphEdge(EMIT, "out" if t != "z" else "z")],
                                submodule=rec("out" if t != "z" else "z"))
                      for t in ("a", "b", "c", "z")]
        self.walks = {"main": mstar_rt.Sequential(
            Loop(Part("p", {"first": "a", "second": "b", "third": "c"}), 2), "z")}


def test_the_default_order_runs_each_walk_once_per_iteration():
    with Runtime(Plain()) as rt:
        h = rt.submit({"x": 0})
        out = h.result(5)
        order = [r["node"] for r in h.stats()]
        _assert_empty(rt)
    assert order == ["a", "b", "c", "a", "b", "c", "z"]
    assert [i for _, i in out["out"]] == [0, 0, 0, 1, 1, 1]
    # the default Model.next_part_walk says the same, from the walks
    m, ctx = Plain(), mstar_rt.RequestContext(id=1, inputs={}, walk="main")
    assert Model.next_part_walk(m, ctx, "p", None) == "first"
    assert Model.next_part_walk(m, ctx, "p", "second") == "third"
    assert Model.next_part_walk(m, ctx, "p", "third") is None


@pytest.mark.parametrize("trouble,words", [
    ("raise", ["next_part_walk for Part 'talker' in walk 'main' after 'warmup' raised",
               "RuntimeError: no voice today"]),
    ("bogus", ["returned 'sing', which is not a walk of the Part",
               "['warmup', 'speak', 'whisper']"])])
def test_a_bad_choice_fails_only_its_request(trouble, words):
    with Runtime(ThinkTalk()) as rt:
        good = [rt.submit({"prompt": k, "n": 3}) for k in range(3)]
        bad = rt.submit({"prompt": 9, "n": 3, "trouble": trouble})
        with pytest.raises(mstar_rt.RequestFailed) as info:
            bad.result(5)
        for h in good:
            assert len(h.result(5)["said"]) == 4
        _assert_empty(rt)
    for w in words:
        assert w in str(info.value), str(info.value)


def test_cancel_while_a_choice_is_pending_frees_everything():
    hold = threading.Event()
    with Runtime(ThinkTalk(hold)) as rt:
        h = rt.submit({"prompt": 1, "n": 30, "trouble": "hold"})
        other = rt.submit({"prompt": 2, "n": 2})
        time.sleep(0.05)  # the talker's state machine is thinking; the thinker decodes on
        assert h.cancel()
        hold.set()  # the choice comes back for a request that is gone
        with pytest.raises(mstar_rt.RequestCancelled):
            h.result(5)
        assert len(other.result(5)["said"]) == 4
        _assert_empty(rt)


def test_a_choice_pending_in_the_conductor_is_freed_by_cancel():
    g = compile_graph(ThinkTalk().nodes, ThinkTalk().walks, ThinkTalk.inputs, {}, {})
    c = mstar_rt._core.Conductor(g.spec)
    rid, outcome = c.submit(0, {g.name_ids[k]: k for k in ThinkTalk.inputs}, 2**63 - 1, 0, False)
    choices = outcome.part_choices
    assert sorted((p, f) for _, _, p, f in choices) == [("talker", -1), ("thinker", -1)]
    ok, _ = c.choose_part(rid, choices[0][1], 0)
    assert ok
    ok, _ = c.cancel(rid)
    assert ok
    assert c.choose_part(rid, choices[1][1], 0)[0] is False
    assert (c.live_requests, c.live_handles, c.stored, c.queued_items) == (0, 0, 0, 0)


def _walks_error(walks):
    nodes = [GraphNode("a", ["x"], ["ya"]), GraphNode("b", ["x"], ["yb"])]
    with pytest.raises(GraphError) as info:
        compile_graph(nodes, walks, ["x"], {}, {})
    return str(info.value)


def test_malformed_parts_are_refused_naming_the_part_and_walk():
    assert _walks_error({"w": Part("p", {})}) == \
        "Part 'p' in walk 'w' has no walks; give it at least one"
    assert "Part 'p' in walk 'w' has a walk named 3" in _walks_error({"w": Part("p", {3: "a"})})
    assert "a Part in walk 'w' has name None" in _walks_error({"w": Part(None, {"k": "a"})})
    assert "two Parts are named 'p' in walk 'w'" in _walks_error(
        {"w": Parallel(Part("p", {"k": "a"}), Part("p", {"k": "b"}))})
    assert "Part 'p' in walk 'w' has walks" in _walks_error({"w": Part("p", ["a"])})


def test_sub_walks_see_each_others_names_and_the_walk_sees_them_after():
    nodes = [GraphNode("a", ["x"], ["ya"]), GraphNode("b", ["ya"], ["yb"]),
             GraphNode("z", ["yb"], [GraphEdge(EMIT, "z")])]
    g = compile_graph(nodes, {"w": mstar_rt.Sequential(Part("p", {"b": "b", "a": "a"}), "z")},
                      ["x"], {}, {})
    assert g.parts == {("w", "p"): ("b", "a")}


def think_talk() -> ThinkTalk:
    """Factory for a placement worker."""
    return ThinkTalk()


def test_parts_run_as_in_process_with_the_talker_in_a_worker():
    from mstar_rt.placement import NodeGroup, PlacedRuntime

    inputs = [{"prompt": 1, "n": 3, "voice": "loud", "steps": 5},
              {"prompt": 2, "n": 2, "voice": "soft", "steps": 3}]
    rt = PlacedRuntime("test_parts:think_talk", [NodeGroup(["warm", "talk", "whisper"], rank=1)],
                       progress=False)
    try:
        placed = [rt.submit(x).result(30) for x in inputs]
    finally:
        rt.close()
    with Runtime(ThinkTalk()) as local:
        assert placed == [local.submit(x).result(5) for x in inputs]

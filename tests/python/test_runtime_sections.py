"""The in-process Runtime over the C++ Conductor, with tiny numeric nodes whose results are exact:
sections (Sequential, Parallel), loops (Loop, DynamicLoop, nested), walks (persisted values, a
next_walk state machine), the order in which EMITs reach the caller, and failures (a raising node,
next_walk or check_stop) that fail only their own request."""

import threading

import pytest

from mstar_rt import (
    EMIT,
    DynamicLoop,
    GraphEdge,
    GraphError,
    GraphNode,
    Loop,
    NodeSubmodule,
    Parallel,
    RequestFailed,
    Sequential,
)

from walk_models import (
    ZERO_LIVE,
    CtxFn,
    Fn,
    Gate,
    Stopper,
    WalkModel,
    drain,
    engine_threads,
    settled,
)

T = 5.0  # seconds: the longest any single wait in this file may take


# ---- sections ------------------------------------------------------------------------------------

def test_sequential_runs_nodes_in_order_and_later_nodes_see_earlier_outputs_and_inputs(serve):
    nodes = [GraphNode("a", ["x"], ["y"]),
             GraphNode("b", ["y"], [GraphEdge(EMIT, "z")]),
             GraphNode("c", ["x", "z"], [GraphEdge(EMIT, "w")])]
    subs = {"a": Fn(lambda d: {"y": d["x"] + 1}), "b": Fn(lambda d: {"z": d["y"] * 10}),
            "c": Fn(lambda d: {"w": d["z"] - d["x"]})}
    rt = serve(WalkModel(nodes, {"main": Sequential("a", "b", "c")}, subs))
    h = rt.submit({"x": 3})
    assert h.result(timeout=T) == {"z": [40], "w": [37]}
    stats = h.stats()
    assert [s["node"] for s in stats] == ["a", "b", "c"]
    assert all(s["walk"] == "main" and s["iteration"] == 0 for s in stats)
    for before, after in zip(stats, stats[1:]):
        assert before["queued"] <= before["started"] <= before["finished"] <= after["started"]
    assert settled(rt) == ZERO_LIVE


def test_parallel_fans_out_from_one_input_and_the_join_reads_both_branches(serve):
    nodes = [GraphNode("src", ["x"], ["h"]),
             GraphNode("left", ["h"], ["l"]),
             GraphNode("right", ["h"], ["r"]),
             GraphNode("join", ["l", "r"], [GraphEdge(EMIT, "o")])]
    subs = {"src": Fn(lambda d: {"h": d["x"] * 2}), "left": Fn(lambda d: {"l": d["h"] + 1}),
            "right": Fn(lambda d: {"r": d["h"] * d["h"]}),
            "join": Fn(lambda d: {"o": (d["l"], d["r"])})}
    walk = Sequential("src", Parallel("left", "right"), "join")
    rt = serve(WalkModel(nodes, {"cfg": walk}, subs))
    hs = [rt.submit({"x": x}) for x in range(5)]
    for x, h in enumerate(hs):
        assert h.result(timeout=T) == {"o": [(2 * x + 1, 4 * x * x)]}
        by_node = {s["node"]: s for s in h.stats()}
        assert by_node["join"]["started"] >= max(by_node["left"]["finished"],
                                                 by_node["right"]["finished"])
        assert min(by_node["left"]["started"], by_node["right"]["started"]) >= \
            by_node["src"]["finished"]
    assert settled(rt) == ZERO_LIVE


def test_parallel_branches_on_different_engines_run_at_the_same_time(serve):
    left_in, right_in = threading.Event(), threading.Event()

    def meet(mine, other, value):
        mine.set()
        if not other.wait(T):  # only possible if the other branch runs concurrently
            raise TimeoutError("the other branch never started")
        return value

    nodes = [GraphNode("left", ["x"], ["l"]), GraphNode("right", ["x"], ["r"]),
             GraphNode("join", ["l", "r"], [GraphEdge(EMIT, "o")])]
    subs = {"left": Fn(lambda d: {"l": meet(left_in, right_in, d["x"] + 1)}),
            "right": Fn(lambda d: {"r": meet(right_in, left_in, d["x"] - 1)}),
            "join": Fn(lambda d: {"o": d["l"] * d["r"]})}
    model = WalkModel(nodes, {"w": Sequential(Parallel("left", "right"), "join")}, subs,
                      engines={"left": "vision", "right": "audio"})
    rt = serve(model)
    assert {t.name for t in engine_threads()} >= {"mstar-engine-vision", "mstar-engine-audio",
                                                   "mstar-engine-default"}
    assert rt.submit({"x": 5}).result(timeout=3 * T) == {"o": [24]}


# ---- loops ----------------------------------------------------------------------------------------

def _doubling_loop_model(iters=4):
    nodes = [GraphNode("init", ["x"], ["s"]),
             GraphNode("step", ["s"], ["s", "v"]),
             GraphNode("after", ["s", "v"], [GraphEdge(EMIT, "final")])]
    subs = {"init": Fn(lambda d: {"s": d["x"]}),
            "step": CtxFn(lambda d, ctx: {"s": d["s"] * 2, "v": (ctx.iteration, d["s"] * 2)}),
            "after": Fn(lambda d: {"final": (d["s"], d["v"], type(d["v"]).__name__)})}
    walk = Sequential("init", Loop("step", iters, outputs=["s"], accumulated_outputs=["v"]), "after")
    return WalkModel(nodes, {"w": walk}, subs)


def test_loop_gives_last_value_outputs_and_accumulated_outputs_as_a_list_in_iteration_order(serve):
    rt = serve(_doubling_loop_model(4))
    h = rt.submit({"x": 1})
    (s, v, kind), = h.result(timeout=T)["final"]
    assert s == 16
    assert kind == "list" and v == [(0, 2), (1, 4), (2, 8), (3, 16)]
    assert [r["iteration"] for r in h.stats() if r["node"] == "step"] == [0, 1, 2, 3]
    assert settled(rt) == ZERO_LIVE


def test_loop_of_one_iteration_still_accumulates_a_list(serve):
    rt = serve(_doubling_loop_model(1))
    assert rt.submit({"x": 5}).result(timeout=T) == {"final": [(10, [(0, 10)], "list")]}


def test_dynamic_loop_stops_each_request_at_its_own_iteration_while_they_share_batches(serve):
    gate = Gate(lambda d: {"tok": 0}, max_batch=8)
    gen = Stopper(lambda d: {"tok": d["tok"] + 1}, stop=lambda d, o: o["tok"] >= d["limit"],
                  loop="gen", max_batch=8)
    nodes = [GraphNode("g", ["limit"], ["tok"]),
             GraphNode("gen", ["tok", "limit"], [GraphEdge(EMIT, "tok")]),
             GraphNode("after", ["tok"], [GraphEdge(EMIT, "last")])]
    walk = Sequential("g", DynamicLoop("gen", 50, "gen", outputs=["tok"]), "after")
    rt = serve(WalkModel(nodes, {"decode": walk},
                         {"g": gate, "gen": gen, "after": Fn(lambda d: {"last": d["tok"]})},
                         inputs=("limit",)))
    blocker = rt.submit({"limit": 1})
    gate.wait_entered()
    limits = [3, 1, 6, 2, 5, 4]
    hs = [rt.submit({"limit": lim}) for lim in limits]  # they queue behind the gate
    gate.open()
    assert blocker.result(timeout=T) == {"tok": [1], "last": [1]}
    for lim, h in zip(limits, hs):
        assert h.result(timeout=T) == {"tok": list(range(1, lim + 1)), "last": [lim]}
        gens = [r for r in h.stats() if r["node"] == "gen"]
        assert [r["iteration"] for r in gens] == list(range(lim))
    sizes = [r["batch_size"] for h in hs for r in h.stats() if r["node"] == "gen"]
    assert max(sizes) == len(limits), sizes  # the first gen step ran for all six at once
    assert max(gen.batches) == len(limits)
    assert settled(rt) == ZERO_LIVE


def test_nested_loops_give_inner_outputs_per_outer_iteration_with_both_iteration_numbers(serve):
    nodes = [GraphNode("o", ["x"], ["base"]),
             GraphNode("i", ["base"], ["iv", "ic"]),
             GraphNode("collect", ["iv", "ic"], [GraphEdge(EMIT, "pair")]),
             GraphNode("fin", ["pair"], [GraphEdge(EMIT, "all")])]
    subs = {"o": CtxFn(lambda d, c: {"base": d["x"] * 100 + 10 * c.iteration}),
            "i": CtxFn(lambda d, c: {"iv": d["base"] + c.iteration, "ic": d["base"] + c.iteration}),
            "collect": Fn(lambda d: {"pair": (tuple(d["iv"]), d["ic"])}),
            "fin": Fn(lambda d: {"all": list(d["pair"])})}
    inner = Loop("i", 3, outputs=["ic"], accumulated_outputs=["iv"])
    walk = Sequential(Loop(Sequential("o", inner, "collect"), 2, accumulated_outputs=["pair"]), "fin")
    rt = serve(WalkModel(nodes, {"w": walk}, subs))
    h = rt.submit({"x": 1})
    pairs = [((100, 101, 102), 102), ((110, 111, 112), 112)]
    assert h.result(timeout=T) == {"pair": pairs, "all": [pairs]}
    its = {}
    for r in h.stats():
        its.setdefault(r["node"], []).append(r["iteration"])
    assert its == {"o": [0, 1], "i": [0, 1, 2, 0, 1, 2], "collect": [0, 1], "fin": [0]}
    assert settled(rt) == ZERO_LIVE


def test_outer_loop_accumulating_an_inner_loops_accumulated_list_keeps_every_list(serve):
    nodes = [GraphNode("o", ["x"], ["base"]), GraphNode("i", ["base"], ["v"]),
             GraphNode("fin", ["v"], [GraphEdge(EMIT, "all")])]
    subs = {"o": CtxFn(lambda d, c: {"base": 10 * c.iteration}),
            "i": CtxFn(lambda d, c: {"v": d["base"] + c.iteration}),
            "fin": Fn(lambda d: {"all": d["v"]})}
    walk = Sequential(Loop(Sequential("o", Loop("i", 2, accumulated_outputs=["v"])), 3,
                           accumulated_outputs=["v"]), "fin")
    try:
        rt = serve(WalkModel(nodes, {"w": walk}, subs))
    except GraphError:
        return  # rejecting the model is an acceptable fix too
    assert rt.submit({"x": 0}).result(timeout=T) == {"all": [[[0, 1], [10, 11], [20, 21]]]}


# ---- walks ----------------------------------------------------------------------------------------

def test_persisted_value_reaches_the_next_walk_and_next_walk_sees_it(serve):
    seen = []

    def next_walk(req, finished, persisted):
        seen.append((finished, dict(persisted)))
        return "decode" if finished == "prefill" else None

    nodes = [GraphNode("enc", ["x"], [GraphEdge("dec", "kv", persist=True), "tmp"]),
             GraphNode("dec", ["kv", "x"], [GraphEdge(EMIT, "out")])]
    subs = {"enc": Fn(lambda d: {"kv": d["x"] * 10, "tmp": -1}),
            "dec": Fn(lambda d: {"out": d["kv"] + d["x"]})}
    rt = serve(WalkModel(nodes, {"prefill": "enc", "decode": "dec"}, subs, next_walk=next_walk))
    h = rt.submit({"x": 3})
    assert h.result(timeout=T) == {"out": [33]}
    assert seen[0] == ("prefill", {"x": 3, "kv": 30})  # tmp was not persisted
    assert [r["walk"] for r in h.stats()] == ["prefill", "decode"]
    assert settled(rt) == ZERO_LIVE


def test_persisted_value_survives_later_walks_that_do_not_produce_it(serve):
    def next_walk(req, finished, persisted):
        req.state["decodes"] = req.state.get("decodes", 0) + (finished == "decode")
        return "decode" if req.state["decodes"] < 3 else None

    nodes = [GraphNode("enc", ["x"], [GraphEdge("dec", "kv", persist=True)]),
             GraphNode("dec", ["kv", "x"], [GraphEdge(EMIT, "out")])]
    subs = {"enc": Fn(lambda d: {"kv": d["x"] * 10}), "dec": Fn(lambda d: {"out": d["kv"] + 1})}
    rt = serve(WalkModel(nodes, {"prefill": "enc", "decode": "dec"}, subs, next_walk=next_walk))
    assert rt.submit({"x": 2}).result(timeout=T) == {"out": [21, 21, 21]}


def test_persisted_name_made_inside_a_loop_reaches_the_next_walk_with_its_last_value(serve):
    nodes = [GraphNode("step", ["x"], [GraphEdge("use", "s", persist=True)]),
             GraphNode("use", ["s"], [GraphEdge(EMIT, "o")])]
    subs = {"step": CtxFn(lambda d, c: {"s": d["x"] + 10 * c.iteration}),
            "use": Fn(lambda d: {"o": d["s"]})}
    rt = serve(WalkModel(nodes, {"a": Loop("step", 3), "b": "use"}, subs,
                         next_walk=lambda req, fin, p: "b" if fin == "a" else None))
    assert rt.submit({"x": 1}).result(timeout=T) == {"o": [21]}
    assert settled(rt) == ZERO_LIVE


def test_state_machine_runs_three_walks_chosen_by_next_walk(serve):
    def next_walk(req, finished, persisted):
        if finished == "final":
            req.state["finished"].append((finished, req.walk))
            return None
        req.state.setdefault("finished", []).append((finished, req.walk, persisted["h"]))
        if finished == "encode":
            return "step"
        return "step" if persisted["h"] < 20 else "final"

    nodes = [GraphNode("enc", ["x"], [GraphEdge("st", "h", persist=True)]),
             GraphNode("st", ["h"], [GraphEdge(EMIT, "h"), GraphEdge("fin", "h", persist=True)]),
             GraphNode("fin", ["h"], [GraphEdge(EMIT, "done")])]
    subs = {"enc": Fn(lambda d: {"h": d["x"] + 1}), "st": Fn(lambda d: {"h": d["h"] * 2}),
            "fin": Fn(lambda d: {"done": d["h"] - 1})}
    rt = serve(WalkModel(nodes, {"encode": "enc", "step": "st", "final": "fin"}, subs,
                         next_walk=next_walk))
    h = rt.submit({"x": 2})
    assert h.result(timeout=T) == {"h": [6, 12, 24], "done": [23]}
    assert h.context.state["finished"] == [("encode", "encode", 3), ("step", "step", 6),
                                           ("step", "step", 12), ("step", "step", 24),
                                           ("final", "final")]
    assert [r["walk"] for r in h.stats()] == ["encode", "step", "step", "step", "final"]
    assert settled(rt) == ZERO_LIVE

# ---- emits ----------------------------------------------------------------------------------------

def test_iterating_a_handle_yields_emits_in_production_order(serve):
    nodes = [GraphNode("a", ["x"], [GraphEdge(EMIT, "p"), "y"]),
             GraphNode("b", ["y"], [GraphEdge(EMIT, "q")]),
             GraphNode("c", ["x"], [GraphEdge(EMIT, "r"), GraphEdge(EMIT, "s")])]
    subs = {"a": Fn(lambda d: {"p": d["x"], "y": d["x"] * 10}),
            "b": CtxFn(lambda d, c: {"q": d["y"] + c.iteration}),
            "c": Fn(lambda d: {"s": -d["x"], "r": d["x"] + 0.5})}
    rt = serve(WalkModel(nodes, {"w": Sequential("a", Loop("b", 3), "c")}, subs))
    h = rt.submit({"x": 7})
    events, error = drain(h, T)
    assert error is None
    assert events == [("p", 7), ("q", 70), ("q", 71), ("q", 72), ("r", 7.5), ("s", -7)]
    assert h.result(timeout=T) == {"p": [7], "q": [70, 71, 72], "r": [7.5], "s": [-7]}
    assert drain(h, T) == ([], None)  # iterating again ends at once: every event was consumed


def test_emits_reach_the_iterator_while_the_request_is_still_running(serve):
    gate = Gate(lambda d: {"z": d["y"] + 1})
    nodes = [GraphNode("a", ["x"], [GraphEdge(EMIT, "y")]),
             GraphNode("g", ["y"], [GraphEdge(EMIT, "z")])]
    rt = serve(WalkModel(nodes, {"w": Sequential("a", "g")},
                         {"a": Fn(lambda d: {"y": d["x"] * 2}), "g": gate}))
    h = rt.submit({"x": 4})
    first = []
    t = threading.Thread(target=lambda: first.append(next(iter(h))), daemon=True)
    t.start()
    t.join(T)
    assert first == [("y", 8)]
    gate.wait_entered()
    assert not h.done
    gate.open()
    assert h.result(timeout=T) == {"y": [8], "z": [9]}

# ---- failures -------------------------------------------------------------------------------------

def _gated_batch(node_fn, n=5):
    """r0 holds the gate; n more requests queue and then reach node 'boom' in one batch."""
    gate = Gate(lambda d: {"y": d["x"]}, max_batch=8)
    boom = Fn(node_fn, max_batch=8)
    nodes = [GraphNode("g", ["x"], ["y"]), GraphNode("boom", ["y"], [GraphEdge(EMIT, "z")])]
    return gate, boom, WalkModel(nodes, {"main": Sequential("g", "boom")}, {"g": gate, "boom": boom})


def test_exception_in_a_node_fails_only_its_request_and_batch_mates_succeed(serve):
    def fn(d):
        if d["y"] == 3:
            raise ValueError(f"bad input {d['y']}")
        return {"z": d["y"] * 100}

    gate, boom, model = _gated_batch(fn)
    rt = serve(model)
    r0 = rt.submit({"x": 0})
    gate.wait_entered()
    hs = {x: rt.submit({"x": x}) for x in range(1, 6)}
    gate.open()
    assert r0.result(timeout=T) == {"z": [0]}
    with pytest.raises(RequestFailed) as info:
        hs[3].result(timeout=T)
    msg = str(info.value)
    assert "node 'boom'" in msg and "walk 'main'" in msg and "ValueError: bad input 3" in msg
    events, error = drain(hs[3], T)
    assert events == [] and isinstance(error, RequestFailed)
    for x in (1, 2, 4, 5):
        assert hs[x].result(timeout=T) == {"z": [x * 100]}
    assert 5 in boom.batches  # the five really were one batch when it raised
    assert settled(rt) == ZERO_LIVE


def test_a_lone_failing_item_runs_once_not_again_to_find_the_culprit(serve):
    calls = []

    def fn(d):
        calls.append(d["x"])
        raise ValueError("bad input")

    boom = Fn(fn, max_batch=8)
    rt = serve(WalkModel([GraphNode("boom", ["x"], [GraphEdge(EMIT, "z")])], {"main": "boom"},
                         {"boom": boom}))
    with pytest.raises(RequestFailed, match="ValueError: bad input"):
        rt.submit({"x": 7}).result(timeout=T)
    assert calls == [7]  # a second run repeated its work (and any side effect)
    assert settled(rt) == ZERO_LIVE


def test_a_check_stop_raising_for_one_item_fails_it_alone_and_keeps_the_batch_forward(serve):
    forwarded = []

    def stop(d, o):
        if d["y"] == 3:
            raise ValueError("cannot judge 3")
        return True

    gate, _, _ = _gated_batch(lambda d: d)
    gen = Stopper(lambda d: (forwarded.append(d["y"]), {"tok": d["y"] * 10})[1], stop, "gen",
                  max_batch=8)
    nodes = [GraphNode("g", ["x"], ["y"]), GraphNode("gen", ["y"], [GraphEdge(EMIT, "tok")])]
    rt = serve(WalkModel(nodes, {"main": Sequential("g", DynamicLoop("gen", 4, "gen"))},
                         {"g": gate, "gen": gen}))
    r0 = rt.submit({"x": 0})
    gate.wait_entered()
    hs = {x: rt.submit({"x": x}) for x in range(1, 6)}
    gate.open()
    assert r0.result(timeout=T) == {"tok": [0]}
    with pytest.raises(RequestFailed, match=r"node 'gen'.*ValueError: cannot judge 3"):
        hs[3].result(timeout=T)
    for x in (1, 2, 4, 5):
        assert hs[x].result(timeout=T) == {"tok": [x * 10]}
    assert 5 in gen.batches  # one batch of five when check_stop raised
    # forward ran once per item: running the batch again item by item to find the culprit
    # would repeat its work (a KV append, a sampled token) for all five
    assert sorted(forwarded) == [0, 1, 2, 3, 4, 5]
    assert settled(rt) == ZERO_LIVE


class _Returns(NodeSubmodule):
    """forward returns ``value`` as it is (not a list of one dict per item); check_stop
    ``stop`` for every item."""

    def __init__(self, value, stop=()):
        self.value, self.stop = value, stop

    def forward(self, batch):
        return self.value if self.value is not None or not self.stop else [{"y": 1} for _ in batch]

    def check_stop(self, batch, outputs):
        return [self.stop for _ in batch]


@pytest.mark.parametrize("value, stop, words", [
    ({"y": 1}, (), "_Returns.forward returned a dict; return a list with one entry per item"),
    (None, (), "_Returns.forward returned None; return a list"),
    ("y", (), "_Returns.forward returned a str"),
    # a string iterated gave its characters as loop names ('s' from "speak")
    (None, "gen", "check_stop gave the string 'gen' for an item; give a tuple of loop names"),
])
def test_a_node_returning_the_wrong_kind_of_thing_is_told_what_to_return(serve, value, stop,
                                                                         words):
    node = GraphNode("n", ["x"], [GraphEdge(EMIT, "y")])
    walks = {"main": DynamicLoop("n", 3, "gen")} if stop else {"main": "n"}
    rt = serve(WalkModel([node], walks, {"n": _Returns(value, stop)}))
    with pytest.raises(RequestFailed, match=words):
        rt.submit({"x": 1}).result(timeout=T)
    assert settled(rt) == ZERO_LIVE


def test_undeclared_output_fails_only_that_request_and_leaks_no_value(serve):
    def fn(d):
        out = {"z": d["y"] * 100}
        if d["y"] == 3:
            out["oops"] = 1
        return out

    gate, boom, model = _gated_batch(fn)
    rt = serve(model)
    r0 = rt.submit({"x": 0})
    gate.wait_entered()
    hs = {x: rt.submit({"x": x}) for x in range(1, 6)}
    gate.open()
    r0.result(timeout=T)
    with pytest.raises(RequestFailed) as info:
        hs[3].result(timeout=T)
    assert "node 'boom'" in str(info.value) and "oops" in str(info.value)
    for x in (1, 2, 4, 5):
        assert hs[x].result(timeout=T) == {"z": [x * 100]}
    assert settled(rt) == ZERO_LIVE


def test_next_walk_raising_fails_only_that_request(serve):
    def next_walk(req, finished, persisted):
        if finished == "w1" and req.inputs["x"] == 2:
            raise KeyError("no such state")
        return "w2" if finished == "w1" else None

    nodes = [GraphNode("a", ["x"], [GraphEdge(EMIT, "y")]),
             GraphNode("b", ["x"], [GraphEdge(EMIT, "z")])]
    subs = {"a": Fn(lambda d: {"y": d["x"] + 1}, 4), "b": Fn(lambda d: {"z": d["x"] * 10}, 4)}
    rt = serve(WalkModel(nodes, {"w1": "a", "w2": "b"}, subs, next_walk=next_walk))
    hs = {x: rt.submit({"x": x}) for x in range(1, 5)}
    with pytest.raises(RequestFailed) as info:
        hs[2].result(timeout=T)
    msg = str(info.value)
    assert "next_walk" in msg and "'w1'" in msg and "KeyError" in msg and "no such state" in msg
    for x in (1, 3, 4):
        assert hs[x].result(timeout=T) == {"y": [x + 1], "z": [x * 10]}
    assert settled(rt) == ZERO_LIVE


def test_next_walk_naming_an_unknown_walk_fails_the_request(serve):
    nodes = [GraphNode("a", ["x"], [GraphEdge(EMIT, "y")])]
    rt = serve(WalkModel(nodes, {"w1": "a"}, {"a": Fn(lambda d: {"y": d["x"]})},
                         next_walk=lambda req, fin, p: "nope"))
    with pytest.raises(RequestFailed, match="'nope'"):
        rt.submit({"x": 1}).result(timeout=T)
    assert settled(rt) == ZERO_LIVE


def test_check_stop_naming_an_unknown_loop_fails_the_request_and_names_the_loop(serve):
    gen = Stopper(lambda d: {"tok": 1}, stop=lambda d, o: True, loop="gne")
    nodes = [GraphNode("gen", ["x"], [GraphEdge(EMIT, "tok")])]
    rt = serve(WalkModel(nodes, {"w": DynamicLoop("gen", 5, "gen")}, {"gen": gen}))
    with pytest.raises(RequestFailed, match="'gne'"):
        rt.submit({"x": 0}).result(timeout=T)
    assert settled(rt) == ZERO_LIVE

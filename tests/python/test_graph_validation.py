"""Graph and walk validation: malformed models fail before anything runs, with a message that names
the problem, the place (node, walk, loop) and the fix."""

import re

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
    compile_model,
)

from walk_models import Fn, WalkModel, close_within, engine_threads


def _model(nodes, walks, inputs=("x",), **kw):
    """Every node gets a trivial submodule (validation never runs them)."""
    subs = {n.name: Fn(lambda d: {}) for n in nodes}
    subs.update(kw.pop("submodules", {}))
    return WalkModel(nodes, walks, subs, inputs=inputs, **kw)


def _error(model) -> str:
    with pytest.raises(GraphError) as info:
        compile_model(model)
    return str(info.value)


def _has(message: str, *parts: str) -> None:
    for p in parts:
        assert p in message, f"{p!r} missing from: {message}"


# ---- names and places ---------------------------------------------------------------------------

def test_walk_running_an_unknown_node_names_the_node_and_the_walk():
    msg = _error(_model([GraphNode("a", ["x"], ["y"])], {"w": Sequential("a", "ghost")}))
    _has(msg, "walk 'w'", "'ghost'", "not in the graph")


def test_unknown_node_deep_inside_nested_sections_is_found():
    walk = Sequential("a", Loop(Parallel("a2", Loop("ghost", 2)), 3))
    nodes = [GraphNode("a", ["x"], ["y"]), GraphNode("a2", ["y"], ["z"])]
    _has(_error(_model(nodes, {"prefill": walk})), "walk 'prefill'", "'ghost'")


def test_input_nobody_produces_gives_the_exact_fix():
    nodes = [GraphNode("x_enc", ["x"], ["h"]), GraphNode("x", ["h", "codes"], ["out"])]
    msg = _error(_model(nodes, {"w": Sequential("x_enc", "x")}, inputs=("x",)))
    assert msg == ("node 'x' in walk 'w' reads 'codes', which no node produces; add an edge named "
                   "'codes' or rename the input")


def test_name_produced_only_in_another_walk_and_not_persisted_is_not_visible():
    nodes = [GraphNode("enc", ["x"], ["h"]), GraphNode("dec", ["h"], ["out"])]
    msg = _error(_model(nodes, {"prefill": "enc", "decode": "dec"}))
    _has(msg, "node 'dec'", "walk 'decode'", "reads 'h'", "which no node produces")


def test_persisted_name_is_visible_in_other_walks():
    nodes = [GraphNode("enc", ["x"], [GraphEdge("dec", "h", persist=True)]),
             GraphNode("dec", ["h"], ["out"])]
    compile_model(_model(nodes, {"prefill": "enc", "decode": "dec"}))


def test_request_inputs_are_visible_in_every_walk():
    nodes = [GraphNode("a", ["x"], ["y"]), GraphNode("b", ["x"], ["z"])]
    compile_model(_model(nodes, {"one": "a", "two": "b"}))


def test_output_produced_twice_in_one_scope_names_both_producers():
    nodes = [GraphNode("a", ["x"], ["y"]), GraphNode("b", ["x"], ["y"]), GraphNode("c", ["y"], ["z"])]
    msg = _error(_model(nodes, {"w": Sequential("a", "b", "c")}))
    _has(msg, "output 'y'", "'a'", "'b'", "walk 'w'", "rename")


def test_output_produced_by_two_parallel_branches_is_rejected():
    nodes = [GraphNode("l", ["x"], ["y"]), GraphNode("r", ["x"], ["y"])]
    _has(_error(_model(nodes, {"cfg": Parallel("l", "r")})), "output 'y'", "'l'", "'r'", "walk 'cfg'")


def test_output_produced_twice_inside_one_loop_body_is_rejected():
    nodes = [GraphNode("a", ["x"], ["y"]), GraphNode("b", ["x"], ["y"])]
    _has(_error(_model(nodes, {"w": Loop(Sequential("a", "b"), 2)})), "output 'y'", "walk 'w'")


def test_initial_value_outside_a_loop_and_update_inside_it_is_allowed():
    nodes = [GraphNode("init", ["x"], ["s"]), GraphNode("step", ["s"], ["s"]),
             GraphNode("use", ["s"], [GraphEdge(EMIT, "o")])]
    compile_model(_model(nodes, {"w": Sequential("init", Loop("step", 3, outputs=["s"]), "use")}))


def test_reading_a_name_produced_later_is_reported_as_a_cycle_outside_a_loop():
    nodes = [GraphNode("a", ["x", "y"], ["z"]), GraphNode("b", ["z"], ["y"])]
    msg = _error(_model(nodes, {"w": Sequential("a", "b")}))
    _has(msg, "node 'a'", "walk 'w'", "reads 'y'", "'b' produces only later", "cycle outside a loop")


def test_the_same_cycle_inside_a_loop_still_needs_a_first_value():
    nodes = [GraphNode("a", ["x", "y"], ["z"]), GraphNode("b", ["z"], ["y"])]
    _has(_error(_model(nodes, {"w": Loop(Sequential("a", "b"), 3)})), "node 'a'", "reads 'y'")


def test_parallel_branch_cannot_read_its_sibling_branchs_output():
    nodes = [GraphNode("l", ["x"], ["y"]), GraphNode("r", ["y"], ["z"])]
    msg = _error(_model(nodes, {"w": Parallel("l", "r")}))
    _has(msg, "node 'r'", "walk 'w'", "reads 'y'", "parallel branch")


def test_node_reading_its_own_output_needs_a_first_value():
    nodes = [GraphNode("step", ["s"], ["s"])]
    msg = _error(_model(nodes, {"w": Loop("step", 3)}))
    _has(msg, "node 'step'", "walk 'w'", "its own output 's'")


def test_name_made_inside_a_loop_but_not_listed_as_its_output_is_invisible_after_it():
    nodes = [GraphNode("step", ["x"], ["v"]), GraphNode("after", ["v"], ["o"])]
    msg = _error(_model(nodes, {"w": Sequential(Loop("step", 2), "after")}))
    _has(msg, "node 'after'", "walk 'w'", "reads 'v'")


def test_name_kept_inside_a_loop_error_points_to_the_loops_outputs():
    nodes = [GraphNode("step", ["x"], ["v"]), GraphNode("after", ["v"], ["o"])]
    msg = _error(_model(nodes, {"w": Sequential(Loop("step", 2), "after")}))
    assert "outputs" in msg and "cycle" not in msg, msg


# ---- loops ----------------------------------------------------------------------------------------

def test_loop_name_both_last_value_and_accumulated_is_rejected():
    nodes = [GraphNode("step", ["x"], ["v"])]
    msg = _error(_model(nodes, {"w": Loop("step", 3, outputs=["v"], accumulated_outputs=["v"])}))
    _has(msg, "Loop in walk 'w'", "['v']", "both an output and an accumulated output")


def test_dynamic_loop_name_both_last_value_and_accumulated_names_the_loop():
    nodes = [GraphNode("step", ["x"], ["v"])]
    walk = DynamicLoop("step", 3, "gen", outputs=["v"], accumulated_outputs=["v"])
    _has(_error(_model(nodes, {"w": walk})), "DynamicLoop 'gen'", "walk 'w'", "both")


@pytest.mark.parametrize("max_iters", [0, -1])
def test_loop_max_iters_below_one_is_rejected(max_iters):
    msg = _error(_model([GraphNode("step", ["x"], ["v"])], {"w": Loop("step", max_iters)}))
    _has(msg, "Loop in walk 'w'", f"max_iters={max_iters}", ">= 1")


def test_dynamic_loop_max_iters_below_one_is_rejected():
    msg = _error(_model([GraphNode("step", ["x"], ["v"])], {"w": DynamicLoop("step", 0, "gen")}))
    _has(msg, "DynamicLoop 'gen'", "walk 'w'", "max_iters=0")


def test_loop_max_iters_must_be_an_integer():
    _has(_error(_model([GraphNode("step", ["x"], ["v"])], {"w": Loop("step", 2.5)})), "max_iters=2.5")


def test_loop_output_that_nothing_inside_produces_is_rejected():
    msg = _error(_model([GraphNode("step", ["x"], ["v"])], {"w": Loop("step", 2, outputs=["vv"])}))
    _has(msg, "Loop in walk 'w'", "'vv'", "no node inside it produces")


def test_dynamic_loop_without_a_name_is_rejected():
    msg = _error(_model([GraphNode("step", ["x"], ["v"])], {"w": DynamicLoop("step", 4, "")}))
    _has(msg, "DynamicLoop in walk 'w'", "needs a name")


def test_two_dynamic_loops_with_one_name_in_a_walk_are_rejected():
    nodes = [GraphNode("a", ["x"], ["v"]), GraphNode("b", ["x"], ["u"])]
    walk = Sequential(DynamicLoop("a", 4, "gen"), DynamicLoop("b", 4, "gen"))
    _has(_error(_model(nodes, {"w": walk})), "two DynamicLoops named 'gen'", "walk 'w'")


def test_nested_dynamic_loops_with_one_name_are_rejected():
    nodes = [GraphNode("a", ["x"], ["v"])]
    walk = DynamicLoop(DynamicLoop("a", 4, "gen"), 4, "gen")
    _has(_error(_model(nodes, {"w": walk})), "two DynamicLoops named 'gen'")


def test_one_dynamic_loop_name_may_be_reused_in_another_walk():
    nodes = [GraphNode("a", ["x"], ["v"]), GraphNode("b", ["x"], ["u"])]
    compile_model(_model(nodes, {"w1": DynamicLoop("a", 4, "gen"), "w2": DynamicLoop("b", 4, "gen")}))


# ---- edges ----------------------------------------------------------------------------------------

def test_edge_to_an_unknown_node_is_rejected():
    nodes = [GraphNode("a", ["x"], [GraphEdge("ghost", "y")])]
    _has(_error(_model(nodes, {"w": "a"})), "edge 'y'", "from 'a'", "'ghost'", "not a node")


def test_edge_to_a_node_that_does_not_read_it_is_rejected():
    nodes = [GraphNode("a", ["x"], [GraphEdge("b", "y")]), GraphNode("b", ["x"], ["z"])]
    msg = _error(_model(nodes, {"w": Sequential("a", "b")}))
    _has(msg, "edge 'y'", "from 'a'", "goes to 'b'", "does not read 'y'", "b's inputs")


def test_streaming_edge_to_a_node_that_does_not_read_it_is_rejected():
    nodes = [GraphNode("a", ["x"], [StreamingGraphEdge("b", "tok", mstar_rt.Fixed(2))]),
             GraphNode("b", ["x"], ["z"])]
    _has(_error(_model(nodes, {"w": Parallel("a", "b")})), "edge 'tok'", "does not read 'tok'")


def test_streaming_edge_to_emit_is_rejected():
    nodes = [GraphNode("a", ["x"], [StreamingGraphEdge(EMIT, "tok", mstar_rt.Fixed(2))])]
    _has(_error(_model(nodes, {"w": "a"})), "streaming edge 'tok'", "EMIT", "GraphEdge(EMIT")


def test_streaming_edge_to_a_node_outside_the_walk_is_rejected():
    nodes = [GraphNode("gen", ["x"], [StreamingGraphEdge("snac", "tok", mstar_rt.Fixed(2))]),
             GraphNode("snac", ["tok"], ["audio"])]
    msg = _error(_model(nodes, {"decode": Loop("gen", 4), "vocode": "snac"}))
    _has(msg, "streaming edge 'tok'", "'snac'", "walk 'decode'")


def test_two_producers_streaming_one_name_to_a_node_is_rejected():
    # A node may read several streams (test_multi_stream.py), but each under its own name.
    nodes = [GraphNode("a", ["x"], [StreamingGraphEdge("c", "t", mstar_rt.Fixed(1))]),
             GraphNode("b", ["x"], [StreamingGraphEdge("c", "t", mstar_rt.Fixed(1))]),
             GraphNode("c", ["t"], ["o"])]
    _has(_error(_model(nodes, {"w": Parallel("a", "b", "c")})), "'t'", "'a'", "'b'", "walk 'w'")


def test_stream_consumer_running_before_its_producer_is_rejected():
    nodes = [GraphNode("gen", ["x"], [StreamingGraphEdge("snac", "tok", mstar_rt.Fixed(2))]),
             GraphNode("snac", ["tok"], [GraphEdge(EMIT, "audio")])]
    with pytest.raises(GraphError, match="snac"):
        compile_model(_model(nodes, {"w": Sequential("snac", Loop("gen", 4))}))


# ---- nodes ---------------------------------------------------------------------------------------

def test_duplicate_node_names_are_rejected():
    nodes = [GraphNode("a", ["x"], ["y"]), GraphNode("a", ["y"], ["z"])]
    _has(_error(_model(nodes, {"w": "a"})), "two nodes are named 'a'", "unique")
    # each with its own submodule on the GraphNode: named as a duplicate, not as a submodule
    # declared twice (the model declares no submodules)
    nodes = [GraphNode("a", ["x"], ["y"], submodule=Fn(lambda d: {})),
             GraphNode("a", ["y"], ["z"], submodule=Fn(lambda d: {}))]
    _has(_error(WalkModel(nodes, {"w": "a"}, {}, inputs=("x",))), "two nodes are named 'a'")


@pytest.mark.parametrize("inputs, outputs, words", [
    (["x"], [3], r"has output 3; an output is a value name \(a string\), a GraphEdge"),
    (["x"], [""], "has output ''"),
    ([3], ["y"], "reads 3; inputs are value names"),
])
def test_a_node_whose_inputs_or_outputs_are_not_names_is_refused_by_name(inputs, outputs,
                                                                         words):
    with pytest.raises(GraphError, match=words):
        GraphNode("a", inputs, outputs)


def test_node_appearing_twice_in_a_walk_is_rejected():
    nodes = [GraphNode("a", ["x"], ["y"]), GraphNode("b", ["y"], ["z"])]
    msg = _error(_model(nodes, {"w": Sequential("a", "b", Loop("a", 2))}))
    _has(msg, "node 'a'", "twice in walk 'w'", "Loop")


def test_node_appearing_in_two_parallel_branches_is_rejected():
    nodes = [GraphNode("a", ["x"], ["y"])]
    _has(_error(_model(nodes, {"cfg": Parallel("a", "a")})), "node 'a'", "twice in walk 'cfg'")


@pytest.mark.parametrize("name", ["", EMIT])
def test_node_needs_a_real_name(name):
    with pytest.raises(GraphError, match="needs a name"):
        GraphNode(name, ["x"], ["y"])


def test_node_listing_an_input_twice_is_rejected():
    with pytest.raises(GraphError, match=re.escape("node 'a' reads 'x' twice")):
        GraphNode("a", ["x", "x"], ["y"])


def test_something_that_is_not_a_node_is_rejected():
    m = _model([GraphNode("a", ["x"], ["y"])], {"w": "a"})
    m.nodes.append("b")
    with pytest.raises(GraphError, match="is not a GraphNode"):
        compile_model(m)


def test_model_without_walks_is_rejected():
    _has(_error(_model([GraphNode("a", ["x"], ["y"])], {})), "no walks")


def test_walk_made_of_something_that_is_not_a_section_is_rejected():
    _has(_error(_model([GraphNode("a", ["x"], ["y"])], {"w": Sequential("a", 42)})), "not a section")


def test_missing_submodule_names_the_node():
    nodes = [GraphNode("a", ["x"], ["y"]), GraphNode("b", ["y"], ["z"])]
    m = WalkModel(nodes, {"w": Sequential("a", "b")}, {"a": Fn(lambda d: {"y": 1})})
    with pytest.raises(ValueError, match=re.escape("no submodule for nodes ['b']")):
        compile_model(m)


def test_invalid_model_starts_no_engine_thread():
    before = set(engine_threads())
    nodes = [GraphNode("a", ["x", "nope"], ["y"])]
    with pytest.raises(GraphError):
        mstar_rt.Runtime(_model(nodes, {"w": "a"}))
    assert set(engine_threads()) == before


# ---- submit ---------------------------------------------------------------------------------------

@pytest.fixture
def two_input_runtime():
    nodes = [GraphNode("add", ["x", "y"], [GraphEdge(EMIT, "s")])]
    rt = mstar_rt.Runtime(WalkModel(nodes, {"w": "add"}, {"add": Fn(lambda d: {"s": d["x"] + d["y"]})},
                                    inputs=("x", "y")))
    yield rt
    close_within(rt)


def test_submit_with_an_unknown_input_names_it(two_input_runtime):
    with pytest.raises(ValueError, match=re.escape("inputs ['z'] are not declared")):
        two_input_runtime.submit({"x": 1, "y": 2, "z": 3})


def test_submit_with_a_missing_input_names_it(two_input_runtime):
    with pytest.raises(ValueError, match=re.escape("['y'] are missing")):
        two_input_runtime.submit({"x": 1})


def test_rejected_submit_leaves_nothing_behind_and_the_runtime_still_works(two_input_runtime):
    rt = two_input_runtime
    for bad in ({"x": 1}, {"x": 1, "y": 2, "q": 0}, {}):
        with pytest.raises(ValueError):
            rt.submit(bad)
    assert rt.live == dict(requests=0, handles=0, stored=0, queued=0, inflight=0)
    assert rt.submit({"x": 1, "y": 2}).result(timeout=5) == {"s": [3]}


def test_initial_walk_naming_an_unknown_walk_fails_the_submit():
    nodes = [GraphNode("a", ["x"], [GraphEdge(EMIT, "y")])]
    rt = mstar_rt.Runtime(WalkModel(nodes, {"w": "a"}, {"a": Fn(lambda d: {"y": d["x"]})},
                                    initial_walk=lambda req: "nope"))
    try:
        with pytest.raises(ValueError, match="initial_walk returned 'nope'"):
            rt.submit({"x": 1})
        assert rt.live["requests"] == 0 and rt.live["stored"] == 0
    finally:
        close_within(rt)

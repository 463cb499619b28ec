"""Graph definitions fuzzed (issue 16, item 2): random models, malformed and valid, written in the
Python DSL (GraphNode / Model / compile_model) and given to the bound C++ graph builder
(_core.GraphBuilder) directly (graph_fuzz.py writes one graph both ways).

Each malformed graph raises GraphError with a message -- the same message both ways -- and never
crashes, hangs or raises anything else; junk where a graph object belongs (a number for a node
name, a list for a section, a bad max_batch) raises GraphError, TypeError or ValueError with a
message. Each graph that compiles compiles to the same IR both ways, and a Runtime built from it
serves a request to the end. Every suite prints how many cases it tried. Nesting, cycles and
shared sections: test_fuzz_graph_nesting.py; integers out of range: test_fuzz_graph_integers.py."""

from __future__ import annotations

import time
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import mstar_rt
from mstar_rt import (EMIT, GraphEdge, GraphError, GraphNode, Loop, Sequential,
                      StreamingGraphEdge, _core, compile_model)

from graph_fuzz import (E, POLICIES, SETTINGS, dsl_model, graphs, judge, loop_counts, outcome,
                        serve, serve_one, valid_graphs)
from walk_models import Fn, WalkModel


def test_random_graphs_are_refused_with_one_message_both_ways_or_compile_and_serve():
    tally: dict = {}
    tried = []

    @settings(max_examples=400, **SETTINGS)
    @given(graph=graphs())
    def one(graph):
        tried.append(graph)
        # a graph without nodes: test_a_model_without_nodes_is_refused_by_the_compiler; a loop
        # of 2**32 - 1 iterations is valid, and runs that long
        if judge(graph, tally)[0] == "ok" and graph["nodes"] and \
                all(n <= 3 for n in loop_counts(graph)):
            serve_one(graph)

    t0 = time.monotonic()
    one()
    print(f"\ngraphs, random: {len(tried)} cases in {time.monotonic() - t0:.1f} s; {tally}")
    assert len(tried) >= 360
    assert len(tally) >= 12  # many different refusals, not one rule hit over and over
    assert tally.get("compiles", 0) >= 10


def test_random_valid_graphs_compile_the_same_both_ways_and_serve_a_request():
    tried = []

    @settings(max_examples=120, **SETTINGS)
    @given(graph=valid_graphs())
    def one(graph):
        tried.append(graph)
        assert judge(graph, {})[0] == "ok", graph
        serve_one(graph)

    t0 = time.monotonic()
    one()
    print(f"\ngraphs, valid: {len(tried)} cases in {time.monotonic() - t0:.1f} s")
    assert len(tried) >= 110


# ---- junk where a graph object belongs (the DSL only: the builder's types refuse it) ------------

JUNK = st.sampled_from([None, 42, 2.5, b"a", ["a"], {"a": 1}, object(), GraphEdge("a", "y")])


JUNK_PLACES = ["node", "node name", "input", "output", "section", "walk", "max_iters",
               "loop outputs", "policy", "max_batch", "inputs", "no submodule", "walk name",
               "engine"]


def junk_model(where: str, junk: Any, number: Any) -> WalkModel:
    """A small valid model with one thing replaced by junk (``number``: for numeric places)."""
    graph = {"inputs": ["x"], "nodes": [("a", ("x",), [("out", "y")], "default", 1),
                                        ("b", ("y",), [("edge", EMIT, "z", False)], "default", 1)],
             "walks": {"w": ("seq", [("node", "a"), ("node", "b")])}}
    model = dsl_model(graph)
    if where == "node":
        model.nodes.append(junk)
    elif where == "node name":
        model.nodes[0] = GraphNode(junk, ["x"], ["y"])
    elif where == "input":
        model.nodes[1] = GraphNode("b", [junk], [GraphEdge(EMIT, "z")])
    elif where == "output":
        model.nodes[0] = GraphNode("a", ["x"], ["y", junk])
    elif where == "section":
        model.walks["w"] = Sequential("a", junk, "b")
    elif where == "walk":
        model.walks["w"] = junk
    elif where == "max_iters":
        model.walks["w"] = Sequential(Loop("a", number), "b")
    elif where == "loop outputs":
        model.walks["w"] = Sequential(Loop("a", 2, outputs=["y", junk]), "b")
    elif where == "policy":
        model.nodes[0] = GraphNode("a", ["x"], ["y", StreamingGraphEdge("b", "y", junk)])
    elif where == "max_batch":
        model.submodules["a"].max_batch = number
    elif where == "inputs":
        model.inputs = (junk,)
    elif where == "no submodule":
        del model.submodules["b"]
    elif where == "walk name":
        model.walks = {junk if isinstance(junk, (int, float, bytes, type(None))) else 7: "a"}
    else:
        model.engines = {"a": junk}
    return model


def test_junk_in_a_model_is_refused_with_a_message_and_nothing_else():
    tried, kinds = [], {}

    @settings(max_examples=200, **SETTINGS)
    @given(where=st.sampled_from(JUNK_PLACES), junk=JUNK,
           number=st.sampled_from([2.0, "3", None, -1, 0, 2.5, [], 2**31, 2**32 - 1]))
    def one(where, junk, number):
        tried.append(where)
        kind, message = outcome(lambda: compile_model(junk_model(where, junk, number)))
        kinds[kind] = kinds.get(kind, 0) + 1
        if kind == "ok":
            try:
                serve(junk_model(where, junk, number), {"x": 1})
            except (ValueError, TypeError) as e:  # b"w" passes for a walk name, then not found
                assert str(e)
                kinds["refused at submit"] = kinds.get("refused at submit", 0) + 1

    t0 = time.monotonic()
    one()
    print(f"\ngraphs, junk: {len(tried)} cases in {time.monotonic() - t0:.1f} s; {kinds}")
    assert len(tried) >= 150


def test_chunk_policies_with_any_parameters_are_made_or_refused_with_a_message():
    tried = []

    @settings(max_examples=200, **SETTINGS)
    @given(name=st.sampled_from(sorted(POLICIES)),
           args=st.lists(st.one_of(st.integers(-2**65, 2**65), st.integers(-1, 5),
                                   st.lists(st.integers(-1, 5), max_size=3), st.none(),
                                   st.floats(), st.text(max_size=2)), max_size=4))
    def one(name, args):
        tried.append((name, args))
        try:
            made = POLICIES[name](*args)
        except (TypeError, ValueError, OverflowError) as e:
            assert str(e)
            return
        assert isinstance(made, mstar_rt.ChunkPolicy) and made.max_chunk >= 1
        assert repr(made)

    one()
    print(f"\nchunk policies: {len(tried)} cases")
    assert len(tried) >= 180


# ---- what the fuzzing found, fixed in the graph compiler --------------------------------------

def test_the_builder_refuses_the_nodes_graph_node_refuses():
    for name, inputs in [("", ["x"]), (EMIT, ["x"]), ("a", ["x", "x"])]:
        with pytest.raises(GraphError) as from_dsl:
            GraphNode(name, inputs, ["y"])
        with pytest.raises(GraphError) as from_builder:
            _core.GraphBuilder().input("x").node(name, inputs, [E.output("y")]) \
                .walk("w", name).compile()
        assert str(from_builder.value) == str(from_dsl.value)


def test_a_node_streaming_to_itself_is_refused():
    node = GraphNode("d", ["x", "y"], [StreamingGraphEdge("d", "y", mstar_rt.Fixed(1)), "h"])
    with pytest.raises(GraphError, match="'d'"):
        compile_model(WalkModel([node], {"w": "d"}, {"d": Fn(lambda d: {"h": 1})}))


def test_a_model_without_nodes_is_refused_by_the_compiler():
    with pytest.raises(GraphError, match="no nodes"):
        compile_model(WalkModel([], {"w": Sequential()}, {}))

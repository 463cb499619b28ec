"""Integers out of range in a graph, fuzzed (issue 16, item 2): any integer as a loop count or a
max_batch compiles when it fits the builder's range and is otherwise a GraphError naming the loop
or the node (not an OverflowError from pybind11); so is a value that is not an integer, or a
streaming edge without a chunk policy. Outside the graph compiler, a priority, a deadline or a
chunk policy size out of range is refused naming it."""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import mstar_rt
from mstar_rt import (DynamicLoop, GraphError, GraphNode, Loop, Parallel, Runtime, Sequential,
                      StreamingGraphEdge, _core, compile_model)
from mstar_rt.compiler import compile_graph

from graph_fuzz import CASE_SECONDS, E, S, SETTINGS, one_node, outcome
from walk_models import Fn, WalkModel, close_within


# ---- integers out of the builder's range: a GraphError naming the loop or the node -------------

@pytest.mark.parametrize("dynamic", [False, True])
def test_a_loop_count_beyond_64_bits_is_a_graph_error(dynamic):
    loop = DynamicLoop("a", 2**63, "gen") if dynamic else Loop("a", 2**63)
    with pytest.raises(GraphError, match="max_iters") as error:
        compile_model(one_node(loop))
    assert str(error.value) == (("DynamicLoop 'gen'" if dynamic else "Loop") +
                                " in walk 'w' has max_iters=9223372036854775808; it must be an "
                                "integer from 1 to 4294967295")


def test_a_max_batch_beyond_32_bits_is_a_graph_error():
    with pytest.raises(GraphError, match="max_batch") as error:
        compile_model(one_node("a", max_batch=2**32))
    assert str(error.value) == "node 'a' has max_batch 4294967296; it must be an integer from 1 " \
                               "to 4294967295"


UINT32_MAX, INT64 = 2**32 - 1, (-2**63, 2**63 - 1)
EDGE_INTS = [0, 1, -1, UINT32_MAX, UINT32_MAX + 1, 2**31, 2**31 - 1, -2**31 - 1, *INT64,
             INT64[0] - 1, INT64[1] + 1, 2**64 - 1, 2**64, -2**64, 10**30, -10**30]
ANY_INT = st.one_of(st.integers(-3, 3), st.sampled_from(EDGE_INTS), st.integers(-2**70, 2**70),
                    st.integers())


def test_any_integer_loop_count_compiles_or_is_a_graph_error_naming_the_loop_and_walk():
    tried = []

    @settings(max_examples=200, **SETTINGS)
    @given(n=ANY_INT, dynamic=st.booleans())
    def one(n, dynamic):
        tried.append(n)
        loop = DynamicLoop("a", n, "gen") if dynamic else Loop("a", n)
        dsl = outcome(lambda: compile_model(one_node(Sequential(loop))))
        if 1 <= n <= UINT32_MAX:
            assert dsl[0] == "ok", dsl
            return
        label = "DynamicLoop 'gen'" if dynamic else "Loop"
        assert dsl[0] == "GraphError" and dsl[1].startswith(
            f"{label} in walk 'w' has max_iters={n}; it must be "), dsl
        assert any(bound in dsl[1] for bound in (">= 1", "at most 4294967295",
                                                 "from 1 to 4294967295")), dsl
        if INT64[0] <= n <= INT64[1]:  # the builder takes it, and refuses it in the same words
            cpp = S.dynamic_loop("gen", "a", n) if dynamic else S.loop("a", n)
            assert outcome(lambda: _core.GraphBuilder().input("x")
                           .node("a", ["x"], [E.output("y")]).walk("w", S.seq([cpp]))
                           .compile()) == dsl

    one()
    print(f"\nloop counts: {len(tried)} cases")
    assert len(tried) >= 180


def test_a_loop_count_that_is_not_an_integer_is_a_graph_error_and_any_integer_type_is_one():
    numpy = pytest.importorskip("numpy")
    for n in [True, False, 2.0, 2.5, "2", None, [2], float("inf"), numpy.float32(2)]:
        with pytest.raises(GraphError, match=re.escape(f"Loop in walk 'w' has max_iters={n!r}; it "
                                                       "must be an integer")):
            compile_model(one_node(Loop("a", n)))
    for n in [numpy.int64(3), numpy.uint8(3), numpy.int32(3)]:
        compile_model(one_node(Loop("a", n)))
    with pytest.raises(GraphError, match="max_iters=18446744073709551615; it must be an integer "
                                         "from 1 to 4294967295"):
        compile_model(one_node(Loop("a", numpy.uint64(2**64 - 1))))


def test_any_integer_max_batch_compiles_or_is_a_graph_error_naming_the_node():
    tried = []
    graph = ([GraphNode("a", ["x"], ["y"])], {"w": "a"}, ["x"], {})

    @settings(max_examples=200, **SETTINGS)
    @given(n=ANY_INT)
    def one(n):
        tried.append(n)
        # a model's submodule: compile_model takes a max_batch below 1 for 1
        dsl = outcome(lambda: compile_model(one_node("a", max_batch=n)))
        if n <= UINT32_MAX:
            assert dsl[0] == "ok" and dsl[1].nodes[0][2] == max(1, n), dsl
        else:
            assert dsl == ("GraphError", f"node 'a' has max_batch {n}; it must be an integer "
                                         "from 1 to 4294967295")
        # the graph compiler itself: 0 is the builder's to refuse, in its words
        direct = outcome(lambda: compile_graph(*graph, {"a": n}))
        if 1 <= n <= UINT32_MAX:
            assert direct[0] == "ok" and direct[1].nodes[0][2] == n
        elif n == 0:
            assert direct == outcome(lambda: _core.GraphBuilder().input("x").node(
                "a", ["x"], [E.output("y")], "default", 0).walk("w", "a").compile())
            assert direct == ("GraphError", "node 'a' has max_batch 0; it must be >= 1")
        else:
            assert direct == ("GraphError", f"node 'a' has max_batch {n}; it must be an integer "
                                            "from 1 to 4294967295")

    one()
    print(f"\nmax_batch: {len(tried)} cases")
    assert len(tried) >= 180
    for junk in [None, "two", float("inf"), float("nan"), [1]]:
        with pytest.raises(GraphError, match=re.escape(f"node 'a' has max_batch {junk!r}; it "
                                                       "must be an integer from 1 to 4294967295")):
            compile_graph(*graph, {"a": junk})


def test_a_streaming_edge_without_a_chunk_policy_is_a_graph_error_naming_the_edge():
    for junk in [None, 4, "Fixed(4)", mstar_rt.Fixed]:
        node = GraphNode("a", ["x"], ["y", StreamingGraphEdge("b", "y", junk)])
        with pytest.raises(GraphError, match=re.escape(
                f"streaming edge 'y' from 'a' has chunk_policy {junk!r}; use Fixed, "
                "SlidingWindow, LeftContext or Ramp")):
            compile_model(WalkModel([node, GraphNode("b", ["y"], ["z"])],
                                    {"w": Parallel(Loop("a", 2), "b")},
                                    {"a": Fn(lambda d: {"y": 1}), "b": Fn(lambda d: {"z": 1})}))


# ---- integers that used to reach pybind11 outside the graph compiler -------------------------

def test_a_priority_beyond_32_bits_is_refused_naming_the_priority():
    rt = Runtime(one_node("a"))
    try:
        for priority in [2**31, -2**31 - 1, 2**64]:
            with pytest.raises(ValueError, match="priority"):
                rt.submit({"x": 1}, priority=priority)
        assert rt.submit({"x": 1}, priority=2**31 - 1).result(CASE_SECONDS) == {}
    finally:
        close_within(rt)


def test_a_deadline_of_any_float_is_served_or_refused_naming_the_deadline():
    rt = Runtime(one_node("a"))
    try:
        for deadline in [1e10, 1e300, -1e12, float("inf"), float("-inf"), float("nan")]:
            try:
                rt.submit({"x": 1}, deadline=deadline).result(CASE_SECONDS)
            except ValueError as e:
                assert "deadline" in str(e)
    finally:
        close_within(rt)


@pytest.mark.parametrize("make", [lambda: mstar_rt.Fixed(-1), lambda: mstar_rt.Fixed(2**64),
                                  lambda: mstar_rt.SlidingWindow(2**64, 1),
                                  lambda: mstar_rt.LeftContext(-1, 1),
                                  lambda: mstar_rt.Ramp([-1], 1), lambda: mstar_rt.Ramp([1], 2**64),
                                  lambda: mstar_rt.Ramp([1], 1, -1)])
def test_a_chunk_policy_size_out_of_range_is_a_value_error_naming_it(make):
    with pytest.raises(ValueError, match=r"^(Fixed|SlidingWindow|LeftContext|Ramp)\("):
        make()

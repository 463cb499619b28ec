"""Graph definitions fuzzed (issue 16, item 2): random models, malformed and valid, written in the
Python DSL (GraphNode / Model / compile_model) and given to the bound C++ graph builder
(_core.GraphBuilder) directly.

Each malformed graph raises GraphError with a message -- the same message both ways -- and never
crashes, hangs or raises anything else; junk where a graph object belongs (a number for a node
name, a list for a section, a bad max_batch) raises GraphError, TypeError or ValueError with a
message. Each graph that compiles compiles to the same IR both ways, and a Runtime built from it
serves a request to the end. Every suite prints how many cases it tried."""

from __future__ import annotations

import dataclasses
import itertools
import re
import time
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mstar_rt
from mstar_rt import (EMIT, DynamicLoop, GraphEdge, GraphError, GraphNode, Loop, Parallel,
                      Runtime, Sequential, StreamingGraphEdge, _core, compile_model)
from mstar_rt.compiler import compile_graph
from mstar_rt.graph import MAX_SECTION_DEPTH, MAX_WALK_SECTIONS

from walk_models import Fn, WalkModel, close_within

S, E = _core.Section, _core.Edge
SETTINGS = dict(derandomize=True, deadline=None, database=None, print_blob=False,
                suppress_health_check=list(HealthCheck))
CASE_SECONDS = 5.0  # the longest one case may take: a hang fails, it does not stall CI

# ---- a graph as plain data, written both ways ------------------------------------------------------
#
# node:    (name, inputs, outputs, engine, max_batch); an output is ("out", name),
#          ("edge", to, name, persist) or ("stream", to, name, policy)
# section: ("node", name) | ("seq", [s]) | ("par", [s]) | ("loop", s, n, outputs, accumulated)
#          | ("dyn", loop name, s, n, outputs, accumulated)
# policy:  (constructor name, args)

POLICIES = {"Fixed": mstar_rt.Fixed, "SlidingWindow": mstar_rt.SlidingWindow,
            "LeftContext": mstar_rt.LeftContext, "Ramp": mstar_rt.Ramp}


def policy(spec: tuple) -> Any:
    name, args = spec
    return POLICIES[name](*args)


def dsl_output(o: tuple) -> Any:
    if o[0] == "out":
        return o[1]
    if o[0] == "edge":
        return GraphEdge(o[1], o[2], o[3])
    return StreamingGraphEdge(o[1], o[2], policy(o[3]))


def builder_output(o: tuple) -> Any:
    if o[0] == "out":
        return E.output(o[1])
    if o[0] == "edge":
        return E(o[1], o[2], o[3])
    return E.stream(o[1], o[2], policy(o[3]))


def dsl_section(s: Any) -> Any:
    if not isinstance(s, tuple):
        return s  # junk, as written
    kind = s[0]
    if kind == "node":
        return s[1]
    if kind == "seq":
        return Sequential(*map(dsl_section, s[1]))
    if kind == "par":
        return Parallel(*map(dsl_section, s[1]))
    if kind == "loop":
        return Loop(dsl_section(s[1]), s[2], s[3], s[4])
    return DynamicLoop(dsl_section(s[2]), s[3], s[1], s[4], s[5])


def builder_section(s: tuple) -> Any:
    kind = s[0]
    if kind == "node":
        return s[1]
    if kind in ("seq", "par"):
        return (S.seq if kind == "seq" else S.par)([builder_section(c) for c in s[1]])
    if kind == "loop":
        return S.loop(builder_section(s[1]), s[2], list(s[3]), list(s[4]))
    return S.dynamic_loop(s[1], builder_section(s[2]), s[3], list(s[4]), list(s[5]))


def outputs_of(node: tuple) -> list[str]:
    names: list[str] = []
    for o in node[2]:
        n = o[1] if o[0] == "out" else o[2]
        if n not in names:
            names.append(n)
    return names


def dsl_model(graph: dict) -> WalkModel:
    nodes = [GraphNode(n[0], n[1], [dsl_output(o) for o in n[2]]) for n in graph["nodes"]]
    subs = {}
    for n in graph["nodes"]:
        outs = outputs_of(n)
        subs[n[0]] = Fn(lambda d, outs=outs: {o: 1 for o in outs}, max_batch=n[4])
    return WalkModel(nodes, {w: dsl_section(s) for w, s in graph["walks"].items()}, subs,
                     inputs=graph["inputs"], engines={n[0]: n[3] for n in graph["nodes"]})


def compile_with_builder(graph: dict) -> Any:
    b = _core.GraphBuilder()
    for x in graph["inputs"]:
        b.input(x)
    for n in graph["nodes"]:
        b.node(n[0], list(n[1]), [builder_output(o) for o in n[2]], n[3], max(1, int(n[4])),
               False)
    for w, s in graph["walks"].items():
        b.walk(w, builder_section(s))
    return b.compile()


def outcome(build) -> tuple[str, Any]:
    """("ok", result) or ("GraphError" / "TypeError" / "ValueError", message); anything else
    fails the test. Times the call."""
    t0 = time.monotonic()
    try:
        result = ("ok", build())
    except (GraphError, TypeError, ValueError) as e:
        assert str(e), f"{type(e).__name__} without a message"
        result = (type(e).__name__ if type(e) is not GraphError else "GraphError", str(e))
    took = time.monotonic() - t0
    assert took < CASE_SECONDS, f"one graph took {took:.1f} s to judge"
    return result


def loop_counts(graph: dict) -> list[int]:
    counts = []

    def visit(s: tuple) -> None:
        if s[0] in ("seq", "par"):
            for c in s[1]:
                visit(c)
        elif s[0] == "loop":
            counts.append(s[2])
            visit(s[1])
        elif s[0] == "dyn":
            counts.append(s[3])
            visit(s[2])

    for root in graph["walks"].values():
        visit(root)
    return counts


IR_PARTS = ("names", "engines", "nodes", "walk_names")


def ir(spec: Any) -> tuple:
    return tuple(getattr(spec, p) for p in IR_PARTS)


# ---- strategies --------------------------------------------------------------------------------

NODE_NAMES = ["a", "b", "c", "d"]
VALUE = st.sampled_from(["x", "s", "h", "y", "tok"])
ITERS = st.one_of(st.integers(1, 3), st.sampled_from([0, -1, -2**63, 2**32 - 1, 2**32, 2**62]))
POLICY = st.one_of(
    st.tuples(st.just("Fixed"), st.tuples(st.integers(1, 4))),
    st.tuples(st.just("SlidingWindow"), st.tuples(st.integers(1, 4), st.integers(1, 4)).filter(
        lambda t: t[1] <= t[0])),
    st.tuples(st.just("LeftContext"), st.tuples(st.integers(0, 3), st.integers(1, 4))),
    st.tuples(st.just("Ramp"), st.tuples(st.lists(st.integers(1, 3), max_size=2).map(tuple),
                                         st.integers(1, 4), st.integers(0, 2))))


def sections(leaf: st.SearchStrategy) -> st.SearchStrategy:
    names = st.lists(VALUE, unique=True, max_size=2).map(tuple)
    return st.recursive(
        leaf.map(lambda n: ("node", n)),
        lambda c: st.one_of(
            st.lists(c, max_size=3).map(lambda p: ("seq", p)),
            st.lists(c, max_size=3).map(lambda p: ("par", p)),
            st.tuples(st.just("loop"), c, ITERS, names, names),
            st.tuples(st.just("dyn"), st.sampled_from(["gen", "gen", "g2", ""]), c, ITERS, names,
                      names)),
        max_leaves=6)


@st.composite
def graphs(draw) -> dict:
    """Random graphs near the valid ones, so every rule gets hit: distinct node names but now
    and then a repeat, plain outputs but now and then an edge or a stream (to a node that may or
    may not read it), walks over the graph's nodes but now and then an unknown one."""
    names = draw(st.lists(st.sampled_from(NODE_NAMES), min_size=1, max_size=4, unique=True))
    if draw(st.integers(0, 9)) == 0:
        names.append(names[0])
    where = st.sampled_from(names + ["ghost", EMIT])
    nodes = []
    for name in names:
        outputs = []
        for value in draw(st.lists(VALUE, unique=True, max_size=2)):
            pick = draw(st.integers(0, 7))
            if pick == 0:
                outputs.append(("edge", draw(where), value, draw(st.booleans())))
            elif pick == 1:  # not to itself: test_a_node_streaming_to_itself_is_refused
                to = draw(where.filter(lambda n, name=name: n != name))
                outputs.append(("stream", to, value, draw(POLICY)))
            elif pick == 2:
                outputs.append(("edge", EMIT, value, draw(st.booleans())))
            else:
                outputs.append(("out", value))
        nodes.append((name, tuple(draw(st.lists(VALUE, unique=True, max_size=3))), outputs,
                       draw(st.sampled_from(["default", "gpu"])), draw(st.integers(1, 4))))
    leaf = st.sampled_from(names + ["ghost"] * (draw(st.integers(0, 5)) == 0))
    walks = draw(st.dictionaries(st.sampled_from(["w", "prefill", "decode"]), sections(leaf),
                                 min_size=0 if draw(st.integers(0, 19)) == 0 else 1,
                                 max_size=3))
    return {"inputs": draw(st.lists(st.sampled_from(["x", "s"]), min_size=1, max_size=2,
                                    unique=True)),
            "nodes": nodes, "walks": walks}


@st.composite
def valid_graphs(draw) -> dict:
    """Graphs built to compile: every node reads only names visible where it runs (request
    inputs, earlier outputs, loop outputs), loops list what they keep, streams are produced in a
    loop and consumed after it or beside it."""
    nodes: list = []
    count = itertools.count()
    accumulated: set = set()

    def node(avail: set, extra_outputs: tuple = (), reads: tuple = ()) -> tuple:
        name = f"n{next(count)}"
        read = tuple(draw(st.lists(st.sampled_from(sorted(avail)), unique=True, max_size=2))) \
            + reads
        out = f"v_{name}"
        outputs = [("out", out)] + ([("edge", EMIT, out, False)] if draw(st.booleans()) else [])
        nodes.append((name, read, outputs + list(extra_outputs),
                      draw(st.sampled_from(["default", "gpu"])), draw(st.integers(1, 4))))
        return ("node", name), {out}

    def section(avail: set, depth: int) -> tuple:
        kinds = ["node", "seq", "par", "loop", "dyn", "stream"] if depth < 3 else ["node"]
        kind = draw(st.sampled_from(kinds))
        if kind == "node":
            return node(avail)
        if kind in ("seq", "par"):
            parts, made, seen = [], set(), set(avail)
            for _ in range(draw(st.integers(1, 3))):
                part, p = section(seen if kind == "seq" else avail, depth + 1)
                parts.append(part)
                made |= p
                if kind == "seq":
                    seen |= p
            return (kind, parts), made
        if kind == "stream":
            consumer, tok = f"n{next(count)}", f"t{next(count)}"
            producer, _ = node(avail, (("stream", consumer, tok, draw(POLICY)),))
            out = f"v_{consumer}"
            nodes.append((consumer, (tok,), [("out", out), ("edge", EMIT, out, False)],
                          "default", draw(st.integers(1, 3))))
            arrange = draw(st.sampled_from(["seq", "par"]))
            return (arrange, [("loop", producer, draw(st.integers(1, 3)), (), ()),
                              ("node", consumer)]), {out}
        body, made = section(avail, depth + 1)
        listed = draw(st.lists(st.sampled_from(sorted(made)), unique=True)) if made else []
        split = draw(st.integers(0, len(listed)))
        outs = tuple(listed[:split])
        acc = tuple(n for n in listed[split:] if n not in accumulated)
        accumulated.update(acc)
        iters = draw(st.integers(1, 3))
        if kind == "loop":
            return ("loop", body, iters, outs, acc), set(outs) | set(acc)
        return ("dyn", f"loop{next(count)}", body, iters, outs, acc), set(outs) | set(acc)

    root, _ = section({"x"}, 0)
    return {"inputs": ["x"], "nodes": nodes, "walks": {"main": root}}


# ---- malformed and valid graphs, both ways -------------------------------------------------------

def judge(graph: dict, tally: dict) -> tuple:
    """Compiles ``graph`` both ways; checks they agree; returns the DSL's outcome."""
    dsl = outcome(lambda: compile_model(dsl_model(graph)).spec)
    cpp = outcome(lambda: compile_with_builder(graph))
    assert dsl[0] in ("ok", "GraphError") and cpp[0] in ("ok", "GraphError"), (dsl, cpp, graph)
    if dsl[0] == "ok":
        assert cpp[0] == "ok", (cpp, graph)
        assert ir(dsl[1]) == ir(cpp[1]), graph
    else:
        assert cpp == dsl, (dsl, cpp, graph)
    key = "compiles" if dsl[0] == "ok" else re.sub(r"'[^']*'|\d+", "_", dsl[1].split(";")[0])
    tally[key] = tally.get(key, 0) + 1
    return dsl


def serve_one(graph: dict) -> None:
    serve(dsl_model(graph), {x: 1 for x in graph["inputs"]}, graph)


def serve(model: Any, inputs: dict, what: Any = None) -> None:
    """A Runtime built from a model that compiled serves a request to the end (or fails it with
    an error), in bounded time."""
    t0 = time.monotonic()
    rt = Runtime(model)
    try:
        handle = rt.submit(inputs)
        try:
            handle.result(CASE_SECONDS)
        except mstar_rt.RequestFailed as e:
            assert str(e)
        except TimeoutError:
            raise AssertionError(f"the request hangs: {what!r}, {rt.live}") from None
    finally:
        close_within(rt)
    assert time.monotonic() - t0 < 2 * CASE_SECONDS


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

def _one_node(walk: Any, max_batch: int = 1) -> WalkModel:
    return WalkModel([GraphNode("a", ["x"], ["y"])], {"w": walk},
                     {"a": Fn(lambda d: {"y": 1}, max_batch=max_batch)})


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


def test_a_deeply_nested_walk_compiles_or_is_refused_with_a_graph_error():
    walk: Any = "a"
    for _ in range(600):
        walk = Sequential(walk)
    kind, message = outcome(lambda: compile_model(_one_node(walk)))
    assert kind == "GraphError", message
    assert "walk 'w'" in message and f"more than {MAX_SECTION_DEPTH} deep" in message
    # and the walk prints and compares, deep as it is
    assert repr(walk).startswith("Sequential(parts=[Sequential(parts=[") and walk == copy(walk)


@pytest.mark.parametrize("dynamic", [False, True])
def test_a_loop_count_beyond_64_bits_is_a_graph_error(dynamic):
    loop = DynamicLoop("a", 2**63, "gen") if dynamic else Loop("a", 2**63)
    with pytest.raises(GraphError, match="max_iters") as error:
        compile_model(_one_node(loop))
    assert str(error.value) == (("DynamicLoop 'gen'" if dynamic else "Loop") +
                                " in walk 'w' has max_iters=9223372036854775808; it must be an "
                                "integer from 1 to 4294967295")


def test_a_max_batch_beyond_32_bits_is_a_graph_error():
    with pytest.raises(GraphError, match="max_batch") as error:
        compile_model(_one_node("a", max_batch=2**32))
    assert str(error.value) == "node 'a' has max_batch 4294967296; it must be an integer from 1 " \
                               "to 4294967295"


# ---- nesting, cycles and shared sections: lowered without recursion -----------------------------

def copy(s: Any) -> Any:
    """A new section tree equal to ``s`` (no object shared), built without recursion."""
    chain = []
    while not isinstance(s, str):
        chain.append(s)
        if isinstance(s, Loop):
            s = s.section
        else:
            assert len(s.parts if isinstance(s, Sequential) else s.branches) == 1
            s = (s.parts if isinstance(s, Sequential) else s.branches)[0]
    for outer in reversed(chain):
        if isinstance(outer, DynamicLoop):
            s = DynamicLoop(s, outer.max_iters, outer.name)
        elif isinstance(outer, Loop):
            s = Loop(s, outer.max_iters)
        else:
            s = type(outer)(s)
    return s


# kind -> (the DSL section around s, the builder's section around c); level i names DynamicLoop i
NESTS = {
    "seq": (lambda s, i: Sequential(s), lambda c, i: S.seq([c])),
    "par": (lambda s, i: Parallel(s), lambda c, i: S.par([c])),
    "loop": (lambda s, i: Loop(s, 1), lambda c, i: S.loop(c, 1)),
    "dyn": (lambda s, i: DynamicLoop(s, 1, f"g{i}"), lambda c, i: S.dynamic_loop(f"g{i}", c, 1)),
}


def test_walks_nested_to_any_depth_compile_up_to_the_limit_and_are_refused_beyond_it():
    tried, refused = [], 0
    depths = st.one_of(st.integers(1, 30),
                       st.integers(MAX_SECTION_DEPTH - 2, MAX_SECTION_DEPTH + 2),
                       st.sampled_from([MAX_SECTION_DEPTH, 2 * MAX_SECTION_DEPTH, 1000, 20_000]))

    @settings(max_examples=40, **SETTINGS)
    @given(kinds=st.lists(st.sampled_from(sorted(NESTS)), min_size=1, max_size=6), depth=depths)
    def one(kinds, depth):
        nonlocal refused
        tried.append(depth)
        walk: Any = "a"
        for i in range(depth):
            walk = NESTS[kinds[i % len(kinds)]][0](walk, i)
        kind, result = outcome(lambda: compile_model(_one_node(walk)))
        # printing and comparing such a walk works at any depth
        assert repr(walk).startswith(type(walk).__qualname__ + "(")
        assert walk == copy(walk) and walk != Sequential(walk) and not walk != copy(walk)
        if depth > MAX_SECTION_DEPTH:
            refused += 1
            assert kind == "GraphError" and result == (
                f"walk 'w' nests sections more than {MAX_SECTION_DEPTH} deep, the most allowed; "
                "flatten it: Sequential('a', 'b', 'c') runs what Sequential(Sequential('a', 'b'), "
                "'c') does"), result
            return
        assert kind == "ok", result
        cpp: Any = "a"
        for i in range(depth):
            cpp = NESTS[kinds[i % len(kinds)]][1](cpp, i)
        built = _core.GraphBuilder().input("x").node("a", ["x"], [E.output("y")]).walk("w", cpp)
        assert ir(result.spec) == ir(built.compile())
        if depth in (1, MAX_SECTION_DEPTH):  # a walk at the limit serves, too
            serve(_one_node(walk), {"x": 1}, depth)

    one()
    print(f"\nnested walks: {len(tried)} cases, {refused} refused, deepest {max(tried)}")
    assert len(tried) >= 35 and refused >= 5 and MAX_SECTION_DEPTH in tried


def _cycles() -> dict[str, Any]:
    """Walks whose sections contain themselves, each way a section can hold another."""
    seq = Sequential("a")
    seq.parts.append(seq)
    par = Parallel("a")
    par.branches.append(Sequential(par))
    loop = Loop("a", 2)
    loop.section = Sequential("a", loop)
    dyn = DynamicLoop("a", 2, "gen")
    dyn.section = dyn
    outer = Sequential("a")
    inner = Loop(Parallel(outer), 3)
    outer.parts.append(Sequential(inner))
    return {"Sequential": seq, "Parallel": par, "Loop": loop, "DynamicLoop": dyn,
            "Sequential, deep": Sequential(outer)}


@pytest.mark.parametrize("name", list(_cycles()))
def test_a_section_inside_itself_is_refused_with_a_graph_error_and_still_prints(name):
    walk = _cycles()[name]
    with pytest.raises(GraphError, match=r"walk 'w' has a \w+ inside itself; a section cannot "
                                         "contain itself"):
        compile_model(_one_node(walk))
    assert "..." in repr(walk)
    assert walk == walk and walk == _cycles()[name] and walk != Sequential("a")


def test_a_section_shared_by_many_places_is_refused_before_it_takes_long():
    shared: Any = "a"
    for _ in range(64):  # 2**64 places from 64 objects
        shared = Sequential(shared, shared)
    kind, message = outcome(lambda: compile_model(_one_node(shared)))
    assert kind == "GraphError" and message.startswith(
        f"walk 'w' has more than {MAX_WALK_SECTIONS} sections and node names"), message
    assert "runs in each" in message
    # shared by two places, it is the builder's rule that refuses it, in the builder's words
    twice = Sequential("a")
    dsl = outcome(lambda: compile_model(_one_node(Parallel(twice, twice))))
    cpp = outcome(lambda: _core.GraphBuilder().input("x").node("a", ["x"], [E.output("y")])
                  .walk("w", S.par([S.seq(["a"]), S.seq(["a"])])).compile())
    assert dsl == cpp and dsl[0] == "GraphError" and "appears twice" in dsl[1]


def dataclass_repr(x: Any) -> str:
    """What the dataclass ``repr`` of a section tree is, recursively (for small trees)."""
    if isinstance(x, mstar_rt.graph.Section):
        return type(x).__qualname__ + "(" + ", ".join(
            f"{f.name}={dataclass_repr(getattr(x, f.name))}" for f in dataclasses.fields(x)
            if f.repr) + ")"
    if type(x) in (list, tuple):
        inner = ", ".join(map(dataclass_repr, x))
        return f"[{inner}]" if type(x) is list else f"({inner}{',' if len(x) == 1 else ''})"
    return repr(x)


def test_sections_print_and_compare_as_their_dataclasses_did():
    assert repr(Loop("a", 2)) == \
        "Loop(section='a', max_iters=2, outputs=(), accumulated_outputs=())"
    assert repr(Sequential("a", DynamicLoop(Parallel("b", "c"), 3, "gen", ["y"]))) == (
        "Sequential(parts=['a', DynamicLoop(section=Parallel(branches=['b', 'c']), max_iters=3, "
        "outputs=('y',), accumulated_outputs=(), name='gen')])")
    with pytest.raises(TypeError, match="unhashable"):
        hash(Sequential("a"))
    tried = []
    trees = sections(st.sampled_from(["a", "b"])).map(dsl_section)

    @settings(max_examples=150, **SETTINGS)
    @given(a=trees, b=trees)
    def one(a, b):
        tried.append(a)
        assert repr(a) == dataclass_repr(a) and repr(b) == dataclass_repr(b)
        assert (a == b) == (dataclass_repr(a) == dataclass_repr(b))
        assert (a != b) == (dataclass_repr(a) != dataclass_repr(b))

    one()
    print(f"\nsection repr and ==: {len(tried)} cases")
    assert len(tried) >= 100


# ---- integers out of the builder's range: a GraphError naming the loop or the node -------------

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
        dsl = outcome(lambda: compile_model(_one_node(Sequential(loop))))
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
            compile_model(_one_node(Loop("a", n)))
    for n in [numpy.int64(3), numpy.uint8(3), numpy.int32(3)]:
        compile_model(_one_node(Loop("a", n)))
    with pytest.raises(GraphError, match="max_iters=18446744073709551615; it must be an integer "
                                         "from 1 to 4294967295"):
        compile_model(_one_node(Loop("a", numpy.uint64(2**64 - 1))))


def test_any_integer_max_batch_compiles_or_is_a_graph_error_naming_the_node():
    tried = []
    graph = ([GraphNode("a", ["x"], ["y"])], {"w": "a"}, ["x"], {})

    @settings(max_examples=200, **SETTINGS)
    @given(n=ANY_INT)
    def one(n):
        tried.append(n)
        # a model's submodule: compile_model takes a max_batch below 1 for 1
        dsl = outcome(lambda: compile_model(_one_node("a", max_batch=n)))
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
    rt = Runtime(_one_node("a"))
    try:
        for priority in [2**31, -2**31 - 1, 2**64]:
            with pytest.raises(ValueError, match="priority"):
                rt.submit({"x": 1}, priority=priority)
        assert rt.submit({"x": 1}, priority=2**31 - 1).result(CASE_SECONDS) == {}
    finally:
        close_within(rt)


def test_a_deadline_of_any_float_is_served_or_refused_naming_the_deadline():
    rt = Runtime(_one_node("a"))
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

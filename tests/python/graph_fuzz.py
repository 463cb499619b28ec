"""Graphs as plain data, for the graph fuzz tests (test_fuzz_graph*.py, issue 16, item 2): one
graph written both ways -- in the Python DSL (GraphNode / Model / compile_model) and for the bound
C++ graph builder (_core.GraphBuilder) --, the hypothesis strategies that draw them (near-valid
ones that hit every rule, and valid ones), and the checks every case goes through: both ways
agree (``judge``), a model that compiled serves a request to the end (``serve``), and no case
takes longer than CASE_SECONDS to judge (``outcome``)."""

from __future__ import annotations

import itertools
import re
import time
from typing import Any

from hypothesis import HealthCheck
from hypothesis import strategies as st

import mstar_rt
from mstar_rt import (EMIT, DynamicLoop, GraphEdge, GraphError, GraphNode, Loop, Parallel,
                      Runtime, Sequential, StreamingGraphEdge, _core, compile_model)

from walk_models import Fn, WalkModel, close_within

S, E = _core.Section, _core.Edge
SETTINGS = dict(derandomize=True, deadline=None, database=None, print_blob=False,
                suppress_health_check=list(HealthCheck))
CASE_SECONDS = 5.0  # the longest one case may take: a hang fails, it does not stall CI

# ---- a graph as plain data, written both ways ----------------------------------------------------
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
    if walks and draw(st.integers(0, 9)):  # mostly without nodes in no walk, which it refuses
        walked = {n for root in walks.values() for n in leaves(root)}
        nodes = [n for n in nodes if n[0] in walked] or nodes
    return {"inputs": draw(st.lists(st.sampled_from(["x", "s"]), min_size=1, max_size=2,
                                    unique=True)),
            "nodes": nodes, "walks": walks}


def leaves(s: tuple) -> list[str]:
    """The node names in a section tuple."""
    kind = s[0]
    if kind == "node":
        return [s[1]]
    if kind in ("seq", "par"):
        return [n for c in s[1] for n in leaves(c)]
    return leaves(s[1] if kind == "loop" else s[2])


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
            reader: Any = ("node", consumer)
            made = {out}
            if draw(st.booleans()):  # a node after the consumer: a section the stream enters
                after, made_after = node(avail, reads=(out,))
                reader, made = ("seq", [reader, after]), made | made_after
            return (arrange, [("loop", producer, draw(st.integers(1, 3)), (), ()),
                              reader]), made
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


def one_node(walk: Any, max_batch: int = 1) -> WalkModel:
    """Node 'a' (x -> y) run by ``walk``."""
    return WalkModel([GraphNode("a", ["x"], ["y"])], {"w": walk},
                     {"a": Fn(lambda d: {"y": 1}, max_batch=max_batch)})


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


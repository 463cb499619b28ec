"""Walks nested, cyclic and shared, fuzzed (issue 16, item 2): the graph compiler lowers a walk
without recursion, so a walk nested to any depth compiles up to MAX_SECTION_DEPTH -- to the same
IR as the C++ builder's -- and is refused with a GraphError beyond it; a section inside itself and
a section shared by more places than MAX_WALK_SECTIONS are refused before they take long; and
sections, however deep, print and compare as the dataclasses they were."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import mstar_rt
from mstar_rt import DynamicLoop, GraphError, Loop, Parallel, Sequential, _core, compile_model
from mstar_rt.graph import MAX_SECTION_DEPTH, MAX_WALK_SECTIONS

from graph_fuzz import E, S, SETTINGS, copy, dsl_section, ir, one_node, outcome, sections, serve


# ---- nesting, cycles and shared sections: lowered without recursion -----------------------------

def test_a_deeply_nested_walk_compiles_or_is_refused_with_a_graph_error():
    walk: Any = "a"
    for _ in range(600):
        walk = Sequential(walk)
    kind, message = outcome(lambda: compile_model(one_node(walk)))
    assert kind == "GraphError", message
    assert "walk 'w'" in message and f"more than {MAX_SECTION_DEPTH} deep" in message
    # and the walk prints and compares, deep as it is
    assert repr(walk).startswith("Sequential(parts=[Sequential(parts=[") and walk == copy(walk)


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
        kind, result = outcome(lambda: compile_model(one_node(walk)))
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
            serve(one_node(walk), {"x": 1}, depth)

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
        compile_model(one_node(walk))
    assert "..." in repr(walk)
    assert walk == walk and walk == _cycles()[name] and walk != Sequential("a")


def test_a_section_shared_by_many_places_is_refused_before_it_takes_long():
    shared: Any = "a"
    for _ in range(64):  # 2**64 places from 64 objects
        shared = Sequential(shared, shared)
    kind, message = outcome(lambda: compile_model(one_node(shared)))
    assert kind == "GraphError" and message.startswith(
        f"walk 'w' has more than {MAX_WALK_SECTIONS} sections and node names"), message
    assert "runs in each" in message
    # shared by two places, it is the builder's rule that refuses it, in the builder's words
    twice = Sequential("a")
    dsl = outcome(lambda: compile_model(one_node(Parallel(twice, twice))))
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

"""One graph compiler: the Python DSL lowers into the C++ builder (mstar::GraphBuilder, bound as
_core.GraphBuilder), so a malformed graph gets the same GraphError, word for word, whether it is
written in the DSL or with the builder directly, as a C++ model would write it. Each case below is
one malformed graph written both ways; test_graph_validation.py pins what the messages say."""

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
    _core,
    compile_model,
)

from walk_models import Fn, WalkModel

S, E = _core.Section, _core.Edge
N = GraphNode


def _out(*names):
    return [E.output(n) for n in names]


def _dsl(nodes, walks, inputs=("x",)):
    return lambda: compile_model(WalkModel(nodes, walks, {n.name: Fn(lambda d: {}) for n in nodes},
                                           inputs=inputs))


# case -> (the graph in the DSL, the same graph given to a builder that declares input 'x')
CASES = {
    "walk runs an unknown node": (
        _dsl([N("a", ["x"], ["y"])], {"w": Sequential("a", "ghost")}),
        lambda b: b.node("a", ["x"], _out("y")).walk("w", S.seq(["a", "ghost"]))),
    "input nobody produces": (
        _dsl([N("a", ["x", "codes"], ["y"])], {"w": "a"}),
        lambda b: b.node("a", ["x", "codes"], _out("y")).walk("w", "a")),
    "name made in another walk and not persisted": (
        _dsl([N("enc", ["x"], ["h"]), N("dec", ["h"], ["o"])], {"prefill": "enc", "decode": "dec"}),
        lambda b: b.node("enc", ["x"], _out("h")).node("dec", ["h"], _out("o"))
                   .walk("prefill", "enc").walk("decode", "dec")),
    "output produced twice in one scope": (
        _dsl([N("a", ["x"], ["y"]), N("b", ["x"], ["y"])], {"w": Parallel("a", "b")}),
        lambda b: b.node("a", ["x"], _out("y")).node("b", ["x"], _out("y"))
                   .walk("w", S.par(["a", "b"]))),
    "reads a name produced later": (
        _dsl([N("a", ["x", "y"], ["z"]), N("b", ["z"], ["y"])], {"w": Sequential("a", "b")}),
        lambda b: b.node("a", ["x", "y"], _out("z")).node("b", ["z"], _out("y"))
                   .walk("w", S.seq(["a", "b"]))),
    "reads its own output with no first value": (
        _dsl([N("step", ["s"], ["s"])], {"w": Loop("step", 3)}),
        lambda b: b.node("step", ["s"], _out("s")).walk("w", S.loop("step", 3))),
    "reads a name kept inside a loop": (
        _dsl([N("step", ["x"], ["v"]), N("after", ["v"], ["o"])],
             {"w": Sequential(Loop("step", 2), "after")}),
        lambda b: b.node("step", ["x"], _out("v")).node("after", ["v"], _out("o"))
                   .walk("w", S.seq([S.loop("step", 2), "after"]))),
    "loop lists a name as output and accumulated": (
        _dsl([N("step", ["x"], ["v", "u"])],
             {"w": Loop("step", 3, outputs=["v", "u"], accumulated_outputs=["u", "v"])}),
        lambda b: b.node("step", ["x"], _out("v", "u"))
                   .walk("w", S.loop("step", 3, ["v", "u"], ["u", "v"]))),
    "dynamic loop with max_iters 0": (
        _dsl([N("step", ["x"], ["v"])], {"w": DynamicLoop("step", 0, "gen")}),
        lambda b: b.node("step", ["x"], _out("v")).walk("w", S.dynamic_loop("gen", "step", 0))),
    "loop with max_iters -1": (
        _dsl([N("step", ["x"], ["v"])], {"w": Loop("step", -1)}),
        lambda b: b.node("step", ["x"], _out("v")).walk("w", S.loop("step", -1))),
    "loop output nothing inside produces": (
        _dsl([N("step", ["x"], ["v"])], {"w": Loop("step", 2, outputs=["vv"])}),
        lambda b: b.node("step", ["x"], _out("v")).walk("w", S.loop("step", 2, ["vv"]))),
    "dynamic loop without a name": (
        _dsl([N("step", ["x"], ["v"])], {"w": DynamicLoop("step", 4, "")}),
        lambda b: b.node("step", ["x"], _out("v")).walk("w", S.dynamic_loop("", "step", 4))),
    "two dynamic loops with one name": (
        _dsl([N("a", ["x"], ["v"]), N("b", ["x"], ["u"])],
             {"w": Sequential(DynamicLoop("a", 4, "gen"), DynamicLoop("b", 4, "gen"))}),
        lambda b: b.node("a", ["x"], _out("v")).node("b", ["x"], _out("u"))
                   .walk("w", S.seq([S.dynamic_loop("gen", "a", 4), S.dynamic_loop("gen", "b", 4)]))),
    "nested accumulation": (
        _dsl([N("step", ["x"], ["v"])],
             {"w": Loop(Loop("step", 2, accumulated_outputs=["v"]), 2, accumulated_outputs=["v"])}),
        lambda b: b.node("step", ["x"], _out("v"))
                   .walk("w", S.loop(S.loop("step", 2, [], ["v"]), 2, [], ["v"]))),
    "edge to an unknown node": (
        _dsl([N("a", ["x"], [GraphEdge("ghost", "y")])], {"w": "a"}),
        lambda b: b.node("a", ["x"], [E("ghost", "y")]).walk("w", "a")),
    "edge to a node that does not read it": (
        _dsl([N("a", ["x"], [GraphEdge("b", "y")]), N("b", ["x"], ["z"])],
             {"w": Sequential("a", "b")}),
        lambda b: b.node("a", ["x"], [E("b", "y")]).node("b", ["x"], _out("z"))
                   .walk("w", S.seq(["a", "b"]))),
    "streaming edge to EMIT": (
        _dsl([N("a", ["x"], [StreamingGraphEdge(EMIT, "tok", mstar_rt.Fixed(2))])], {"w": "a"}),
        lambda b: b.node("a", ["x"], [E.stream(EMIT, "tok", mstar_rt.Fixed(2))]).walk("w", "a")),
    "stream to a node the walk does not run": (
        _dsl([N("gen", ["x"], [StreamingGraphEdge("snac", "tok", mstar_rt.Fixed(2))]),
              N("snac", ["tok"], ["audio"])], {"decode": Loop("gen", 4), "vocode": "snac"}),
        lambda b: b.node("gen", ["x"], [E.stream("snac", "tok", mstar_rt.Fixed(2))])
                   .node("snac", ["tok"], _out("audio"))
                   .walk("decode", S.loop("gen", 4)).walk("vocode", "snac")),
    "two producers streaming one name to a node": (
        _dsl([N("a", ["x"], [StreamingGraphEdge("c", "t", mstar_rt.Fixed(1))]),
              N("b", ["x"], [StreamingGraphEdge("c", "t", mstar_rt.Fixed(1))]),
              N("c", ["t"], ["o"])], {"w": Parallel("a", "b", "c")}),
        lambda b: b.node("a", ["x"], [E.stream("c", "t", mstar_rt.Fixed(1))])
                   .node("b", ["x"], [E.stream("c", "t", mstar_rt.Fixed(1))])
                   .node("c", ["t"], _out("o")).walk("w", S.par(["a", "b", "c"]))),
    "stream consumer before its producer": (
        _dsl([N("gen", ["x"], [StreamingGraphEdge("snac", "tok", mstar_rt.Fixed(2))]),
              N("snac", ["tok"], [GraphEdge(EMIT, "audio")])],
             {"w": Sequential("snac", Loop("gen", 4))}),
        lambda b: b.node("gen", ["x"], [E.stream("snac", "tok", mstar_rt.Fixed(2))])
                   .node("snac", ["tok"], [E(EMIT, "audio")])
                   .walk("w", S.seq(["snac", S.loop("gen", 4)]))),
    "stream consumer inside its producer's loop": (
        _dsl([N("p", ["x"], [StreamingGraphEdge("c", "s", mstar_rt.Fixed(1))]),
              N("c", ["s"], [GraphEdge(EMIT, "y")])], {"w": Loop(Sequential("p", "c"), 3)}),
        lambda b: b.node("p", ["x"], [E.stream("c", "s", mstar_rt.Fixed(1))])
                   .node("c", ["s"], [E(EMIT, "y")]).walk("w", S.loop(S.seq(["p", "c"]), 3))),
    "two nodes with one name": (
        _dsl([N("a", ["x"], ["y"]), N("a", ["y"], ["z"])], {"w": "a"}),
        lambda b: b.node("a", ["x"], _out("y")).node("a", ["y"], _out("z")).walk("w", "a")),
    "node twice in a walk": (
        _dsl([N("a", ["x"], ["y"]), N("b", ["y"], ["z"])], {"w": Sequential("a", "b", Loop("a", 2))}),
        lambda b: b.node("a", ["x"], _out("y")).node("b", ["y"], _out("z"))
                   .walk("w", S.seq(["a", "b", S.loop("a", 2)]))),
    "no walks": (
        _dsl([N("a", ["x"], ["y"])], {}),
        lambda b: b.node("a", ["x"], _out("y"))),
    "a node in no walk": (
        _dsl([N("a", ["x"], ["y"]), N("b", ["x"], ["z"])], {"w": "a"}),
        lambda b: b.node("a", ["x"], _out("y")).node("b", ["x"], _out("z")).walk("w", "a")),
}


@pytest.mark.parametrize("case", CASES)
def test_the_dsl_and_the_cpp_builder_refuse_a_malformed_graph_with_the_same_message(case):
    dsl, builder = CASES[case]
    with pytest.raises(GraphError) as from_dsl:
        dsl()
    with pytest.raises(GraphError) as from_builder:
        builder(_core.GraphBuilder().input("x")).compile()
    assert str(from_dsl.value) == str(from_builder.value)


def test_graph_error_is_the_compilers_own_class_and_a_value_error():
    assert GraphError is _core.GraphError and issubclass(GraphError, ValueError)


def test_a_valid_graph_compiles_to_the_same_ir_either_way():
    nodes = [N("enc", ["x"], [GraphEdge("dec", "h", persist=True)]),
             N("dec", ["h", "s"], ["s", GraphEdge(EMIT, "tok"),
                                   StreamingGraphEdge("voc", "tok", mstar_rt.Fixed(2))]),
             N("voc", ["tok"], [GraphEdge(EMIT, "audio")])]
    walks = {"prefill": Sequential("enc"),
             "decode": Parallel(DynamicLoop("dec", 8, "gen", outputs=["s"]), "voc")}
    model = WalkModel(nodes, walks, {n.name: Fn(lambda d: {}) for n in nodes}, inputs=("x", "s"),
                      engines={"voc": "audio"})
    from_dsl = compile_model(model).spec
    from_builder = (
        _core.GraphBuilder().input("x").input("s")
        .node("enc", ["x"], [E("dec", "h", persist=True)])
        .node("dec", ["h", "s"], [E.output("s"), E(EMIT, "tok"),
                                  E.stream("voc", "tok", mstar_rt.Fixed(2))])
        .node("voc", ["tok"], [E(EMIT, "audio")], engine="audio")
        .walk("prefill", S.seq(["enc"]))
        .walk("decode", S.par([S.dynamic_loop("gen", "dec", 8, ["s"]), "voc"]))
        .compile())
    for part in ("names", "engines", "nodes", "walk_names"):
        assert getattr(from_dsl, part) == getattr(from_builder, part), part

"""A node is declared once: GraphNode(name, inputs, outputs, submodule=, engine=, max_batch=).
The older Model.submodules / Model.engines maps still work, alone or mixed with the new form; a
node declared both ways differently is a GraphError naming it; the model's maps read back every
node; max_batch on the node caps its batches."""

from __future__ import annotations

import pytest

from mstar_rt import EMIT, GraphEdge, GraphError, GraphNode, Model, Runtime, Sequential
from mstar_rt.model import node_engines, node_submodules

from walk_models import ZERO_LIVE, Fn, Gate, settled

T = 5.0


class Declared(Model):
    inputs = ("x",)
    walks = {"main": Sequential("a", "b")}

    def __init__(self, b_batch=None) -> None:
        self.gate = Gate(lambda d: {"y": d["x"] + 1})
        self.b = Fn(lambda d: {"z": d["y"] * 10}, max_batch=8)
        self.nodes = [GraphNode("a", ["x"], ["y"], submodule=self.gate, engine="first"),
                      GraphNode("b", ["y"], [GraphEdge(EMIT, "z")], submodule=self.b,
                                engine="second", max_batch=b_batch)]


def test_a_model_declared_node_by_node_runs_on_the_engines_its_nodes_name(serve):
    model = Declared()
    rt = serve(model)
    assert set(rt.engines) == {"first", "second"}
    assert model.submodules == {"a": model.gate, "b": model.b}
    assert model.engines == {"a": "first", "b": "second"}
    model.gate.open()
    assert [rt.submit({"x": k}).result(T) for k in range(3)] == [{"z": [10 * (k + 1)]}
                                                                 for k in range(3)]
    assert settled(rt) == ZERO_LIVE


def test_max_batch_on_the_node_caps_its_batches(serve):
    model = Declared(b_batch=2)
    seen = []
    forward = model.b.forward
    model.b.forward = lambda batch: (seen.append(len(batch)), forward(batch))[1]
    rt = serve(model)
    handles = [rt.submit({"x": k}) for k in range(9)]  # pile up behind the gate
    model.gate.wait_entered()
    model.gate.open()
    for h in handles:
        h.result(T)
    assert max(seen) <= 2 and sum(seen) == 9


def test_the_older_maps_still_work_alone_and_mixed_with_node_fields(serve):
    class Older(Model):
        inputs = ("x",)
        nodes = [GraphNode("a", ["x"], ["y"]),
                 GraphNode("b", ["y"], [GraphEdge(EMIT, "z")], submodule=Fn(lambda d: {"z": d["y"]}),
                           engine="other")]
        walks = {"main": Sequential("a", "b")}
        submodules = {"a": Fn(lambda d: {"y": d["x"] * 2})}
        engines = {"a": "lm"}

    model = Older()
    assert node_engines(model) == {"a": "lm", "b": "other"}
    assert set(node_submodules(model)) == {"a", "b"}
    rt = serve(model)
    assert set(rt.engines) == {"lm", "other"}
    assert rt.submit({"x": 4}).result(T) == {"z": [8]}


def test_a_node_declared_twice_differently_is_a_graph_error_naming_it():
    one, other = Fn(lambda d: {"y": 1}), Fn(lambda d: {"y": 2})

    class Twice(Model):
        inputs = ("x",)
        walks = {"main": "a"}

        def __init__(self, **maps) -> None:
            self.nodes = [GraphNode("a", ["x"], [GraphEdge(EMIT, "y")], submodule=one,
                                    engine="e")]
            for k, v in maps.items():
                setattr(self, k, v)

    with pytest.raises(GraphError, match="node 'a' has a submodule in its GraphNode and another"):
        Runtime(Twice(submodules={"a": other}))
    with pytest.raises(GraphError, match="node 'a' runs on engine 'e' by its GraphNode but on 'f'"):
        Runtime(Twice(engines={"a": "f"}))
    # The same thing said twice is no conflict.
    rt = Runtime(Twice(submodules={"a": one}, engines={"a": "e"}))
    try:
        assert rt.submit({"x": 0}).result(T) == {"y": [1]}
    finally:
        rt.close()


def test_a_node_without_a_submodule_or_with_a_bad_engine_is_refused_naming_it():
    class Missing(Model):
        inputs = ("x",)
        nodes = [GraphNode("a", ["x"], [GraphEdge(EMIT, "y")])]
        walks = {"main": "a"}

    with pytest.raises(ValueError, match=r"no submodule for nodes \['a'\].*submodule="):
        Runtime(Missing())
    with pytest.raises(GraphError, match="node 'a' has engine ''"):
        GraphNode("a", ["x"], ["y"], engine="")


def test_each_model_instance_has_its_own_submodules():
    one, two = Declared(), Declared()
    assert one.submodules["a"] is not two.submodules["a"]
    assert one.nodes[0] == two.nodes[0]  # equal declarations: the submodule is not compared


def test_a_model_filling_the_older_maps_in_place_still_works(serve):
    class InPlace(Model):
        inputs = ("x",)

        def __init__(self) -> None:
            self.nodes, self.walks, self.submodules, self.engines = [], {}, {}, {}
            self.nodes.append(GraphNode("a", ["x"], [GraphEdge(EMIT, "y")]))
            self.walks["main"] = "a"
            self.submodules.update({"a": Fn(lambda d: {"y": d["x"] + 1})})
            self.engines.update({"a": "mine"})

    rt = serve(InPlace())
    assert set(rt.engines) == {"mine"}
    assert rt.submit({"x": 1}).result(T) == {"y": [2]}

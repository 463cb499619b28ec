"""Mistakes a new user makes writing a first model in the DSL or a first serve config: each is
refused where it is made, naming what to fix, instead of failing every request later, crashing
inside the compiler with a message that names nothing, or being read as something else."""

from __future__ import annotations

import pytest

from mstar_rt import (EMIT, DynamicLoop, GraphEdge, GraphError, GraphNode, Loop, Model,
                      RequestFailed, Runtime, compile_model)
from mstar_rt.config import ConfigError
from mstar_rt.serve.config import PolicySpec, SpeechSpec
from mstar_rt.serve.deployment import Deployment

from walk_models import Fn, WalkModel


def _copy(d: dict) -> dict:
    return {"y": d["x"]}


def _model(walk=None, nodes=None, inputs=("x",)) -> WalkModel:
    nodes = nodes or [GraphNode("a", ["x"], [GraphEdge(EMIT, "y")])]
    return WalkModel(nodes, {"w": walk or "a"}, {n.name: Fn(_copy) for n in nodes},
                     inputs=inputs)


# ---- GraphNode --------------------------------------------------------------------------------

@pytest.mark.parametrize("kw, fix", [
    (dict(inputs="image"), "inputs=['image']"),       # was read as 'i', 'm', 'a', 'g', 'e'
    (dict(outputs="h"), "outputs=['h']"),
    (dict(outputs=GraphEdge(EMIT, "h")), "outputs=[GraphEdge("),  # was a TypeError
])
def test_a_lone_name_or_edge_where_a_list_belongs_is_refused_with_the_list_to_write(kw, fix):
    args = {"inputs": ["image"], "outputs": ["h"], **kw}
    with pytest.raises(GraphError) as info:
        GraphNode("enc", args["inputs"], args["outputs"])
    assert "node 'enc'" in str(info.value) and fix in str(info.value)


def test_a_node_name_that_is_not_a_string_is_refused_by_the_node():
    with pytest.raises(GraphError, match="a node is named 7; name it with a non-empty string"):
        GraphNode(7, ["x"], ["y"])  # type: ignore[arg-type]


# ---- Loops ------------------------------------------------------------------------------------

def test_loop_outputs_given_as_one_string_are_refused_not_read_as_letters():
    nodes = [GraphNode("a", ["x"], ["logits"])]
    with pytest.raises(GraphError) as info:
        compile_model(_model(Loop("a", 2, outputs="logits"), nodes))  # type: ignore[arg-type]
    assert str(info.value) == ("Loop in walk 'w' has outputs='logits'; give a list, even of one: "
                               "outputs=['logits']")


def test_a_dynamic_loop_named_by_a_number_is_refused_naming_the_walk():
    with pytest.raises(GraphError, match="DynamicLoop in walk 'w' is named 5"):
        compile_model(_model(DynamicLoop("a", 3, 5)))  # type: ignore[arg-type]


# ---- the model's inputs, walks and nodes -------------------------------------------------------

def test_model_inputs_given_as_one_string_are_refused_when_the_model_compiles():
    # was: compiled with inputs 'i', 'm', ..., and every submit refused {"image": ...}
    model = _model(nodes=[GraphNode("a", ["image"], [GraphEdge(EMIT, "y")])], inputs=["image"])
    model.inputs = "image"  # type: ignore[assignment]
    with pytest.raises(GraphError, match=r"the model's inputs are 'image'; give a list"):
        compile_model(model)


def test_walks_given_as_a_list_are_refused_with_the_dict_to_write():
    model = _model()
    model.walks = ["a"]  # type: ignore[assignment]  # was an AttributeError: no .items()
    with pytest.raises(GraphError, match=r"walks are a list; give a dict of walk name"):
        compile_model(model)


def test_a_walk_named_by_a_number_is_refused_naming_it():
    model = _model()
    model.walks = {1: "a"}  # type: ignore[dict-item]  # was the builder's TypeError
    with pytest.raises(GraphError, match="has a walk named 1; name each walk"):
        compile_model(model)


def test_nodes_given_as_one_node_are_refused():
    model = _model()
    model.nodes = GraphNode("a", ["x"], ["y"])  # type: ignore[assignment]
    with pytest.raises(GraphError, match=r"WalkModel.nodes is a GraphNode; give a list"):
        compile_model(model)


class _Declared(Model):
    inputs = ("x",)
    nodes = [GraphNode("a", ["x"], [GraphEdge(EMIT, "y")], submodule=Fn(_copy))]
    walks = {"w": "a"}


def test_a_runtime_of_the_model_class_is_refused_at_construction():
    # was: every submit raised "initial_walk() missing 1 required positional argument"
    with pytest.raises(TypeError, match=r"_Declared is a class; pass a model object: _Declared\(\)"):
        Runtime(_Declared)  # type: ignore[arg-type]
    with Runtime(_Declared()) as rt:
        assert rt.submit({"x": 3}).result(timeout=10) == {"y": [3]}


def test_something_that_is_not_a_model_is_refused_by_type():
    with pytest.raises(TypeError, match="a dict is not a model; subclass mstar_rt.Model"):
        compile_model({"nodes": []})  # type: ignore[arg-type]


# ---- submodules -------------------------------------------------------------------------------

def test_a_submodule_class_instead_of_an_object_is_refused_at_construction():
    # was: compiled, and every request failed in forward() ("missing 'batch'")
    model = _model()
    model.submodules = {"a": Fn}
    with pytest.raises(GraphError, match=r"node 'a' has submodule Fn, a class; pass an object"):
        Runtime(model)


def test_a_function_as_a_submodule_is_refused_naming_the_node_and_the_base_class():
    model = _model()
    model.submodules = {"a": lambda batch: [{"y": 1} for _ in batch]}
    with pytest.raises(GraphError) as info:  # was: AttributeError: ... no attribute 'end_stream'
        compile_model(model)
    assert "node 'a' has submodule" in str(info.value)
    assert "subclass mstar_rt.NodeSubmodule" in str(info.value)


# ---- the serve config against the model --------------------------------------------------------

class _Speaker(WalkModel):
    sample_rate = 16000


def _speaker() -> _Speaker:
    nodes = [GraphNode("tts", ["text", "voice"], [GraphEdge(EMIT, "audio")])]
    return _Speaker(nodes, {"speak": "tts"}, {"tts": Fn(lambda d: {"audio": 0})},
                    inputs=("text", "voice"))


def test_speech_inputs_the_model_does_not_take_are_refused_when_the_server_starts():
    # was: served, and every /v1/audio/speech request got a 400 blaming the client
    with pytest.raises(ConfigError, match=r"speech.inputs: \['speed'\] are not inputs of the "
                                          r"model; its inputs are \['text', 'voice'\]"):
        Deployment.for_model(_speaker(), None, speech=SpeechSpec(inputs={"speed": 2}))
    ok = Deployment.for_model(_speaker(), None, speech=SpeechSpec(inputs={"voice": "a"}))
    assert ok.speech is not None and ok.speech.inputs == {"voice": "a"}


def _policy_model() -> WalkModel:
    nodes = [GraphNode("act", ["image", "state"], [GraphEdge(EMIT, "actions")])]
    return WalkModel(nodes, {"w": "act"}, {"act": Fn(lambda d: {"actions": 0})},
                     inputs=("image", "state"))


def test_policy_images_naming_no_observation_key_are_refused_when_the_server_starts():
    observation = {"observation/image": "image", "observation/state": "state"}
    # was: accepted, and JPEG bytes sent under the real key reached the model undecoded
    with pytest.raises(ConfigError, match=r"policy.images names \['observation/img'\], which "
                                          r"are not observation keys"):
        Deployment.for_model(_policy_model(), None, policy=PolicySpec(
            observation=observation, images=["observation/img"]))
    with pytest.raises(ConfigError, match=r"policy.images names \['camera'\]"):
        Deployment.for_model(_policy_model(), None, policy=PolicySpec(images=["camera"]))
    Deployment.for_model(_policy_model(), None, policy=PolicySpec(
        observation=observation, images=["observation/image"]))
    Deployment.for_model(_policy_model(), None, policy=PolicySpec(images=["image"]))


# ---- requests ---------------------------------------------------------------------------------

@pytest.mark.parametrize("inputs", [None, 5, "x", [("x", 1)]])
def test_submit_of_something_not_a_dict_is_refused_naming_the_inputs_to_give(inputs):
    # was: "'NoneType' object is not iterable", "dictionary update sequence element ..."
    with Runtime(_model()) as rt:
        with pytest.raises(TypeError, match=r"submit: inputs is a \w+; give a dict of value name "
                                            r"-> value, with the names \['x'\]"):
            rt.submit(inputs)  # type: ignore[arg-type]
        assert rt.submit({"x": 1}).result(timeout=10) == {"y": [1]}


class _StopsOnAValue(Fn):
    """check_stop names a value ('y'), not the DynamicLoop ('decode')."""

    def check_stop(self, batch, outputs):
        return [("y",) for _ in batch]


def test_check_stop_naming_a_value_instead_of_the_loop_fails_the_request_by_name():
    # was: silently ignored, so the loop ran on to max_iters (100 executions, not 1)
    node = GraphNode("a", ["x"], [GraphEdge(EMIT, "y")])
    model = WalkModel([node], {"w": DynamicLoop("a", 100, "decode")},
                      {"a": _StopsOnAValue(_copy)})
    with Runtime(model) as rt:
        with pytest.raises(RequestFailed, match="check_stop named loop 'y', which is not a "
                                                "DynamicLoop of the model"):
            rt.submit({"x": 1}).result(timeout=10)
    assert model.submodules["a"].batches == [1]

"""mstar_rt.config: one ModelSpec and one NodeGroup for serving, placement and embedding; every
error names the key; every key an in-process node group accepts either takes effect or is refused
with what to do instead; the HTTP request bodies check themselves the same way."""

from __future__ import annotations

import inspect

import os
from pathlib import Path

import placement_models as pm
import pytest

from mstar_rt import embed
from mstar_rt.config import (ConfigError, ModelSpec, NodeGroup, load_config, read_placement,
                             resolve_factory)
from mstar_rt.placement.config import make_plan
from mstar_rt.serve.bodies import BadBody, GenerateBody, SpeechBody, parse
from mstar_rt.serve.config import build_model, build_runtime

ROOT = Path(__file__).resolve().parents[2]
ROBOT = {"class": "policy:ChunkPolicyModel", "path": ["examples/robot"]}


def _serve(**overrides):
    return load_config({"model": ROBOT, **overrides}, base_dir=str(ROOT))


# ---- one model spec ----------------------------------------------------------------------------

def test_class_and_factory_args_and_kwargs_are_two_spellings_of_one_spec():
    a = ModelSpec.model_validate({"class": "pkg.mod:build", "args": {"n": 1}})
    b = ModelSpec.model_validate({"factory": "pkg.mod:build", "kwargs": {"n": 1}})
    assert a == b == ModelSpec("pkg.mod:build", {"n": 1}) == ModelSpec(factory="pkg.mod:build",
                                                                      kwargs={"n": 1})
    assert a.name == "build" and a.args == {"n": 1}
    with pytest.raises(ConfigError, match=r"model\.kwargs: give args or kwargs, not both"):
        load_config({"model": {"class": "a:b", "args": {}, "kwargs": {}}})
    with pytest.raises(ConfigError, match=r"model\.factory: give class or factory, not both"):
        load_config({"model": {"class": "a:b", "factory": "a:b"}})


def test_serving_placement_and_embed_build_the_model_through_one_resolver(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.environ.get("PYTHONPATH", ""))  # restored afterwards
    by_file = _serve(model={"class": "examples/robot/policy.py:ChunkPolicyModel"})
    assert type(build_model(by_file)).__name__ == "ChunkPolicyModel"
    assert resolve_factory("examples/robot/policy.py:ChunkPolicyModel", str(ROOT)) is \
        resolve_factory("policy:ChunkPolicyModel")  # the file's module is reused, not reloaded
    placed = read_placement({"model": {"factory": "policy:ChunkPolicyModel",
                                       "path": ["examples/robot"]},
                             "node_groups": [{"nodes": ["mlp"], "rank": 1}]}, str(ROOT))
    assert placed["model"].path == (str(ROOT / "examples" / "robot"),)  # absolute for workers
    assert str(ROOT / "examples" / "robot") in os.environ["PYTHONPATH"].split(os.pathsep)
    rt = embed.load(str(ROOT / "examples" / "robot" / "policy.py"), "ChunkPolicyModel")
    try:
        assert type(rt.model).__name__ == "ChunkPolicyModel"
    finally:
        rt.close()


def test_a_model_file_named_like_a_loaded_module_does_not_replace_it(tmp_path, monkeypatch):
    import json
    import sys

    monkeypatch.setattr(sys, "path", list(sys.path))  # restored afterwards
    # json.py took sys.modules["json"] for the whole process: json.dumps was gone
    (tmp_path / "json.py").write_text((ROOT / "examples/robot/policy.py").read_text())
    factory = resolve_factory(f"{tmp_path / 'json.py'}:ChunkPolicyModel")
    assert sys.modules["json"] is json and json.dumps({"a": 1}) == '{"a": 1}'
    assert factory.__module__.startswith("mstar_model_json_")
    assert resolve_factory(f"{tmp_path / 'json.py'}:ChunkPolicyModel") is factory  # reused
    # its folder goes last on the path: a later "import json" (a worker process inherits the
    # path as PYTHONPATH: torch failed to import there) still finds the standard library
    assert sys.path[-1] == str(tmp_path)
    del sys.modules[factory.__module__]


def test_a_factory_that_refuses_its_args_is_a_config_error_but_its_own_bugs_are_not():
    with pytest.raises(ConfigError, match=r"model\.args: policy:ChunkPolicyModel rejected them"):
        build_model(_serve(model={**ROBOT, "args": {"layers": 3}}))
    with pytest.raises(TypeError, match="not an mstar_rt.Model"):
        ModelSpec("json:JSONDecoder").build()


# ---- node groups -------------------------------------------------------------------------------

def test_process_defaults_to_false_in_a_serving_config_and_true_in_placement():
    group = {"nodes": ["mlp"], "rank": 1}
    assert _serve(node_groups=[group]).node_groups[0].process is False
    placed = read_placement({"model": "m:f", "node_groups": [group]})
    assert placed["node_groups"] == [NodeGroup(["mlp"], rank=1)]
    assert placed["node_groups"][0].process is True


@pytest.mark.parametrize("group, needle", [
    ({"nodes": ["mlp"], "device": "cuda:1"},
     "node_groups[0].device: an in-process group cannot move its nodes to 'cuda:1'"),
    ({"nodes": ["mlp"], "walks": ["act"]},
     "node_groups[0].walks: an in-process node runs on its one engine in every walk"),
    ({"nodes": ["mlp"], "model_kwargs": {"device": "cuda"}},
     "node_groups[0].model_kwargs: only a worker process builds a model"),
    ({"nodes": ["mlp"], "request_inputs": False}, "node_groups[0].request_inputs"),
])
def test_an_in_process_group_refuses_what_it_would_otherwise_ignore(group, needle):
    config = _serve(node_groups=[group])
    model = build_model(config)  # valid against the model ...
    with pytest.raises(ConfigError) as e:  # ... but not what an in-process runtime can do
        build_runtime(config, model)
    assert needle in str(e.value)
    assert "process: true" in str(e.value) or "drop" in str(e.value)


def test_in_process_refusals_reach_python_callers_and_the_placement_planner():
    with pytest.raises(ConfigError, match=r"NodeGroup\.device: .* worker process"):
        NodeGroup(["head"], rank=3, process=False, device="cuda:1")
    with pytest.raises(ConfigError, match=r"NodeGroup\.walks: worker processes serve a node"):
        NodeGroup(["head"], rank=1, walks=["decode"])
    groups = read_placement  # a config file's groups are checked with their key path
    with pytest.raises(ConfigError, match=r"node_groups\[1\]\.walks: an in-process node"):
        groups({"model": "m:f", "node_groups": [{"nodes": ["a"], "rank": 1},
                                                {"nodes": ["b"], "process": False,
                                                 "walks": ["x"]}]})
    planned = NodeGroup.model_validate({"nodes": ["encoder"], "process": False,
                                        "device": "cuda:0"})
    with pytest.raises(ConfigError, match=r"node_groups\[0\]\.device"):
        make_plan(pm.pipeline(), [planned])


def test_tp_size_in_the_model_args_beside_worker_processes_is_refused_before_any_build():
    # Every process built a tensor-parallel group of its own; a split KV engine then failed
    # every request, and the parent's group outlived close().
    from mstar_rt.placement import PlacedRuntime

    needle = r"model: args.tp_size 2 beside worker processes .* give the LM's node group tp_size"
    lm = {"class": "placement_models:checkpoint_lm", "args": {"path": "x", "tp_size": 2}}
    split = [{"nodes": ["prefill"], "rank": 1}, {"nodes": ["decode"], "rank": 2}]
    with pytest.raises(ConfigError, match=needle):
        read_placement({"model": lm, "node_groups": split})
    with pytest.raises(ConfigError, match=needle):
        load_config({"model": lm, "node_groups": [{**g, "process": True} for g in split]})
    with pytest.raises(ConfigError, match=needle):  # nothing is built: "x" is no checkpoint
        PlacedRuntime(ModelSpec(lm["class"], lm["args"]), [NodeGroup(["prefill"], rank=1)])


def test_constructor_errors_name_the_class_and_key():
    with pytest.raises(ConfigError, match=r"NodeGroup\.rank: must be an integer >= 0, not '1'"):
        NodeGroup(["a"], rank="1")
    with pytest.raises(ConfigError, match=r"NodeGroup\.device: must be 'cpu', 'cuda' or"):
        NodeGroup(["a"], rank=1, device="gpu")
    with pytest.raises(ConfigError, match=r"ModelSpec\.factory: 'nocolon' is not"):
        ModelSpec("nocolon")


def test_serving_config_reads_kv_cache_and_placement_options():
    config = _serve(kv_cache={"num_pages": 8}, placement={"restart": "auto", "shm_bytes": 1024})
    assert config.kv_cache.sizes() == {"num_pages": 8}
    assert config.placement.given() == {"restart": "auto", "shm_bytes": 1024}
    with pytest.raises(ConfigError, match=r"placement\.restart: must be 'manual' or 'auto'"):
        _serve(placement={"restart": "always"})
    with pytest.raises(ConfigError, match=r"model\.name: a placement config serves no clients"):
        read_placement({"model": {"class": "m:f", "name": "x"}})
    with pytest.raises(ConfigError, match=r"model\.checkpoint: worker processes"):
        read_placement({"model": {"checkpoint": "ckpt"}})


# ---- request bodies ----------------------------------------------------------------------------

def test_placement_options_reach_every_placed_runtime_setting():
    from mstar_rt.config import PlacementOptions
    from mstar_rt.placement import PlacedRuntime

    opts = PlacementOptions(segments=False, kv_timeout_s=5, direct_bytes=1 << 20)
    assert opts.given() == {"segments": False, "kv_timeout_s": 5.0, "direct_bytes": 1 << 20}
    assert PlacementOptions(direct=False).given() == {"direct_bytes": None}  # off
    assert PlacementOptions(direct=True).given() == {}  # PlacedRuntime's default size
    with pytest.raises(ValueError, match="direct_bytes"):
        read_placement({"model": "placement_models:pipeline", "direct": False,
                        "direct_bytes": 4096})
    with pytest.raises(ValueError, match="direct_bytes"):
        PlacementOptions(direct_bytes=0)
    assert PlacementOptions(spin_us=0).given() == {"spin_us": 0}  # always sleep
    for bad in (-1, 20_000, True, "fast"):
        with pytest.raises(ValueError, match=r"spin_us[\s\S]*microseconds from 0"):
            PlacementOptions(spin_us=bad)
    params = set(inspect.signature(PlacedRuntime.__init__).parameters) - {"self"}
    settings = set(PlacementOptions.model_fields) - {"direct"}
    assert settings <= params, settings - params
    # what the config leaves to the Python caller: objects and what the file itself gives
    assert params - settings == {"model", "node_groups", "model_kwargs", "engines"}, \
        params - settings


def test_request_bodies_name_the_field_to_fix():
    ok = parse(SpeechBody, {"input": "hi", "response_format": None})
    assert (ok.input, ok.response_format, ok.voice) == ("hi", "pcm", None)
    for body, param, needle in [({"input": "hi", "volume": 1}, "volume", "unknown field 'volume'"),
                                ({"input": ""}, "input", "'input' must be a non-empty"),
                                ({"input": "hi", "speed": True}, "speed", "only speed 1.0")]:
        with pytest.raises(BadBody, match=needle) as e:
            parse(SpeechBody, body)
        assert e.value.param == param
    with pytest.raises(BadBody, match=r"the model takes \['text', 'voice'\]"):
        parse(GenerateBody, {"inputs": [1]}, inputs=("text", "voice"))
    body = parse(GenerateBody, {"inputs": {"n": 1}, "deadline_s": 2, "priority": -1})
    assert (body.deadline_s, body.priority, body.arrays) == (2.0, -1, "base64")

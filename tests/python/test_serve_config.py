"""The serving config and the `mstar-rt serve` CLI: every example config loads, every wrong key is
named in the error, placement is checked against the model, kv_cache sizes reach the KV engine,
and the CLI loads, serves and stops on SIGINT (or says what is wrong and exits 2)."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from child_env import child_env
import yaml

import mstar_rt
from mstar_rt.serve.cli import main
from mstar_rt.serve.config import ConfigError, build_model, build_runtime, load_config

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "examples" / "serve").glob("*.yaml"))
ROBOT = {"model": {"class": "policy:ChunkPolicyModel", "path": ["examples/robot"]}}


def _load(**overrides):
    return load_config({**ROBOT, **overrides}, base_dir=str(ROOT))


def test_every_example_config_loads(monkeypatch):
    monkeypatch.setenv("MSTAR_API_KEY", "k")  # speech_espeak.yaml reads its key from there
    assert len(EXAMPLES) >= 5
    for path in EXAMPLES:
        config = load_config(path)
        assert config.model.name and config.server.host == "127.0.0.1", path
    espeak = load_config(ROOT / "examples" / "serve" / "speech_espeak.yaml")
    assert espeak.server.api_key == "k"


def test_robot_config_builds_the_model_and_keeps_rank_structure():
    config = load_config(ROOT / "examples" / "serve" / "robot_policy.yaml")
    model = build_model(config)
    assert type(model).__name__ == "ChunkPolicyModel"
    assert config.ranks == {0: {"device": "cpu", "process": False}}
    assert config.policy.shapes == {"obs": (8,)} and config.policy.dtypes == {"obs": "float32"}
    rt = build_runtime(config, model)
    try:
        assert isinstance(rt, mstar_rt.Runtime)
    finally:
        rt.close()


def test_kv_cache_sizes_reach_the_models_kv_engine():
    config = load_config({"model": {"class": "mstar_rt.models.orpheus:OrpheusTTS.tiny",
                                    "args": {"constrain_codes": True}},
                          "kv_cache": {"page_size": 8, "num_pages": 48}})
    model = build_model(config)
    rt = build_runtime(config, model)
    try:
        cache = rt.engines["lm"].cache
        assert (cache.page_size, cache.num_pages) == (8, 48)
    finally:
        rt.close()


@pytest.mark.parametrize("raw, needle", [
    ({}, "model: missing"),
    ({"model": "nocolon"}, "model.class: 'nocolon' is not 'package.module:Name'"),
    ({"model": {"class": "a:B", "checkpoint": "x"}}, "give exactly one of"),
    ({"model": {"class": "a:B", "argz": {}}}, "model.argz: unknown key"),
    ({**ROBOT, "modle": 1}, "modle: unknown key"),
    ({**ROBOT, "max_concurrent_requests": 0}, "max_concurrent_requests: must be a positive"),
    ({**ROBOT, "max_concurrent_requests": "8"}, "max_concurrent_requests: must be a positive"),
    ({**ROBOT, "request_timeout_s": -1}, "request_timeout_s: must be a positive"),
    # inf overflowed time_t in every wait on it: each policy request failed
    ({**ROBOT, "request_timeout_s": float("inf")}, "request_timeout_s: must be at most"),
    ({**ROBOT, "kv_cache": {"pages": 4}}, "kv_cache.pages: unknown key"),
    ({**ROBOT, "kv_cache": {"num_pages": 0}}, "kv_cache.num_pages: must be a positive"),
    ({**ROBOT, "server": {"port": 70000}}, "server.port: must be an integer in 0..65535"),
    ({**ROBOT, "server": {"host": ""}}, "server.host"),
    ({**ROBOT, "server": {"api_key_env": "MSTAR_TEST_UNSET_KEY"}},
     "environment variable 'MSTAR_TEST_UNSET_KEY' is not set"),
    ({**ROBOT, "server": {"api_key": "a", "api_key_env": "B"}}, "not both"),
    ({**ROBOT, "node_groups": {"nodes": ["mlp"]}}, "node_groups: must be a list"),
    ({**ROBOT, "node_groups": [{"nodes": []}]}, "node_groups[0].nodes: list at least one"),
    ({**ROBOT, "node_groups": [{"nodes": ["mlp"], "rank": -1}]}, "node_groups[0].rank"),
    ({**ROBOT, "node_groups": [{"nodes": ["mlp"], "process": "yes"}]},
     "node_groups[0].process: must be true or false"),
    ({**ROBOT, "node_groups": [{"nodes": ["mlp"], "gpu": 1}]}, "node_groups[0].gpu: unknown key"),
    ({**ROBOT, "speech": {"voice": "x"}}, "speech.voice: unknown key"),
    ({**ROBOT, "speech": {"output_rate": 0}}, "speech.output_rate: must be a positive"),
    ({**ROBOT, "policy": {"shapes": {"obs": "8"}}}, "policy.shapes.obs: must be a list"),
    ({**ROBOT, "policy": {"dtypes": {"obs": "float33"}}}, "policy.dtypes.obs"),
    ({**ROBOT, "policy": {"observation": {"a": 1}}}, "policy.observation: must map strings"),
    # an AttributeError and a msgpack TypeError at startup, with tracebacks
    ({**ROBOT, "policy": {"shapes": [8]}}, "policy.shapes: must be a mapping"),
    ({**ROBOT, "policy": {"metadata": {"released": __import__("datetime").date(2024, 1, 1)}}},
     "policy.metadata: must be plain data"),
])
def test_a_wrong_key_is_named_in_the_error(raw, needle, monkeypatch):
    monkeypatch.delenv("MSTAR_TEST_UNSET_KEY", raising=False)
    with pytest.raises(ConfigError) as e:
        load_config(raw, base_dir=str(ROOT))
    assert needle in str(e.value), str(e.value)


@pytest.mark.parametrize("overrides, needle", [
    ({"model": {"class": "no_such_module_xyz:Thing"}}, "cannot import module 'no_such_module_xyz'"),
    ({"model": {"class": "policy:NoSuchClass", "path": ["examples/robot"]}},
     "has no attribute 'NoSuchClass'"),
    ({"model": {"class": "policy:ChunkPolicyModel", "path": ["examples/nowhere"]}},
     "model.path: 'examples/nowhere'"),
    ({"model": {"class": "policy:ChunkPolicyModel", "path": ["examples/robot"],
                "args": {"layers": 3}}}, "model.args: policy:ChunkPolicyModel rejected them"),
    ({"model": {"class": "policy:ChunkMLP", "path": ["examples/robot"]}}, "not an mstar_rt.Model"),
    ({"node_groups": [{"nodes": ["mlp", "decoder"]}]}, "['decoder'] are not nodes of the model"),
    ({"node_groups": [{"nodes": ["mlp"], "walks": ["speak"]}]}, "['speak'] are not walks"),
    ({"node_groups": [{"nodes": ["mlp"], "rank": 0},
                      {"nodes": ["mlp"], "rank": 1}]}, "node 'mlp' is already on rank 0"),
    ({"node_groups": [{"nodes": ["mlp"], "rank": 0, "device": "cpu"},
                      {"nodes": ["normalize"], "rank": 0, "device": "cuda:0"}]},
     "rank 0 is already"),
    ({"kv_cache": {"num_pages": 64}}, "has no KVCacheEngine to size"),
])
def test_the_config_is_checked_against_the_model(overrides, needle):
    with pytest.raises(ConfigError) as e:
        build_model(_load(**overrides))
    assert needle in str(e.value), str(e.value)


@pytest.mark.parametrize("section, spec, needle", [
    ("policy", {"actions": "akshuns"}, "policy.actions: the model EMITs no 'akshuns'"),
    ("policy", {"outputs": {"nothing": "x"}}, "policy.outputs.nothing: the model EMITs no"),
    ("policy", {"shapes": {"obzz": [8]}}, "policy.shapes.obzz: not an input the observation"),
    ("policy", {"dtypes": {"obq": "float32"}}, "policy.dtypes.obq: not an input"),
    ("speech", {"audio_output": "audoi", "model_rate": 16000, "text_input": "obs",
                "voice_input": None},
     "speech.audio_output: the model EMITs no 'audoi'"),
])
def test_policy_and_speech_names_that_match_nothing_in_the_model_are_refused(section, spec,
                                                                            needle):
    """They were ignored: every request failed, or a speech request got 200 and no audio."""
    from mstar_rt.serve.deployment import Deployment

    config = _load(**{section: spec})
    model = build_model(config)
    with pytest.raises(ConfigError, match=re.escape(needle)):
        Deployment.from_config(config, model, runtime=None)


def test_speech_voices_the_model_does_not_have_are_refused():
    from mstar_rt import EMIT, GraphEdge, GraphNode, Model, NodeSubmodule
    from mstar_rt.serve.config import SpeechSpec
    from mstar_rt.serve.deployment import Deployment

    class Silent(NodeSubmodule):
        def forward(self, batch):
            return [{"audio": None} for _ in batch]

    class Voiced(Model):
        inputs, sample_rate, voices = ("text", "voice"), 16000, ("en-us", "de")
        nodes = [GraphNode("tts", ["text", "voice"], [GraphEdge(EMIT, "audio")],
                           submodule=Silent())]
        walks = {"speak": "tts"}

    with pytest.raises(ConfigError, match=r"speech.voices: the model has no voices \['klingon'\]"):
        Deployment.for_model(Voiced(), None, speech=SpeechSpec(voices=["en-us", "klingon"]))
    assert Deployment.for_model(Voiced(), None).speech.voices == ("en-us", "de")


def test_one_node_may_sit_on_different_ranks_in_different_walks():
    config = _load(node_groups=[{"nodes": ["mlp"], "rank": 0, "walks": ["act"]},
                                {"nodes": ["normalize", "denormalize"], "rank": 1}])
    build_model(config)
    assert config.ranks == {0: {"device": "cpu", "process": False},
                            1: {"device": "cpu", "process": False}}


@pytest.mark.parametrize("groups, needle", [
    ([{"nodes": ["mlp"], "rank": 0, "process": True}], "rank 0 is the parent process"),
    ([{"nodes": ["mlp"], "rank": 1, "process": True, "walks": ["act"]}],
     "node_groups[0].walks: worker processes serve a node in every walk"),
])
def test_process_ranks_the_placement_runtime_cannot_serve_are_config_errors(groups, needle):
    config = _load(node_groups=groups)
    with pytest.raises(ConfigError) as e:
        build_runtime(config, build_model(config))
    assert needle in str(e.value)


# ---- the CLI -----------------------------------------------------------------------------------

def test_cli_reports_a_bad_config_and_exits_2(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({**ROBOT, "server": {"port": "eighty"}}))
    assert main(["serve", str(bad)]) == 2
    assert "server.port: must be an integer" in capsys.readouterr().err
    assert main(["serve", str(tmp_path / "missing.yaml")]) == 2
    assert "does not exist" in capsys.readouterr().err
    (tmp_path / "broken.yaml").write_text("model: [unclosed")
    assert main(["serve", str(tmp_path / "broken.yaml")]) == 2
    assert "not valid YAML" in capsys.readouterr().err


@pytest.mark.parametrize("path, name", [
    ("ckpt/llama-tiny", "llama-tiny"),
    ("hub/models--lerobot--pi0/snapshots/0123abcd", "lerobot/pi0"),
    ("outputs/train/pick_cube/checkpoints/005000/pretrained_model", "pick_cube/005000"),
])
def test_a_checkpoints_served_name_is_what_a_client_would_recognise(path, name):
    from mstar_rt.config import ModelSpec

    assert ModelSpec.model_validate({"checkpoint": path}).name == name
    assert ModelSpec.model_validate({"checkpoint": path, "name": "mine"}).name == "mine"


@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM], ids=["sigint", "sigterm"])
def test_cli_serves_with_progress_lines_and_an_api_key_then_stops_on_a_signal(stop):
    env = child_env()
    proc = subprocess.Popen(
        [sys.executable, "-m", "mstar_rt.serve.cli", "serve",
         str(ROOT / "examples" / "serve" / "robot_policy.yaml"), "--port", "0",
         "--api-key", "cli-key"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=env, cwd=ROOT)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    try:
        end = time.monotonic() + 60
        while not any("serving" in x for x in lines):
            assert proc.poll() is None and time.monotonic() < end, (lines, proc.stderr.read())
            time.sleep(0.05)
        (line,) = [x for x in lines if "serving" in x]
        assert "robot-chunk-policy" in line and "API key required" in line
        url = re.search(r"(http://127\.0\.0\.1:\d+)", line).group(1)
        assert httpx.get(url + "/health").json()["model"] == "robot-chunk-policy"
        assert httpx.get(url + "/v1/models").status_code == 401
        assert httpx.get(url + "/v1/models", headers={"x-api-key": "cli-key"}).status_code == 200
        proc.send_signal(stop)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    reader.join(5)
    err = proc.stderr.read()
    assert "[1/4" in err and "[4/4" in err and "building model policy:ChunkPolicyModel" in err
    assert any("stopped" in x for x in lines)


TINY_MODEL_FILE = """
from mstar_rt import EMIT, GraphEdge, GraphNode, Model, NodeSubmodule


class Inc(NodeSubmodule):
    def forward(self, batch):
        return [{"y": b["x"] + 1} for b in batch]


class Tiny(Model):
    inputs = ("x",)

    def __init__(self):
        self.nodes = [GraphNode("inc", ["x"], [GraphEdge(EMIT, "y")], submodule=Inc())]
        self.walks = {"main": "inc"}
"""


def test_a_model_file_beside_the_config_builds_in_worker_processes_from_any_folder(tmp_path,
                                                                                   monkeypatch):
    """'m.py:Tiny' is relative to the config's folder; with process: true it was looked up in
    the working directory (model.class: model module file .../m.py does not exist)."""
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "m.py").write_text(TINY_MODEL_FILE)
    (tmp_path / "sub" / "c.yaml").write_text(yaml.safe_dump(
        {"model": {"class": "m.py:Tiny"},
         "node_groups": [{"nodes": ["inc"], "rank": 1, "process": True}]}))
    monkeypatch.chdir(tmp_path)
    config = load_config("sub/c.yaml")
    rt = build_runtime(config, build_model(config))
    try:
        assert rt.submit({"x": 1}).result(60) == {"y": [2]}
    finally:
        rt.close()


@pytest.mark.parametrize("model_file, needle", [
    ("def f(:\n", r"model.class: cannot import .*broken.py.*line 1"),
    ("def build():\n    raise RuntimeError('boom')\n",
     "model.class: building broken.py:build failed: RuntimeError: boom"),
    ("def build():\n    raise KeyError('weights')\n",
     "model.class: building broken.py:build failed: KeyError: 'weights'"),
])
def test_cli_names_the_model_when_building_it_fails_whatever_it_raised(tmp_path, capsys,
                                                                       model_file, needle):
    """A SyntaxError, RuntimeError or KeyError ended in a traceback (exit 1); a ValueError in
    one line that named no model."""
    (tmp_path / "broken.py").write_text(model_file)
    (tmp_path / "c.yaml").write_text(yaml.safe_dump({"model": {"class": "broken.py:build"}}))
    assert main(["serve", str(tmp_path / "c.yaml")]) == 2
    assert re.search(needle, capsys.readouterr().err)


def test_cli_refuses_an_unknown_log_level_and_a_host_that_does_not_resolve(tmp_path, capsys):
    config = tmp_path / "robot.yaml"
    config.write_text(yaml.safe_dump({"model": {**ROBOT["model"],
                                                "path": [str(ROOT / "examples" / "robot")]}}))
    with pytest.raises(SystemExit) as e:  # a KeyError from uvicorn after the model was built
        main(["serve", str(config), "--log-level", "foo"])
    assert e.value.code == 2 and "invalid choice: 'foo'" in capsys.readouterr().err
    assert main(["serve", str(config), "--host", "not a host!", "--port", "0"]) == 2
    assert "check server.host" in capsys.readouterr().err


def test_a_ray_address_where_nothing_answers_fails_at_once(tmp_path, capsys):
    """ray.init retried it for minutes (killed at 120 s in the audit)."""
    pytest.importorskip("ray")
    config = tmp_path / "robot.yaml"
    config.write_text(yaml.safe_dump({"model": {**ROBOT["model"],
                                                "path": [str(ROOT / "examples" / "robot")]}}))
    t0 = time.monotonic()
    assert main(["serve", str(config), "--ray-address", "127.0.0.1:1"]) == 1
    assert "ray address 127.0.0.1:1: nothing answers there" in capsys.readouterr().err
    assert time.monotonic() - t0 < 30


def test_a_key_given_twice_in_the_yaml_is_named_with_its_line(tmp_path):
    config = tmp_path / "twice.yaml"
    config.write_text("model: {class: 'policy:ChunkPolicyModel', path: [x]}\n"
                      "server: {port: 8001}\n"
                      "server: {port: 8002}\n")  # the last one won without a word
    with pytest.raises(ConfigError, match=r"not valid YAML \(line 3\): the key 'server' is "
                                          "given twice"):
        load_config(config)


def test_a_checkpoint_with_worker_processes_is_refused_before_it_loads(tmp_path):
    with pytest.raises(ConfigError, match="model.checkpoint: worker processes"):
        load_config({"model": {"checkpoint": str(tmp_path)},
                     "node_groups": [{"nodes": ["lm"], "rank": 1, "process": True}]})


@pytest.mark.parametrize("section", ["ray", "policy", "speech"])
def test_a_section_left_empty_in_the_yaml_is_refused(tmp_path, section):
    # a bare "ray:" read as null served without Ray, while "ray: {}" started one replica
    config = tmp_path / "empty.yaml"
    config.write_text(f"model: {{class: 'policy:ChunkPolicyModel', path: [x]}}\n{section}:\n")
    with pytest.raises(ConfigError, match=f"{section}: is empty, which would leave the section "
                                          f"out; write '{section}: {{}}'"):
        load_config(config)


def test_a_group_tp_size_the_model_cannot_take_is_blamed_on_the_group():
    # it said "model.args: ... got an unexpected keyword argument 'tp_size'", a key never written
    config = load_config({"model": {"class": "placement_models:smolvla_policy"},
                          "node_groups": [{"nodes": ["vision"], "tp_size": 2}]})
    with pytest.raises(ConfigError, match=r"node_groups\[0\]\.tp_size: 2 needs a model that "
                                          r"runs tensor-parallel .* takes no tp_size"):
        build_model(config)

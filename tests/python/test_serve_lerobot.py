"""Serving a LeRobot checkpoint: ``model: {checkpoint: DIR}`` recognises a pi0 / pi0.5 / SmolVLA
policy directory, and the openpi websocket takes LeRobot's own observation keys (cameras as uint8
[H, W, 3] arrays, as robots send them, or JPEG/PNG bytes; ``observation.state``; ``task``) and
returns the unnormalised action chunk -- equal to LeRobot's fixture when the flow noise is
given, and to a direct submit otherwise."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import yaml
from openpi_client.websocket_client_policy import WebsocketClientPolicy
from safetensors.torch import load_file

from mstar_rt.models.lerobot import lerobot_family
from mstar_rt.serve.config import PolicySpec, build_model, load_config
from test_serve_support import serving, settled

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "reference" / "fixtures"
pytestmark = pytest.mark.filterwarnings("ignore:connect\\(\\) must be used:DeprecationWarning")
TOL = 1e-4


def _config(tmp_path: Path, family: str, **extra: object) -> Path:
    d = FIXTURES / family
    args: dict = {"max_batch": 4, **extra}
    if family != "smolvla":
        args.update(tokenizer=str(d / "tokenizer"), sizes={"vision_heads": 2})
    else:
        args.update(vlm_dir=str(d / "smolvlm_tiny"), progress=False)
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump({"model": {"checkpoint": str(d / "checkpoint"), "args": args}}))
    return path


def _observation(family: str, with_noise: bool) -> tuple[dict, np.ndarray]:
    io = load_file(str(FIXTURES / family / "io.safetensors"))
    meta = json.loads((FIXTURES / family / "io.json").read_text())
    obs = {cam: io[f"input.{cam}.uint8"].permute(1, 2, 0).numpy() for cam in
           meta["cameras_in_order"]}  # [H, W, 3] uint8, as a robot sends its camera frames
    obs["observation.state"] = io["input.observation.state"].numpy()
    obs["task"] = meta["prompt"]
    if with_noise:
        obs["noise"] = io["input.noise"][0].numpy()
    return obs, io["output.action_chunk"][0].numpy()


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "cuda_graphs"])
@pytest.mark.parametrize("family", ["pi0", "pi05", "smolvla"])
def test_a_lerobot_checkpoint_is_served_on_the_openpi_websocket_as_lerobot_computes_it(
        tmp_path, family, graphs):
    # cuda_graphs: true in the config runs the flow steps through the static buckets (eagerly
    # on this CPU): the same answer
    config = load_config(_config(tmp_path, family, **({"cuda_graphs": True} if graphs else {})))
    model = build_model(config)
    assert (model.graphs is not None) == graphs
    assert lerobot_family(FIXTURES / family / "checkpoint") == family
    spec = model.openpi_defaults()
    spec["observation"]["noise"] = "noise"  # the fixture's flow noise, for an exact comparison
    with serving(model, name=family, policy=PolicySpec(**spec)) as s:
        client = WebsocketClientPolicy("127.0.0.1", s.port)
        meta = client.get_server_metadata()
        assert meta["policy"] == family and meta["action_horizon"] == model.policy.config.chunk_size
        obs, want = _observation(family, with_noise=True)
        got = client.infer(obs)["actions"]
        assert got.shape == want.shape
        assert float(np.abs(got - want).max()) < TOL
        assert settled(s)["requests"] == 0
    if graphs:
        assert model.graphs.runs >= model.policy.config.num_steps and model.graphs.holding == 0


def test_the_default_mapping_takes_lerobot_keys_and_jpeg_cameras(tmp_path):
    import cv2

    config = load_config(_config(tmp_path, "pi0"))
    model = build_model(config)
    obs, _ = _observation("pi0", with_noise=False)
    obs["seed"] = np.int64(7)  # as openpi_client sends an integer: the same chunk again
    direct_inputs = {"images": {k: v for k, v in obs.items() if k.startswith("observation.images")},
                     "state": obs["observation.state"], "task": obs["task"], "seed": 7}
    with serving(model, name="pi0") as s:  # the policy mapping comes from the checkpoint
        want = s.rt.submit(direct_inputs).result(60)["actions"][0].numpy()
        client = WebsocketClientPolicy("127.0.0.1", s.port)
        assert np.abs(client.infer(obs)["actions"] - want).max() < TOL
        # without a seed every chunk starts from fresh noise, as LeRobot's and openpi's do
        unseeded = {k: v for k, v in obs.items() if k != "seed"}
        a, b = (client.infer(unseeded)["actions"] for _ in range(2))
        assert np.abs(a - b).max() > 1e-3 and np.abs(a - want).max() > 1e-3
        # any camera may be missing (LeRobot masks it out): the chunk of the one camera given
        first, *others = [k for k in obs if k.startswith("observation.images")]
        one_camera = {k: v for k, v in obs.items() if k not in others}
        want_one = s.rt.submit({**direct_inputs, "images": {first: obs[first]}}).result(60)
        assert np.abs(client.infer(one_camera)["actions"]
                      - want_one["actions"][0].numpy()).max() < TOL
        png = {k: cv2.imencode(".png", v[..., ::-1])[1].tobytes()  # lossless: the same pixels
               for k, v in obs.items() if k.startswith("observation.images")}
        assert np.abs(client.infer({**obs, **png})["actions"] - want).max() < TOL
        with pytest.raises(Exception, match="observation.state"):
            client.infer({k: v for k, v in obs.items() if k != "observation.state"})
        # no camera at all: the error names the cameras' keys (it named an input 'images')
        no_camera = {k: v for k, v in obs.items() if not k.startswith("observation.images")}
        with pytest.raises(Exception, match=r"none of \['observation.images.*send one at least"):
            client.infer(no_camera)
        assert settled(s)["requests"] == 0


def _rtc_config(tmp_path: Path, family: str) -> Path:
    """The family's fixture checkpoint with its ``rtc/config.json`` (an ``rtc_config``)."""
    import shutil

    d = FIXTURES / family
    ckpt = tmp_path / "rtc_checkpoint"
    shutil.copytree(d / "checkpoint", ckpt)
    shutil.copy(d / "rtc" / "config.json", ckpt / "config.json")
    path = _config(tmp_path, family)
    cfg = yaml.safe_load(path.read_text())
    cfg["model"]["checkpoint"] = str(ckpt)
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.mark.parametrize("family", ["pi0", "smolvla"])
def test_real_time_chunking_over_the_websocket_is_lerobots_guided_chunk(tmp_path, family):
    """A client that adds the previous reply's left-over actions and its inference delay gets
    LeRobot's guided chunk (the RTC fixture); without them, the plain one -- on one connection."""
    model = build_model(load_config(_rtc_config(tmp_path, family)))
    io = load_file(str(FIXTURES / family / "rtc" / "io.safetensors"))
    meta = json.loads((FIXTURES / family / "rtc" / "io.json").read_text())
    spec = model.openpi_defaults()
    spec["observation"]["noise"] = "noise"
    with serving(model, name=family, policy=PolicySpec(**spec)) as s:
        client = WebsocketClientPolicy("127.0.0.1", s.port)
        info = client.get_server_metadata()
        assert info["rtc"]["schedule"] == meta["rtc_config"]["prefix_attention_schedule"]
        assert info["observation"]["prev_actions"]["optional"] is True
        obs, _ = _observation(family, with_noise=False)
        obs["noise"] = io["input.noise"][0].numpy()
        guided = client.infer({**obs, "prev_actions": io["input.prev_actions"].numpy(),
                               "inference_delay": meta["inference_delay"]})["actions"]
        assert float(np.abs(guided - io["output.action_chunk"][0].numpy()).max()) < TOL
        plain = client.infer(obs)["actions"]
        assert float(np.abs(plain - io["output.unguided.action_chunk"][0].numpy()).max()) < TOL
        with pytest.raises(Exception, match=r"prev_actions.*shape \(4, 5\)"):
            client.infer({**obs, "prev_actions": np.zeros((4, 5), np.float32)})
        with pytest.raises(Exception, match="needs 'prev_actions'"):
            client.infer({**obs, "inference_delay": 2})
        assert float(np.abs(client.infer(obs)["actions"] - plain).max()) < TOL
        assert settled(s)["requests"] == 0


def test_left_over_actions_are_refused_by_name_where_guidance_is_disabled(tmp_path):
    from mstar_rt.models.lerobot_pi0 import LeRobotPi0Policy
    from mstar_rt.models.lerobot_rtc import RtcSettings

    d = FIXTURES / "pi0"
    default = build_model(load_config(_config(tmp_path, "pi0")))  # no rtc_config: LeRobot's
    assert default.openpi_defaults()["metadata"]["rtc"]["schedule"] == RtcSettings().schedule
    model = LeRobotPi0Policy.from_pretrained(d / "checkpoint", tokenizer=d / "tokenizer",
                                             sizes={"vision_heads": 2}, max_batch=4,
                                             rtc=RtcSettings(enabled=False))
    with serving(model, name="pi0", policy=PolicySpec(**model.openpi_defaults())) as s:
        client = WebsocketClientPolicy("127.0.0.1", s.port)
        assert client.get_server_metadata()["rtc"] is None
        obs, _ = _observation("pi0", with_noise=False)
        with pytest.raises(Exception, match="real-time chunking"):
            client.infer({**obs, "prev_actions": np.zeros((4, 6), np.float32)})
        client.infer(obs)  # the connection still serves
        assert settled(s)["requests"] == 0


@pytest.mark.parametrize("family", ["pi0", "smolvla"])
def test_config_args_are_checked_before_loading_and_read_as_a_config_means_them(tmp_path,
                                                                                 family):
    """A misspelled arg, an unknown dtype or a CUDA device without CUDA: named before anything
    loads. A dtype as text is that dtype; a relative tokenizer / SmolVLM folder is read from
    the config's folder, as the checkpoint is."""
    import torch

    path = _config(tmp_path, family, max_batchh=4)
    with pytest.raises(ValueError, match=r"takes no \['max_batchh'\]; it takes \[.*'max_batch'"):
        build_model(load_config(path))
    with pytest.raises(ValueError, match="'float8' is not one of"):
        build_model(load_config(_config(tmp_path, family, dtype="float8")))
    # a number or an unusable device reached torch: an accelerator or aten error
    with pytest.raises(ValueError, match="model.args.dtype: 16 is not one of"):
        build_model(load_config(_config(tmp_path, family, dtype=16)))
    with pytest.raises(ValueError, match="model.args.device: 5 is not a device name"):
        build_model(load_config(_config(tmp_path, family, device=5)))
    with pytest.raises(ValueError, match="model.args.device: 'mps'; the checkpoints served"):
        build_model(load_config(_config(tmp_path, family, device="mps")))
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="'cuda:0', but torch sees no CUDA device"):
            build_model(load_config(_config(tmp_path, family, device="cuda:0")))
    config = yaml.safe_load(_config(tmp_path, family, dtype="bfloat16").read_text())
    args = config["model"]["args"]
    key = "tokenizer" if family != "smolvla" else "vlm_dir"
    shutil.copytree(args[key], tmp_path / "assets" / key)
    args[key] = str(Path("..") / "assets" / key)  # from configs/, not from the working folder
    folder = tmp_path / "configs"
    folder.mkdir()
    (folder / "serve.yaml").write_text(yaml.safe_dump(config))
    model = build_model(load_config(folder / "serve.yaml"))  # run from another folder
    # (pi0 in bfloat16 is LeRobot's mixed precision: some parameters stay float32)
    assert torch.bfloat16 in {p.dtype for p in model.policy.module.parameters()}


def test_the_servers_warm_up_runs_a_lerobot_policy_and_its_graph_buckets(tmp_path):
    """Cameras, prev_actions, seed and noise are optional keys and the cameras declare no size:
    the warm-up still runs the policy (black frames of WARM_UP_IMAGE) at every batch size, and
    first lets the model capture its flow steps' buckets (model.warm_up)."""
    from mstar_rt.serve.warmup import warm_up

    model = build_model(load_config(_config(tmp_path, "pi0", cuda_graphs=True)))
    with serving(model, name="pi0", max_concurrent_requests=2) as s:
        done = warm_up(s.state.deployment)
        assert done.skipped is None, done.describe()
        # every node ran (a burst of 2 may split on a busy machine: `missing` says so)
        assert {"vision", "prefix", "denoise"} <= set(done.sizes) and 1 in done.sizes["denoise"]
        # every bucket, not only the sizes the bursts formed
        assert model.graphs.built == model.graphs.buckets
        assert settled(s)["requests"] == 0


@pytest.mark.parametrize("policy_type", ["act", None])
def test_a_lerobot_policy_of_another_type_is_named_not_read_as_a_llama(tmp_path, policy_type):
    d = tmp_path / "checkpoint"
    shutil.copytree(FIXTURES / "pi0" / "checkpoint", d)
    config = json.loads((d / "config.json").read_text())
    config.pop("type")
    if policy_type is not None:
        config["type"] = policy_type
    (d / "config.json").write_text(json.dumps(config))
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump({"model": {"checkpoint": str(d)}}))
    with pytest.raises(ValueError, match=f"a LeRobot policy of type {policy_type!r}"):
        build_model(load_config(path))


def test_the_args_a_checkpoints_loader_passes_itself_are_not_taken_from_the_config():
    from mstar_rt.models.checkpoint_dirs import accepted_args, signature_without
    from mstar_rt.models.qwen3_omni.omni import Qwen3Omni

    omni = accepted_args((Qwen3Omni.from_pretrained,
                          signature_without(Qwen3Omni.__init__, "tokenizer")))
    assert "tokenizer" not in omni and {"tp_size", "max_batch", "dtype"} <= set(omni)


def test_a_model_warm_up_that_fails_skips_the_warm_up_and_the_server_serves(tmp_path):
    from mstar_rt.serve.warmup import warm_up

    model = build_model(load_config(_config(tmp_path, "pi0")))

    def broken() -> None:
        raise RuntimeError("CUDA out of memory (simulated)")

    model.warm_up = broken
    with serving(model, name="pi0", max_concurrent_requests=2) as s:
        done = warm_up(s.state.deployment)
        assert done.skipped == ("the model's warm_up() failed (RuntimeError: CUDA out of memory "
                                "(simulated))")
        obs, _ = _observation("pi0", with_noise=False)
        client = WebsocketClientPolicy("127.0.0.1", s.port)
        assert client.infer(obs)["actions"].shape == (10, 6)

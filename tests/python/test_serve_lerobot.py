"""Serving a LeRobot checkpoint: ``model: {checkpoint: DIR}`` recognises a pi0 / pi0.5 / SmolVLA
policy directory, and the openpi websocket takes LeRobot's own observation keys (cameras as uint8
[H, W, 3] arrays, as robots send them, or JPEG/PNG bytes; ``observation.state``; ``task``) and
returns the unnormalised action chunk -- equal to LeRobot's fixture when the flow noise is
given, and to a direct submit otherwise."""

from __future__ import annotations

import json
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


def _config(tmp_path: Path, family: str) -> Path:
    d = FIXTURES / family
    args: dict = {"max_batch": 4}
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


@pytest.mark.parametrize("family", ["pi0", "pi05", "smolvla"])
def test_a_lerobot_checkpoint_is_served_on_the_openpi_websocket_as_lerobot_computes_it(
        tmp_path, family):
    config = load_config(_config(tmp_path, family))
    model = build_model(config)
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


def test_the_default_mapping_takes_lerobot_keys_and_jpeg_cameras(tmp_path):
    import cv2

    config = load_config(_config(tmp_path, "pi0"))
    model = build_model(config)
    obs, _ = _observation("pi0", with_noise=False)
    direct_inputs = {"images": {k: v for k, v in obs.items() if k.startswith("observation.images")},
                     "state": obs["observation.state"], "task": obs["task"]}
    with serving(model, name="pi0") as s:  # the policy mapping comes from the checkpoint
        want = s.rt.submit(direct_inputs).result(60)["actions"][0].numpy()
        client = WebsocketClientPolicy("127.0.0.1", s.port)
        assert np.abs(client.infer(obs)["actions"] - want).max() < TOL
        png = {k: cv2.imencode(".png", v[..., ::-1])[1].tobytes()  # lossless: the same pixels
               for k, v in obs.items() if k.startswith("observation.images")}
        assert np.abs(client.infer({**obs, **png})["actions"] - want).max() < TOL
        with pytest.raises(Exception, match="observation.state"):
            client.infer({k: v for k, v in obs.items() if k != "observation.state"})
        assert settled(s)["requests"] == 0

"""LeRobot's guided real-time chunking (RTC) for pi0, pi0.5 and SmolVLA, against LeRobot 0.6.1
itself (tests/reference/fixtures/<family>/rtc: the family's tiny checkpoint with ``rtc_config``
enabled, and ``predict_action_chunk(batch, noise=..., inference_delay=3,
prev_chunk_left_over=...)`` recorded step by step). The checkpoint's ``rtc_config`` is read;
the plain computation follows LeRobot's guided trajectory; the walks serve the guided chunk and,
in the same batch, an unguided request with the same noise, each equal to LeRobot's."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from mstar_rt.engines import KVCacheEngine
from mstar_rt.models.lerobot_pi0 import LeRobotPi0Policy
from mstar_rt.models.lerobot_pi0_config import RtcSettings
from mstar_rt.models.lerobot_pi0_load import load_lerobot_pi0
from mstar_rt.models.lerobot_pi0_reference import reference_actions
from mstar_rt.models.lerobot_pi0_request import prefix_weights
from mstar_rt.models.smolvla import SmolVLAPolicy
from mstar_rt.models.smolvla_checkpoint import load_lerobot_smolvla
from mstar_rt.models.smolvla_reference import sample_actions_reference

from walk_models import ZERO_LIVE, settled, wait_until

FIXTURES = Path(__file__).resolve().parents[1] / "reference" / "fixtures"
FAMILIES = ("pi0", "pi05", "smolvla")
TOL = 1e-4  # float32, absolute (the fixtures' tolerance)
TIMEOUT = 60.0
pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conftest.py


class RtcFixture:
    """One family's RTC case: the policy loaded from its checkpoint with ``rtc/config.json``,
    the plain fixture's observation and the guided call's tensors and metadata."""

    def __init__(self, family: str, tmp: Path) -> None:
        d = FIXTURES / family
        self.family = family
        self.plain = load_file(str(d / "io.safetensors"))
        self.plain_meta = json.loads((d / "io.json").read_text())
        self.io = load_file(str(d / "rtc" / "io.safetensors"))
        self.meta = json.loads((d / "rtc" / "io.json").read_text())
        ckpt = tmp / family
        shutil.copytree(d / "checkpoint", ckpt)
        shutil.copy(d / "rtc" / "config.json", ckpt / "config.json")
        if family == "smolvla":
            self.policy = load_lerobot_smolvla(ckpt, vlm_dir=str(d / "smolvlm_tiny"),
                                               progress=False)
        else:
            tiny = json.loads((d / "tiny_sizes.json").read_text())
            heads = tiny["paligemma_hf_config"]["vision_config"]["num_attention_heads"]
            self.policy = load_lerobot_pi0(ckpt, tokenizer=d / "tokenizer",
                                           sizes={"vision_heads": heads}, verbose=False)

    @property
    def rtc(self) -> RtcSettings:
        return self.policy.config.rtc

    def observation(self, guided: bool = True, **changes) -> dict:
        p = self.plain
        obs = {"images": {k: p[f"input.{k}"] for k in self.plain_meta["cameras_in_order"]},
               "state": p["input.observation.state"], "task": self.plain_meta["prompt"],
               "noise": self.io["input.noise"]}
        if guided:
            obs.update(delay=self.meta["inference_delay"],
                       prev_actions=self.io["input.prev_actions"])
        obs.update(changes)
        return obs

    def reference(self, obs: dict) -> dict:
        """Our plain computation: the intermediates under the fixture's names."""
        if self.family == "smolvla":
            rec: dict = {}
            chunk = sample_actions_reference(self.policy, obs, rec, self.rtc)
            return {"model.x_t": rec["x_t"], "model.v_t": rec["v_t"],
                    "model.v_t_base": rec["v_t_base"],
                    "model.actions_padded": rec["actions_padded"],
                    "output.action_chunk_normalized": rec["action_chunk_normalized"],
                    "output.action_chunk": chunk}
        out = reference_actions(self.policy, obs, self.rtc)
        return {"model.x_t": out["x_t"], "model.v_t": out["v_t"],
                "model.actions_padded": out["actions_padded"],
                "output.action_chunk_normalized": out["action_chunk_normalized"],
                "output.action_chunk": out["action_chunk"]}

    def serve(self, serve, engine: KVCacheEngine, rtc: RtcSettings | None = None):
        """A Runtime over the walks (guidance settings: the checkpoint's unless ``rtc``)."""
        model = SmolVLAPolicy if self.family == "smolvla" else LeRobotPi0Policy
        return serve(model(self.policy, engine=engine, rtc=rtc))


@pytest.fixture(scope="module", params=FAMILIES)
def fx(request, tmp_path_factory) -> RtcFixture:
    return RtcFixture(request.param, tmp_path_factory.mktemp("rtc_checkpoints"))


def close(got: torch.Tensor, want: torch.Tensor, what: str) -> float:
    diff = (got.float().reshape(want.shape) - want.float()).abs().max().item()
    assert diff <= TOL, f"{what}: max |diff| {diff:.3g} > {TOL}"
    return diff


def test_the_checkpoints_rtc_config_is_read(fx):
    want = fx.meta["rtc_config"]
    assert fx.rtc == RtcSettings(want["prefix_attention_schedule"], want["max_guidance_weight"],
                                 want["execution_horizon"], want["enabled"])


def test_the_fixture_exercises_guidance(fx):
    io, meta = fx.io, fx.meta
    plain = fx.plain["output.action_chunk_normalized"]
    executed = meta["executed_of_previous_chunk"]
    assert torch.equal(io["input.prev_chunk_left_over"], plain[:, executed:])
    guided, unguided = io["output.action_chunk"], io["output.unguided.action_chunk"]
    assert (guided - unguided).abs().max() > 0.1
    d = meta["inference_delay"]  # guidance pulls the frozen actions towards what will execute
    prev = io["input.prev_actions"][None, :d]
    assert (guided[:, :d] - prev).abs().mean() < (unguided[:, :d] - prev).abs().mean()


def test_the_prefix_weights_are_lerobots(fx):
    r, n = fx.rtc, fx.io["input.prev_actions"].shape[0]
    chunk = fx.policy.config.chunk_size
    got = prefix_weights(r.schedule, fx.meta["inference_delay"], min(r.execution_horizon, n), chunk)
    close(got, fx.io["model.prefix_weights"], "prefix weights")


def test_the_reference_follows_lerobots_guided_trajectory(fx):
    out = fx.reference(fx.observation())
    for name, got in out.items():
        close(got, fx.io[name], name)


def test_the_walks_serve_the_guided_chunk_beside_an_unguided_one(serve, fx):
    engine = KVCacheEngine(page_size=16, num_pages=64)
    rt = fx.serve(serve, engine)
    handles = [rt.submit(fx.observation()), rt.submit(fx.observation(guided=False))]
    guided, unguided = (h.result(timeout=TIMEOUT)["actions"][0] for h in handles)
    close(guided, fx.io["output.action_chunk"], "served guided chunk")
    close(unguided, fx.io["output.unguided.action_chunk"], "served unguided chunk")
    sizes = [s["batch_size"] for h in handles for s in h.stats() if s["node"] == "denoise"]
    assert max(sizes) >= 2, f"the guided and unguided flow steps never shared a step: {sizes}"
    cache = engine.cache
    assert settled(rt) == ZERO_LIVE
    assert wait_until(lambda: cache.free_pages == cache.num_pages and cache.live_sequences == 0)


def test_requests_with_their_own_left_overs_each_equal_the_reference(serve, fx):
    prev = fx.io["input.prev_actions"]
    g = torch.Generator().manual_seed(7)
    cases = [fx.observation(),
             fx.observation(delay=1, prev_actions=prev[:4] - 0.3),
             fx.observation(delay=0, prev_actions=prev + 0.2,
                            noise=torch.randn(fx.io["input.noise"].shape[1:], generator=g))]
    rt = fx.serve(serve, KVCacheEngine(page_size=16, num_pages=64))
    handles = [rt.submit(o) for o in cases]
    for i, (o, h) in enumerate(zip(cases, handles)):
        close(h.result(timeout=TIMEOUT)["actions"][0], fx.reference(o)["output.action_chunk"],
              f"request {i}")
    assert settled(rt) == ZERO_LIVE


@pytest.mark.parametrize("change, words", [
    (dict(delay=2, prev_actions=None), "needs 'prev_actions'"),
    (dict(delay=10), "below the chunk size"),
    (dict(delay=-1), "'delay' must be an integer"),
    (dict(prev_actions=torch.zeros(4, 5)), r"'prev_actions' must be finite floats \[N >= 1, 6\]"),
    (dict(prev_actions=torch.full((4, 6), float("nan"))), "'prev_actions' must be finite"),
])
def test_bad_guidance_inputs_are_refused_at_submit(serve, fx, change, words):
    rt = fx.serve(serve, KVCacheEngine(page_size=16, num_pages=16))
    with pytest.raises(ValueError, match=words):
        rt.submit(fx.observation(**change))
    assert settled(rt) == ZERO_LIVE


def test_prev_actions_are_refused_when_guidance_is_disabled(serve, fx):
    rt = fx.serve(serve, KVCacheEngine(page_size=16, num_pages=16), RtcSettings(enabled=False))
    with pytest.raises(ValueError, match="real-time chunking"):
        rt.submit(fx.observation())
    assert settled(rt) == ZERO_LIVE


@pytest.mark.parametrize("rtc_config, words", [
    ({"prefix_attention_schedule": "CUBIC"}, "prefix_attention_schedule"),
    ({"max_guidance_weight": 0}, "max_guidance_weight"),
    ([1, 2], "rtc_config"),
])
def test_a_bad_smolvla_rtc_config_is_refused_naming_the_field(tmp_path, rtc_config, words):
    d = FIXTURES / "smolvla"
    ckpt = tmp_path / "checkpoint"
    shutil.copytree(d / "checkpoint", ckpt)
    config = json.loads((d / "rtc" / "config.json").read_text())
    if isinstance(rtc_config, dict):
        rtc_config = {**config["rtc_config"], **rtc_config}
    (ckpt / "config.json").write_text(json.dumps({**config, "rtc_config": rtc_config}))
    with pytest.raises(ValueError, match=words):
        load_lerobot_smolvla(ckpt, vlm_dir=str(d / "smolvlm_tiny"), progress=False)

"""The reaching demo's tiny pi0 of LeRobot's own architecture (examples/robot/pi0_real.py): the
committed LeRobot checkpoint directory is small and the library recognises and loads it; served by
the Runtime it gives the chunk of the library's LeRobot-order reference and of the dense forward
training used, with LeRobot's guided real-time chunking from the run-time inputs d and
prev_actions; the guidance pulls the chunk's head towards the actions still to execute; and one
short episode under the C++ ControlLoop at 50 Hz, with d and the plan sent, reaches the target."""

from __future__ import annotations

import argparse
import pathlib
import sys

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
ROBOT = ROOT / "examples" / "robot"
sys.path.insert(0, str(ROBOT))

torch = pytest.importorskip("torch")
pytest.importorskip("mujoco")
pytest.importorskip("cv2")
pytest.importorskip("tokenizers")

import mstar_rt  # noqa: E402
from arm_env import ArmEnv  # noqa: E402
from expert import expert_chunk  # noqa: E402
from mstar_rt.models.lerobot import lerobot_family, load_lerobot_policy  # noqa: E402
from mstar_rt.models.lerobot_pi0 import LeRobotPi0Policy  # noqa: E402
from mstar_rt.models.lerobot_pi0_reference import reference_actions  # noqa: E402
from pi0_real import CAMERA, SIZES, WEIGHTS_DIR, RealPi0  # noqa: E402

TIMEOUT = 60.0
pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conftest.py


@pytest.fixture(scope="module")
def policy() -> RealPi0:
    return RealPi0.load()


def observations(n: int) -> list[np.ndarray]:
    env = ArmEnv()
    return [env.reset(seed) for seed in range(n)]


def test_the_checkpoint_is_a_small_lerobot_pi0_directory_the_library_loads(tmp_path):
    import yaml

    from mstar_rt.serve.config import build_model, load_config

    files = [f for f in WEIGHTS_DIR.rglob("*") if f.is_file()]
    assert sum(f.stat().st_size for f in files) < 2 * 1024 * 1024
    assert {"config.json", "model.safetensors", "policy_preprocessor.json",
            "policy_postprocessor.json", "tokenizer.json"} <= {f.name for f in files}
    assert lerobot_family(WEIGHTS_DIR) == "pi0"
    model = load_lerobot_policy(WEIGHTS_DIR, sizes=SIZES, max_batch=2)
    assert isinstance(model, LeRobotPi0Policy)
    c = model.policy.config
    assert (c.family, c.cameras, c.state_dim, c.action_dim, c.chunk_size) == \
        ("pi0", (CAMERA,), 8, 2, 20)
    assert c.rtc is not None and c.rtc.enabled and model.rtc == c.rtc  # served with guidance
    # and as `mstar-rt serve` loads it (the tokenizer is found in the directory)
    config = tmp_path / "serve.yaml"
    config.write_text(yaml.safe_dump({"model": {"checkpoint": str(WEIGHTS_DIR),
                                                "args": {"sizes": SIZES}}}))
    served = build_model(load_config(config))
    assert isinstance(served, LeRobotPi0Policy) and served.policy.config == c


def test_served_chunks_equal_the_reference_and_the_dense_forward_with_guided_rtc(serve, policy):
    rt = serve(LeRobotPi0Policy(policy.policy, max_batch=4))
    cases = []
    for obs, d, seed in zip(observations(3), (0, 3, 6), (11, 12, 13)):
        plan = expert_chunk(obs)[: 8] if d else None
        cases.append((obs, d, plan, seed, policy.request(obs, d, plan, seed)))
    assert "prev_actions" not in cases[0][4] and cases[1][4]["delay"] == 3
    handles = [rt.submit(r) for *_, r in cases]  # one batch: guided and unguided together
    for (obs, d, plan, seed, r), h in zip(cases, handles):
        chunk = h.result(timeout=TIMEOUT)["actions"][0]
        want = reference_actions(policy.policy, r, policy.rtc)["action_chunk"]
        torch.testing.assert_close(chunk, want, atol=1e-4, rtol=0)
        np.testing.assert_allclose(policy.decode(chunk, obs), policy.act(obs, d, plan, seed),
                                   atol=1e-4)


def test_guidance_pulls_the_head_of_the_chunk_towards_the_actions_still_to_execute(policy):
    obs = observations(2)[1]
    plan = expert_chunk(obs)[:8] + 0.15  # a plan off what the policy would do from here
    free = policy.act(obs, 0, None, seed=3)
    for d in (2, 5):
        guided = policy.act(obs, d, plan, seed=3)
        head = slice(0, d)
        assert np.abs(guided[head] - plan[head]).max() < 0.5 * np.abs(free[head] - plan[head]).max()
        # past the plan the policy is free again: the guided chunk ends where the free one does
        assert np.abs(guided[-1] - free[-1]).max() < 0.05


def test_a_short_episode_under_the_control_loop_with_guided_rtc_reaches_the_target():
    import demo
    from clients import Pi0RealClient

    client = Pi0RealClient()
    args = argparse.Namespace(rate_hz=50.0, mode="rtc", no_rtc_inputs=False, realtime=False)
    env = ArmEnv()
    latency = mstar_rt.LatencyTracker(window=demo.LATENCY_WINDOW, control_period_s=0.02)
    with mstar_rt.Runtime(client.model()) as runtime:
        runtime.submit(client.request(env.reset(0), 0, None, 0)).result(timeout=TIMEOUT)
        episodes = [demo.run_episode(runtime, client, env, seed, 2, args, latency)
                    for seed in range(3)]
    for e in episodes:
        assert e["distance"][-1] < 0.5 * e["distance"][0], e["distance"][[0, -1]]
    assert sum(e["success"] for e in episodes) >= 2
    # the inference thread sent d (the tracker measured the injected 2 ticks) with the plan
    assert max(d for e in episodes for d in e["given_d"]) >= 2

"""The reaching demo's miniature pi0 (examples/robot/pi0_policy.py): served by the Runtime it gives
the chunk of the plain recompute reference for the same noise; the delay d and the frozen actions
are run-time inputs (requests with different d batch together, nothing is recompiled, the first
d actions are the frozen ones) and the free actions continue the frozen ones as the expert's
continuation does (what training-time RTC taught it); a short closed loop through the Runtime
reaches its targets; bad delays are refused naming the input."""

from __future__ import annotations

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

import mstar_rt.runtime  # noqa: E402
from arm_env import ArmEnv  # noqa: E402
from expert import expert_chunk, expert_continuation, rollout  # noqa: E402
from mstar_rt.models.pi0 import Pi0Policy, sample_actions_recompute  # noqa: E402
from pi0_policy import HORIZON, MAX_DELAY, WEIGHTS_DIR, MiniPi0, frozen_rows  # noqa: E402

TIMEOUT = 60.0
TOLERANCE = 0.08  # rad: the trained policy's first free actions against the expert's continuation


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conftest.py


@pytest.fixture(scope="module")
def policy() -> MiniPi0:
    return MiniPi0.load()


def observations(n: int) -> list[np.ndarray]:
    env = ArmEnv()
    return [env.reset(seed) for seed in range(n)]


def expert_plan(obs: np.ndarray) -> np.ndarray:
    """A plausible plan the loop is executing: the expert's chunk from this observation."""
    return expert_chunk(obs, horizon=HORIZON)[: HORIZON // 2]


def test_shipped_weights_are_small_and_load():
    size = sum(f.stat().st_size for f in WEIGHTS_DIR.iterdir())
    assert size < 2 * 1024 * 1024, size
    c = MiniPi0.load().module.config
    assert (c.action_horizon, c.action_dim, c.state_dim, c.max_images) == (HORIZON, 2, 8, 1)


def test_served_chunk_equals_the_recompute_reference_and_the_dense_forward(serve, policy):
    rt = serve(Pi0Policy(policy.module))
    cases = [(obs, d, seed) for obs, d, seed in zip(observations(3), (0, 3, 7), (11, 12, 13))]
    requests = [policy.request(obs, d, expert_plan(obs), seed) for obs, d, seed in cases]
    handles = [rt.submit(r) for r in requests]
    for (obs, d, seed), r, h in zip(cases, requests, handles):
        chunk = h.result(timeout=TIMEOUT)["actions"][0]
        torch.testing.assert_close(chunk, sample_actions_recompute(policy.module, r), atol=1e-4,
                                   rtol=0)
        np.testing.assert_allclose(policy.from_model(chunk.numpy(), obs),
                                   policy.act(obs, d, expert_plan(obs), seed), atol=1e-4)


def test_delay_and_frozen_actions_are_run_time_inputs_batched_without_recompiling(
        serve, policy, monkeypatch):
    compiled = []
    real = mstar_rt.runtime.compile_model
    monkeypatch.setattr(mstar_rt.runtime, "compile_model",
                        lambda m: compiled.append(m) or real(m))
    rt = serve(Pi0Policy(policy.module))
    assert len(compiled) == 1
    obs = observations(1)[0]
    plan = expert_plan(obs)[:7]  # shorter than the largest d: frozen_rows pads with the hold
    delays = (0, 2, 5, 9, MAX_DELAY)
    handles = [rt.submit(policy.request(obs, d, plan, seed=3)) for d in delays]
    chunks = {d: policy.from_model(h.result(timeout=TIMEOUT)["actions"][0].numpy(), obs)
              for d, h in zip(delays, handles)}
    assert len(compiled) == 1  # a new d is a new request, never a new graph
    sizes = [s["batch_size"] for h in handles for s in h.stats() if s["node"] == "denoise"]
    assert max(sizes) >= 2, f"requests with different d never shared a flow step: {sizes}"
    for d in delays[1:]:
        # trained RTC: the first d actions are the frozen ones (exact up to the transform)
        np.testing.assert_allclose(chunks[d][:d], frozen_rows(plan, d, obs), atol=1e-5)
        assert not np.allclose(chunks[d][:d], chunks[0][:d], atol=1e-3)
    # The free actions see the frozen ones: other frozen actions, another continuation.
    moved = rt.submit(policy.request(obs, 5, plan + 0.3, seed=3)).result(timeout=TIMEOUT)
    moved = policy.from_model(moved["actions"][0].numpy(), obs)
    np.testing.assert_allclose(moved[:5], plan[:5] + 0.3, atol=1e-5)
    assert np.abs(moved[5:8] - chunks[5][5:8]).max() > 1e-3
    assert len(compiled) == 1


def test_the_expert_continuation_of_its_own_plan_is_that_plan():
    obs = np.stack(observations(4))
    full = expert_chunk(obs, horizon=HORIZON)
    np.testing.assert_array_equal(expert_continuation(obs, full, np.zeros(4, int), HORIZON), full)
    np.testing.assert_allclose(expert_continuation(obs, full, np.array([1, 3, 7, 10]), HORIZON),
                               full, atol=1e-6)
    shifted = expert_continuation(obs, full + 0.2, np.full(4, 5), HORIZON)
    np.testing.assert_array_equal(shifted[:, :5], full[:, :5] + 0.2)  # the fixed rows are kept
    # and continued: fixing more of the continuation's own rows changes nothing
    np.testing.assert_allclose(expert_continuation(obs, shifted, np.full(4, 9), HORIZON), shifted,
                               atol=1e-6)
    assert np.abs(shifted[:, 5:] - full[:, 5:]).max() > 0.1  # not the plan from the state


@pytest.mark.parametrize("seed", range(4))
def test_the_policy_continues_its_frozen_actions_as_the_expert_would(policy, seed):
    # What trained RTC is for: the free actions follow on from the frozen ones. Frozen actions
    # off the expert's plan (shifted by 0.15 rad) must be continued from where they end, not
    # replaced by a fresh plan from the measured state (0.13 rad away at the switch).
    obs = observations(seed + 1)[seed]
    fresh = expert_chunk(obs, horizon=HORIZON)
    fixed = fresh[: HORIZON // 2] + 0.15
    for d in (3, 6):
        chunk = policy.act(obs, d, fixed, seed=1)
        want = expert_continuation(obs[None], fixed[None], np.array([d]), HORIZON)[0]
        np.testing.assert_allclose(chunk[:d], fixed[:d], atol=1e-5)
        near = slice(d, d + 3)  # the actions executed right after the switch
        assert np.abs(chunk[near] - want[near]).max() < TOLERANCE
        assert np.abs(chunk[d] - want[d]).max() < np.abs(chunk[d] - fresh[d]).max()


def test_a_short_closed_loop_through_the_runtime_reaches_the_targets(serve, policy):
    rt = serve(Pi0Policy(policy.module))
    env = ArmEnv()
    count = [0]

    def served(obs: np.ndarray, delay: int, plan: np.ndarray) -> np.ndarray:
        count[0] += 1
        out = rt.submit(policy.request(obs, delay, plan, seed=count[0])).result(timeout=TIMEOUT)
        return policy.from_model(out["actions"][0].numpy(), obs)

    results = [rollout(env, served, seed, delay=4, max_ticks=150, horizon=HORIZON,
                       plan_aware=True) for seed in range(4)]
    assert sum(ok for ok, _ in results) >= 3, results


@pytest.mark.parametrize("delay, words", [
    (-1, ["'delay'", ">= 0"]),
    (HORIZON, [f"'delay' {HORIZON}", "below the action horizon"]),
])
def test_a_bad_delay_is_refused_at_submit_naming_the_input(serve, policy, delay, words):
    rt = serve(Pi0Policy(policy.module))
    obs = observations(1)[0]
    good = policy.request(obs, 3, expert_plan(obs))
    bad = {**good, "delay": delay,
           "prev_actions": np.zeros((HORIZON, 2), np.float32)}
    with pytest.raises(ValueError) as e:
        rt.submit(bad)
    for w in words:
        assert w in str(e.value), (w, str(e.value))
    assert rt.submit(good).result(timeout=TIMEOUT)["actions"][0].shape == (HORIZON, 2)
    with pytest.raises(ValueError, match=rf"delay must be an integer in \[0, {HORIZON}\)"):
        policy.request(obs, delay, expert_plan(obs))

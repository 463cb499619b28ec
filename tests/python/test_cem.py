"""The CEM planner walk: its batched rollouts (with a shared history broadcast into every
sample) equal the world model's full-recompute loop per candidate; the same seed gives the same
plan, a different seed different samples, no seed a fresh draw per request; planning lowers the
energy; bad inputs are refused at submit naming the input; several planning requests run side
by side."""

from __future__ import annotations

import re

import pytest
import torch

from mstar_rt.models.cem import (CEMConfig, CEMPlanner, energy, plan_context, rollout_batch)
from mstar_rt.models.world_model import rollout_recompute
from mstar_rt.models.world_model_layers import WorldModelConfig, random_world_model

from walk_models import ZERO_LIVE, settled

TIMEOUT = 60.0
pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conftest.py


@pytest.fixture(scope="module")
def predictor():
    return random_world_model(WorldModelConfig(), seed=1)


def observation(c: WorldModelConfig, context: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return dict(frames=torch.randn(context, c.num_patches, c.embed_dim, generator=g),
                states=torch.randn(context, c.state_dim, generator=g),
                past_actions=torch.randn(context - 1, c.action_dim, generator=g),
                goal_state=torch.randn(c.state_dim, generator=g))


@pytest.mark.parametrize("context", [1, 3])
def test_batched_rollouts_equal_the_full_recompute_of_each_candidate(predictor, context):
    c = predictor.config
    obs = observation(c, context, seed=context)
    horizon = 3
    ctx = plan_context(predictor, obs["frames"], obs["states"], obs["past_actions"],
                       obs["goal_state"], horizon)
    assert (ctx.history is None) == (context == 1)
    candidates = torch.randn(5, horizon, c.action_dim, generator=torch.Generator().manual_seed(9))
    final_states, final_frames = rollout_batch(predictor, ctx, candidates)
    for i in range(5):
        states, frames = rollout_recompute(predictor, obs["frames"], obs["states"],
                                           torch.cat([obs["past_actions"], candidates[i]]),
                                           horizon)
        torch.testing.assert_close(final_states[i], states[-1], atol=1e-4, rtol=0)
        torch.testing.assert_close(final_frames[i], frames[-1], atol=1e-4, rtol=0)


def plan(rt, obs: dict, seed: int) -> dict:
    return rt.submit({**obs, "seed": seed}).result(timeout=TIMEOUT)


def test_same_seed_same_plan_different_seed_different_samples(serve, predictor):
    config = CEMConfig(samples=32, top_k=4, iterations=3, horizon=2)
    planner = CEMPlanner(predictor, config)
    seen: list[torch.Tensor] = []
    real = planner.submodules["cem_evaluate"].forward

    def spy(batch):
        seen.extend(b["candidates"].clone() for b in batch)
        return real(batch)

    planner.submodules["cem_evaluate"].forward = spy
    rt = serve(planner)
    obs = observation(predictor.config, 2, seed=4)
    a, b, other = plan(rt, obs, 7), plan(rt, obs, 7), plan(rt, obs, 8)
    assert torch.equal(a["plan"][0], b["plan"][0]) and torch.equal(a["action"][0], b["action"][0])
    assert a["best_energy"] == b["best_energy"] and len(a["best_energy"]) == 3
    assert a["plan"][0].shape == (2, predictor.config.action_dim)
    assert torch.equal(a["action"][0], a["plan"][0][0])
    assert len(seen) == 9
    assert all(torch.equal(x, y) for x, y in zip(seen[:3], seen[3:6]))
    assert not any(torch.allclose(x, y) for x, y in zip(seen[:3], seen[6:]))
    assert not torch.allclose(a["plan"][0], other["plan"][0])
    # without a seed a request draws its own: its iterations differ from each other and
    # from every other request's, as a fresh draw should
    seen.clear()
    rt.submit(obs).result(timeout=TIMEOUT), rt.submit(obs).result(timeout=TIMEOUT)
    assert len(seen) == 6 and len({float(x.sum()) for x in seen}) == 6
    assert settled(rt) == ZERO_LIVE


def test_planning_lowers_the_energy_below_random_actions(serve, predictor):
    c = predictor.config
    config = CEMConfig(samples=48, top_k=6, iterations=4, horizon=2)
    rt = serve(CEMPlanner(predictor, config))
    obs = observation(c, 1, seed=11)
    out = plan(rt, obs, 3)
    ctx = plan_context(predictor, obs["frames"], obs["states"], None, obs["goal_state"], 2)
    random_actions = torch.randn(48, 2, c.action_dim, generator=torch.Generator().manual_seed(0))
    baseline = energy(rollout_batch(predictor, ctx, random_actions)[0], ctx.goal)
    assert out["energy"][0] < float(baseline.median())


def test_planning_requests_side_by_side_get_their_own_plans(serve, predictor):
    config = CEMConfig(samples=16, top_k=4, iterations=2, horizon=2)
    rt = serve(CEMPlanner(predictor, config))
    c = predictor.config
    observations = [observation(c, ctx, seed=20 + ctx) for ctx in (1, 2, 3)]
    handles = [rt.submit({**o, "seed": 5}) for o in observations]
    plans = [h.result(timeout=TIMEOUT) for h in handles]
    alone = [plan(rt, o, 5) for o in observations]
    for p, q in zip(plans, alone):
        assert torch.equal(p["plan"][0], q["plan"][0])
    assert settled(rt) == ZERO_LIVE


@pytest.mark.parametrize("change, words", [
    (dict(goal_state=torch.zeros(3)), ["'goal_state'", "[7]"]),
    (dict(past_actions=torch.zeros(2, 7)), ["'past_actions'", "[1, 7]"]),
    (dict(frames=torch.zeros(2, 16, 8)), ["'frames'", "[C, 16, 32]"]),
    (dict(seed=-1), ["'seed'", ">= 0"]),
    (dict(goal_state=None), ["'goal_state'", "missing"]),
    (dict(goal_state=torch.full((7,), float("nan"))), ["'goal_state'", "NaN"]),
])
def test_bad_planner_inputs_are_refused_at_submit(serve, predictor, change, words):
    rt = serve(CEMPlanner(predictor, CEMConfig(samples=8, top_k=2, iterations=1)))
    obs = observation(predictor.config, 2, seed=0)
    with pytest.raises(ValueError) as e:
        rt.submit({**obs, "seed": 0, **change})
    for w in words:
        assert w in str(e.value), (w, str(e.value))
    assert len(plan(rt, obs, 0)["action"]) == 1
    assert settled(rt) == ZERO_LIVE


def test_config_rejects_top_k_above_samples():
    with pytest.raises(ValueError, match="top_k"):
        CEMConfig(samples=4, top_k=5)


@pytest.mark.parametrize("field, value, needs", [
    # each of these built a planner that served wrong plans or failed every request
    ("max_action", -1.0, "a finite number > 0"),  # clamp(1, -1) pinned every action at -1
    ("max_action", float("nan"), "a finite number > 0"),
    ("horizon", 2.5, "an integer >= 1"), ("init_std", -1.0, "a finite number > 0"),
    ("min_std", -1.0, "a finite number >= 0"), ("momentum", 1.5, "a number in [0, 1]"),
    ("samples", True, "an integer >= 1")])
def test_config_fields_that_cannot_plan_are_refused_by_name(field, value, needs):
    with pytest.raises(ValueError, match=re.escape(f"CEMConfig: {field}={value!r} (needs {needs}")):
        CEMConfig(**{field: value})


def test_a_horizon_past_the_predictors_frames_is_refused_when_the_planner_is_built(predictor):
    frames = predictor.config.max_frames
    with pytest.raises(ValueError, match=f"horizon {frames} needs {frames + 1} frames"):
        CEMPlanner(predictor, CEMConfig(horizon=frames))
    CEMPlanner(predictor, CEMConfig(horizon=frames - 1))

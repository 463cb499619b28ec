"""Upstream's CEM planner over the real V-JEPA 2-AC predictor, served as the ``plan`` walk: its
energies are upstream's objective (mean absolute difference of the final predicted frame from
the goal frame) on upstream's rollouts, so it ranks candidates as the reference does; on a toy
case whose goal frame is where a known action leads, the plan finds that action; plans are
reproducible by seed; images and a goal image through the encoder plan as their features do;
bad requests are refused naming the input."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F

from mstar_rt.models.vjepa2_cem import (VJEPA2CEMConfig, VJEPA2Planner, evaluate, full_actions,
                                        vjepa2_plan_context)
from mstar_rt.models.vjepa2_predictor import next_pose

from test_vjepa2_predictor import CONFIGS, tiny_config, upstream_predictor
from test_vjepa2_world_model import encoder_pair, pair  # noqa: F401  (fixtures)
from walk_models import ZERO_LIVE, settled

TIMEOUT = 120.0
pytestmark = [pytest.mark.usefixtures("one_torch_thread"),
              pytest.mark.filterwarnings("ignore:.*sdp_kernel:FutureWarning")]


@pytest.fixture(scope="module")
def planner_pair():
    """Random weights whose predictions depend clearly on the action (a stronger action
    encoder), so that the energy landscape has a minimum to find."""
    up, ours = upstream_predictor(tiny_config(**CONFIGS["grid2x2"]), seed=5, std=0.1)
    with torch.no_grad():
        for m in (up, ours):
            m.action_encoder.weight.mul_(3.0)
    return up, ours


@torch.no_grad()
def reference_energies(up, frames, states, past, goal, candidates) -> torch.Tensor:
    """Upstream's planner on all candidates at once: its step (predictor over every frame so
    far, newest prediction layer-normed, pose update), then ``l1`` of the final frame."""
    s, n = candidates.shape[0], goal.shape[0]
    zs = frames.expand(s, *frames.shape)
    ss = states.expand(s, *states.shape)
    acts = torch.cat([past.expand(s, *past.shape), candidates], 1)
    for _ in range(candidates.shape[1]):
        t = zs.shape[1]
        z = F.layer_norm(up(zs.flatten(1, 2), acts[:, :t], ss)[:, -n:], (goal.shape[-1],))
        zs = torch.cat([zs, z[:, None]], 1)
        ss = torch.cat([ss, next_pose(ss[:, -1], acts[:, t - 1])[:, None]], 1)
    return torch.mean(torch.abs(zs[:, -1].flatten(1) - goal.flatten()[None]), dim=-1)


def observation(c, context: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return dict(frames=F.layer_norm(torch.randn(context, c.num_patches, c.embed_dim, generator=g),
                                    (c.embed_dim,)),
                states=torch.rand(context, 7, generator=g),
                past_actions=0.05 * torch.randn(context - 1, 7, generator=g),
                goal=F.layer_norm(torch.randn(c.num_patches, c.embed_dim, generator=g),
                                  (c.embed_dim,)))


@pytest.mark.parametrize("context", [1, 3])
def test_energies_rank_candidates_as_the_reference_objective_does(planner_pair, context):
    up, ours = planner_pair
    obs = observation(ours.config, context, seed=context)
    ctx = vjepa2_plan_context(ours, obs["frames"], obs["states"], obs["past_actions"],
                              obs["goal"], horizon=2)
    g = torch.Generator().manual_seed(9)
    moves = torch.randn(64, 2, 4, generator=g) * torch.tensor([0.05, 0.05, 0.05, 0.5])
    candidates = full_actions(moves)
    got = evaluate(ours, ctx, candidates)
    want = reference_energies(up, obs["frames"], obs["states"], obs["past_actions"],
                              obs["goal"], candidates)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    torch.testing.assert_close(evaluate(ours, ctx, candidates, max_rollouts=24), got,
                               atol=1e-6, rtol=0)  # in chunks of 24, 24, 16: the same
    assert int(got.argmin()) == int(want.argmin())
    assert set(got.topk(10, largest=False).indices.tolist()) == \
        set(want.topk(10, largest=False).indices.tolist())


def test_the_plan_finds_the_action_that_leads_to_the_goal(serve, planner_pair):
    up, ours = planner_pair
    c = ours.config
    obs = observation(c, 1, seed=0)
    target = full_actions(torch.tensor([[0.04, -0.03, 0.02, 0.5]] * 2))
    goal = None
    with torch.no_grad():  # the goal frame: where the target actions lead, by the reference
        zs, ss = obs["frames"], obs["states"]
        for t in range(2):
            z = F.layer_norm(up(zs.flatten(0, 1)[None], target[None, :t + 1], ss[None])
                             [0, -c.num_patches:], (c.embed_dim,))
            zs, ss = torch.cat([zs, z[None]]), torch.cat([ss, next_pose(ss[-1], target[t])[None]])
        goal = zs[-1]
    config = VJEPA2CEMConfig(samples=100, top_k=10, iterations=8)
    rt = serve(VJEPA2Planner(ours, config))
    out = rt.submit({**obs, "past_actions": None, "goal": goal, "seed": 1}).result(
        timeout=TIMEOUT)
    plan, action = out["plan"][0], out["action"][0]
    assert torch.equal(action, plan[0]) and plan.shape == (2, 7)
    assert torch.all(plan[:, 3:6] == 0)                       # rotation is not planned
    assert (action[:3] - target[0, :3]).norm() < 0.4 * target[0, :3].norm()
    assert abs(float(action[6]) - 0.5) < 0.1
    energy = lambda a: float(reference_energies(up, obs["frames"], obs["states"],  # noqa: E731
                                                torch.zeros(0, 7), goal, a[None])[0])
    assert abs(out["energy"][0] - energy(plan)) < 1e-6
    assert energy(plan) < 0.05 * energy(torch.zeros(2, 7))
    assert out["best_energy"][-1] < out["best_energy"][0]
    assert settled(rt) == ZERO_LIVE


def test_same_seed_same_plan_and_samples_stay_in_upstreams_bounds(serve, planner_pair):
    _, ours = planner_pair
    config = VJEPA2CEMConfig(samples=24, top_k=4, iterations=3, horizon=2)
    planner = VJEPA2Planner(ours, config)
    seen: list[torch.Tensor] = []
    real = planner.submodules["cem_evaluate"].forward

    def spy(batch):
        seen.extend(b["candidates"].clone() for b in batch)
        return real(batch)

    planner.submodules["cem_evaluate"].forward = spy
    rt = serve(planner)
    obs = observation(ours.config, 2, seed=4)
    a, b, other = (rt.submit({**obs, "seed": s}).result(timeout=TIMEOUT) for s in (7, 7, 8))
    assert torch.equal(a["plan"][0], b["plan"][0]) and a["best_energy"] == b["best_energy"]
    assert not torch.allclose(a["plan"][0], other["plan"][0])
    cands = torch.stack(seen)
    assert cands[..., :3].abs().max() <= config.maxnorm
    assert cands[..., 6].abs().max() <= config.max_gripper
    assert torch.all(cands[..., 3:6] == 0)
    assert settled(rt) == ZERO_LIVE


def test_images_and_goal_image_plan_as_their_features(serve, pair, encoder_pair):
    _, ours = pair
    hf, encoder = encoder_pair
    config = VJEPA2CEMConfig(samples=16, top_k=4, iterations=2)
    g = torch.Generator().manual_seed(3)
    images, goal_image = (torch.randn(*shape, generator=g).clamp(-2.1, 2.6)  # normalized pixels
                          for shape in ((2, 3, 48, 48), (3, 48, 48)))
    with torch.no_grad():
        feats = F.layer_norm(hf.get_vision_features(
            torch.cat([images, goal_image[None]])[:, None].repeat(1, 2, 1, 1, 1)), (40,))
    states, past = torch.rand(2, 7, generator=g), 0.05 * torch.randn(1, 7, generator=g)
    rt = serve(VJEPA2Planner(ours, config, encoder))
    seeing = rt.submit({"images": images, "goal_image": goal_image, "states": states,
                        "past_actions": past, "seed": 2}).result(timeout=TIMEOUT)
    rt2 = serve(VJEPA2Planner(ours, config))
    told = rt2.submit({"frames": feats[:2], "goal": feats[2], "states": states,
                       "past_actions": past, "seed": 2}).result(timeout=TIMEOUT)
    torch.testing.assert_close(seeing["plan"][0], told["plan"][0], atol=1e-5, rtol=0)


@pytest.mark.parametrize("change, words", [
    (dict(goal=torch.zeros(3, 32)), ["'goal'", "[4, 32]"]),
    (dict(past_actions=torch.zeros(2, 7)), ["'past_actions'", "[1, 7]"]),
    (dict(frames=torch.zeros(2, 4, 8)), ["'frames'", "[C, 4, 32]"]),
    (dict(seed=-1), ["'seed'", ">= 0"]),
    (dict(goal=None), ["'goal'", "missing"]),
    (dict(goal=torch.full((4, 32), float("nan"))), ["'goal'", "NaN"]),
])
def test_bad_planner_inputs_are_refused_at_submit(serve, planner_pair, change, words):
    _, ours = planner_pair
    rt = serve(VJEPA2Planner(ours, VJEPA2CEMConfig(samples=8, top_k=2, iterations=1)))
    obs = observation(ours.config, 2, seed=0)
    with pytest.raises(ValueError) as e:
        rt.submit({**obs, "seed": 0, **change})
    for w in words:
        assert w in str(e.value), (w, str(e.value))
    assert len(rt.submit({**obs, "seed": 0}).result(timeout=TIMEOUT)["action"]) == 1
    assert settled(rt) == ZERO_LIVE


def test_config_defaults_are_upstreams_and_top_k_is_checked():
    c = VJEPA2CEMConfig()
    assert (c.samples, c.top_k, c.iterations, c.horizon, c.maxnorm) == (400, 10, 10, 2, 0.05)
    with pytest.raises(ValueError, match="top_k"):
        VJEPA2CEMConfig(samples=4, top_k=5)
    # a negative maxnorm pinned every translation at it; momenta past 1 diverge
    for field, value, needs in [("maxnorm", -0.05, "> 0"), ("max_gripper", -1, "> 0"),
                                ("momentum_mean", 2, "in [0, 1]"), ("horizon", 1.5, ">= 1"),
                                ("gripper_round", float("nan"), ">= 0")]:
        with pytest.raises(ValueError, match=rf"{field}={value!r} \(needs .*{re.escape(needs)}"):
            VJEPA2CEMConfig(**{field: value})

"""A cross-entropy-method (CEM) planner over the world model, served as a ``plan`` walk.

    context -> Loop(iterations){ sample -> evaluate -> update } -> act

``context`` runs the observed history once; each iteration ``sample`` draws S candidate action
sequences from the current Gaussian (a generator seeded by the request's ``seed`` and the
iteration, so a plan with a seed is reproducible; without one a request draws its own),
``evaluate`` rolls all S out as one batch through the
predictor and scores them (L1 distance of the final predicted state to ``goal_state``),
``update`` refits mean and std to the top-k -- all on the predictor's device. ``act`` EMITs the
first action of the final mean (``action``), the whole mean (``plan``) and its energy.

The S rollouts advance in lockstep, one frame block per step, over a dense K/V buffer
(:class:`~mstar_rt.models.world_model_layers.BatchedRolloutKV`). What all samples share -- the
history blocks before the last observed frame -- is computed once per request and broadcast
into every sample's buffer (the dense form of forking a KV prefix). The last observed frame's
block is per sample, because it holds the sample's first action and attention within a block is
full; so with a single observed frame nothing can be shared. Why not the paged engine: a
KVWork is one sequence, and S samples of one request would need S labels per work.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional

import torch

from mstar_rt.models.cem_walk import CEMWalk
from mstar_rt.models.config_checks import check_fields
from mstar_rt.models.sampling import request_seed
from mstar_rt.models.world_model import check_rollout_inputs, real_tensor
from mstar_rt.models.world_model_layers import (ACPredictor, BatchedRolloutKV, ContextKV,
                                                block_causal_mask)


@dataclass(frozen=True)
class CEMConfig:
    """Upstream V-JEPA 2-AC planning uses 400 samples, top 10, 10 iterations, horizon 2."""

    samples: int = 64
    top_k: int = 8
    iterations: int = 5
    horizon: int = 2
    init_std: float = 1.0
    min_std: float = 1e-3
    max_action: Optional[float] = None   # clamp samples to [-max_action, max_action]
    momentum: float = 0.0                # weight of the old mean / std in an update

    def __post_init__(self) -> None:
        check_fields(self, counts=("samples", "top_k", "iterations", "horizon"),
                     positive=("init_std",) + (("max_action",) if self.max_action is not None
                                               else ()),
                     nonnegative=("min_std",), fractions=("momentum",))
        if not 1 <= self.top_k <= self.samples:
            raise ValueError(f"top_k must lie in [1, samples={self.samples}]; got {self.top_k}")


def check_plan_fits(horizon: int, max_frames: int) -> None:
    """At submit every request would be refused: a plan of ``horizon`` steps after one observed
    frame needs ``horizon + 1`` frames of the predictor."""
    if horizon + 1 > max_frames:
        raise ValueError(f"a plan of horizon {horizon} needs {horizon + 1} frames (one observed); "
                         f"this predictor holds at most {max_frames}: lower the horizon")


@dataclass
class PlanContext:
    """One planning request's shared part: the history's K/V (None with one observed frame),
    the last observed frame and state, and the goal."""

    history: Optional[ContextKV]
    frame: torch.Tensor    # [N, E]
    state: torch.Tensor    # [S]
    goal: torch.Tensor     # [S]


@torch.inference_mode()
def plan_context(predictor: ACPredictor, frames: Any, states: Any, past_actions: Any,
                 goal_state: Any, horizon: int, check_only: bool = False) -> PlanContext:
    """Checks a request's inputs and (unless ``check_only``) runs its history blocks once."""
    c = predictor.config
    for name, value in (("frames", frames), ("states", states), ("goal_state", goal_state)):
        if value is None:
            raise ValueError(f"planner input '{name}' is missing")
    frames_t = real_tensor(frames, "frames")
    ctx = 1 if frames_t.dim() == 2 else int(frames_t.shape[0])
    if ctx < 1:  # it blamed 'past_actions' for the 0 observed frames
        raise ValueError(f"'frames' holds no observed frame; give at least one, got "
                         f"{list(frames_t.shape)}")
    if past_actions is None:
        past_actions = torch.zeros(0, c.action_dim)
    past = real_tensor(past_actions, "past_actions", predictor.device, predictor.dtype)
    if tuple(past.shape) != (ctx - 1, c.action_dim):
        raise ValueError(f"'past_actions' must be [{ctx - 1}, {c.action_dim}] (the actions taken "
                         f"between the {ctx} observed frames); got {list(past.shape)}")
    if not bool(torch.isfinite(past).all()):
        raise ValueError("'past_actions' holds NaN or infinite values; give finite numbers")
    filler = torch.zeros(horizon, c.action_dim, dtype=past.dtype, device=past.device)
    r = check_rollout_inputs(c, {"frames": frames, "states": states, "horizon": horizon,
                                 "actions": torch.cat([past, filler])},
                             None, predictor.device, predictor.dtype)
    goal = real_tensor(goal_state, "goal_state", predictor.device, predictor.dtype)
    if goal.shape != (c.state_dim,):
        raise ValueError(f"'goal_state' must be [{c.state_dim}]; got {list(goal.shape)}")
    if not bool(torch.isfinite(goal).all()):
        raise ValueError("'goal_state' holds NaN or infinite values; give finite numbers")
    history = None if check_only else history_kv(predictor, r.frames, r.states, past)
    return PlanContext(history, r.frames[-1], r.states[-1], goal)


@torch.inference_mode()
def history_kv(predictor: Any, frames: torch.Tensor, states: torch.Tensor,
               past: torch.Tensor) -> Optional[ContextKV]:
    """The K/V of the blocks before the last observed frame (None with one frame): what every
    candidate of a plan shares."""
    if frames.shape[0] < 2:
        return None
    f = predictor.config.block_tokens
    n = (frames.shape[0] - 1) * f
    history = ContextKV(block_causal_mask(n, f, predictor.device))
    x = predictor.embed(frames[:-1], states[:-1], past)
    predictor(x, torch.arange(n, device=predictor.device), history)
    return history


@torch.inference_mode()
def rollout_batch(predictor: ACPredictor, context: PlanContext,
                  actions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rolls the candidates ``actions [S, H, A]`` out from ``context`` in lockstep; returns the
    final predicted (states ``[S, state_dim]``, frames ``[S, N, E]``)."""
    c = predictor.config
    samples, horizon = actions.shape[:2]
    f = c.block_tokens
    start = context.history.length if context.history is not None else 0
    kv = BatchedRolloutKV(predictor, samples, start + horizon * f)
    if context.history is not None:
        kv.seed_context(context.history)
    z = context.frame.expand(samples, *context.frame.shape)
    s = context.state.expand(samples, *context.state.shape)
    for t in range(horizon):
        x = predictor.embed(z[:, None], s[:, None], actions[:, t:t + 1])
        positions = torch.arange(kv.length, kv.length + f, device=predictor.device)
        kv.begin(f)
        out = predictor(x, positions, kv)
        kv.commit()
        z, s = predictor.predict(out, s, actions[:, t])
    return s, z


def energy(final_states: torch.Tensor, goal: torch.Tensor) -> torch.Tensor:
    """L1 distance of each final state to the goal: ``[S]``."""
    return (final_states - goal).abs().sum(-1)


class CEMPlanner(CEMWalk):
    """The ``plan`` walk (see the module docstring). Inputs: ``frames [C, N, E]``, ``states
    [C, S]``, ``past_actions [C - 1, A]`` (optional with one frame), ``goal_state [S]`` and
    ``seed``. EMITs ``best_energy`` per iteration, then ``action [A]``, ``plan [H, A]`` and the
    plan's ``energy``."""

    inputs = ("frames", "states", "past_actions", "goal_state", "seed")
    input_defaults = {"past_actions": None, "seed": None}

    def __init__(self, predictor: ACPredictor, config: Optional[CEMConfig] = None) -> None:
        self.predictor = predictor.eval()
        c = config or CEMConfig()
        check_plan_fits(c.horizon, predictor.config.max_frames)
        super().__init__(c, ["frames", "states", "past_actions", "goal_state"])

    def validate_inputs(self, inputs: Mapping[str, Any]) -> None:
        request_seed(inputs.get("seed"))  # checked; a request without one draws its own
        plan_context(self.predictor, inputs["frames"], inputs["states"], inputs["past_actions"],
                     inputs["goal_state"], self.config.horizon, check_only=True)

    def start(self, inputs: Mapping[str, Any]) -> tuple[PlanContext, torch.Tensor, torch.Tensor]:
        p, c = self.predictor, self.config
        ctx = plan_context(p, inputs["frames"], inputs["states"], inputs["past_actions"],
                           inputs["goal_state"], c.horizon)
        shape = (c.horizon, p.config.action_dim)
        return (ctx, torch.zeros(shape, device=p.device, dtype=p.dtype),
                torch.full(shape, c.init_std, device=p.device, dtype=p.dtype))

    def sample(self, mean: torch.Tensor, std: torch.Tensor,
               noise: torch.Tensor) -> torch.Tensor:
        cand = mean + std * noise
        m = self.config.max_action
        return cand if m is None else cand.clamp(-m, m)

    def energies(self, context: PlanContext, candidates: torch.Tensor) -> torch.Tensor:
        final, _ = rollout_batch(self.predictor, context, candidates)
        return energy(final, context.goal)

    def refit(self, mean: torch.Tensor, std: torch.Tensor,
              elites: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.config
        m = c.momentum
        return (m * mean + (1 - m) * elites.mean(0),
                (m * std + (1 - m) * elites.std(0, unbiased=False)).clamp(min=c.min_std))

    def act(self, context: PlanContext, mean: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor, float]:
        final, _ = rollout_batch(self.predictor, context, mean[None])
        return mean[0], mean, float(energy(final, context.goal)[0])

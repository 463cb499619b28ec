"""Upstream's V-JEPA 2-AC planner (``notebooks/utils/mpc_utils.cem``) served as a ``plan`` walk.

    [encoder ->] context -> Loop(iterations){ sample -> evaluate -> update } -> act

Upstream's cross-entropy method over end-effector actions: a Gaussian over the translation
(3) and gripper (1) of each of ``horizon`` actions (rotation stays 0), starting at mean 0, std
``maxnorm`` (translation) and 1 (gripper); samples are clipped to ``[-maxnorm, maxnorm]`` and
``[-max_gripper, max_gripper]``; each sample is rolled out through the predictor (poses by
upstream's pose update) and scored by the energy -- the mean absolute difference between the
final predicted frame's features and the goal frame's (both layer-normed); the ``top_k``
lowest refit mean and (unbiased) std, blended with the old ones by the momenta. ``act`` EMITs
the final mean as the ``plan [H, 7]`` with gripper values below ``gripper_round`` in magnitude
set to 0, its first step as ``action [7]``, and the plan's ``energy``; each iteration EMITs its
``best_energy``.

The candidates roll out in lockstep over dense K/V buffers, sharing the history before the last
observed frame (``cem.rollout_batch``). Samples come from a generator seeded by the request's
``seed`` and the iteration, so a plan with a seed is reproducible (upstream draws from the
global RNG; a request without a seed draws its own, sampling.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional

import torch

from mstar_rt.graph import GraphNode
from mstar_rt.models.cem import PlanContext, check_plan_fits, history_kv, rollout_batch
from mstar_rt.models.cem_walk import CEMWalk
from mstar_rt.models.config_checks import check_fields
from mstar_rt.models.sampling import request_seed
from mstar_rt.models.vjepa2_encoder import VJEPA2FrameEncoder, check_images
from mstar_rt.models.vjepa2_predictor import VJEPA2ACPredictor
from mstar_rt.models.vjepa2_world_model import EncoderNode, check_encoder_fits
from mstar_rt.models.world_model import check_rollout_inputs, real_tensor

TRANSLATION, GRIPPER = slice(0, 3), slice(6, 7)


@dataclass(frozen=True)
class VJEPA2CEMConfig:
    """Upstream's planning arguments (``WorldModel.mpc_args`` of its example: rollout 2, 400
    samples, top 10, 10 CEM steps, momenta 0.15, maxnorm 0.05)."""

    samples: int = 400
    top_k: int = 10
    iterations: int = 10
    horizon: int = 2
    momentum_mean: float = 0.15
    momentum_std: float = 0.15
    momentum_mean_gripper: float = 0.15
    momentum_std_gripper: float = 0.15
    maxnorm: float = 0.05
    max_gripper: float = 0.75
    gripper_round: float = 0.25
    #: Candidates rolled out at once (ours, not upstream's): bounds the dense K/V buffers, e.g.
    #: 100 x 2 frames x 24.2 MiB (bfloat16, full-size predictor) = 4.7 GiB.
    max_rollouts: int = 100

    def __post_init__(self) -> None:
        check_fields(self, counts=("samples", "top_k", "iterations", "horizon", "max_rollouts"),
                     positive=("maxnorm", "max_gripper"), nonnegative=("gripper_round",),
                     fractions=("momentum_mean", "momentum_std", "momentum_mean_gripper",
                                "momentum_std_gripper"))
        if not 2 <= self.top_k <= self.samples:
            raise ValueError(f"top_k must lie in [2, samples={self.samples}] (the std of the "
                             f"elites needs two); got {self.top_k}")


def frame_energy(final_frames: torch.Tensor, goal: torch.Tensor) -> torch.Tensor:
    """Upstream's objective: per candidate, the mean absolute difference of its final predicted
    frame ``[S, N, E]`` from the goal frame ``[N, E]`` over all tokens and features: ``[S]``."""
    return (final_frames - goal).abs().flatten(1).mean(-1)


def full_actions(moves: torch.Tensor) -> torch.Tensor:
    """``[..., 4]`` (translation, gripper) -> ``[..., 7]`` actions with zero rotation."""
    zeros = moves.new_zeros(*moves.shape[:-1], 3)
    return torch.cat([moves[..., :3], zeros, moves[..., 3:]], -1)


@torch.inference_mode()
def vjepa2_plan_context(predictor: VJEPA2ACPredictor, frames: Any, states: Any,
                        past_actions: Any, goal: Any, horizon: int,
                        check_only: bool = False) -> PlanContext:
    """Checks a request's inputs (``frames [C, N, E]``, ``states [C, 7]``, ``past_actions
    [C - 1, 7]``, ``goal [N, E]``) and, unless ``check_only``, runs its history once."""
    c = predictor.config
    for name, value in (("frames", frames), ("states", states), ("goal", goal)):
        if value is None:
            raise ValueError(f"planner input '{name}' is missing")
    frames_t = real_tensor(frames, "frames")
    ctx = 1 if frames_t.dim() == 2 else int(frames_t.shape[0])
    if ctx < 1:  # it blamed 'past_actions' for the 0 observed frames
        raise ValueError(f"'frames' holds no observed frame; give at least one, got "
                         f"{list(frames_t.shape)}")
    dev, dt = predictor.device, predictor.dtype
    past = torch.zeros(0, c.action_dim) if past_actions is None else past_actions
    past = real_tensor(past, "past_actions", dev, dt)
    if past.dim() != 2 or tuple(past.shape) != (ctx - 1, c.action_dim):
        raise ValueError(f"'past_actions' must be [{ctx - 1}, {c.action_dim}] (the actions taken "
                         f"between the {ctx} observed frames); got {list(past.shape)}")
    filler = torch.zeros(horizon, c.action_dim, dtype=dt, device=dev)
    r = check_rollout_inputs(c, {"frames": frames, "states": states, "horizon": horizon,
                                 "actions": torch.cat([past, filler])}, None, dev, dt)
    goal_t = real_tensor(goal, "goal", dev, dt)
    if tuple(goal_t.shape) != (c.num_patches, c.embed_dim):
        raise ValueError(f"'goal' must be the goal frame's features [{c.num_patches}, "
                         f"{c.embed_dim}]; got {list(goal_t.shape)}")
    for name, t in (("past_actions", past), ("goal", goal_t)):
        if not bool(torch.isfinite(t).all()):
            raise ValueError(f"'{name}' holds NaN or infinite values; give finite numbers")
    history = None if check_only else history_kv(predictor, r.frames, r.states,
                                                 r.actions[:r.context - 1])
    return PlanContext(history, r.frames[-1], r.states[-1], goal_t)


def evaluate(predictor: VJEPA2ACPredictor, context: PlanContext, actions: torch.Tensor,
             max_rollouts: Optional[int] = None) -> torch.Tensor:
    """Energies ``[S]`` of the candidate action sequences ``[S, H, 7]``, rolled out
    ``max_rollouts`` at a time (all at once by default)."""
    step = max_rollouts or actions.shape[0]
    return torch.cat([frame_energy(rollout_batch(predictor, context, actions[i:i + step])[1],
                                   context.goal)
                      for i in range(0, actions.shape[0], step)])


class VJEPA2Planner(CEMWalk):
    """The ``plan`` walk (see the module docstring). Inputs: ``frames [C, N, E]`` and ``goal
    [N, E]`` (layer-normed encoder features) -- or, with ``encoder``, camera ``images`` and
    ``goal_image`` (see ``vjepa2_encoder.check_images``) --, ``states [C, 7]``, ``past_actions
    [C - 1, 7]`` (optional with one frame) and ``seed``."""

    input_defaults = {"past_actions": None, "seed": None}

    def __init__(self, predictor: VJEPA2ACPredictor, config: Optional[VJEPA2CEMConfig] = None,
                 encoder: Optional[VJEPA2FrameEncoder] = None) -> None:
        self.predictor = predictor.eval()
        self.encoder = encoder
        c = config or VJEPA2CEMConfig()
        check_plan_fits(c.horizon, predictor.config.max_frames)
        if predictor.config.action_dim != 7:
            raise ValueError("the planner samples 7-d end-effector actions (xyz, rotation, "
                             f"gripper); this predictor takes {predictor.config.action_dim}")
        first = None
        self.inputs = ("frames", "states", "past_actions", "goal", "seed")
        if encoder is not None:
            check_encoder_fits(encoder, predictor.config)
            self.inputs = ("images", "goal_image", "states", "past_actions", "seed")
            first = (GraphNode("encoder", ["images", "goal_image"], ["frames", "goal"]),
                     EncoderNode(encoder, {"images": "frames", "goal_image": "goal"},
                                 predictor.device, predictor.dtype), "encoder")
        super().__init__(c, ["frames", "states", "past_actions", "goal"], first)

    def validate_inputs(self, inputs: Mapping[str, Any]) -> None:
        request_seed(inputs.get("seed"))  # checked; a request without one draws its own
        c = self.predictor.config
        frames, goal = inputs.get("frames"), inputs.get("goal")
        if self.encoder is not None:
            crop = self.encoder.config.crop_size
            images = check_images(inputs.get("images"), crop)
            goal_image = check_images(inputs.get("goal_image"), crop, "goal_image")
            if goal_image.shape[0] != 1:
                raise ValueError(f"'goal_image' must be one image; got {goal_image.shape[0]}")
            frames = torch.zeros(()).expand(images.shape[0], c.num_patches, c.embed_dim)
            goal = torch.zeros(()).expand(c.num_patches, c.embed_dim)
        vjepa2_plan_context(self.predictor, frames, inputs["states"], inputs.get("past_actions"),
                            goal, self.config.horizon, check_only=True)

    def start(self, inputs: Mapping[str, Any]) -> tuple[PlanContext, torch.Tensor, torch.Tensor]:
        p, c = self.predictor, self.config
        ctx = vjepa2_plan_context(p, inputs["frames"], inputs["states"], inputs["past_actions"],
                                  inputs["goal"], c.horizon)
        mean = torch.zeros(c.horizon, 4, device=p.device, dtype=p.dtype)
        std = torch.ones_like(mean)
        std[:, :3] = c.maxnorm
        return ctx, mean, std

    def sample(self, mean: torch.Tensor, std: torch.Tensor,
               noise: torch.Tensor) -> torch.Tensor:
        c = self.config
        moves = noise * std + mean
        moves[..., :3] = moves[..., :3].clamp(-c.maxnorm, c.maxnorm)
        moves[..., 3:] = moves[..., 3:].clamp(-c.max_gripper, c.max_gripper)
        return full_actions(moves)

    def energies(self, context: PlanContext, candidates: torch.Tensor) -> torch.Tensor:
        return evaluate(self.predictor, context, candidates, self.config.max_rollouts)

    def refit(self, mean: torch.Tensor, std: torch.Tensor,
              elites: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.config
        sel_mean, sel_std = elites.mean(0), elites.std(0)  # unbiased, as upstream
        new_mean = torch.cat([
            sel_mean[..., TRANSLATION] * (1 - c.momentum_mean) + mean[..., :3] * c.momentum_mean,
            sel_mean[..., GRIPPER] * (1 - c.momentum_mean_gripper)
            + mean[..., 3:] * c.momentum_mean_gripper], -1)
        new_std = torch.cat([
            sel_std[..., TRANSLATION] * (1 - c.momentum_std) + std[..., :3] * c.momentum_std,
            sel_std[..., GRIPPER] * (1 - c.momentum_std_gripper)
            + std[..., 3:] * c.momentum_std_gripper], -1)
        return new_mean, new_std

    def act(self, context: PlanContext, mean: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor, float]:
        moves = mean.clone()
        grip = moves[..., 3:]
        grip[grip.abs() < self.config.gripper_round] = 0
        plan = full_actions(moves)
        return plan[0], plan, float(evaluate(self.predictor, context, plan[None])[0])

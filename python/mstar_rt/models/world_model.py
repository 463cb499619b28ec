"""A V-JEPA-2-AC-style world model served as a ``rollout`` walk on the KV engine.

The walk is one DynamicLoop over the predictor node. Iteration 0 writes the request's observed
frames into the paged cache as frame blocks (block-causal attention) -- the last one carrying
the first planned action -- and predicts the next frame and state; every later iteration
processes only the block of the frame it predicted (with the next action) against the cache and
predicts the one after. Each iteration EMITs its predicted ``state`` and ``frame``; a request
stops at its own ``horizon``, and requests of different horizons share the engine's steps.

    wm = WorldModel(random_world_model())            # or WorldModel.from_pretrained(dir)
    with mstar_rt.Runtime(wm) as rt:
        out = rt.submit({"frames": z, "states": s, "actions": a, "horizon": 15}).result()
        out["state"]   # 15 predicted states [state_dim], in order

Inputs: ``frames [C, N, E]`` (encoder features of the C observed frames, oldest first; ``[N,
E]`` for one), ``states [C, S]``, ``actions [C - 1 + horizon, A]`` (the C - 1 actions taken
between the observed frames, then the planned ones) and ``horizon`` (defaults to what the
actions allow). :func:`rollout_recompute` is the upstream planning loop, which recomputes the
whole growing context at every step; it is the reference and the benchmark's baseline.

The predictor is either this repository's miniature (:class:`ACPredictor`, a learned state
head) or the real V-JEPA 2-AC predictor (:class:`~mstar_rt.models.vjepa2_predictor.
VJEPA2ACPredictor`, upstream's pose update); both offer ``embed``, ``forward(x, positions,
attn)``, ``predict(block_out, state, action)`` and ``kv_layout``. ``vjepa2_world_model`` puts
the V-JEPA 2 encoder in front of this walk.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Mapping, Optional, Union

import numpy as np
import torch

from mstar_rt.engines.kv_engine import KVCacheEngine, KVNodeSubmodule, KVStep, KVWork
from mstar_rt.engines.masks import BlockCausal
from mstar_rt.engines.paged_kv import KVLayout
from mstar_rt.graph import EMIT, DynamicLoop, GraphEdge, GraphNode
from mstar_rt.model import Model, WorkContext
from mstar_rt.models.sampling import whole_number
from mstar_rt.models.world_model_layers import (ACPredictor, DenseAttention, WorldModelConfig,
                                                block_causal_mask, load_world_model)

if TYPE_CHECKING:
    from mstar_rt.models.vjepa2_predictor import VJEPA2ACPredictor

#: What the walk serves: the miniature or the V-JEPA 2-AC predictor.
Predictor = Union[ACPredictor, "VJEPA2ACPredictor"]

LOOP = "horizon"


class RolloutInputs:
    """A request's inputs, checked and on the predictor's device."""

    def __init__(self, frames: torch.Tensor, states: torch.Tensor, actions: torch.Tensor,
                 horizon: int) -> None:
        self.frames, self.states, self.actions, self.horizon = frames, states, actions, horizon

    @property
    def context(self) -> int:
        return self.frames.shape[0]


def real_tensor(value: Any, name: str, device: Any = None,
                dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """Input ``name`` as a tensor of real numbers on ``device`` / ``dtype``; ValueError naming
    it for what is not (text, complex numbers whose imaginary part a cast would drop, booleans)."""
    try:
        t = value if torch.is_tensor(value) else torch.as_tensor(np.asarray(value))
    except (TypeError, ValueError, RuntimeError) as e:
        raise ValueError(f"'{name}' must be an array or tensor of numbers, not "
                         f"{type(value).__name__} ({e})") from None
    if t.dtype == torch.bool or t.is_complex() or not (t.is_floating_point() or t.dtype in (
            torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)):
        raise ValueError(f"'{name}' must hold real numbers, got {str(t.dtype)[6:]}")
    return t.to(device=device, dtype=dtype)


def check_rollout_inputs(config: WorldModelConfig, inputs: Mapping[str, Any],
                         max_horizon: Optional[int] = None, device: Any = "cpu",
                         dtype: torch.dtype = torch.float32) -> RolloutInputs:
    """Validates ``frames``, ``states``, ``actions`` and ``horizon``; raises a ValueError that
    names the input and the shape it needs."""
    c = config
    for key in ("frames", "states", "actions"):
        if inputs.get(key) is None:
            raise ValueError(f"world model input '{key}' is missing")
    frames = real_tensor(inputs["frames"], "frames", device, dtype)
    if frames.dim() == 2:
        frames = frames[None]
    if frames.dim() != 3 or frames.shape[1:] != (c.num_patches, c.embed_dim) or not len(frames):
        raise ValueError(f"'frames' must be [C, {c.num_patches}, {c.embed_dim}] (C >= 1 observed "
                         f"frames of {c.num_patches} patch features of width {c.embed_dim}); got "
                         f"{list(frames.shape)}")
    ctx = frames.shape[0]
    states = real_tensor(inputs["states"], "states", device, dtype)
    if states.dim() == 1:
        states = states[None]
    if tuple(states.shape) != (ctx, c.state_dim):
        raise ValueError(f"'states' must be [{ctx}, {c.state_dim}] (one state per observed "
                         f"frame); got {list(states.shape)}")
    actions = real_tensor(inputs["actions"], "actions", device, dtype)
    if actions.dim() != 2 or actions.shape[1] != c.action_dim:
        raise ValueError(f"'actions' must be [T, {c.action_dim}]; got {list(actions.shape)}")
    for name, t in (("frames", frames), ("states", states), ("actions", actions)):
        _check_finite(name, t)
    available = actions.shape[0] - (ctx - 1)
    horizon = inputs.get("horizon")
    if horizon is None and available < 1:  # it blamed a horizon the request never gave
        raise ValueError(f"'actions' has {actions.shape[0]} rows; {ctx} observed frames need "
                         f"{ctx - 1} between them and one more per predicted frame")
    horizon = available if horizon is None else whole_number(horizon, "horizon", minimum=1)
    if horizon > available:
        raise ValueError(f"'actions' has {actions.shape[0]} rows but {ctx} observed frames and "
                         f"horizon {horizon} need {ctx - 1 + horizon} ({ctx - 1} taken between "
                         "the observed frames, then one per predicted frame)")
    if max_horizon is not None and horizon > max_horizon:
        raise ValueError(f"'horizon' {horizon} exceeds this world model's max_horizon "
                         f"{max_horizon}; raise max_horizon or plan shorter")
    if ctx - 1 + horizon > c.max_frames:
        raise ValueError(f"{ctx} observed frames and horizon {horizon} make "
                         f"{ctx - 1 + horizon} frame blocks; the predictor takes at most "
                         f"max_frames={c.max_frames}")
    return RolloutInputs(frames, states, actions[: ctx - 1 + horizon], horizon)


def _check_finite(name: str, t: torch.Tensor) -> None:
    if not bool(torch.isfinite(t).all()):
        raise ValueError(f"'{name}' holds NaN or infinite values; give finite numbers")


class PredictorNode(KVNodeSubmodule):
    """One rollout step per request: iteration 0 the observed frames (C blocks), later
    iterations the one predicted block, all as one ragged batch over the paged cache."""

    def __init__(self, predictor: Predictor, max_horizon: int, max_batch: int = 64) -> None:
        self.predictor = predictor
        self.max_horizon = max_horizon
        self.max_batch = max_batch
        self.mask = BlockCausal(predictor.config.block_tokens)

    def kv_layout(self) -> KVLayout:
        return self.predictor.kv_layout()

    def prepare_inputs(self, ctx: WorkContext, inputs: dict) -> KVWork:
        state, p = ctx.request.state, self.predictor
        c = p.config
        if ctx.iteration == 0:
            r = check_rollout_inputs(c, inputs, self.max_horizon, p.device, p.dtype)
            state.update(context=r.context, horizon=r.horizon, actions=r.actions)
            frames, states, actions = r.frames, r.states, r.actions[: r.context]
            reserve = (r.context - 1 + r.horizon) * c.block_tokens
        else:  # the frame and state the previous iteration predicted, carried by the loop
            t = state["context"] - 1 + ctx.iteration
            frames, states = inputs["frames"], inputs["states"]
            actions = state["actions"][t:t + 1]
            reserve = 0
        return KVWork(frames.shape[0] * c.block_tokens, mask=self.mask, reserve=reserve,
                      payload=(frames, states, actions, ctx.iteration, state))

    @torch.inference_mode()
    def forward_kv(self, works: list[KVWork], step: KVStep) -> list[Mapping[str, Any]]:
        p = self.predictor
        x = torch.cat([p.embed(*w.payload[:3]) for w in works])
        out = p(x, step.positions, step)
        f = p.config.block_tokens
        ends = torch.cumsum(torch.tensor([w.num_tokens for w in works]), 0).tolist()
        last = torch.stack([out[e - f:e] for e in ends])              # each work's newest block
        frames, states = p.predict(last, torch.stack([w.payload[1][-1] for w in works]),
                                   torch.stack([w.payload[2][-1] for w in works]))
        # copies: a view kept the whole batch's output alive as long as one frame was held
        return [{"frames": frames[i:i + 1].clone(), "states": states[i:i + 1].clone(),
                 "frame": frames[i].clone(), "state": states[i].clone()}
                for i in range(len(works))]

    def check_stop(self, works: list[KVWork], outputs: list) -> list:
        return [(LOOP,) if w.payload[3] + 1 >= w.payload[4]["horizon"] else () for w in works]


class WorldModel(Model):
    """The ``rollout`` walk over a predictor (see the module docstring).

    ``max_horizon`` bounds a request's horizon (the DynamicLoop's ``max_iters``; default 32,
    at most the predictor's ``max_frames``). The default
    engine has pages of one frame block and room for four rollouts of ``max_horizon`` frames at
    once (more wait for pages); pass ``engine`` to size the cache for a large predictor.
    """

    inputs = ("frames", "states", "actions", "horizon")
    input_defaults = {"horizon": None}

    def __init__(self, predictor: Predictor, max_horizon: Optional[int] = None,
                 engine: Optional[KVCacheEngine] = None, max_batch: int = 64) -> None:
        if max_horizon is None:
            max_horizon = min(32, predictor.config.max_frames)
        if isinstance(max_horizon, bool) or not isinstance(max_horizon, int) or \
                not 1 <= max_horizon <= predictor.config.max_frames:
            # above max_frames no request can reach it, but the cache was sized for it
            raise ValueError(f"max_horizon={max_horizon!r}: give an integer from 1 to the "
                             f"predictor's max_frames={predictor.config.max_frames}")
        self.predictor = predictor.eval()
        self.max_horizon = max_horizon
        self.node = PredictorNode(self.predictor, max_horizon, max_batch)
        self.nodes = [GraphNode("predictor", ["frames", "states", "actions", "horizon"],
                                ["frames", "states", GraphEdge(EMIT, "state"),
                                 GraphEdge(EMIT, "frame")])]
        self.walks = {"rollout": DynamicLoop("predictor", max_horizon, LOOP,
                                             outputs=["frames", "states"])}
        self.submodules = {"predictor": self.node}
        self.engines = {"predictor": "world_model"}
        block = predictor.config.block_tokens
        self.engine_specs = {"world_model": engine or KVCacheEngine(
            page_size=block, num_pages=4 * (max_horizon + 8), max_batch=max_batch,
            max_tokens_per_step=max(4096, 8 * block))}

    def validate_inputs(self, inputs: Mapping[str, Any]) -> None:
        check_rollout_inputs(self.predictor.config, inputs, self.max_horizon)

    @staticmethod
    def from_pretrained(path: Union[str, os.PathLike], dtype: Optional[torch.dtype] = None,
                        device: str = "cpu", progress: bool = True, **kwargs: Any) -> "WorldModel":
        """Serves the predictor saved in ``path`` (see ``world_model_layers.save_world_model``)."""
        return WorldModel(load_world_model(path, dtype, device, progress), **kwargs)


@torch.inference_mode()
def rollout_recompute(predictor: Predictor, frames: torch.Tensor, states: torch.Tensor,
                      actions: torch.Tensor, horizon: Optional[int] = None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """The upstream planning loop: at every step, run the predictor over the whole context so
    far (observed and predicted frames) with a dense block-causal mask, and keep the last
    block's prediction. Returns (states ``[H, S]``, frames ``[H, N, E]``)."""
    r = check_rollout_inputs(predictor.config, {"frames": frames, "states": states,
                                                "actions": actions, "horizon": horizon},
                             None, predictor.device, predictor.dtype)
    f = predictor.config.block_tokens
    zs, ss = r.frames, r.states
    out_states, out_frames = [], []
    for k in range(r.horizon):
        t = zs.shape[0]
        x = predictor.embed(zs, ss, r.actions[:t])
        mask = block_causal_mask(t * f, f, predictor.device)
        out = predictor(x, torch.arange(t * f, device=predictor.device), DenseAttention(mask))
        z, s = predictor.predict(out[-f:], ss[-1], r.actions[t - 1])
        zs, ss = torch.cat([zs, z[None]]), torch.cat([ss, s[None]])
        out_states.append(s)
        out_frames.append(z)
    return torch.stack(out_states), torch.stack(out_frames)

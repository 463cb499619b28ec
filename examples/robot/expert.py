"""The scripted expert (analytic IK plus a smooth time-indexed approach) and a simulated-time
chunked rollout, shared by training and the tests.

expert_chunk(obs) plans H joint set-points for ticks t0 .. t0 + H - 1, where t0 is the tick the
observation was taken at: a_k = goal + (q - goal) * exp(-(k + 1) * dt / TAU). The plan is an
exponential approach, not a step, so that (a) consecutive chunks from nearby states agree, which
keeps chunk switches smooth, and (b) the residual a_k - q is (goal - q) times a fixed profile —
easy for a small MLP to learn to the ~1 cm accuracy the task needs.

rollout() runs the closed loop the demo runs — an ActionChunkBuffer popped once per tick, a new
chunk requested when fewer than H/2 actions remain and published `delay` ticks after its
observation — but on simulated ticks in one thread, as fast as the CPU goes. Training uses it to
visit the states chunked, delayed execution really produces (with perturbations), and the tests
use it to check the expert.
"""

from __future__ import annotations

from typing import Callable, Optional

import numpy as np

import mstar_rt
from arm_env import ACTION_DIM, TIMESTEP, ArmEnv, inverse_kinematics

HORIZON = 20  # H: actions per chunk (0.4 s at 50 Hz, comfortably more than 2 x the 5-tick delay)
RATE_HZ = 50.0  # the control rate the expert's time constant and the training data assume
TAU = 0.12  # s: time constant of the planned approach (the servo itself settles in ~0.3 s)


def expert_chunk(obs: np.ndarray, horizon: int = HORIZON, rate_hz: float = RATE_HZ) -> np.ndarray:
    """(H, 2) float32 joint set-points from one observation (q, qd, target, ee); a batch of
    observations (N, 8) gives (N, H, 2)."""
    q = np.asarray(obs, dtype=np.float64)[..., None, 0:2]
    goal = inverse_kinematics(np.asarray(obs)[..., None, 4:6])
    k = np.arange(1, horizon + 1)[:, None]
    return (goal + (q - goal) * np.exp(-k / (rate_hz * TAU))).astype(np.float32)




def actions_left(buffer: mstar_rt.ActionChunkBuffer, tick: int) -> int:
    """How many planned actions are left from `tick` on (call it from the loop's thread)."""
    return len(buffer.remaining(tick))


def substeps(rate_hz: float) -> int:
    """Physics steps per control tick."""
    return max(1, int(round(1.0 / (rate_hz * TIMESTEP))))


def rollout(env: ArmEnv, chunk_fn: Callable[[np.ndarray], np.ndarray], seed: int, delay: int = 0,
            mode: str = "rtc", max_ticks: int = 150, rate_hz: float = RATE_HZ,
            action_noise: float = 0.0, rng: Optional[np.random.Generator] = None,
            record: Optional[list] = None, stop_on_success: bool = True) -> tuple[bool, int]:
    """One episode of chunked execution on simulated ticks; returns (success, ticks used).

    chunk_fn(obs) -> (H, A) is the policy. `delay` is the injected inference delay in ticks (the
    chunk from the observation at tick t0 is published just before tick t0 + delay).
    `action_noise` (rad, Gaussian, held for a few ticks) perturbs the executed set-points so the
    states visited stray off the expert's path — what lets behaviour cloning recover from its own
    errors. Every observation is appended to `record` when given.
    """
    rng = rng or np.random.default_rng(seed)
    buffer = mstar_rt.ActionChunkBuffer(horizon=HORIZON, action_dim=ACTION_DIM, mode=mode)
    obs = env.reset(seed)
    n_sub = substeps(rate_hz)
    pending: list[tuple[int, np.ndarray, int]] = []  # (publish at tick, chunk, obs tick)
    noise = np.zeros(ACTION_DIM)
    for tick in range(max_ticks):
        # Ask for a chunk when the plan runs low and none is on its way (as the demo's thread).
        if record is not None:
            record.append(obs)
        if not pending and actions_left(buffer, tick) < HORIZON // 2:
            pending.append((tick + delay, chunk_fn(obs), tick))
        while pending and pending[0][0] <= tick:
            _, chunk, obs_tick = pending.pop(0)
            buffer.publish(chunk, obs_tick)
        action, _fresh = buffer.pop(tick)
        if action_noise > 0 and tick % 5 == 0:
            noise = rng.normal(0.0, action_noise, ACTION_DIM)
        env.apply(action + noise)
        env.step_physics(n_sub)
        obs = env.observe()
        if stop_on_success and env.success():
            return True, tick + 1
    return env.success(), max_ticks

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

from typing import Callable, Iterable, Optional

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


def expert_continuation(obs: np.ndarray, plan: np.ndarray, delay: np.ndarray,
                        horizon: int = HORIZON, rate_hz: float = RATE_HZ) -> np.ndarray:
    """The expert's chunk when its first `delay` actions are already fixed (real-time chunking):
    (N, H, 2) for observations (N, 8), fixed plans (N, >= max delay, 2) and delays (N,). Rows
    below d are the plan's; from d on the same exponential approach continues from the last
    fixed set-point (from q when d = 0, which is expert_chunk). Continuing the plan rather than
    restarting from the measured q (which lags the servo's set-point) is what keeps a switch
    smooth: with the goal unchanged, the continuation is the old plan itself."""
    obs = np.asarray(obs, dtype=np.float64)
    plan = np.asarray(plan, dtype=np.float64)
    d = np.asarray(delay, dtype=np.int64)
    n = len(obs)
    goal = inverse_kinematics(obs[:, 4:6])[:, None]
    last = plan[np.arange(n), np.maximum(d - 1, 0)]
    start = np.where((d > 0)[:, None], last, obs[:, 0:2])[:, None]
    k = np.arange(horizon)[None, :, None]
    steps = (k - d[:, None, None] + 1) / (rate_hz * TAU)
    out = goal + (start - goal) * np.exp(-np.maximum(steps, 0))
    fixed = k < d[:, None, None]
    rows = np.minimum(np.arange(horizon), plan.shape[1] - 1)
    return np.where(fixed, plan[:, rows], out).astype(np.float32)


def substeps(rate_hz: float) -> int:
    """Physics steps per control tick."""
    return max(1, int(round(1.0 / (rate_hz * TIMESTEP))))


def rollout(env: ArmEnv, chunk_fn: Callable[[np.ndarray], np.ndarray], seed: int, delay: int = 0,
            mode: str = "rtc", max_ticks: int = 150, rate_hz: float = RATE_HZ,
            action_noise: float = 0.0, rng: Optional[np.random.Generator] = None,
            record: Optional[list] = None, stop_on_success: bool = True,
            horizon: int = HORIZON, plan_aware: bool = False,
            plans: Optional[list] = None) -> tuple[bool, int]:
    """One episode of chunked execution on simulated ticks; returns (success, ticks used).

    chunk_fn(obs) -> (H, A) is the policy. `delay` is the injected inference delay in ticks (the
    chunk from the observation at tick t0 is published just before tick t0 + delay).
    `action_noise` (rad, Gaussian, held for a few ticks) perturbs the executed set-points so the
    states visited stray off the expert's path — what lets behaviour cloning recover from its own
    errors. Every observation is appended to `record` when given.

    `horizon` is the buffer's H. With `plan_aware` the policy is called as chunk_fn(obs, delay,
    plan), plan being the actions the loop will still execute from the observation's tick on
    (what real-time chunking conditions on); `plans` collects that plan for every observation
    recorded.
    """
    rng = rng or np.random.default_rng(seed)
    buffer = mstar_rt.ActionChunkBuffer(horizon=horizon, action_dim=ACTION_DIM, mode=mode)
    obs = env.reset(seed)
    n_sub = substeps(rate_hz)
    pending: list[tuple[int, np.ndarray, int]] = []  # (publish at tick, chunk, obs tick)
    noise = np.zeros(ACTION_DIM)
    for tick in range(max_ticks):
        # Ask for a chunk when the plan runs low and none is on its way (as the demo's thread).
        plan = buffer.remaining(tick)  # pop(tick) has not run: this is the plan from tick on
        if record is not None:
            record.append(obs)
        if plans is not None:
            plans.append(plan)
        if not pending and len(plan) < horizon // 2:
            chunk = chunk_fn(obs, delay, plan) if plan_aware else chunk_fn(obs)
            pending.append((tick + delay, chunk, tick))
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


def success_rate(env: ArmEnv, chunk_fn: Callable, seeds: Iterable[int], delay: int,
                 **rollout_kw: object) -> tuple[float, float]:
    """(success rate, mean ticks to success) of rtc-merged rollouts (at most 150 ticks) from
    ``seeds`` — how the training scripts judge a policy on held-out seeds."""
    seeds = list(seeds)
    results = [rollout(env, chunk_fn, s, delay=delay, mode="rtc", max_ticks=150, **rollout_kw)
               for s in seeds]
    ok = [t for s, t in results if s]
    return len(ok) / len(seeds), float(np.mean(ok)) if ok else float("nan")

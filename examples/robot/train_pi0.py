"""Trains the miniature pi0 (examples/robot/pi0_policy.py) by behaviour cloning from the scripted
expert with the flow-matching loss and trained real-time chunking, and saves
examples/robot/pi0_weights/ (save_pi0's config.json + model.safetensors, and norm_stats.json).

1. Expert rollouts under the chunked, delayed execution the demo uses (random delay, merge mode
   rtc or latest, held set-point noise, episodes running past success). Each observation is
   recorded with the plan the loop still had to execute at that tick.
2. Flow matching with training-time RTC: per sample a delay d (0 .. H/2) and a flow time tau; the
   chunk's first d positions hold the recorded plan -- exactly what the served request freezes --
   at flow time 1, the others hold tau * a + (1 - tau) * noise at time tau, where the label a is
   the expert continuing from the frozen actions (expert.expert_continuation; a demonstration
   is one trajectory, so its prefix and continuation agree); the loss is the MSE of the expert's
   velocity against a - noise on the positions that are not frozen. tau is drawn
   half from the sampler's own Euler grid (i / num_steps), half from 1 - Beta(1.5, 1) (pi0's
   emphasis on the noisy end).
3. DAgger: the trained policy drives (plan-aware, with d), the expert labels what it visits, and
   training continues on the aggregate.
4. A held-out closed-loop check on simulated ticks at delays 0, 2, 5 and 8 (printed table).

Deterministic (seeded), one torch thread, a few minutes on 2 CPU cores:
    python examples/robot/train_pi0.py
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import time

import numpy as np

os.environ["OMP_NUM_THREADS"] = "1"  # tiny tensors: an OpenMP team only spins (see train_policy)
import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from arm_env import ArmEnv  # noqa: E402
from expert import expert_chunk, expert_continuation, rollout, success_rate  # noqa: E402
from pi0_policy import (HORIZON, MAX_DELAY, WEIGHTS_DIR, MiniPi0, NormStats,  # noqa: E402
                        batched_velocity, encode_prefix, frozen_mask, frozen_rows,
                        mini_pi0_config, pixels_for)
from mstar_rt.models.pi0_layers import Pi0Module  # noqa: E402
from training import add_common_args, fit, print_held_out, seeded  # noqa: E402

TRAIN_SEED0 = 200_000  # training episodes; the demo uses seeds 0, 1, 2, ...
EVAL_SEED0 = 50_000


class Data:
    """Observations with the plan the loop still held at each (padded to H by the hold)."""

    def __init__(self) -> None:
        self.obs: list[np.ndarray] = []
        self.plans: list[np.ndarray] = []

    def add(self, obs: list, plans: list) -> None:
        self.obs += obs
        self.plans += [frozen_rows(p, HORIZON, o) for p, o in zip(plans, obs)]

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        return np.asarray(self.obs, np.float32), np.asarray(self.plans, np.float32)


def collect(env: ArmEnv, data: Data, chunk_fn, plan_aware: bool, episodes: int, seed0: int,
            rng: np.random.Generator, noise_max: float, desc: str) -> None:
    for ep in tqdm(range(episodes), desc=desc, leave=False):
        obs: list = []
        plans: list = []
        rollout(env, chunk_fn, seed0 + ep, delay=int(rng.integers(0, MAX_DELAY - 1)),
                mode=str(rng.choice(["rtc", "latest"])), max_ticks=int(rng.integers(40, 80)),
                action_noise=float(rng.uniform(0.0, noise_max)), rng=rng, record=obs,
                stop_on_success=False, horizon=HORIZON, plan_aware=plan_aware, plans=plans)
        data.add(obs, plans)


def expert_fn(obs: np.ndarray, delay: int, plan: np.ndarray) -> np.ndarray:
    """The expert as the trained policy acts: continuing the d actions that will execute."""
    fixed = frozen_rows(plan, max(delay, 1), obs)[None]
    return expert_continuation(obs[None], fixed, np.array([delay]), horizon=HORIZON)[0]


class Trainer:
    def __init__(self, policy: MiniPi0, seed: int) -> None:
        self.policy = policy
        self.gen = torch.Generator().manual_seed(seed)
        self.beta = torch.distributions.Beta(torch.tensor(1.5), torch.tensor(1.0))

    def tensors(self, data: Data) -> dict:
        obs, plans = data.arrays()
        return dict(obs=obs, plan=plans, pixels=pixels_for(obs),
                    state=torch.from_numpy(self.policy.state(obs)))

    def loss(self, t: dict, idx: torch.Tensor) -> torch.Tensor:
        module: Pi0Module = self.policy.module
        n_steps = module.config.num_steps
        b = len(idx)
        d = torch.randint(0, MAX_DELAY + 1, (b,), generator=self.gen)
        d = torch.where(torch.rand(b, generator=self.gen) < 0.2, torch.zeros_like(d), d)
        # The label: the plan's first d actions, then the expert continuing from them.
        obs, i = t["obs"][idx.numpy()], idx.numpy()
        chunk = expert_continuation(obs, t["plan"][i], d.numpy(), horizon=HORIZON)
        a = torch.from_numpy(self.policy.to_model(chunk, obs))
        grid = torch.randint(0, n_steps, (b,), generator=self.gen).float() / n_steps
        torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=self.gen)))
        smooth = (1 - self.beta.sample((b,))).clamp(0, 0.999)
        tau = torch.where(torch.rand(b, generator=self.gen) < 0.5, grid, smooth)
        noise = torch.randn(a.shape, generator=self.gen)
        frozen = frozen_mask(d, HORIZON)
        x = torch.where(frozen[..., None], a, tau[:, None, None] * a
                        + (1 - tau[:, None, None]) * noise)
        times = torch.where(frozen, torch.ones_like(x[..., 0]), tau[:, None].expand(b, HORIZON))
        prefix = encode_prefix(module, t["pixels"][idx], t["state"][idx])
        v = batched_velocity(module, prefix, x, times)
        err = ((v - (a - noise)) ** 2).mean(-1)
        free = (~frozen).float()
        return (err * free).sum() / free.sum()

    def train(self, data: Data, steps: int, lr: float, batch: int, desc: str) -> float:
        t = self.tensors(data)
        module = self.policy.module
        return fit(module, lambda idx: self.loss(t, idx), len(t["state"]), steps, lr, batch,
                   self.gen, desc)


def policy_fn(policy: MiniPi0):
    """chunk_fn for plan-aware rollouts; a fresh noise seed per chunk, deterministic."""
    count = [0]

    def fn(obs: np.ndarray, delay: int, plan: np.ndarray) -> np.ndarray:
        count[0] += 1
        return policy.act(obs, min(delay, MAX_DELAY), plan, seed=count[0])
    return fn


def evaluate(policy: MiniPi0, env: ArmEnv, episodes: int,
             delays: tuple[int, ...] = (0, 2, 5, 8)) -> dict[int, tuple[float, float]]:
    seeds = range(EVAL_SEED0, EVAL_SEED0 + episodes)
    return {delay: success_rate(env, policy_fn(policy),
                                tqdm(seeds, desc=f"eval delay {delay}", leave=False), delay,
                                horizon=HORIZON, plan_aware=True)
            for delay in delays}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(parser, episodes=600, dagger_rounds=1, dagger_episodes=200, steps=2000,
                    steps_help="flow-matching steps (DAgger: half)", eval_episodes=50,
                    out=WEIGHTS_DIR)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--num-steps", type=int, default=5, help="flow (Euler) steps per chunk")
    args = parser.parse_args()

    rng = seeded()
    env = ArmEnv()
    start = time.perf_counter()

    data = Data()
    collect(env, data, expert_fn, True, args.episodes, TRAIN_SEED0, rng, 0.25, "expert rollouts")
    obs, _ = data.arrays()
    stats = NormStats.fit(obs, expert_chunk(obs, horizon=HORIZON))
    policy = MiniPi0(Pi0Module(mini_pi0_config(args.num_steps)), stats)
    trainer = Trainer(policy, seed=0)
    loss = trainer.train(data, args.steps, 3e-3, args.batch, "flow matching")
    print(f"BC: {len(data.obs)} samples, loss {loss:.3e} ({time.perf_counter() - start:.0f} s)")

    seed = TRAIN_SEED0 + args.episodes
    for r in range(args.dagger_rounds):
        collect(env, data, policy_fn(policy), True, args.dagger_episodes, seed, rng, 0.1,
                f"DAgger {r + 1} rollouts")
        seed += args.dagger_episodes
        loss = trainer.train(data, args.steps // 2, 1.5e-3, args.batch, f"DAgger {r + 1} training")
        print(f"DAgger round {r + 1}: {len(data.obs)} samples, loss {loss:.3e} "
              f"({time.perf_counter() - start:.0f} s)")

    policy.save(args.out)
    size = sum(f.stat().st_size for f in args.out.iterdir())
    params = sum(p.numel() for p in policy.module.parameters())
    print(f"saved {args.out} ({size / 1024:.0f} KB, {params} parameters) in "
          f"{time.perf_counter() - start:.0f} s")

    print_held_out(evaluate(policy, env, args.eval_episodes), args.eval_episodes,
                   "rtc, d and the plan passed to the policy")
    print(f"total {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()

"""Trains the tiny pi0 of LeRobot's architecture (examples/robot/pi0_real.py) by behaviour cloning
from the scripted expert with LeRobot's flow-matching loss, and saves examples/robot/
pi0_real_weights/ as a LeRobot checkpoint directory.

1. Expert rollouts under the chunked, delayed execution the demo uses (train_pi0.collect: random
   delay, merge mode rtc or latest, held set-point noise, episodes running past success). The
   label of an observation is what the expert executes from its tick on: its plan continued from
   the set-point the servo is given at that tick (expert.expert_continuation with d = 1; the
   measured joint angles lag that set-point), as offsets from the measured joint angles.
2. Flow matching as LeRobot's PI0Policy.forward trains pi0: x_t = t noise + (1 - t) actions with
   t ~ Beta(1.5, 1) * 0.999 + 0.001, the action expert's velocity against noise - actions, MSE
   over the action's own dimensions. One batched forward of the library's PiModule -- the backbone over
   image + prompt tokens, the expert over the state token and the action tokens with LeRobot's
   attention mask (prefix bidirectional; the state sees the prefix; actions see everything).
   No training-time RTC: the guidance is LeRobot's inference-time form.
3. DAgger: the policy drives (guided RTC with d and the plan, as served), the expert labels
   what it visits, training continues on the aggregate.
4. A held-out closed-loop check on simulated ticks at delays 0, 2, 5 and 8 with guided RTC:
   the saved directory reloaded, its chunks from pi0_real.sample_chunk (which the tests hold to
   the served walks and the library's LeRobot-order reference); a printed table.

Deterministic (seeded), one torch thread, a few minutes on 2 CPU cores:
    python examples/robot/train_pi0_real.py
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
import torch.nn.functional as F  # noqa: E402
from tqdm import tqdm  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from arm_env import ArmEnv  # noqa: E402
from expert import expert_continuation, success_rate  # noqa: E402
from mstar_rt.models.lerobot_pi0_io import PiProcessor, preprocess_image  # noqa: E402
from mstar_rt.models.lerobot_pi0_layers import PiModule  # noqa: E402
from mstar_rt.models.lerobot_pi0_load import LeRobotPi0  # noqa: E402
from pi0_real import (MAX_DELAY, TASK, WEIGHTS_DIR, RealPi0, feature_stats,  # noqa: E402
                      save_checkpoint, tiny_config, velocity)
from topdown import topdown_image  # noqa: E402
from train_pi0 import Data, collect, expert_fn  # noqa: E402
from training import add_common_args, fit, print_held_out, seeded  # noqa: E402

TRAIN_SEED0 = 300_000  # training episodes; the demo uses seeds 0, 1, 2, ... and train_pi0 200_000+
EVAL_SEED0 = 50_000


def labels(obs: np.ndarray, plans: np.ndarray, horizon: int) -> np.ndarray:
    """The expert's chunk [N, H, 2] from each observation's tick: the plan's set-point for that
    tick, then the expert's approach continued from it."""
    return expert_continuation(obs, plans, np.ones(len(obs), np.int64), horizon=horizon)


class Trainer:
    def __init__(self, module: PiModule, processor: PiProcessor, seed: int) -> None:
        self.module, self.processor = module, processor
        self.gen = torch.Generator().manual_seed(seed)
        self.beta = torch.distributions.Beta(torch.tensor(1.5), torch.tensor(1.0))
        self.ids = processor.tokens(processor.prompt(TASK))

    def tensors(self, data: Data) -> dict[str, torch.Tensor]:
        obs, plans = data.arrays()
        h = self.module.config.chunk_size
        delta = labels(obs, plans, h) - obs[:, None, 0:2]
        size = self.module.config.vision.image_size
        p = self.processor
        return dict(
            pixels=torch.stack([preprocess_image(topdown_image(o, size), size) for o in obs]),
            state=p.state.normalize(torch.from_numpy(obs)),
            actions=p.normalized_actions(torch.from_numpy(delta.reshape(-1, 2))).view(
                len(obs), h, -1))

    def loss(self, t: dict[str, torch.Tensor], idx: torch.Tensor) -> torch.Tensor:
        """LeRobot's PI0Pytorch.forward loss, averaged over the action's own dimensions."""
        actions = t["actions"][idx]
        b = len(idx)
        noise = torch.randn(actions.shape, generator=self.gen)
        torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=self.gen)))
        time_ = self.beta.sample((b,)) * 0.999 + 0.001
        x_t = time_[:, None, None] * noise + (1 - time_[:, None, None]) * actions
        v = velocity(self.module, t["pixels"][idx], self.ids, t["state"][idx], x_t, time_)
        return F.mse_loss(v, noise - actions)

    def train(self, data: Data, steps: int, lr: float, batch: int, desc: str) -> float:
        t = self.tensors(data)
        module = self.module
        return fit(module, lambda idx: self.loss(t, idx), len(t["state"]), steps, lr, batch,
                   self.gen, desc)


def policy_fn(policy: RealPi0):
    """chunk_fn for plan-aware rollouts: guided RTC with d and the plan; a fresh noise seed per
    chunk, deterministic."""
    count = [0]

    def fn(obs: np.ndarray, delay: int, plan: np.ndarray) -> np.ndarray:
        count[0] += 1
        return policy.act(obs, min(delay, MAX_DELAY), plan, seed=count[0])
    return fn


def evaluate(policy: RealPi0, env: ArmEnv, episodes: int,
             delays: tuple[int, ...] = (0, 2, 5, 8)) -> dict[int, tuple[float, float]]:
    seeds = range(EVAL_SEED0, EVAL_SEED0 + episodes)
    return {delay: success_rate(env, policy_fn(policy),
                                tqdm(seeds, desc=f"eval delay {delay}", leave=False), delay,
                                horizon=policy.horizon, plan_aware=True)
            for delay in delays}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(parser, episodes=600, dagger_rounds=1, dagger_episodes=150, steps=1500,
                    steps_help="flow-matching steps (DAgger: half)", eval_episodes=50,
                    out=WEIGHTS_DIR)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--num-steps", type=int, default=5, help="flow (Euler) steps per chunk")
    args = parser.parse_args()

    rng = seeded()
    env = ArmEnv()
    start = time.perf_counter()
    config = tiny_config(args.num_steps)

    data = Data()
    collect(env, data, expert_fn, True, args.episodes, TRAIN_SEED0, rng, 0.25, "expert rollouts")
    obs, plans = data.arrays()
    delta = labels(obs, plans, config.chunk_size) - obs[:, None, 0:2]
    stats = {"observation.state": feature_stats(obs), "action": feature_stats(delta.reshape(-1, 2))}
    module = PiModule(config)
    save_checkpoint(module, stats, args.out)  # the processor files: normalisation, tokenizer
    processor = PiProcessor.from_dir(args.out, config)
    trainer = Trainer(module, processor, seed=0)
    loss = trainer.train(data, args.steps, 3e-3, args.batch, "flow matching")
    print(f"BC: {len(data.obs)} samples, loss {loss:.3e} ({time.perf_counter() - start:.0f} s)")

    policy = RealPi0(LeRobotPi0(config, module, processor, str(args.out)))
    seed = TRAIN_SEED0 + args.episodes
    for r in range(args.dagger_rounds):
        collect(env, data, policy_fn(policy), True, args.dagger_episodes, seed, rng, 0.1,
                f"DAgger {r + 1} rollouts")
        seed += args.dagger_episodes
        loss = trainer.train(data, args.steps // 2, 1.5e-3, args.batch, f"DAgger {r + 1} training")
        print(f"DAgger round {r + 1}: {len(data.obs)} samples, loss {loss:.3e} "
              f"({time.perf_counter() - start:.0f} s)")

    save_checkpoint(module, stats, args.out)
    size = sum(f.stat().st_size for f in args.out.rglob("*") if f.is_file())
    params = sum(p.numel() for p in module.parameters())
    print(f"saved {args.out} ({size / 1024:.0f} KB, {params} parameters) in "
          f"{time.perf_counter() - start:.0f} s")

    print_held_out(evaluate(RealPi0.load(args.out), env, args.eval_episodes),
                   args.eval_episodes, "guided RTC, d and the plan passed to the policy; the "
                   "saved directory reloaded")
    print(f"total {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()

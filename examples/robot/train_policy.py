"""Trains the chunk policy by behaviour cloning from the scripted expert (with DAgger rounds) and
saves examples/robot/policy.safetensors.

1. Expert rollouts under the same chunked, delayed execution the demo uses (random delay 0-6
   ticks, merge mode rtc or latest) with set-point noise held for a few ticks, so the data covers
   states off the expert's own path — and episodes run past success, so settling at the target
   (where the 2 cm accuracy is decided) is well covered.
2. Behaviour cloning: every recorded observation is labelled with the expert's chunk for it;
   the MLP regresses the normalised residual chunk (MSE).
3. DAgger: the trained policy drives (same delays and a little noise), the expert labels the
   states it visits, the data is aggregated and training continues. This fixes the compounding
   error plain BC suffers from in closed loop.
4. Evaluation on held-out seeds at delay 0, 2, 5 (simulated ticks; fast), printed as a table.

Runs in well under 2 minutes on 2 CPU cores (one torch thread):  python examples/robot/train_policy.py
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import time

import numpy as np

# One thread, set before torch loads. The network is tiny (batch 512 x 128 wide): a second
# OpenMP thread buys little, and on a busy 2-core machine its spin-waiting team slowed training
# ~10x and batch-1 rollout inference ~50x. One thread keeps the run well under 2 minutes.
os.environ["OMP_NUM_THREADS"] = "1"
import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from arm_env import ArmEnv  # noqa: E402
from expert import HORIZON, expert_chunk, rollout, success_rate  # noqa: E402
from policy import WEIGHTS, ChunkMLP  # noqa: E402
from training import add_common_args, print_held_out, seeded  # noqa: E402

TRAIN_SEED0 = 100_000  # training episodes use seeds from here on; the demo uses 0, 1, 2, ...
EVAL_SEED0 = 50_000


def collect(env: ArmEnv, chunk_fn, episodes: int, seed0: int, rng: np.random.Generator,
            noise_max: float, desc: str) -> np.ndarray:
    """Observations visited by `chunk_fn` driving chunked, delayed, perturbed episodes."""
    record: list = []
    for ep in tqdm(range(episodes), desc=desc, leave=False):
        rollout(env, chunk_fn, seed0 + ep, delay=int(rng.integers(0, 7)),
                mode=str(rng.choice(["rtc", "latest"])), max_ticks=int(rng.integers(35, 70)),
                action_noise=float(rng.uniform(0.0, noise_max)), rng=rng, record=record,
                stop_on_success=False)
    return np.asarray(record, np.float32)


def train(net: ChunkMLP, obs: np.ndarray, steps: int, lr: float, batch: int, desc: str) -> float:
    """Adam on the normalised residual MSE, cosine learning-rate decay; returns the last loss."""
    target = expert_chunk(obs) - obs[:, None, 0:2]  # the residual the network predicts
    x = net.normalize(torch.from_numpy(obs))
    y = (torch.from_numpy(target.reshape(len(obs), -1)) - net.out_mean) / net.out_std
    opt = torch.optim.Adam(net.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps, eta_min=lr * 0.02)
    gen = torch.Generator().manual_seed(0)
    net.train()
    avg = None
    bar = tqdm(range(steps), desc=desc, leave=False)
    for step in bar:
        idx = torch.randint(0, len(x), (batch,), generator=gen)
        loss = torch.nn.functional.mse_loss(net(x[idx]), y[idx])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        avg = loss.item() if avg is None else 0.98 * avg + 0.02 * loss.item()
        if step % 200 == 0:
            bar.set_postfix(loss=f"{avg:.2e}")
    net.eval()
    return float(avg)


def evaluate(net: ChunkMLP, env: ArmEnv, episodes: int) -> dict[int, tuple[float, float]]:
    """delay -> (success rate, mean ticks to success) on held-out seeds, rtc merging."""
    return {delay: success_rate(env, net.act, range(EVAL_SEED0, EVAL_SEED0 + episodes), delay)
            for delay in (0, 2, 5)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(parser, episodes=800, dagger_rounds=2, dagger_episodes=300, steps=3000,
                    steps_help="BC steps (DAgger rounds: half)", eval_episodes=100, out=WEIGHTS)
    parser.add_argument("--hidden", type=int, default=128)
    args = parser.parse_args()

    rng = seeded()
    env = ArmEnv()
    start = time.perf_counter()

    obs = collect(env, expert_chunk, args.episodes, TRAIN_SEED0, rng, 0.25, "expert rollouts")
    net = ChunkMLP(horizon=HORIZON, hidden=args.hidden)
    net.set_stats(obs, expert_chunk(obs) - obs[:, None, 0:2])  # fixed from the expert data
    loss = train(net, obs, args.steps, 2e-3, 512, "behaviour cloning")
    print(f"BC: {len(obs)} samples, loss {loss:.2e}")

    seed = TRAIN_SEED0 + args.episodes
    for r in range(args.dagger_rounds):
        new = collect(env, net.act, args.dagger_episodes, seed, rng, 0.1, f"DAgger {r + 1} rollouts")
        seed += args.dagger_episodes
        obs = np.concatenate([obs, new])
        loss = train(net, obs, args.steps // 2, 1e-3, 512, f"DAgger {r + 1} training")
        print(f"DAgger round {r + 1}: {len(obs)} samples, loss {loss:.2e}")

    net.save(args.out)
    train_s = time.perf_counter() - start
    print(f"saved {args.out} ({args.out.stat().st_size / 1024:.0f} KB, "
          f"{sum(p.numel() for p in net.parameters())} parameters) in {train_s:.0f} s")

    print_held_out(evaluate(net, env, args.eval_episodes), args.eval_episodes, "rtc")
    print(f"total {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()

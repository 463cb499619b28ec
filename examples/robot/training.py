"""What the two training scripts (train_policy.py, train_pi0.py) share: their command line, the
seeding that makes reruns bit-identical, and the held-out report."""

from __future__ import annotations

import argparse
import pathlib
from typing import Callable

import numpy as np
import torch


def add_common_args(parser: argparse.ArgumentParser, *, episodes: int, dagger_rounds: int,
                    dagger_episodes: int, steps: int, steps_help: str, eval_episodes: int,
                    out: pathlib.Path) -> None:
    parser.add_argument("--episodes", type=int, default=episodes, help="expert episodes")
    parser.add_argument("--dagger-rounds", type=int, default=dagger_rounds)
    parser.add_argument("--dagger-episodes", type=int, default=dagger_episodes)
    parser.add_argument("--steps", type=int, default=steps, help=steps_help)
    parser.add_argument("--eval-episodes", type=int, default=eval_episodes)
    parser.add_argument("--out", type=pathlib.Path, default=out)


def seeded() -> np.random.Generator:
    """Fixed seeds and one torch thread (tiny tensors); the rollout noise generator."""
    torch.manual_seed(0)
    torch.set_num_threads(1)
    return np.random.default_rng(0)


def print_held_out(results: dict[int, tuple[float, float]], episodes: int, detail: str) -> None:
    print(f"\nheld-out closed-loop check ({episodes} episodes, simulated ticks, {detail}):")
    print(f"{'delay':>5}  {'success':>8}  {'ticks to success':>16}")
    for delay, (rate, ticks) in results.items():
        print(f"{delay:>5}  {rate:>8.0%}  {ticks:>16.1f}")


def fit(module: torch.nn.Module, loss: Callable[[torch.Tensor], torch.Tensor], samples: int,
        steps: int, lr: float, batch: int, gen: torch.Generator, desc: str) -> float:
    """AdamW with a one-cycle schedule and gradient clipping over random minibatches of sample
    indices (``loss(idx)``); returns the smoothed final loss. Leaves the module in eval mode."""
    from tqdm import tqdm

    opt = torch.optim.AdamW(module.parameters(), lr=lr, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, lr, total_steps=steps, pct_start=0.05)
    module.train()
    avg = None
    bar = tqdm(range(steps), desc=desc, leave=False)
    for step in bar:
        idx = torch.randint(0, samples, (batch,), generator=gen)
        value = loss(idx)
        opt.zero_grad(set_to_none=True)
        value.backward()
        torch.nn.utils.clip_grad_norm_(module.parameters(), 1.0)
        opt.step()
        sched.step()
        avg = value.item() if avg is None else 0.98 * avg + 0.02 * value.item()
        if step % 100 == 0:
            bar.set_postfix(loss=f"{avg:.3e}")
    module.eval()
    return float(avg)

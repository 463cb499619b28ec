"""What the two training scripts (train_policy.py, train_pi0.py) share: their command line, the
seeding that makes reruns bit-identical, and the held-out report."""

from __future__ import annotations

import argparse
import pathlib

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

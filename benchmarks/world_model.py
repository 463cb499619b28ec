#!/usr/bin/env python3
"""World-model rollout benchmark: the ``rollout`` walk (a DynamicLoop over a KV-cached
block-causal predictor, one new frame block per step) against the upstream V-JEPA 2-AC planning
loop, which recomputes the whole growing context at every step, at horizons 4, 15 and 30.

    python benchmarks/world_model.py [--quick] [--out benchmarks/results/world_model.json]

Both sides run the same random-weight predictor (MODEL below: the V-JEPA 2-AC predictor's layout
scaled for a CPU -- 12x12 patch tokens + an action and a state token per frame, 2 layers of
width 256 instead of 24 of 1024), float32, one observed frame, one request at a time, one torch
thread each (the engine's worker uses one on small CPUs; the baseline is set to match). Each
cell is timed after a warm-up; cells alternate sides and the figures are medians. Every pair of
runs on the same inputs is compared (max_abs_diff_states, and relative to the largest state).
``speedup_h30`` = recompute latency / rollout-walk latency at H = 30 (target >= 15; M* reports
12.5 on an H100 for the full-size model).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

import mstar_rt
from mstar_rt.engines import KVCacheEngine
from mstar_rt.models.world_model import WorldModel, rollout_recompute
from mstar_rt.models.world_model_layers import WorldModelConfig, random_world_model

from bench_common import machine  # noqa: E402  (benchmarks/ is on sys.path)

try:
    from tqdm import tqdm
except ImportError:
    tqdm = None

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "world_model.json"
HORIZONS = (4, 15, 30)
MODEL = dict(embed_dim=256, hidden_size=256, num_layers=2, num_heads=4, grid=(12, 12),
             action_dim=7, state_dim=7, max_frames=40)
TINY = dict(embed_dim=32, hidden_size=64, num_layers=2, num_heads=4, grid=(4, 4),
            action_dim=7, state_dim=7, max_frames=40)
FULL = dict(reps=3)
QUICK = dict(reps=1)
TARGET = 15.0
TIMEOUT_S = 600.0


def make_inputs(c: WorldModelConfig, horizon: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return dict(frames=torch.randn(1, c.num_patches, c.embed_dim, generator=g),
                states=torch.randn(1, c.state_dim, generator=g),
                actions=0.1 * torch.randn(horizon, c.action_dim, generator=g), horizon=horizon)


def run_ours(rt: mstar_rt.Runtime, inputs: dict) -> tuple[float, torch.Tensor]:
    t0 = time.perf_counter()
    out = rt.submit(inputs).result(timeout=TIMEOUT_S)
    dt = time.perf_counter() - t0
    if len(out["state"]) != inputs["horizon"]:
        raise AssertionError(f"rollout gave {len(out['state'])} states for horizon "
                             f"{inputs['horizon']}")
    return dt, torch.stack(out["state"])


def run_recompute(predictor: Any, inputs: dict) -> tuple[float, torch.Tensor]:
    t0 = time.perf_counter()
    states, _frames = rollout_recompute(predictor, inputs["frames"], inputs["states"],
                                        inputs["actions"], inputs["horizon"])
    return time.perf_counter() - t0, states


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="one repetition (under a minute)")
    ap.add_argument("--tiny", action="store_true",
                    help="a tiny predictor (a smoke test of the script, not a measurement)")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = ap.parse_args()
    cfg = QUICK if args.quick else FULL
    torch.set_num_threads(1)
    config = WorldModelConfig(**(TINY if args.tiny else MODEL))
    predictor = random_world_model(config, seed=0)
    params_m = sum(p.numel() for p in predictor.parameters()) / 1e6
    block = config.block_tokens
    engine = KVCacheEngine(page_size=block, num_pages=2 * (max(HORIZONS) + 2), max_batch=8,
                           max_tokens_per_step=8 * block)
    model = WorldModel(predictor, max_horizon=max(HORIZONS), engine=engine)

    times: dict[tuple[str, int], list[float]] = {}
    worst_diff = worst_rel = 0.0
    outputs: dict[tuple[str, int, int], torch.Tensor] = {}
    cells = [(kind, h) for h in HORIZONS for kind in ("ours", "recompute")]
    bar = tqdm(total=len(cells) * cfg["reps"], desc="world_model", unit="run") if tqdm else None
    with mstar_rt.Runtime(model) as rt:
        for h in HORIZONS[:1]:  # warm-up of both sides
            run_ours(rt, make_inputs(config, h, 99))
            run_recompute(predictor, make_inputs(config, h, 99))
        for rep in range(cfg["reps"]):
            for kind, h in (cells if rep % 2 == 0 else cells[::-1]):
                inputs = make_inputs(config, h, rep)
                dt, states = (run_ours(rt, inputs) if kind == "ours"
                              else run_recompute(predictor, inputs))
                times.setdefault((kind, h), []).append(dt)
                outputs[(kind, h, rep)] = states
                other = outputs.get(("recompute" if kind == "ours" else "ours", h, rep))
                if other is not None:  # both sides ran the same inputs: compare them
                    diff = float((states - other).abs().max())
                    worst_diff = max(worst_diff, diff)
                    worst_rel = max(worst_rel, diff / float(other.abs().max()))
                if bar:
                    bar.set_postfix_str(f"{kind} H={h} {dt * 1e3:.0f} ms", refresh=False)
                    bar.update(1)
        leaked = engine.cache.num_pages - engine.cache.free_pages
    if bar:
        bar.close()

    med = statistics.median
    figures: dict[str, Any] = {}
    ratios: dict[str, float] = {}
    for h in HORIZONS:
        ours, base = med(times[("ours", h)]), med(times[("recompute", h)])
        figures[f"rollout_ms_h{h}"] = round(ours * 1e3, 2)
        figures[f"recompute_ms_h{h}"] = round(base * 1e3, 2)
        figures[f"rollout_ms_per_step_h{h}"] = round(ours * 1e3 / h, 2)
        ratios[f"speedup_h{h}"] = round(base / ours, 2)
    figures.update({
        "max_abs_diff_states": worst_diff,
        "max_rel_diff_states": worst_rel,
        "kv_pages_leaked": leaked,
        "params_millions": round(params_m, 2),
        "tokens_per_frame": block,
        "torch_threads": torch.get_num_threads(),
        "reps": cfg["reps"],
    })
    result = {"name": "world_model", "quick": bool(args.quick), "machine": machine(),
              "config": {**config.to_dict(), "grid": list(config.grid)},
              "figures": figures, "ratios": ratios}

    print(f"\npredictor: {config.num_layers} layers x {config.hidden_size} wide, "
          f"{config.num_heads} heads, {config.num_patches} patches + 2 tokens per frame, "
          f"{params_m:.1f} M params, float32, {figures['torch_threads']} torch thread")
    print(f"{'horizon':>8}{'rollout walk ms':>17}{'recompute ms':>14}{'speedup':>9}")
    for h in HORIZONS:
        print(f"{h:>8}{figures[f'rollout_ms_h{h}']:>17.1f}{figures[f'recompute_ms_h{h}']:>14.1f}"
              f"{ratios[f'speedup_h{h}']:>9.2f}")
    print(f"states max |ours - recompute| = {worst_diff:.2e} ({worst_rel:.1e} of max |state|); "
          f"KV pages still held: {leaked}")
    verdict = "met" if ratios["speedup_h30"] >= TARGET else "NOT met"
    print(f"target speedup_h30 >= {TARGET:g}: {ratios['speedup_h30']:.2f} ({verdict})")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")
    plot(args.out.with_suffix(".png"), figures, ratios, config)
    return 0


def plot(path: Path, figures: dict, ratios: dict, config: WorldModelConfig) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ours = [figures[f"rollout_ms_h{h}"] for h in HORIZONS]
    base = [figures[f"recompute_ms_h{h}"] for h in HORIZONS]
    ax.plot(HORIZONS, base, "o-", color="tab:red", label="recompute the context every step")
    ax.plot(HORIZONS, ours, "o-", color="tab:green", label="rollout walk (KV DynamicLoop)")
    for h, o, b in zip(HORIZONS, ours, base):
        ax.annotate(f"{ratios[f'speedup_h{h}']:.1f}x", (h, b), xytext=(4, -12),
                    textcoords="offset points", fontsize=8)
    ax.set_yscale("log")
    ax.set_xlabel("horizon (predicted frames)")
    ax.set_ylabel("rollout latency, ms (log)")
    ax.set_title(f"world-model rollout, {config.num_layers}L x {config.hidden_size}, "
                 f"{config.block_tokens} tokens/frame", fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""VLA action-chunk benchmark: the pi0-style policy served as walks (image encoder and prefix
once, into the KV cache; 10 flow steps of the action expert reading it) against the plain
forward that recomputes the images and the prefix at every flow step.

    python benchmarks/vla.py [--quick] [--out benchmarks/results/vla.json]

Both sides run the same random-weight model (MODEL below: pi0's shapes scaled for a CPU --
three 224 px camera images (14x14 SigLIP patches each), a 20-token prompt and a state token in the prefix, a
50 x 32 action chunk, 10 flow steps), float32, one request at a time, one torch thread each.
Latency = submit to chunk (ours) or the whole call (recompute), medians over the repetitions,
cells alternating. Every pair of runs on the same inputs is compared (max_abs_diff_actions).
``prefix_reuse_speedup`` = recompute latency / ours.

Then (not with --tiny) the real pi0 architecture side by side with LeRobot's own
``predict_action_chunk`` on one checkpoint (benchmarks/vla_lerobot.py): ratios
``lerobot_over_ours_latency_1robot`` and ``lerobot_over_ours_throughput_8robots``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench_common import machine, use_source_tree  # noqa: E402  (benchmarks/ is on sys.path)

# this checkout's package when it is built in place (as vla_lerobot.py, which the LeRobot
# section imports: both must see the same mstar_rt, or that import fails)
use_source_tree()
import mstar_rt  # noqa: E402
from mstar_rt.engines import KVCacheEngine  # noqa: E402
from mstar_rt.models.pi0 import Pi0Policy, sample_actions_recompute  # noqa: E402
from mstar_rt.models.pi0_layers import Pi0Config, random_pi0  # noqa: E402
from mstar_rt.models.siglip import SiglipConfig  # noqa: E402

try:
    from tqdm import tqdm
except ImportError:
    tqdm = None

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "vla.json"
CAMERAS, PROMPT_TOKENS = 3, 20
MODEL = dict(vision=SiglipConfig(hidden_size=192, intermediate_size=768, num_layers=4,
                                 num_heads=3, image_size=224, patch_size=16),
             vocab_size=1024, width=512, mlp_width=2048, num_layers=6, num_heads=8,
             num_kv_heads=1, head_dim=64, expert_width=256, expert_mlp_width=1024,
             state_dim=32, action_dim=32, action_horizon=50, num_steps=10)
TINY = dict()  # Pi0Config's defaults: a smoke test of the script, not a measurement
FULL = dict(reps=5)
QUICK = dict(reps=1)
TIMEOUT_S = 600.0


def make_inputs(c: Pi0Config, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    g = torch.Generator().manual_seed(seed)
    return dict(images=[rng.integers(0, 256, (240, 320, 3), dtype=np.uint8)
                        for _ in range(min(CAMERAS, c.max_images))],
                prompt=rng.integers(0, c.vocab_size, min(PROMPT_TOKENS, c.max_prompt_tokens)).tolist(),
                state=torch.randn(c.state_dim, generator=g),
                noise=torch.randn(c.action_horizon, c.action_dim, generator=g))


def run_ours(rt: mstar_rt.Runtime, inputs: dict) -> tuple[float, torch.Tensor, dict]:
    t0 = time.perf_counter()
    h = rt.submit(inputs)
    chunk = h.result(timeout=TIMEOUT_S)["actions"][0]
    dt = time.perf_counter() - t0
    busy: dict[str, float] = {}
    for s in h.stats():
        busy[s["node"]] = busy.get(s["node"], 0.0) + s["finished"] - s["started"]
    return dt, chunk, busy


def run_recompute(module: Any, inputs: dict) -> tuple[float, torch.Tensor]:
    t0 = time.perf_counter()
    chunk = sample_actions_recompute(module, inputs)
    return time.perf_counter() - t0, chunk


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="one repetition (under a minute)")
    ap.add_argument("--tiny", action="store_true",
                    help="a tiny model (a smoke test of the script, not a measurement)")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = ap.parse_args()
    cfg = QUICK if args.quick else FULL
    torch.set_num_threads(1)
    config = Pi0Config(**(TINY if args.tiny else MODEL))
    module = random_pi0(config, seed=0, std=0.02)
    params_m = sum(p.numel() for p in module.parameters()) / 1e6
    expert_m = sum(p.numel() for n, p in module.named_parameters()
                   if n.startswith(("expert", "action"))) / 1e6
    engine = KVCacheEngine(page_size=16, num_pages=2 * -(-config.max_prefix // 16), max_batch=4)
    policy = Pi0Policy(module, engine=engine, max_batch=4)

    ours_t: list[float] = []
    base_t: list[float] = []
    node_busy: dict[str, list[float]] = {}
    worst = 0.0
    bar = tqdm(total=3 * cfg["reps"] + 1, desc="vla", unit="run") if tqdm else None
    with mstar_rt.Runtime(policy) as rt:
        warm = make_inputs(config, 99)
        run_ours(rt, warm)
        run_recompute(module, warm)
        for rep in range(cfg["reps"]):
            inputs = make_inputs(config, rep)
            chunks = {}
            for kind in (("ours", "recompute") if rep % 2 == 0 else ("recompute", "ours")):
                if kind == "ours":
                    dt, chunks[kind], busy = run_ours(rt, inputs)
                    ours_t.append(dt)
                    for node, s in busy.items():
                        node_busy.setdefault(node, []).append(s)
                else:
                    dt, chunks[kind] = run_recompute(module, inputs)
                    base_t.append(dt)
                if bar:
                    bar.set_postfix_str(f"{kind} {dt * 1e3:.0f} ms", refresh=False)
                    bar.update(1)
            worst = max(worst, float((chunks["ours"] - chunks["recompute"]).abs().max()))
        leaked = engine.cache.num_pages - engine.cache.free_pages
    # The guided real-time-chunking form on the same inputs plus a previous chunk (delay 5):
    # what its backward pass per flow step costs against the trained form's plain steps.
    guided_busy: list[float] = []
    guided = Pi0Policy(module, engine=KVCacheEngine(page_size=16, num_pages=engine.num_pages,
                                                    max_batch=4), max_batch=4, rtc="guided")
    with mstar_rt.Runtime(guided) as rt:
        for rep in range(cfg["reps"] + 1):
            inputs = make_inputs(config, rep)
            inputs.update(delay=5, prev_actions=torch.flip(inputs["noise"], [0]))
            _dt, _chunk, busy = run_ours(rt, inputs)
            if rep:  # the first run warms up the backward pass
                guided_busy.append(busy["denoise"])
            if bar:
                bar.set_postfix_str(f"guided {_dt * 1e3:.0f} ms", refresh=False)
                bar.update(1)
    if bar:
        bar.close()

    med = statistics.median
    ours, base = med(ours_t), med(base_t)
    prefix_tokens = (min(CAMERAS, config.max_images) * config.vision.num_patches
                     + min(PROMPT_TOKENS, config.max_prompt_tokens) + 1)
    figures: dict[str, Any] = {
        "chunk_ms_prefix_reuse": round(ours * 1e3, 2),
        "chunk_ms_recompute": round(base * 1e3, 2),
        "vision_node_ms": round(med(node_busy["vision"]) * 1e3, 2),
        "prefix_node_ms": round(med(node_busy["prefix"]) * 1e3, 2),
        "flow_steps_ms_total": round(med(node_busy["denoise"]) * 1e3, 2),
        "flow_steps_ms_total_guided_rtc": round(med(guided_busy) * 1e3, 2),
        "max_abs_diff_actions": worst,
        "kv_pages_leaked": leaked,
        "prefix_tokens": prefix_tokens,
        "action_chunk": [config.action_horizon, config.action_dim],
        "flow_steps": config.num_steps,
        "params_millions": round(params_m, 2),
        "expert_params_millions": round(expert_m, 2),
        "torch_threads": torch.get_num_threads(),
        "reps": cfg["reps"],
    }
    ratios = {"prefix_reuse_speedup": round(base / ours, 2)}
    result = {"name": "vla", "quick": bool(args.quick), "machine": machine(),
              "config": config.to_dict(), "figures": figures, "ratios": ratios}
    if not args.tiny:  # the real pi0 architecture against LeRobot itself (vla_lerobot.py)
        from vla_lerobot import plot as plot_lerobot
        from vla_lerobot import report as report_lerobot
        from vla_lerobot import run as run_lerobot

        side = run_lerobot(args.quick)
        report_lerobot(side)
        result["lerobot"] = side
        ratios.update(side["ratios"])
        plot_lerobot(args.out.with_name("vla_lerobot.png"), side)

    print(f"\nmodel: {params_m:.1f} M params (expert {expert_m:.1f} M), prefix {prefix_tokens} "
          f"tokens, chunk {config.action_horizon} x {config.action_dim}, {config.num_steps} flow "
          f"steps, float32, {figures['torch_threads']} torch thread")
    print(f"{'':<34}{'ms':>10}")
    print(f"{'prefix reuse (walks)':<34}{figures['chunk_ms_prefix_reuse']:>10.1f}")
    print(f"{'  vision node':<34}{figures['vision_node_ms']:>10.1f}")
    print(f"{'  prefix node':<34}{figures['prefix_node_ms']:>10.1f}")
    print(f"{'  flow steps (all)':<34}{figures['flow_steps_ms_total']:>10.1f}")
    print(f"{'  flow steps, guided RTC':<34}{figures['flow_steps_ms_total_guided_rtc']:>10.1f}")
    print(f"{'recompute prefix every flow step':<34}{figures['chunk_ms_recompute']:>10.1f}")
    print(f"prefix_reuse_speedup = {ratios['prefix_reuse_speedup']:.2f}; actions max |diff| = "
          f"{worst:.1e}; KV pages still held: {leaked}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2, default=str))
    print(f"wrote {args.out}")
    plot(args.out.with_suffix(".png"), figures, ratios)
    return 0


def plot(path: Path, figures: dict, ratios: dict) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    fig, ax = plt.subplots(figsize=(7, 3.2))
    parts = [("vision", figures["vision_node_ms"], "tab:blue"),
             ("prefix", figures["prefix_node_ms"], "tab:orange"),
             ("flow steps", figures["flow_steps_ms_total"], "tab:green")]
    left = 0.0
    for label, ms, color in parts:
        ax.barh(1, ms, left=left, color=color, label=label)
        left += ms
    ax.barh(0, figures["chunk_ms_recompute"], color="tab:red",
            label="recompute (vision + prefix + expert) x steps")
    ax.set_yticks([0, 1], ["recompute", "prefix reuse"])
    ax.set_xlabel("action-chunk latency, ms")
    ax.set_title(f"pi0-style chunk: prefix reuse {ratios['prefix_reuse_speedup']:.1f}x faster",
                 fontsize=10)
    ax.legend(fontsize=8, loc="upper right")  # the reuse bar is short: its right side is free
    ax.grid(alpha=0.3, axis="x")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Control-loop benchmark: wake-up lateness of mstar_rt.ControlLoop against a Python time.sleep
loop, while an inference workload runs on another thread of the same process.

    python benchmarks/control_loop.py [--quick] [--out benchmarks/results/control_loop.json]

The workload (one Python thread, continuously): Python pre-processing (a numpy observation,
normalisation, per-joint Python bookkeeping, a tokenised prompt), a torch forward of a small
conv + MLP policy (torch.set_num_threads(1)) and Python post-processing (un-normalise and clip
a 50 x 7 action chunk, and a per-action safety filter: forward kinematics and obstacle
clearance in pure Python, as robot wrappers do), then publish the chunk into an
ActionChunkBuffer stamped with the current control tick.

Loops measured beside it, each popping one action per tick from that buffer, at 100 Hz and 500 Hz:
  * ours   mstar_rt.ControlLoop(rate, action_buffer=buf), no Python callback: the tick is C++
           (clock_nanosleep on absolute deadlines; the GIL is never taken), lateness from .stats;
           once with realtime=False (SCHED_OTHER) and once with realtime=True (SCHED_FIFO(80)).
  * sleep  the straightforward Python loop: deadline += period; time.sleep(deadline - now);
           lateness = time.monotonic() - deadline; buf.pop(tick); once as it is (SCHED_OTHER)
           and once with its thread raised to SCHED_FIFO(80) by os.sched_setscheduler.
Lateness = wake time minus deadline, both sides. The SCHED_FIFO runs happen only where the
kernel grants it (the modes in effect are printed and stored under "notes"). Headline figures
and ratios compare the two loops under the same class, SCHED_FIFO when granted (what the loop is
built for; giving the Python loop the same priority makes the ratio about the loop, not about
privileges, and keeps other processes' CFS load on a shared VM out of it), else SCHED_OTHER;
other_* figures and ratios are both under SCHED_OTHER. The kinds alternate (order reversed every repetition); figures are medians
over the repetitions of each percentile. Percentiles are nearest-rank; ours come from the
loop's 1 µs histogram (bin upper edges, at most 1 µs high). Writes the JSON result and a PNG of
the 100 Hz lateness histograms (log y).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import threading
import time
from pathlib import Path

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

import mstar_rt as m  # noqa: E402

from bench_common import machine  # noqa: E402  (benchmarks/ is on sys.path)

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "control_loop.json"
RATES = (100, 500)
KINDS = ("ours_rt", "sleep_rt", "ours", "sleep")  # headline pair first
HORIZON, ACTION_DIM, STATE_DIM = 50, 7, 14
HIST_MAX_MS, HIST_BINS = 50.0, 50_000  # 1 µs bins for ours
FULL = dict(seconds=10.0, reps=5)
QUICK = dict(seconds=2.5, reps=2)
PRIORITY = 80

try:
    from tqdm import tqdm
except ImportError:
    tqdm = None


# ---- the inference workload -----------------------------------------------------------------------

class Policy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Sequential(
            nn.Conv2d(3, 32, 5, 2, 2), nn.ReLU(), nn.Conv2d(32, 64, 3, 2, 1), nn.ReLU(),
            nn.Conv2d(64, 64, 3, 2, 1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.mlp = nn.Sequential(
            nn.Linear(64 + 2 * STATE_DIM, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(),
            nn.Linear(512, HORIZON * ACTION_DIM))

    def forward(self, image, state):
        return self.mlp(torch.cat([self.conv(image), state], 1))


PROMPT = "pick up the red cube and put it in the bowl on the left side of the table".split()
IMG_MEAN = np.array([0.485, 0.456, 0.406], np.float32)
IMG_STD = np.array([0.229, 0.224, 0.225], np.float32)
S_MEAN = [0.1 * i for i in range(STATE_DIM)]
S_STD = [1.0 + 0.05 * i for i in range(STATE_DIM)]
A_MEAN = [0.02 * i for i in range(ACTION_DIM)]
A_STD = [0.5 + 0.1 * i for i in range(ACTION_DIM)]


LINKS = [(0.0, 0.333, -math.pi / 2), (0.0, 0.0, math.pi / 2), (0.0825, 0.316, math.pi / 2),
         (-0.0825, 0.0, -math.pi / 2), (0.0, 0.384, math.pi / 2), (0.088, 0.0, math.pi / 2)]
OBSTACLES = [(0.5, 0.0, 0.1, 0.08), (0.3, 0.3, 0.2, 0.05), (0.4, -0.3, 0.15, 0.06)]


def workspace_ok(q: list) -> bool:
    """Forward kinematics of a 6-joint arm (Denavit-Hartenberg, pure Python, as many robot
    wrappers check each commanded action) and a clearance test of every joint position against
    a few spherical obstacles. This is the Python-heavy part of the workload: the GIL is held
    throughout, which is what a Python control loop on the same interpreter has to wait for."""
    t = [[1.0, 0.0, 0.0, 0.0], [0.0, 1.0, 0.0, 0.0], [0.0, 0.0, 1.0, 0.0]]
    for (a, d, alpha), theta in zip(LINKS, q):
        ct, st, ca, sa = math.cos(theta), math.sin(theta), math.cos(alpha), math.sin(alpha)
        link = [[ct, -st * ca, st * sa, a * ct], [st, ct * ca, -ct * sa, a * st],
                [0.0, sa, ca, d]]
        t = [[sum(t[i][k] * link[k][j] for k in range(3)) + (t[i][3] if j == 3 else 0.0)
              for j in range(4)] for i in range(3)]
        x, y, z = t[0][3], t[1][3], t[2][3]
        for ox, oy, oz, r in OBSTACLES:
            if (x - ox) ** 2 + (y - oy) ** 2 + (z - oz) ** 2 < r * r:
                return False
    return z > -0.1


class Inference(threading.Thread):
    """Runs pre-processing -> forward -> post-processing -> publish until stopped."""

    def __init__(self, policy: Policy, buffer, rate: float) -> None:
        super().__init__(daemon=True)
        self.policy, self.buffer, self.rate = policy, buffer, rate
        self.t0 = math.inf  # monotonic time of tick 0 (set when the loop starts)
        self.stop_flag = threading.Event()
        self.iterations = 0
        self.phase_s = [0.0, 0.0, 0.0]  # pre, forward, post
        self.rng = np.random.default_rng(0)
        self.history: list = []

    def preprocess(self):
        image = self.rng.integers(0, 256, (96, 96, 3), dtype=np.uint8)
        state = self.rng.standard_normal(STATE_DIM)
        img = (image.astype(np.float32) / 255.0 - IMG_MEAN) / IMG_STD
        img = np.ascontiguousarray(img.transpose(2, 0, 1))
        feats = [(float(s) - mu) / sd for s, mu, sd in zip(state, S_MEAN, S_STD)]
        self.history.append(feats)
        del self.history[:-10]
        delta = [sum(col) / len(self.history) for col in zip(*self.history)]
        tokens = [hash(w) % 1000 for w in PROMPT]
        meta = {"tokens": tokens, "n": len(tokens), "keys": sorted({w[0] for w in PROMPT})}
        return torch.from_numpy(img)[None], torch.tensor([feats + delta]), meta

    def postprocess(self, out: torch.Tensor) -> np.ndarray:
        raw = out.numpy().reshape(HORIZON, ACTION_DIM)
        chunk = []
        for row in raw.tolist():  # per-action Python checks, as robot wrappers do
            act = [max(-1.0, min(1.0, a * sd + mu)) for a, mu, sd in zip(row, A_MEAN, A_STD)]
            act[-1] = 1.0 if act[-1] > 0 else -1.0  # gripper open / closed
            if not workspace_ok(act[:-1]):  # a safety filter: hold the previous action
                act = list(chunk[-1]) if chunk else [0.0] * ACTION_DIM
            chunk.append(act)
        return np.asarray(chunk, dtype=np.float32)

    def step(self) -> None:
        t_a = time.perf_counter()
        obs_tick = max(0, int((time.monotonic() - self.t0) * self.rate)) if self.t0 < math.inf else 0
        image, state, _meta = self.preprocess()
        t_b = time.perf_counter()
        with torch.inference_mode():
            out = self.policy(image, state)
        t_c = time.perf_counter()
        chunk = self.postprocess(out)
        self.buffer.publish(chunk, obs_tick)
        t_d = time.perf_counter()
        for i, dt in enumerate((t_b - t_a, t_c - t_b, t_d - t_c)):
            self.phase_s[i] += dt
        self.iterations += 1

    def run(self) -> None:
        while not self.stop_flag.is_set():
            self.step()


# ---- the loops --------------------------------------------------------------------------------------

def nearest_rank(sorted_ms: np.ndarray, p: float) -> float:
    k = max(1, math.ceil(p * len(sorted_ms) / 100.0 - 1e-9))
    return float(sorted_ms[k - 1])


def set_fifo(on: bool) -> str:
    """Raise (or restore) the calling thread's policy; returns the mode in effect."""
    if not on:
        os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
        return "SCHED_OTHER"
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(PRIORITY))
        return f"SCHED_FIFO({PRIORITY})"
    except OSError as e:
        return f"SCHED_OTHER (SCHED_FIFO refused: {e.strerror})"


def run_ours(buffer, rate: int, ticks: int, realtime: bool, worker: Inference) -> dict:
    loop = m.ControlLoop(rate, action_buffer=buffer, realtime=realtime, priority=PRIORITY,
                         histogram_max_ms=HIST_MAX_MS, histogram_bins=HIST_BINS)
    worker.t0 = time.monotonic()
    loop.run(ticks)
    s = loop.stats
    counts, width = loop.lateness_bins_ms
    counts = np.asarray(counts[:-1], dtype=np.float64)  # the overflow bin has no position
    return {"p50": s["lateness_p50_ms"], "p99": s["lateness_p99_ms"], "p999": s["lateness_p999_ms"],
            "max": s["lateness_max_ms"], "missed": s["missed_deadlines"], "ticks": s["ticks"],
            "mode": loop.mode, "starved": loop.starved_ticks,
            "hist": ((np.arange(len(counts)) + 0.5) * width, counts)}


def run_sleep(buffer, rate: int, ticks: int, realtime: bool, worker: Inference) -> dict:
    mode = set_fifo(True) if realtime else "SCHED_OTHER"
    try:
        period = 1.0 / rate
        late = np.empty(ticks)
        starved = 0
        deadline = time.monotonic()
        worker.t0 = deadline
        deadline -= period
        for tick in range(ticks):  # the straightforward loop
            deadline += period
            time.sleep(max(0.0, deadline - time.monotonic()))
            late[tick] = time.monotonic() - deadline
            _action, fresh = buffer.pop(tick)
            starved += not fresh
    finally:
        if realtime:
            set_fifo(False)
    ms = np.sort(late * 1e3)
    return {"p50": nearest_rank(ms, 50), "p99": nearest_rank(ms, 99), "p999": nearest_rank(ms, 99.9),
            "max": float(ms[-1]), "missed": int(np.sum(ms >= period * 1e3)), "ticks": ticks,
            "mode": mode, "starved": starved, "hist": (ms, np.ones_like(ms))}


def cpu_counters() -> tuple:
    """(busy s, steal s, wall s) of the whole machine, and this process's CPU s."""
    f = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    hz = os.sysconf("SC_CLK_TCK")
    return (f[0] + f[1] + f[2] + f[5] + f[6]) / hz, f[7] / hz, time.monotonic(), time.process_time()


def measure(kind: str, rate: int, seconds: float, policy: Policy) -> dict:
    buffer = m.ActionChunkBuffer(HORIZON, ACTION_DIM)
    worker = Inference(policy, buffer, rate)
    worker.start()
    while worker.iterations < 3:  # the workload is running before the loop starts
        time.sleep(0.001)
    n0, phase0, t0 = worker.iterations, list(worker.phase_s), time.perf_counter()
    c0 = cpu_counters()
    try:
        fn = run_ours if kind.startswith("ours") else run_sleep
        r = fn(buffer, rate, int(round(seconds * rate)), kind.endswith("_rt"), worker)
    finally:
        worker.stop_flag.set()
        worker.join()
    busy, steal, wall, ours = (b - a for a, b in zip(c0, cpu_counters()))
    r["foreign_cpu_pct"] = max(0.0, 100.0 * (busy - ours) / wall)  # other processes, % of one CPU
    r["steal_pct"] = 100.0 * steal / (wall * (os.cpu_count() or 1))
    n = max(1, worker.iterations - n0)
    r["infer_hz"] = (worker.iterations - n0) / (time.perf_counter() - t0)
    r["phase_ms"] = [(b - a) * 1e3 / n for a, b in zip(phase0, worker.phase_s)]
    return r


# ---- main ---------------------------------------------------------------------------------------------

def fifo_available() -> bool:
    granted = set_fifo(True).startswith("SCHED_FIFO")  # probes the main thread, then restores it
    set_fifo(False)
    return granted


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="shorter cells, fewer repetitions (under a minute)")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = ap.parse_args()
    cfg = QUICK if args.quick else FULL
    torch.set_num_threads(1)
    torch.manual_seed(0)
    policy = Policy().eval()
    with torch.inference_mode():  # warm up
        [policy(torch.zeros(1, 3, 96, 96), torch.zeros(1, 2 * STATE_DIM)) for _ in range(20)]
    kinds = [k for k in KINDS if not k.endswith("_rt") or fifo_available()]
    cells = [(rate, kind) for rate in RATES for kind in kinds]
    samples: dict = {}
    bar = tqdm(total=cfg["reps"] * len(cells), desc="control_loop", unit="cell") if tqdm else None
    for rep in range(cfg["reps"]):
        for rate, kind in (cells if rep % 2 == 0 else cells[::-1]):
            r = measure(kind, rate, cfg["seconds"], policy)
            samples.setdefault((rate, kind), []).append(r)
            if bar:
                bar.set_postfix_str(f"{kind}@{rate}Hz p99={r['p99']:.2f}ms", refresh=False)
                bar.update(1)
            else:
                print(f"  rep {rep} {kind}@{rate}Hz p99={r['p99']:.3f} ms", flush=True)
    if bar:
        bar.close()

    def med(rate, kind, key):
        return statistics.median(r[key] for r in samples[(rate, kind)])

    fifo = "ours_rt" in kinds  # headline: both loops under SCHED_FIFO when granted, else SCHED_OTHER
    prefix = ({"ours_rt": "", "sleep_rt": "sleep_", "ours": "other_", "sleep": "other_sleep_"} if fifo
              else {"ours": "", "sleep": "sleep_"})
    figures: dict = {}
    for rate in RATES:
        for kind in kinds:
            for q in ("p50", "p99", "p999", "max"):
                figures[f"{prefix[kind]}{q}_lateness_ms_{rate}hz"] = round(med(rate, kind, q), 4)
            runs = samples[(rate, kind)]
            figures[f"{prefix[kind]}missed_deadlines_pct_{rate}hz"] = round(
                100.0 * sum(r["missed"] for r in runs) / sum(r["ticks"] + (r["missed"] if kind.startswith("ours") else 0)
                                                             for r in runs), 3)
            figures[f"{prefix[kind]}inference_iters_per_s_{rate}hz"] = round(med(rate, kind, "infer_hz"), 1)
            figures[f"{prefix[kind]}foreign_cpu_pct_{rate}hz"] = round(med(rate, kind, "foreign_cpu_pct"), 1)
            figures[f"{prefix[kind]}steal_pct_{rate}hz"] = round(med(rate, kind, "steal_pct"), 2)
    all_runs = [r for v in samples.values() for r in v]
    for i, name in enumerate(("pre", "forward", "post")):
        figures[f"workload_{name}_ms"] = round(statistics.median(r["phase_ms"][i] for r in all_runs), 3)
    figures["seconds_per_cell"] = cfg["seconds"]
    figures["repetitions"] = cfg["reps"]
    figures["headline_is_sched_fifo"] = int(fifo)

    def ratio(num, den):
        return round(num / den, 3) if den > 0 else float("inf")

    ratios = {}
    for p in ("", "other_") if fifo else ("",):
        for rate in RATES:
            ratios[f"{p}p99_lateness_sleep_over_ours_{rate}hz"] = ratio(
                figures[f"{p}sleep_p99_lateness_ms_{rate}hz"], figures[f"{p}p99_lateness_ms_{rate}hz"])
        ratios[f"{p}p50_lateness_sleep_over_ours_100hz"] = ratio(
            figures[f"{p}sleep_p50_lateness_ms_100hz"], figures[f"{p}p50_lateness_ms_100hz"])
    modes = {f"{kind}_{rate}hz": sorted({r["mode"] for r in samples[(rate, kind)]}) for rate, kind in cells}
    notes = {
        "headline_scheduling": (f"SCHED_FIFO({PRIORITY}) for both loops (ours realtime=True, the Python loop's "
                                "thread raised by os.sched_setscheduler): unprefixed figures and ratios; "
                                "other_*: both loops under SCHED_OTHER (realtime=False, plain Python loop)")
                               if fifo else "SCHED_OTHER for both loops (SCHED_FIFO was refused)",
        "modes": modes,
        "percentiles": "nearest rank per run, median over repetitions; p99.9 of a %g s cell at 100 Hz "
                       "rests on %d ticks" % (cfg["seconds"], int(cfg["seconds"] * 100)),
        "other_steal": "other%: CPU time of other processes (% of one CPU), steal%: hypervisor steal "
                       "(% of all CPUs), medians per cell, from /proc/stat",
        "missed": "ours: deadlines skipped (no catch-up); sleep: ticks that woke a full period late "
                  "(it catches up in a burst)",
    }

    names = {"ours": "C++ loop", "sleep": "py sleep", "ours_rt": "C++ loop", "sleep_rt": "py sleep"}
    print(f"\nwake-up lateness, ms (median of {cfg['reps']} x {cfg['seconds']:g} s per cell), "
          f"inference thread busy: pre {figures['workload_pre_ms']:.2f} ms + forward "
          f"{figures['workload_forward_ms']:.2f} ms + post {figures['workload_post_ms']:.2f} ms")
    print(f"{'rate':>6} {'loop':<10}{'mode':<16}{'p50':>8}{'p99':>8}{'p99.9':>8}{'max':>8}"
          f"{'missed%':>9}{'infer/s':>9}{'other%':>8}{'steal%':>8}")
    for rate in RATES:
        for kind in kinds:
            p = prefix[kind]
            mode = "/".join(modes[f"{kind}_{rate}hz"])
            print(f"{rate:>4}Hz {names[kind]:<10}{mode[:15]:<16}"
                  + "".join(f"{figures[f'{p}{q}_lateness_ms_{rate}hz']:>8.3f}" for q in ("p50", "p99", "p999", "max"))
                  + f"{figures[f'{p}missed_deadlines_pct_{rate}hz']:>9.2f}"
                  + f"{figures[f'{p}inference_iters_per_s_{rate}hz']:>9.0f}"
                  + f"{figures[f'{p}foreign_cpu_pct_{rate}hz']:>8.1f}{figures[f'{p}steal_pct_{rate}hz']:>8.2f}")
    foreign = statistics.median(r["foreign_cpu_pct"] for r in all_runs)
    if foreign > 10:
        print(f"WARNING: other processes used {foreign:.0f}% of a CPU (median per cell) during the run; "
              "the tails reflect that as much as the loops")
    print()
    for k, v in ratios.items():
        print(f"{k:<42} {v:.2f}")
    print(f"target p50_lateness_ms_100hz <= 0.2: {figures['p50_lateness_ms_100hz']:.3f} "
          f"({'met' if figures['p50_lateness_ms_100hz'] <= 0.2 else 'NOT met'})")
    r99 = ratios["p99_lateness_sleep_over_ours_100hz"]
    print(f"target p99_lateness_sleep_over_ours_100hz >= 5: {r99:.2f} ({'met' if r99 >= 5 else 'NOT met'})")
    print(f"headline: {notes['headline_scheduling']}")

    args.out.parent.mkdir(parents=True, exist_ok=True)
    result = {"name": "control_loop", "quick": args.quick, "machine": machine(),
              "figures": figures, "ratios": ratios, "notes": notes}
    args.out.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return 0
    edges = np.logspace(-2, math.log10(HIST_MAX_MS), 101)  # >= 50 ms lands in the last bin
    fig, ax = plt.subplots(figsize=(8, 4.5))
    colors = {"ours": "tab:green", "ours_rt": "tab:olive", "sleep": "tab:red", "sleep_rt": "tab:orange"}
    for kind in kinds:
        xs = np.concatenate([r["hist"][0] for r in samples[(100, kind)]])
        ws = np.concatenate([r["hist"][1] for r in samples[(100, kind)]])
        counts, _ = np.histogram(np.clip(xs, edges[0], edges[-1]), bins=edges, weights=ws)
        mode = "/".join(modes[f"{kind}_100hz"])
        ax.stairs(np.where(counts > 0, counts, np.nan), edges, color=colors[kind],
                  label=f"{names[kind]}, {mode} (p99 {figures[f'{prefix[kind]}p99_lateness_ms_100hz']:.2f} ms)")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("wake-up lateness (ms)")
    ax.set_ylabel(f"ticks (all {cfg['reps']} repetitions)")
    ax.set_title("100 Hz loop lateness beside a busy inference thread (lower/left is better)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out.with_suffix(".png"), dpi=110)
    print(f"wrote {args.out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

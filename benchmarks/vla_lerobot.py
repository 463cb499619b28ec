"""pi0 (or SmolVLA) side by side with LeRobot (a section of benchmarks/vla.py; also runs alone):

    python benchmarks/vla_lerobot.py [--quick] [--family pi0|smolvla] [--compile]
                                     [--out benchmarks/results/vla_lerobot[_smolvla].json]

The same checkpoint served two ways, alternating in one run: LeRobot 0.6.1's own
``PI0Policy`` / ``SmolVLAPolicy.predict_action_chunk`` (with its pre/post-processors) in its
venv, a child process (benchmarks/vla_lerobot_worker.py builds the checkpoint there, with
LeRobot's classes, and saves it), and ours (``LeRobotPi0Policy`` / ``SmolVLAPolicy`` loading that
directory, served by the Runtime). One torch
thread each, and both processes on one and the same CPU core: ours has an engine thread per
engine (vision, the KV engine), which could otherwise overlap on a second core. Latency per action chunk with 1 robot; throughput with 8 robots asking at once
(LeRobot serves them one after another -- it has no request batching; ours batches them).
Every chunk pair is compared (``max_abs_diff_actions``).

Without the LeRobot venv (``bash tests/reference/setup_lerobot_venv.sh``; Python 3.12) the
section says so and measures ours alone on the committed tiny fixture checkpoint.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench_common import machine, use_source_tree  # noqa: E402

use_source_tree()
import mstar_rt  # noqa: E402
from mstar_rt.models.lerobot_pi0 import LeRobotPi0Policy  # noqa: E402
from mstar_rt.models.smolvla import SmolVLAPolicy  # noqa: E402
from vla_observations import CAMERAS, noise, observation  # noqa: E402

ROOT = HERE.parent
VENV = Path(os.environ.get("LEROBOT_VENV", "/work/venvs/lerobot"))
FIXTURES = ROOT / "tests" / "reference" / "fixtures"
ROBOTS = 8


class LeRobotWorker:
    """The LeRobot process: JSON lines in, JSON lines out."""

    def __init__(self, out: Path, log: Any, family: str) -> None:
        self.proc = subprocess.Popen(
            [str(VENV / "bin" / "python"), str(HERE / "vla_lerobot_worker.py"), str(out),
             "--family", family],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True, cwd=ROOT)
        self.info = self._read()

    def _read(self) -> dict:
        while True:  # LeRobot prints a few lines of its own on stdout
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"the LeRobot worker exited ({self.proc.wait()})")
            if line.startswith("{"):
                return json.loads(line)

    def run(self, robots: int, seed: int) -> dict:
        self.proc.stdin.write(json.dumps({"cmd": "run", "robots": robots, "seed": seed}) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


def ours_inputs(seed: int) -> dict:
    obs = observation(seed)
    return {"images": {cam: obs[cam] for cam in CAMERAS}, "state": obs["observation.state"],
            "task": obs["task"], "noise": noise(seed)[0]}


def ours_round(rt: mstar_rt.Runtime, robots: int, seed: int) -> tuple[list[float], float, list]:
    """``robots`` requests at once; (each latency, wall time, each chunk)."""
    inputs = [ours_inputs(seed + r) for r in range(robots)]
    t0 = time.perf_counter()
    handles = [rt.submit(x) for x in inputs]
    chunks, latencies = [], []
    for h in handles:
        chunks.append(h.result(timeout=600)["actions"][0])
        latencies.append(time.perf_counter() - t0)
    return latencies, time.perf_counter() - t0, chunks


def load_ours(family: str, ckpt: Optional[Path], compile: bool) -> Any:
    """Our policy over the worker's checkpoint (None: the committed tiny fixture)."""
    if family == "smolvla":
        from mstar_rt.models.smolvla_checkpoint import load_lerobot_smolvla

        fixture = FIXTURES / "smolvla"
        path, vlm = ((ckpt / "checkpoint", ckpt / "smolvlm") if ckpt else
                     (fixture / "checkpoint", fixture / "smolvlm_tiny"))
        return SmolVLAPolicy(load_lerobot_smolvla(path, vlm_dir=str(vlm), progress=False),
                             max_batch=ROBOTS, compile=compile)
    root, heads = (ckpt, {"vision_heads": 4}) if ckpt else (FIXTURES / "pi0", {"vision_heads": 2})
    return LeRobotPi0Policy.from_pretrained(root / "checkpoint", tokenizer=root / "tokenizer",
                                            sizes=heads, max_batch=ROBOTS, compile=compile)


def run(quick: bool, compile: bool = False, family: str = "pi0") -> dict:
    torch.set_num_threads(1)
    # Pinned before any thread or child exists, so that every one of ours and the LeRobot
    # process inherit it: the comparison is core for core.
    core = min(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {core})
    reps, rounds = (3, 2) if quick else (10, 5)
    have_venv = (VENV / "bin" / "python").exists()
    tmp = tempfile.TemporaryDirectory(prefix="mstar-vla-lerobot-")
    log = open(Path(tmp.name) / "worker.log", "w")
    worker: Optional[LeRobotWorker] = None
    ckpt: Optional[Path] = None
    if have_venv:
        ckpt = Path(tmp.name) / "ckpt"
        worker = LeRobotWorker(ckpt, log, family)
    else:
        print(f"LeRobot venv not found at {VENV} (bash tests/reference/setup_lerobot_venv.sh, "
              "Python 3.12): ours alone, on the tiny fixture checkpoint")
    policy = load_ours(family, ckpt, compile)
    t0 = time.perf_counter()
    policy.warm_up()  # compiles every bucket's flow step now (nothing without --compile)
    warm_s = time.perf_counter() - t0
    params = sum(p.numel() for p in policy.policy.module.parameters())
    if family == "smolvla" and worker is None:  # the fixture's cameras and sizes differ
        raise SystemExit("the SmolVLA side-by-side needs the LeRobot venv")
    ours1, theirs1, ours8, theirs8, worst = [], [], [], [], 0.0
    try:
        with mstar_rt.Runtime(policy) as rt:
            ours_round(rt, ROBOTS, 1000)  # warm-up
            if worker:
                worker.run(1, 1000)
            for rep in range(reps):
                _, dt, mine = ours_round(rt, 1, rep)
                ours1.append(dt)
                if worker:
                    got = worker.run(1, rep)
                    theirs1.append(got["latency_s"][0])
                    worst = max(worst, float((mine[0] - torch.tensor(got["actions"][0])).abs().max()))
            for rnd in range(rounds):
                seed = 100 + rnd * ROBOTS
                _, wall, mine = ours_round(rt, ROBOTS, seed)
                ours8.append(ROBOTS / wall)
                if worker:
                    got = worker.run(ROBOTS, seed)
                    theirs8.append(ROBOTS / sum(got["latency_s"]))
                    for a, b in zip(mine, got["actions"]):
                        worst = max(worst, float((a - torch.tensor(b)).abs().max()))
            pages = rt.engines["vla"].cache
            leaked = pages.num_pages - pages.free_pages
    finally:
        if worker:
            worker.close()
        log.close()
        tmp.cleanup()
    med = statistics.median
    figures: dict[str, Any] = {
        "family": family,
        "ours_chunk_ms_1robot": round(med(ours1) * 1e3, 1),
        "ours_chunks_per_s_8robots": round(med(ours8), 2),
        "params_millions": round(params / 1e6, 2), "reps": reps, "rounds": rounds,
        "kv_pages_leaked": leaked, "reference": "lerobot==0.6.1" if worker else "not run",
        "cores_per_side": len(os.sched_getaffinity(0)),
        "flow_steps": "torch.compile" if compile else "eager", "warm_up_s": round(warm_s, 1),
    }
    ratios: dict[str, float] = {}
    if worker:
        figures.update(lerobot_chunk_ms_1robot=round(med(theirs1) * 1e3, 1),
                       lerobot_chunks_per_s_8robots=round(med(theirs8), 2),
                       max_abs_diff_actions=worst)
        ratios = {"lerobot_over_ours_latency_1robot": round(med(theirs1) / med(ours1), 2),
                  "lerobot_over_ours_throughput_8robots": round(med(ours8) / med(theirs8), 2)}
    return {"figures": figures, "ratios": ratios}


def report(result: dict) -> None:
    f, r = result["figures"], result["ratios"]
    print(f"\n{f.get('family', 'pi0')} ({f['params_millions']} M params), one torch thread and one "
          "core per side; "
          f"reference: {f['reference']}")
    print(f"{'':<28}{'ours':>12}{'LeRobot':>12}")
    print(f"{'chunk ms, 1 robot':<28}{f['ours_chunk_ms_1robot']:>12}"
          f"{f.get('lerobot_chunk_ms_1robot', '-'):>12}")
    print(f"{'chunks/s, 8 robots':<28}{f['ours_chunks_per_s_8robots']:>12}"
          f"{f.get('lerobot_chunks_per_s_8robots', '-'):>12}")
    for k, v in r.items():
        print(f"{k} = {v}")
    if "max_abs_diff_actions" in f:
        print(f"actions max |diff| = {f['max_abs_diff_actions']:.1e}")


def plot(path: Path, result: dict) -> None:
    f = result["figures"]
    if "lerobot_chunk_ms_1robot" not in f:
        return
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, (a, b) = plt.subplots(1, 2, figsize=(8, 3))
    a.bar(["LeRobot", "ours"], [f["lerobot_chunk_ms_1robot"], f["ours_chunk_ms_1robot"]],
          color=["tab:gray", "tab:green"])
    a.set_ylabel("ms per chunk, 1 robot")
    b.bar(["LeRobot", "ours"], [f["lerobot_chunks_per_s_8robots"], f["ours_chunks_per_s_8robots"]],
          color=["tab:gray", "tab:green"])
    b.set_ylabel("chunks/s, 8 robots")
    fig.suptitle(f"{f.get('family', 'pi0')}, same checkpoint: LeRobot predict_action_chunk vs "
                 "mstar_rt", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--compile", action="store_true",
                    help="ours with the flow steps through torch.compile (static buckets)")
    ap.add_argument("--family", choices=["pi0", "smolvla"], default="pi0")
    ap.add_argument("--out", type=Path, help="default benchmarks/results/vla_lerobot.json "
                    "(vla_lerobot_smolvla.json for SmolVLA)")
    args = ap.parse_args()
    name = "vla_lerobot" + ("_smolvla" if args.family == "smolvla" else "")
    args.out = args.out or ROOT / "benchmarks" / "results" / f"{name}.json"
    result = {"name": name, "quick": args.quick, "machine": machine(),
              **run(args.quick, args.compile, args.family)}
    report(result)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")
    plot(args.out.with_suffix(".png"), result)
    return 0


if __name__ == "__main__":
    sys.exit(main())

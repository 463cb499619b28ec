#!/usr/bin/env python3
"""Soak benchmark: proves that serving for a long time leaks nothing and does not drift.

    python benchmarks/soak.py [--quick] [--only policy,speech,runtime,voice,deadlines,
                              placement,disagg,omni,tp,vla,served]
                              [--out benchmarks/results/soak.json]

Sections (each a function in a soak_*.py module, run one after another):
  * policy     the openpi policy websocket (examples/serve/vision_policy.yaml, a `mstar-rt
               serve` subprocess) under 16 openpi_client connections sending observations back
               to back, each reconnecting every 100 requests (soak_servers.py).
  * speech     /v1/audio/speech of the Orpheus-style TTS (tiny random weights, paged KV cache)
               under 4 streaming HTTP clients, one request in 8 abandoned after its first audio
               (soak_servers.py).
  * runtime    100k requests through an in-process Runtime (three cheap nodes on two engines,
               a DynamicLoop), 30 % cancelled at random points (soak_runtime.py).
  * voice      a VoiceAgent session on the virtual audio devices, back-to-back turns
               (soak_voice.py).
  * deadlines  deadline scheduling under overload (soak_deadlines.py: run_deadlines).
  * placement  a PlacedRuntime over two worker processes under chaos: random tensor sizes through
               small arenas, cancels at random points, workers SIGKILLed every few seconds
               (restart auto); every finished request checked exactly (soak_placement.py).
  * disagg     the same chaos on a small Llama whose prefill and decode walks run on two
               workers (K/V moving between them); tokens checked against the model in-process,
               no page held at the end (soak_disagg.py).
  * omni       the same chaos on a tiny Qwen3-Omni, thinker on one worker and talker, code
               predictor and code2wav on the other; tokens and audio chunks checked against the
               model in-process (soak_omni.py).
  * tp         a small Llama at tp_size 2 in this process (a follower process) under cancels and
               the follower SIGKILLed every few seconds, the group rebuilding itself; tokens
               checked against tp_size 1, no page held at the end (soak_tp.py).
  * vla        LeRobot's pi0, pi0.5 and SmolVLA (tiny fixtures) with their flow steps through the
               static batch buckets of cuda_graphs, under random bursts with 15 % cancelled
               mid-chunk; every chunk checked against the reference (soak_vla.py).
  * served     `mstar-rt serve` with its nodes in worker processes, a worker SIGKILLed every few
               seconds: the camera policy over two workers on the openpi websocket, then the
               Orpheus-style TTS with LM and codec on two workers on /v1/audio/speech; answers
               checked against the same server's before the chaos (soak_served.py).
Each section runs in a fresh interpreter (soak.py --section NAME), so its process figures start
clean. Full run: 10 minutes per server section and of voice, 1-minute windows; --quick: 60 s and
10-second windows (the drift figure is still last window's p99 over the first's; the JSON says the
window length), after the same 30 s client warm-up as the full run: a server's heap settles over
its first 30-60 s of traffic (up to ~1 MB of fragmentation with nothing in use growing, then flat),
which a 10 s warm-up left inside the quick run's measured minute. Servers are measured through
/proc/<pid> (RSS, fds, threads) and /metrics (KV pages, live requests, outcomes): a baseline after
a warm-up with no client connected, the end after the clients left and the server dropped every
request. RSS growth is the slope of a least-squares line through the RSS samples (for the servers,
after the first window: 16 connections opening).

Headline figures (targets): rss_growth_mb_per_min of the policy server (<= 1), leaked_fds,
leaked_threads, kv_pages_in_use_at_end, errors (0), p99_drift_ratio of the policy server
(<= 1.5), voice_underruns (0), and the ratio deadline_met_with_over_without. Every section's
own figures are kept, prefixed with its name.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_common import child_pythonpath, machine, use_source_tree  # noqa: E402

use_source_tree()

from soak_servers import SoakTimes  # noqa: E402

DEFAULT_OUT = ROOT / "benchmarks" / "results" / "soak.json"
SECTIONS = ("policy", "speech", "runtime", "voice", "deadlines", "placement", "disagg", "omni",
            "tp", "vla", "served")
FULL = dict(seconds=600.0, window_s=60.0, warmup_s=30.0, sample_s=5.0, runtime_requests=100_000,
            voice_s=600.0)
QUICK = dict(seconds=60.0, window_s=10.0, warmup_s=30.0, sample_s=1.0,
             runtime_requests=100_000, voice_s=60.0)
# figure -> (target text, met?)
TARGETS: dict[str, tuple[str, Callable[[float], bool]]] = {
    "rss_growth_mb_per_min": ("<= 1", lambda v: v <= 1.0),
    "leaked_fds": ("0", lambda v: v == 0),
    "leaked_threads": ("0", lambda v: v == 0),
    "kv_pages_in_use_at_end": ("0", lambda v: v == 0),
    "errors": ("0", lambda v: v == 0),
    "p99_drift_ratio": ("<= 1.5", lambda v: v <= 1.5),
    "voice_underruns": ("0", lambda v: v == 0),
    "wrong_outputs": ("0", lambda v: v == 0),
    "shm_files_left": ("0", lambda v: v == 0),
    "workers_left": ("0", lambda v: v == 0),
}
# Reported, not judged here: soak_deadlines.py owns its target.
RATIO_TARGETS: dict[str, tuple[str, Any]] = {"deadline_met_with_over_without": ("-", None)}


class SectionNotRun(Exception):
    pass


# ---- the sections -------------------------------------------------------------------------------

def section_policy(quick: bool, cfg: dict) -> dict:
    from soak_servers import run_policy
    return run_policy(quick, _times(cfg))


def section_speech(quick: bool, cfg: dict) -> dict:
    from soak_servers import run_speech
    return run_speech(quick, _times(cfg))


def section_runtime(quick: bool, cfg: dict) -> dict:
    from soak_runtime import run_runtime
    return run_runtime(quick, cfg["runtime_requests"])


def section_voice(quick: bool, cfg: dict) -> dict:
    from soak_voice import NotRun, run_voice
    try:
        return run_voice(quick, cfg["voice_s"], cfg["sample_s"])
    except NotRun as e:
        raise SectionNotRun(str(e)) from None


def section_deadlines(quick: bool, cfg: dict) -> dict:
    try:
        from soak_deadlines import run_deadlines
    except ImportError as e:
        raise SectionNotRun(f"benchmarks/soak_deadlines.py cannot be imported ({e})") from None
    got = run_deadlines(quick)
    if "figures" in got or "ratios" in got:
        got = {**got.get("figures", {}), **got.get("ratios", {})}
    # Numbers are figures (ratio names: "_over_" / "_vs_"); anything nested is kept as detail.
    figures = {k: v for k, v in got.items() if isinstance(v, (int, float))}
    return {"figures": {k: v for k, v in figures.items() if not _is_ratio(k)},
            "ratios": {k: v for k, v in figures.items() if _is_ratio(k)},
            "details": {k: v for k, v in got.items() if k not in figures}}


def section_placement(quick: bool, cfg: dict) -> dict:
    from soak_placement import run_placement
    return run_placement(quick, cfg["seconds"])


def section_disagg(quick: bool, cfg: dict) -> dict:
    from soak_disagg import run_disagg
    return run_disagg(quick, cfg["seconds"])


def section_omni(quick: bool, cfg: dict) -> dict:
    from soak_omni import run_omni
    return run_omni(quick, cfg["seconds"])


def section_tp(quick: bool, cfg: dict) -> dict:
    from soak_tp import run_tp
    return run_tp(quick, cfg["seconds"])


def section_vla(quick: bool, cfg: dict) -> dict:
    from soak_vla import run_vla
    return run_vla(quick, cfg["seconds"])


def section_served(quick: bool, cfg: dict) -> dict:
    from soak_served import run_served
    return run_served(quick, cfg["seconds"])


def _is_ratio(name: str) -> bool:
    return "_over_" in name or "_vs_" in name


RUNNERS = {"policy": section_policy, "speech": section_speech, "runtime": section_runtime,
           "voice": section_voice, "deadlines": section_deadlines, "placement": section_placement,
           "disagg": section_disagg, "omni": section_omni, "tp": section_tp,
           "vla": section_vla, "served": section_served}


def run_section(name: str, quick: bool, cfg: dict) -> dict:
    """One section in this process: its record, with ``status`` ok / not run / failed."""
    try:
        return {"status": "ok", **RUNNERS[name](quick, cfg)}
    except SectionNotRun as e:
        return {"status": "not run", "reason": str(e)}
    except Exception as e:  # a failed section is reported, and counts as an error
        traceback.print_exc()
        return {"status": "failed", "reason": f"{type(e).__name__}: {e}"}


def run_child(name: str, quick: bool) -> dict:
    """Runs a section in a fresh interpreter, so that its process figures (RSS, fds, threads)
    start clean and no section's leftovers land on the next one."""
    with tempfile.TemporaryDirectory(prefix="soak_") as tmp:
        out = Path(tmp) / f"{name}.json"
        cmd = [sys.executable, str(Path(__file__).resolve()), "--section", name,
               "--section-out", str(out)] + (["--quick"] if quick else [])
        env = dict(os.environ, PYTHONPATH=child_pythonpath(str(ROOT / "benchmarks")))
        r = subprocess.run(cmd, env=env, cwd=ROOT, stdin=subprocess.DEVNULL)
        if not out.exists():
            return {"status": "failed", "reason": f"the section's process exited with {r.returncode} "
                                                  "without a result (its output is above)"}
        return json.loads(out.read_text())


def _times(cfg: dict) -> SoakTimes:
    return SoakTimes(cfg["seconds"], cfg["window_s"], cfg["warmup_s"], cfg["sample_s"])


# ---- the result ---------------------------------------------------------------------------------

def headline(sections: dict[str, dict]) -> tuple[dict, dict]:
    """The issue's figures over the sections that ran, plus every section's own figures
    (prefixed with its name), and the ratios."""
    ran = {n: s for n, s in sections.items() if s.get("status") == "ok"}
    fig = {n: s["figures"] for n, s in ran.items()}
    figures: dict[str, Any] = {}
    if "policy" in fig:
        figures["rss_growth_mb_per_min"] = fig["policy"]["rss_growth_mb_per_min"]
        figures["p99_drift_ratio"] = fig["policy"]["p99_drift_ratio"]
    leaky = [f for f in fig.values() if "leaked_fds" in f]
    if leaky:  # fewer fds or threads at the end than at the start is not a leak
        figures["leaked_fds"] = sum(max(0, f["leaked_fds"]) for f in leaky)
        figures["leaked_threads"] = sum(max(0, f["leaked_threads"]) for f in leaky)
    kv = [f["kv_pages_in_use_at_end"] for f in fig.values() if "kv_pages_in_use_at_end" in f]
    if kv:
        figures["kv_pages_in_use_at_end"] = sum(kv)
    if "voice" in fig:
        figures["voice_underruns"] = fig["voice"]["underruns"]
        figures["voice_overruns"] = fig["voice"]["overruns"]
        figures["voice_turns_recognized"] = fig["voice"]["turns_recognized_exactly"]
        figures["ring_frames_in_use_at_end"] = (fig["voice"]["output_ring_frames_in_use"]
                                                + fig["voice"]["input_ring_frames_in_use"])
    if "runtime" in fig:
        figures["runtime_live_at_end"] = fig["runtime"]["live_at_end"]
    for key in ("wrong_outputs", "shm_files_left", "workers_left"):
        got = [f[key] for n, f in fig.items()
               if n in ("placement", "disagg", "omni", "tp", "vla", "served") and key in f]
        if got:
            figures[key] = sum(got)
    figures["errors"] = (sum(int(f.get("errors", 0)) for f in fig.values())
                         + sum(1 for s in sections.values() if s.get("status") == "failed"))
    ratios: dict[str, Any] = {}
    for name, f in fig.items():
        for k, v in f.items():
            figures[k if k.startswith(f"{name}_") else f"{name}_{k}"] = v
        ratios.update(ran[name].get("ratios", {}))
    return figures, ratios


def print_table(result: dict) -> None:
    s = result["sections"]
    print(f"\nsoak ({'--quick' if result['quick'] else 'full'}: {result['soak_s']:.0f} s per server "
          f"section, windows of {result['window_s']:.0f} s; load average "
          f"{os.getloadavg()[0]:.1f})")
    print(f"{'section':<9}| {'requests':>8} {'req/s':>7} | {'p50 ms 1st>last':>16} "
          f"{'p99 ms 1st>last':>16} {'drift':>5} | {'RSS MB start>end':>16} {'MB/min':>6} | "
          f"{'fds':>7} {'threads':>7} | {'errors':>6}")
    for name, sec in s.items():
        if sec.get("status") != "ok":
            print(f"{name:<9}| {sec.get('status')}: {sec.get('reason', '')[:100]}")
            continue
        f = sec["figures"]
        if "rss_start_mb" not in f:  # deadlines: its own figures
            both = {**f, **sec.get("ratios", {})}
            print(f"{name:<9}| " + ", ".join(f"{k} {_fmt(v)}" for k, v in both.items())[:110])
            continue
        w = sec.get("windows")

        def span(a: Any, b: Any) -> str:
            return f"{_fmt(a)}>{_fmt(b)}"

        p50 = span(w[0]["p50_ms"], w[-1]["p50_ms"]) if w else "-"
        p99 = span(w[0]["p99_ms"], w[-1]["p99_ms"]) if w else "-"
        rss = f"{f['rss_start_mb']:.1f}>{f['rss_end_mb']:.1f}"
        n = f.get("requests", f.get("turns_played", 0))
        print(f"{name:<9}| {n:>8} {_fmt(f.get('requests_per_s')):>7} | {p50:>16} {p99:>16} "
              f"{_fmt(f.get('p99_drift_ratio')):>5} | {rss:>16} "
              f"{_fmt(f['rss_growth_mb_per_min']):>6} | "
              f"{span(f['fds_start'], f['fds_end']):>7} "
              f"{span(f['threads_start'], f['threads_end']):>7} | {f['errors']:>6}")
    print(f"\n{'figure':<34}{'value':>10}  {'target':<8}{'met':>4}")
    for key, (target, _) in {**TARGETS, **RATIO_TARGETS}.items():
        v = result["figures"].get(key, result["ratios"].get(key))
        met = result["met"].get(key)
        print(f"{key:<34}{_fmt(v):>10}  {target:<8}{'-' if met is None else 'yes' if met else 'NO':>4}")


def _fmt(v: Any) -> str:
    if v is None:
        return "n/a"
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
    return str(v)


def plot(result: dict, path: Path) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    s = {n: v for n, v in result["sections"].items() if v.get("status") == "ok"}
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for ax, name in zip(axes[:2], ("policy", "speech")):
        if name not in s:
            ax.set_title(f"{name}: not run")
            continue
        w = s[name]["windows"]
        xs = [(x["start_s"] + s[name]["window_s"] / 2) / 60 for x in w]
        ax.plot(xs, [x["p50_ms"] for x in w], "o-", label="p50")
        ax.plot(xs, [x["p99_ms"] for x in w], "s--", label="p99")
        ax.set(xlabel="minutes into the soak", ylabel="latency per request (ms)", ylim=(0, None),
               title=f"{name}: latency per {s[name]['window_s']:.0f} s window")
        ax.grid(alpha=0.3)
        ax.legend()
    ax = axes[2]
    for name in ("policy", "speech", "runtime", "voice"):
        if name in s and s[name].get("rss_series"):
            series = s[name]["rss_series"]
            ax.plot([p[0] / 60 for p in series], [p[1] - series[0][1] for p in series],
                    label=f"{name} ({series[0][1]:.0f} MB at start)")
    ax.set(xlabel="minutes into the section", ylabel="RSS growth (MiB)",
           title="resident memory over time")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="60 s per section, 10 s windows")
    ap.add_argument("--only", default=",".join(SECTIONS),
                    help=f"comma-separated sections to run (of {', '.join(SECTIONS)})")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--section", choices=SECTIONS, help=argparse.SUPPRESS)
    ap.add_argument("--section-out", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    only = [x.strip() for x in args.only.split(",") if x.strip()]
    unknown = [x for x in only if x not in SECTIONS]
    if unknown:
        ap.error(f"--only: unknown sections {unknown}; the sections are {', '.join(SECTIONS)}")
    cfg = QUICK if args.quick else FULL
    if args.section:  # a child: one section, its record written to --section-out
        record = run_section(args.section, args.quick, cfg)
        args.section_out.write_text(json.dumps(record, default=str))
        return 0
    sections: dict[str, dict] = {}
    for name in [x for x in SECTIONS if x in only]:
        print(f"== {name}", flush=True)
        t0 = time.monotonic()
        sections[name] = run_child(name, args.quick)
        sections[name]["section_s"] = round(time.monotonic() - t0, 1)
        print(f"   {sections[name]['status']} in {sections[name]['section_s']:.0f} s", flush=True)
    figures, ratios = headline(sections)
    met = {k: check(figures[k]) for k, (_, check) in TARGETS.items()
           if figures.get(k) is not None}
    met.update({k: check(ratios[k]) for k, (_, check) in RATIO_TARGETS.items()
                if check is not None and ratios.get(k) is not None})
    result = {"name": "soak", "quick": args.quick, "machine": machine(),
              "soak_s": cfg["seconds"], "window_s": cfg["window_s"],
              "drift_window": f"p99_drift_ratio = p99 of the last {cfg['window_s']:.0f} s window "
                              f"over the first's",
              "config": cfg, "figures": figures, "ratios": ratios, "met": met,
              "sections": sections}
    print_table(result)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2, default=str))
    plot(result, args.out.with_suffix(".png"))
    print(f"\nwrote {args.out} and {args.out.with_suffix('.png').name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Decode benchmark: tokens/s of a CausalLM served by mstar_rt at 1, 4 and 16 concurrent
requests against transformers' ``generate`` run request by request, on the same weights.

    python benchmarks/decode.py [--quick] [--profile] [--out benchmarks/results/decode.json]

The model is a random-weight Llama (MODEL below: ~41 M parameters, the size of a small speech
or action-token LM) built with transformers, saved with save_pretrained and loaded into ours
with CausalLM.from_pretrained, float32 on CPU, greedy, EOS off, fixed random prompts of 16-32
tokens and a fixed number of new tokens per request.
  * ours  N requests submitted at once to a fresh Runtime (warmed up by one short request);
          tokens/s = N * max_tokens / (last result - first submit). Time to first token per
          request = the prefill node's completion (from the request's timeline) minus its
          submit time.
  * hf    the same N requests one after another with hf.generate(max_new_tokens=min_new_tokens=
          max_tokens, do_sample=False); tokens/s = N * max_tokens / total time.
Both are warmed up first. Each ours cell closes its Runtime before HF runs: an engine worker that
has run torch ops keeps OpenMP threads alive, and while they exist torch ops on any other thread
pay for them (it halved HF's tokens/s here). The same holds the other way round: the engine's
worker pays for the main thread's OpenMP threads, which loading the model created, as it would
in any deployment; op_thread_cost records the per-op price. The cells alternate (order reversed
every repetition) and figures are medians over the repetitions (best_*: the best repetition of
each side, a check on the medians when load hits one side harder). Every run checks its token
counts, and each request's tokens are compared with HF's (greedy_match_pct; a mismatch is
reported with HF's logit margin at the first differing token, so a near-tie can be told from a
bug). The CPU time other processes took during
each cell is recorded (foreign_cpu_pct, steal_pct): on a shared 2-core VM it decides much of
the result, so a cell that ran beside more than BUSY_LIMIT_PCT of a CPU of other processes' work
is rerun.

After the timed cells a 1-request and a 16-request run go through timers wrapped around the
engine's phases (taking work, preparing it, scheduling, StepPlan, model, attention, logits,
sampling, reporting to the Conductor): the per-step breakdowns are stored and plotted. --profile
adds a cProfile of the engine worker thread and a torch-profiler op table for a 16-request run,
printed and saved to benchmarks/results/decode_profile.txt.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
import transformers  # noqa: E402

import mstar_rt  # noqa: E402

from bench_common import machine  # noqa: E402  (benchmarks/ is on sys.path)
from decode_profile import PHASES, op_thread_cost, profiled_runs, timed_run  # noqa: E402
from decode_runs import (MODEL, PROMPT_TOKENS, THREADS, build_models, contention,  # noqa: E402
                         cpu_counters, divergence, make_prompts, run_hf, run_ours, serve_once)

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "decode.json"
CONCURRENCY = (1, 4, 16)
FULL = dict(max_tokens=64, reps=5, reruns=3)
QUICK = dict(max_tokens=16, reps=2, reruns=0)
TARGET_16REQ = 5.0
# Two torch threads on two vCPUs: while another process holds a core, each parallel op waits for
# the descheduled OpenMP thread, and HF on the main thread (spinning OpenMP workers) fell to 3-5
# tokens/s here (and lost a quarter at 10-20 % of a CPU of load). A cell run under such load says
# more about the neighbours than about the two sides, so it is rerun.
BUSY_LIMIT_PCT = 15.0  # % of one CPU; a cell is rerun at most cfg["reruns"] times

try:
    from tqdm import tqdm
except ImportError:
    tqdm = None


# ---- main ----------------------------------------------------------------------------------------

def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="fewer tokens and repetitions, no reruns (under a minute when idle)")
    ap.add_argument("--profile", action="store_true",
                    help="also cProfile + torch-profile a 16-request run (prints and saves it)")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = ap.parse_args()
    cfg = QUICK if args.quick else FULL
    max_tokens, reps = cfg["max_tokens"], cfg["reps"]
    transformers.logging.set_verbosity_error()
    threads = THREADS  # the default, the same for both sides (each on a thread of its own)
    # Libgomp keeps one OpenMP pool per thread that ran a parallel op, and with more pool threads
    # than cores every op pays a futex wake (docs/engines.md). So the main thread keeps torch at
    # one thread (loading, setup), and each side runs with every core on a thread whose pool
    # ends with it: HF on a fresh thread per cell, ours on the engine worker of a fresh Runtime.
    torch.set_num_threads(1)

    with tempfile.TemporaryDirectory() as tmp:
        hf, lm, params_m = build_models(tmp)
    module = lm.module
    prompts = make_prompts(max(CONCURRENCY), MODEL["vocab_size"])
    cells = [(n, kind) for n in CONCURRENCY for kind in ("ours", "hf")]
    samples: dict = defaultdict(list)
    reruns = 0
    mismatches: list[dict] = []
    matched: dict = defaultdict(int)
    compared: dict = defaultdict(int)
    with mstar_rt.Runtime(lm) as rt:  # warm up both, including a batched step
        run_ours(rt, prompts, 4)
    run_hf(hf, prompts[:2], 4)
    bar = tqdm(total=reps * len(cells), desc="decode", unit="cell") if tqdm else None
    for rep in range(reps):
        for n, kind in (cells if rep % 2 == 0 else cells[::-1]):
            attempts = []
            for attempt in range(1 + cfg["reruns"]):
                reruns += attempt > 0
                c0 = cpu_counters()
                r = (serve_once(module, prompts[:n], max_tokens) if kind == "ours"
                     else run_hf(hf, prompts[:n], max_tokens))
                r["foreign_cpu_pct"], r["steal_pct"] = contention(c0, cpu_counters())
                attempts.append(r)
                if r["foreign_cpu_pct"] <= BUSY_LIMIT_PCT:
                    break
            r = min(attempts, key=lambda a: a["foreign_cpu_pct"])
            r["tokens_per_s"] = n * max_tokens / r["wall_s"]
            samples[(n, kind)].append(r)
            if bar:
                bar.set_postfix_str(f"{kind}@{n}req {r['tokens_per_s']:.0f} tok/s",
                                    refresh=False)
                bar.update(1)
            else:
                print(f"  rep {rep} {kind}@{n}req {r['tokens_per_s']:.1f} tok/s", flush=True)
        for n in CONCURRENCY:  # this repetition's tokens, ours against HF's
            for i, (a, b) in enumerate(zip(samples[(n, "hf")][-1]["tokens"],
                                           samples[(n, "ours")][-1]["tokens"])):
                compared[n] += 1
                if a == b:
                    matched[n] += 1
                else:
                    pos, margin = divergence(hf, prompts[i], a, b)
                    mismatches.append(dict(requests=n, rep=rep, request=i, first_diff=pos,
                                           hf_logit_margin=margin))
    if bar:
        bar.close()

    profiles = {}
    for n in (1, max(CONCURRENCY)):
        # One run each, rerun when disturbed; steal counts here (no other side to be fair to).
        attempts = []
        for _attempt in range(1 + cfg["reruns"]):
            c0 = cpu_counters()
            prof = timed_run(module, prompts[:n], max_tokens)
            prof["foreign_cpu_pct"], prof["steal_pct"] = contention(c0, cpu_counters())
            attempts.append(prof)
            if prof["foreign_cpu_pct"] + prof["steal_pct"] <= BUSY_LIMIT_PCT:
                break
        profiles[n] = min(attempts, key=lambda a: a["foreign_cpu_pct"] + a["steal_pct"])
    thread_cost = op_thread_cost()
    profile_text = profiled_runs(module, prompts, max_tokens) if args.profile else None

    def med(n: int, kind: str, key: str) -> float:
        return statistics.median(r[key] for r in samples[(n, kind)])

    figures: dict = {}
    ratios: dict = {}
    per_rep: dict = {}
    for n in CONCURRENCY:
        ours_tps, hf_tps = med(n, "ours", "tokens_per_s"), med(n, "hf", "tokens_per_s")
        figures[f"tokens_per_s_{n}req"] = round(ours_tps, 2)
        figures[f"hf_tokens_per_s_{n}req"] = round(hf_tps, 2)
        figures[f"ttft_ms_{n}req"] = round(1e3 * statistics.median(
            statistics.median(r["ttft_s"]) for r in samples[(n, "ours")]), 2)
        figures[f"ttft_max_ms_{n}req"] = round(1e3 * statistics.median(
            max(r["ttft_s"]) for r in samples[(n, "ours")]), 2)
        figures[f"ms_per_step_{n}req"] = round(1e3 * statistics.median(
            r["wall_s"] / r["steps"] for r in samples[(n, "ours")]), 2)
        figures[f"hf_ms_per_token_{n}req"] = round(1e3 / hf_tps, 2)
        figures[f"foreign_cpu_pct_{n}req"] = round(statistics.median(
            r["foreign_cpu_pct"] for kind in ("ours", "hf") for r in samples[(n, kind)]), 1)
        figures[f"steal_pct_{n}req"] = round(statistics.median(
            r["steal_pct"] for kind in ("ours", "hf") for r in samples[(n, kind)]), 1)
        figures[f"greedy_match_pct_{n}req"] = round(100.0 * matched[n] / compared[n], 1)
        ratios[f"tokens_per_s_{n}req_vs_hf"] = round(ours_tps / hf_tps, 3)
        # Best of the repetitions, each side: what either reaches undisturbed; a check on the
        # medians when background load hits one side harder (HF's spinning threads) than the other.
        best_ours = max(r["tokens_per_s"] for r in samples[(n, "ours")])
        best_hf = max(r["tokens_per_s"] for r in samples[(n, "hf")])
        figures[f"best_tokens_per_s_{n}req"] = round(best_ours, 2)
        figures[f"hf_best_tokens_per_s_{n}req"] = round(best_hf, 2)
        figures[f"best_ratio_{n}req_vs_hf"] = round(best_ours / best_hf, 3)
        per_rep[f"{n}req"] = [round(o["tokens_per_s"] / h["tokens_per_s"], 2)
                              for o, h in zip(samples[(n, "ours")], samples[(n, "hf")])]
    figures["reruns"] = reruns
    figures["max_tokens"] = max_tokens
    figures["repetitions"] = reps
    figures["torch_threads"] = threads
    figures["params_millions"] = round(params_m, 2)
    for n, prof in profiles.items():
        for key, v in prof["ms_per_step"].items():
            figures[f"profile_{n}req_ms_per_step_{key}"] = round(v, 3)
        figures[f"profile_{n}req_ms_per_step_total"] = round(prof["wall_ms_per_step"], 3)
        figures[f"profile_{n}req_foreign_cpu_pct"] = round(prof["foreign_cpu_pct"], 1)
        figures[f"profile_{n}req_steal_pct"] = round(prof["steal_pct"], 1)
    figures.update({k: round(v, 2) for k, v in thread_cost.items()})
    config = {"model": {"architecture": "LlamaForCausalLM (transformers, random weights)",
                        **MODEL, "head_dim": MODEL["hidden_size"] // MODEL["num_attention_heads"],
                        "tie_word_embeddings": False, "params_millions": round(params_m, 2)},
              "dtype": "float32", "device": "cpu", "sampling": "greedy, EOS off",
              "prompt_tokens": list(PROMPT_TOKENS), "max_tokens": max_tokens,
              "concurrency": list(CONCURRENCY), "repetitions": reps, "torch_threads": threads,
              "engine_worker_threads": samples[(1, "ours")][0]["worker_threads"] or threads,
              "engine": "KVCacheEngine(page_size=16, num_pages=256, max_batch=64), torch attention",
              "torch": torch.__version__, "transformers": transformers.__version__}
    notes = {"per_rep_ratios": per_rep,
             "cells": [dict(rep=i, requests=n, kind=kind, tokens_per_s=round(r["tokens_per_s"], 1),
                            foreign_cpu_pct=round(r["foreign_cpu_pct"], 1),
                            steal_pct=round(r["steal_pct"], 1))
                       for (n, kind), runs in samples.items() for i, r in enumerate(runs)],
             "mismatches": mismatches[:20],
             "foreign_cpu": "foreign_cpu_pct / steal_pct: CPU time of other processes / stolen "
                            "by the hypervisor during a cell, % of one CPU, median over the "
                            "cells of that concurrency (from /proc/stat); a cell where the "
                            f"former exceeds {BUSY_LIMIT_PCT}% is rerun, up to {cfg['reruns']} "
                            "times (reruns counts them) and the least disturbed attempt is kept. "
                            "Steal is not a criterion: it shows up in our cells and not in HF's "
                            "(likely its OpenMP threads sleeping and waking per op: a vCPU's "
                            "wake-up counts as steal), so rerunning on it would favour ours",
             "ttft": "ours: the prefill node's completion minus the request's submit time, "
                     "median over the requests of a run (ttft_max: the slowest), median over runs",
             "profile": "profile_<n>req_*: one n-request run through timers, ms per engine "
                        "step by phase (exclusive times; the total is the run's wall time per "
                        "step)",
             "thread_cost": "linear_1x512x1536_*: one F.linear of a [1, 512] input by a [1536, "
                            "512] weight on the main thread and on a fresh thread, µs per op and "
                            "voluntary context switches per op; the engine runs on a worker "
                            "thread and pays the difference on every parallel op"}

    print(f"\nmodel: Llama {MODEL['hidden_size']}h x {MODEL['num_hidden_layers']}L, "
          f"{MODEL['num_attention_heads']}/{MODEL['num_key_value_heads']} heads, vocab "
          f"{MODEL['vocab_size']}, {params_m:.1f} M params, fp32; prompts {PROMPT_TOKENS[0]}-"
          f"{PROMPT_TOKENS[1]} tokens, {max_tokens} new; torch threads {threads} (engine worker "
          f"{config['engine_worker_threads']}); "
          f"medians of {reps}")
    print(f"{'requests':>8}{'ours tok/s':>12}{'HF tok/s':>10}{'ratio':>8}{'ratio range':>14}"
          f"{'ms/step':>9}{'TTFT ms':>9}{'TTFT max':>10}{'greedy = HF':>13}{'best ratio':>12}"
          f"{'other%':>8}{'steal%':>8}")
    for n in CONCURRENCY:
        rr = per_rep[f"{n}req"]
        print(f"{n:>8}{figures[f'tokens_per_s_{n}req']:>12.1f}"
              f"{figures[f'hf_tokens_per_s_{n}req']:>10.1f}"
              f"{ratios[f'tokens_per_s_{n}req_vs_hf']:>8.2f}{f'{min(rr):.2f}-{max(rr):.2f}':>14}"
              f"{figures[f'ms_per_step_{n}req']:>9.1f}{figures[f'ttft_ms_{n}req']:>9.1f}"
              f"{figures[f'ttft_max_ms_{n}req']:>10.1f}"
              f"{f'{matched[n]}/{compared[n]}':>13}{figures[f'best_ratio_{n}req_vs_hf']:>12.2f}"
              f"{figures[f'foreign_cpu_pct_{n}req']:>8.0f}"
              f"{figures[f'steal_pct_{n}req']:>8.1f}")
    for m in mismatches[:5]:
        print(f"  mismatch: {m['requests']} req, rep {m['rep']}, request {m['request']}: first "
              f"differing token {m['first_diff']}, HF logit margin {m['hf_logit_margin']:.2e}")
    busy = [r["foreign_cpu_pct"] for v in samples.values() for r in v]
    still = sum(b > BUSY_LIMIT_PCT for b in busy)
    print(f"{reruns} cell runs were repeated for other processes' load; {still} of {len(busy)} "
          f"kept cells still ran beside more than {BUSY_LIMIT_PCT:g}% of a CPU of it")
    r16 = ratios["tokens_per_s_16req_vs_hf"]
    print(f"target tokens_per_s_16req_vs_hf >= {TARGET_16REQ:g}: {r16:.2f} "
          f"({'met' if r16 >= TARGET_16REQ else 'NOT met'})")
    print("\nwhere an engine step goes (ms per step, one run through timers):")
    print(f"  {'':<40}" + "".join(f"{f'{n} req':>18}" for n in profiles))
    for key, label in PHASES:
        cells = [(p["ms_per_step"][key], 100 * p["ms_per_step"][key] / p["wall_ms_per_step"])
                 for p in profiles.values()]
        print(f"  {label:<40}" + "".join(f"{ms:>9.2f}{pct:>7.1f} %" for ms, pct in cells))
    print(f"  {'total (wall / steps)':<40}" + "".join(
        f"{p['wall_ms_per_step']:>9.2f}{'':>9}" for p in profiles.values()))
    tc = thread_cost
    print(f"one linear [1x512]x[512x1536]: {tc['linear_1x512x1536_us_main_thread']:.0f} µs on the "
          f"main thread, {tc['linear_1x512x1536_us_worker_thread']:.0f} µs on a worker thread "
          f"({tc['linear_1x512x1536_ctx_switches_per_op_worker_thread']:.1f} context switches "
          "per op there)")

    args.out.parent.mkdir(parents=True, exist_ok=True)
    result = {"name": "decode", "quick": args.quick, "machine": machine(), "config": config,
              "figures": figures, "ratios": ratios, "notes": notes}
    args.out.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")
    if profile_text is not None:
        path = args.out.with_name(args.out.stem + "_profile.txt")
        path.write_text(profile_text)
        print(profile_text)
        print(f"wrote {path}")
    plot(args.out.with_suffix(".png"), figures, ratios, profiles, max_tokens, params_m)
    return 0


def plot(path: Path, figures: dict, ratios: dict, profiles: dict, max_tokens: int,
         params_m: float) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4), gridspec_kw={"width_ratios": [1, 1.2]})
    xs = range(len(CONCURRENCY))
    ours = [figures[f"tokens_per_s_{n}req"] for n in CONCURRENCY]
    hf = [figures[f"hf_tokens_per_s_{n}req"] for n in CONCURRENCY]
    ax.bar([x - 0.2 for x in xs], ours, 0.4, label="mstar_rt (concurrent)", color="tab:green")
    ax.bar([x + 0.2 for x in xs], hf, 0.4, label="HF generate (one by one)", color="tab:red")
    for x, n, o, h in zip(xs, CONCURRENCY, ours, hf):
        ax.annotate(f"{ratios[f'tokens_per_s_{n}req_vs_hf']:.1f}x", (x, max(o, h)), ha="center",
                    va="bottom", fontsize=9, xytext=(0, 3), textcoords="offset points")
    ax.set_xticks(list(xs))
    ax.set_xticklabels([f"{n} req" for n in CONCURRENCY])
    ax.set_ylim(0, 1.25 * max(ours + hf))
    ax.set_ylabel("generated tokens / s")
    ax.set_title(f"Llama {params_m:.0f} M fp32 CPU, {max_tokens} tokens/request", fontsize=10)
    ax.legend(fontsize=8, loc="upper left")
    colors = plt.get_cmap("tab20").colors
    for row, (n, prof) in enumerate(profiles.items()):
        left = 0.0
        for i, (key, label) in enumerate(PHASES):
            v = prof["ms_per_step"][key]
            bx.barh([row], [v], left=left, color=colors[i % len(colors)],
                    label=label if row == 0 else None)
            left += v
    bx.set_yticks(range(len(profiles)))
    bx.set_yticklabels([f"{n} req" for n in profiles])
    bx.set_xlabel("ms per engine step")
    bx.set_title("where an engine step goes", fontsize=10)
    bx.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.25), ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())

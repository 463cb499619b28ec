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
import cProfile
import io
import json
import os
import pstats
import statistics
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
import transformers  # noqa: E402

import mstar_rt  # noqa: E402
import mstar_rt.models.causal_lm as causal_lm  # noqa: E402
from mstar_rt.engines import KVCacheEngine, SamplingParams  # noqa: E402
from mstar_rt.models.causal_lm import CausalLM  # noqa: E402

from bench_common import machine  # noqa: E402  (benchmarks/ is on sys.path)

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "decode.json"
CONCURRENCY = (1, 4, 16)
PROMPT_TOKENS = (16, 32)  # inclusive range of prompt lengths
MODEL = dict(vocab_size=16384, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
             num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1024)
FULL = dict(max_tokens=64, reps=5, reruns=3)
QUICK = dict(max_tokens=16, reps=2, reruns=0)
TARGET_16REQ = 5.0
THREADS = torch.get_num_threads()  # torch's default for this machine: both sides get it
# Two torch threads on two vCPUs: while another process holds a core, each parallel op waits for
# the descheduled OpenMP thread, and HF on the main thread (spinning OpenMP workers) fell to 3-5
# tokens/s here (and lost a quarter at 10-20 % of a CPU of load). A cell run under such load says
# more about the neighbours than about the two sides, so it is rerun.
BUSY_LIMIT_PCT = 15.0  # % of one CPU; a cell is rerun at most cfg["reruns"] times
TIMEOUT_S = 600.0

try:
    from tqdm import tqdm
except ImportError:
    tqdm = None


# ---- the two models ------------------------------------------------------------------------------

def build_models(path: str) -> tuple[Any, CausalLM, float]:
    """A random-weight HF Llama saved to ``path`` and ours loaded from it (the same weights)."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(**MODEL, tie_word_embeddings=False, eos_token_id=None,
                                   bos_token_id=None, pad_token_id=None, dtype="float32")
    hf = transformers.LlamaForCausalLM(cfg).eval()
    hf.save_pretrained(path)
    ours = make_ours(CausalLM.from_pretrained(path, progress=False).module)
    params_m = sum(p.numel() for p in hf.parameters()) / 1e6
    return hf, ours, params_m


def make_ours(module: torch.nn.Module) -> CausalLM:
    """A fresh CausalLM (and engine) around an already loaded module."""
    # 16 requests x (32 + 64 tokens) need 96 pages of 16; 256 leaves room without a large cache.
    # The engine's worker gets every core (the main thread keeps torch at one thread, so the
    # worker's OpenMP pool is the only one alive while it runs; see main()).
    return CausalLM(module, engine=KVCacheEngine(page_size=16, num_pages=256, max_batch=64,
                                                 num_threads=THREADS))


def make_prompts(count: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1234)
    lo, hi = PROMPT_TOKENS
    lengths = torch.randint(lo, hi + 1, (count,), generator=g).tolist()
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


# ---- one run of each -----------------------------------------------------------------------------

def run_ours(rt: mstar_rt.Runtime, prompts: list, max_tokens: int) -> dict:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    engine = rt.engines["lm"]
    steps0 = engine.steps
    submitted, handles = [], []
    t0 = time.perf_counter()
    for p in prompts:
        submitted.append(time.monotonic())  # the Conductor's timeline uses CLOCK_MONOTONIC too
        handles.append(rt.submit({"prompt": p, "params": params}))
    tokens = [h.result(timeout=TIMEOUT_S)["token"] for h in handles]
    t1 = time.perf_counter()
    ttft = []
    for h, t_sub in zip(handles, submitted):
        prefill = [r for r in h.stats() if r["node"] == "prefill"]
        if len(prefill) != 1:
            raise AssertionError(f"expected one prefill execution, saw {len(prefill)}")
        ttft.append(prefill[0]["finished"] - t_sub)
    check_counts("ours", tokens, max_tokens)
    return {"tokens": tokens, "wall_s": t1 - t0, "ttft_s": ttft, "steps": engine.steps - steps0,
            "t0": t0, "t1": t1}


def serve_once(module: torch.nn.Module, prompts: list, max_tokens: int) -> dict:
    """One timed run in a Runtime of its own, warmed up by a short request first. A Runtime
    left open between runs would keep its worker's OpenMP threads alive, and those slow down
    torch ops on every other thread, HF's included (see op_thread_cost)."""
    with mstar_rt.Runtime(make_ours(module)) as rt:
        run_ours(rt, prompts[:1], 2)
        r = run_ours(rt, prompts, max_tokens)
        # torch threads on the worker, where the engine sets them (None: torch's default)
        r["worker_threads"] = getattr(rt.engines["lm"], "num_threads", None)
        return r


def run_hf(hf: Any, prompts: list, max_tokens: int) -> dict:
    """HF's requests on a fresh thread with every core; its OpenMP pool ends with the thread."""
    result: dict = {}

    def body() -> None:
        torch.set_num_threads(THREADS)
        try:
            result.update(_run_hf(hf, prompts, max_tokens))
        except BaseException as e:  # re-raised on the calling thread
            result["error"] = e

    t = threading.Thread(target=body, name="hf-generate")
    t.start()
    t.join()
    if "error" in result:
        raise result["error"]
    return result


def _run_hf(hf: Any, prompts: list, max_tokens: int) -> dict:
    tokens = []
    t0 = time.perf_counter()
    for p in prompts:
        ids = torch.tensor([p])
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                          min_new_tokens=max_tokens, do_sample=False, pad_token_id=0)
        tokens.append(out[0, len(p):].tolist())
    wall = time.perf_counter() - t0
    check_counts("hf", tokens, max_tokens)
    return {"tokens": tokens, "wall_s": wall}


def cpu_counters() -> tuple[float, float, float, float]:
    """Machine-wide busy and stolen CPU s, this process's CPU s and the wall clock: other
    processes on a shared VM (and other VMs on its host) compete for the same cores."""
    f = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    hz = os.sysconf("SC_CLK_TCK")
    return (f[0] + f[1] + f[2] + f[5] + f[6]) / hz, f[7] / hz, time.process_time(), time.monotonic()


def contention(c0: tuple, c1: tuple) -> tuple[float, float]:
    """(other processes' CPU, hypervisor steal) between two counter readings, % of one CPU."""
    busy, steal, own, wall = (b - a for a, b in zip(c0, c1))
    return max(0.0, 100.0 * (busy - own) / wall), 100.0 * steal / wall


def check_counts(kind: str, tokens: list, max_tokens: int) -> None:
    """A run that produced fewer tokens cannot be allowed to look fast."""
    bad = [len(t) for t in tokens if len(t) != max_tokens]
    if bad:
        raise AssertionError(f"{kind}: requests produced {bad} tokens, expected {max_tokens} each")


def divergence(hf: Any, prompt: list, ref: list, ours: list) -> tuple[int, float]:
    """Index of the first differing token and HF's logit margin there (its pick minus ours)."""
    i = next(k for k, (a, b) in enumerate(zip(ref, ours)) if a != b)
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + ref[:i]])).logits[0, -1]
    return i, float(logits[ref[i]] - logits[ours[i]])


# ---- where a step's time goes --------------------------------------------------------------------

PHASES = (  # (key, label) in the order they are stacked in the plot
    ("model", "model: linear, norms, RoPE, MLP"),
    ("attention", "model: paged attention"),
    ("logits", "lm_head (logits)"),
    ("sample", "sampling"),
    ("forward_kv", "forward_kv Python (ids, outputs)"),
    ("plan", "StepPlan build"),
    ("engine_step", "engine step: grouping, commit, KVStep"),
    ("check_stop", "check_stop"),
    ("report", "report: Conductor complete + emits"),
    ("take_prepare", "take + prepare_inputs"),
    ("schedule", "schedule (admit pages)"),
    ("loop_other", "worker loop, rest"),
)


class Timers:
    """Wraps callables and records every call (name, start, end, enclosing call). Times are
    exclusive (a wrapped call inside another counts only for itself), so the phases add up
    however the engine nests them, and are clipped to a window: the idle wait for the first
    submit must not count."""

    def __init__(self) -> None:
        self.calls: list[list] = []  # [key, start, end, parent index or -1]
        self.stack = threading.local()
        self.undo: list[tuple[Any, str, Any, bool]] = []

    def wrap(self, obj: Any, attr: str, key: str) -> None:
        fn = getattr(obj, attr)
        calls, local, clock = self.calls, self.stack, time.perf_counter

        def timed(*args: Any, **kwargs: Any) -> Any:
            stack = local.__dict__.setdefault("s", [])
            rec = [key, clock(), None, stack[-1] if stack else -1]
            calls.append(rec)
            stack.append(len(calls) - 1)
            try:
                return fn(*args, **kwargs)
            finally:
                rec[2] = clock()
                stack.pop()

        self.undo.append((obj, attr, obj.__dict__.get(attr), attr in obj.__dict__))
        setattr(obj, attr, timed)

    def restore(self) -> None:
        for obj, attr, old, had in reversed(self.undo):
            if had:
                setattr(obj, attr, old)
            else:
                delattr(obj, attr)
        self.undo.clear()

    def exclusive(self, t0: float, t1: float) -> dict[str, float]:
        """Seconds per name inside [t0, t1], each call less the wrapped calls within it."""
        def inside(rec: list) -> float:
            end = rec[2] if rec[2] is not None else t1
            return max(0.0, min(end, t1) - max(rec[1], t0))

        out: dict[str, float] = defaultdict(float)
        for rec in self.calls:
            t = inside(rec)
            out[rec[0]] += t
            if rec[3] >= 0:
                out[self.calls[rec[3]][0]] -= t
        return out


def timed_run(module: torch.nn.Module, prompts: list, max_tokens: int) -> dict:
    """One run with timers around the engine's phases; returns ms per step by phase."""
    lm = make_ours(module)
    engine = lm.engine_specs["lm"]
    timers = Timers()
    for attr, key in (("_take", "take_prepare"), ("_prepare", "take_prepare"),
                      ("_schedule", "schedule"), ("_run_step", "engine_step"),
                      ("_forward", "engine_step"), ("_report", "report")):
        timers.wrap(engine, attr, key)
    timers.wrap(lm.lm, "forward_kv", "forward_kv")
    timers.wrap(lm.lm, "check_stop", "check_stop")
    timers.wrap(module, "forward", "model")
    timers.wrap(module, "logits", "logits")
    timers.wrap(causal_lm, "sample", "sample")
    try:
        with mstar_rt.Runtime(lm) as rt:
            timers.wrap(engine.backend, "plan", "plan")
            timers.wrap(engine.backend, "attend", "attention")
            run_ours(rt, prompts[:1], 2)  # warm-up: its calls fall outside the window
            run = run_ours(rt, prompts, max_tokens)
    finally:
        timers.restore()
    s, steps = timers.exclusive(run["t0"], run["t1"]), run["steps"]
    per_step = {key: s[key] * 1e3 / steps for key, _label in PHASES if key != "loop_other"}
    wall_per_step = run["wall_s"] / steps
    per_step["loop_other"] = max(0.0, wall_per_step * 1e3 - sum(per_step.values()))
    return {"ms_per_step": per_step, "wall_ms_per_step": wall_per_step * 1e3, "steps": steps,
            "tokens_per_s": len(prompts) * max_tokens / run["wall_s"]}


def op_thread_cost(batches: int = 5, reps: int = 200) -> dict[str, float]:
    """µs and voluntary context switches per small linear, on this (main) thread and on a fresh
    thread, alternating, medians of the batches: where a thread other than the first to use
    OpenMP runs torch ops, OpenMP's workers may sleep between ops instead of spinning."""
    import resource

    w, x = torch.randn(1536, 512), torch.randn(1, 512)
    samples: dict[str, list[float]] = defaultdict(list)

    def measure(where: str) -> None:
        for _ in range(50):
            torch.nn.functional.linear(x, w)
        r0, t0 = resource.getrusage(resource.RUSAGE_THREAD), time.perf_counter()
        for _ in range(reps):
            torch.nn.functional.linear(x, w)
        t1, r1 = time.perf_counter(), resource.getrusage(resource.RUSAGE_THREAD)
        samples[f"linear_1x512x1536_us_{where}"].append((t1 - t0) * 1e6 / reps)
        samples[f"linear_1x512x1536_ctx_switches_per_op_{where}"].append(
            (r1.ru_nvcsw - r0.ru_nvcsw) / reps)

    for _ in range(batches):
        measure("main_thread")
        worker = threading.Thread(target=measure, args=("worker_thread",))
        worker.start()
        worker.join(timeout=TIMEOUT_S)
    return {k: statistics.median(v) for k, v in samples.items()}


def profiled_runs(module: torch.nn.Module, prompts: list, max_tokens: int) -> str:
    """cProfile of the engine worker thread, then a torch-profiler op table; returns the text."""
    out = io.StringIO()
    prof = cProfile.Profile()

    def boot(frame: Any, event: str, arg: Any) -> None:
        # Runs as the first profile event of each new thread: profile only the LM worker.
        sys.setprofile(None)
        if threading.current_thread().name == "mstar-engine-lm":
            prof.enable()

    threading.setprofile(boot)
    try:
        rt = mstar_rt.Runtime(make_ours(module))
    finally:
        threading.setprofile(None)  # type: ignore[arg-type]
    with rt:
        run_ours(rt, prompts[:1], 2)
        run = run_ours(rt, prompts, max_tokens)
    # the worker thread has exited, so its hook fires no more
    out.write(f"== cProfile of the engine worker thread, {len(prompts)} requests x {max_tokens} "
              f"tokens, {run['steps']} steps, wall {run['wall_s']:.2f} s (slowed by cProfile)\n")
    stats = pstats.Stats(prof, stream=out)
    stats.sort_stats("cumulative").print_stats(35)
    stats.sort_stats("tottime").print_stats(25)

    # The torch profiler records ops of the thread that starts it: start it on the worker.
    from torch.profiler import ProfilerActivity, profile
    lm = make_ours(module)
    engine = lm.engine_specs["lm"]
    tprof = profile(activities=[ProfilerActivity.CPU])
    state = {"on": False, "done": False}
    inner = engine._run_step

    def run_step(chosen: list) -> None:
        if not state["on"] and not state["done"]:
            tprof.start()
            state["on"] = True
        inner(chosen)
        if state["on"] and not len(engine.host.requests):  # the last request has ended
            tprof.stop()
            state["on"], state["done"] = False, True

    with mstar_rt.Runtime(lm) as rt:
        run_ours(rt, prompts[:1], 2)  # warm-up, before the wrapper is in place
        engine._run_step = run_step  # type: ignore[method-assign]
        run_ours(rt, prompts, max_tokens)
    out.write("\n== torch profiler, ops on the engine worker thread (self CPU time)\n")
    out.write(tprof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
    return out.getvalue()


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

"""Where an engine step of benchmarks/decode.py goes: timers wrapped around the engine's phases
(exclusive times, ms per step), the per-op price of running torch on a thread other than the
main one, and a cProfile + torch-profiler run of the engine worker thread."""

from __future__ import annotations

import cProfile
import io
import pstats
import statistics
import sys
import threading
import time
from collections import defaultdict
from typing import Any

import torch

import mstar_rt
import mstar_rt.models.causal_lm as causal_lm

from decode_runs import TIMEOUT_S, make_ours, run_ours


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

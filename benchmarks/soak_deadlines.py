"""The soak benchmark's deadline section: under overload (requests arriving faster than the
engine serves them), the share of requests that finish within their deadline, with kept
deadlines (``fail_late``: late work is dropped, hopeless requests are refused at submit) and
without (the deadline only orders the queue, so the queue grows and every request runs late).

Run alone: ``python benchmarks/soak_deadlines.py [--quick]`` (soak.py runs it as a section).
"""

from __future__ import annotations

import argparse
import json
import threading
import time

from bench_common import use_source_tree

use_source_tree()

from mstar_rt import (  # noqa: E402
    EMIT,
    DeadlineExceeded,
    GraphEdge,
    GraphNode,
    Model,
    NodeSubmodule,
    RequestFailed,
    Runtime,
    Sequential,
)

SERVICE_S = 0.002   # one node execution (sleeps: the GIL is free, as on a GPU)
DEADLINE_S = 0.025  # each request's deadline, relative to its submit
OVERLOAD = 2.0      # offered load over capacity


class _Work(NodeSubmodule):
    max_batch = 1

    def forward(self, batch):
        time.sleep(SERVICE_S * len(batch))
        return [{"y": x["x"]} for x in batch]


class _Echo(NodeSubmodule):
    max_batch = 8

    def forward(self, batch):
        return [{"z": x["y"]} for x in batch]


class _Served(Model):
    """work (2 ms per request, one at a time) -> echo (EMITs z)."""

    inputs = ("x",)

    def __init__(self) -> None:
        self.nodes = [GraphNode("work", ["x"], ["y"]), GraphNode("echo", ["y"], [GraphEdge(EMIT, "z")])]
        self.walks = {"main": Sequential("work", "echo")}
        self.submodules = {"work": _Work(), "echo": _Echo()}


def _run(fail_late: bool, seconds: float) -> dict:
    """Open-loop arrivals at OVERLOAD x capacity for ``seconds``; counts who met the deadline."""
    rate = OVERLOAD / SERVICE_S
    done_at: dict[int, float] = {}
    errors = {"expired": 0, "refused": 0, "other": 0}
    submitted: list[tuple[float, object]] = []
    lock = threading.Lock()
    with Runtime(_Served()) as rt:
        t0 = time.monotonic()
        k = 0
        while True:
            due = t0 + k / rate
            now = time.monotonic()
            if now - t0 >= seconds:
                break
            if due > now:
                time.sleep(due - now)
            t_sub = time.monotonic()
            try:
                h = rt.submit({"x": k}, deadline=DEADLINE_S, fail_late=fail_late)
                submitted.append((t_sub, h))
            except DeadlineExceeded:
                with lock:
                    errors["refused"] += 1
                submitted.append((t_sub, None))
            k += 1
        for i, (t_sub, h) in enumerate(submitted):
            if h is None:
                continue
            try:
                h.result(timeout=120)
                done_at[i] = max(r["finished"] for r in h.stats())  # monotonic seconds
            except DeadlineExceeded:
                errors["expired"] += 1
            except RequestFailed:
                errors["other"] += 1
        live = rt.live
    met = sum(1 for i, (t_sub, _) in enumerate(submitted)
              if i in done_at and done_at[i] - t_sub <= DEADLINE_S)
    n = len(submitted)
    latencies = sorted(done_at[i] - submitted[i][0] for i in done_at)

    def pct(q: float) -> float:
        return round(1e3 * latencies[min(len(latencies) - 1, int(q * len(latencies)))], 2) \
            if latencies else float("nan")

    return {"submitted": n, "met": met, "met_share": round(met / max(n, 1), 4),
            "completed": len(done_at), **errors, "p50_ms_completed": pct(0.5),
            "p99_ms_completed": pct(0.99), "left_live": live}


def run_deadlines(quick: bool) -> dict:
    """The section's figures (``deadline_met_with_over_without`` among them)."""
    seconds = 4.0 if quick else 30.0
    without = _run(False, seconds)
    kept = _run(True, seconds)
    ratio = kept["met_share"] / max(without["met_share"], 1.0 / max(without["submitted"], 1))
    return {
        "deadline_overload": {"service_ms": SERVICE_S * 1e3, "deadline_ms": DEADLINE_S * 1e3,
                              "offered_over_capacity": OVERLOAD, "seconds_each": seconds,
                              "without_fail_late": without, "with_fail_late": kept},
        "deadline_met_with_over_without": round(ratio, 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    figures = run_deadlines(ap.parse_args().quick)
    o = figures["deadline_overload"]
    print(f"{'deadlines kept':<16}{'met':>8}{'share':>8}{'expired':>9}{'refused':>9}"
          f"{'p99 ms':>9}")
    for label, r in (("no", o["without_fail_late"]), ("yes", o["with_fail_late"])):
        print(f"{label:<16}{r['met']:>8}{r['met_share']:>8.2f}{r['expired']:>9}{r['refused']:>9}"
              f"{r['p99_ms_completed']:>9}")
    print(json.dumps({"deadline_met_with_over_without": figures["deadline_met_with_over_without"]}))


if __name__ == "__main__":
    main()

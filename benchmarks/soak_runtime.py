"""The in-process soak section: many requests through a small Runtime model, a good share of
them cancelled at random points, from the submitting thread and from another one.

The model is three cheap nodes on two engines: ``embed`` (engine ``front``) doubles ``x``, a
DynamicLoop of ``gen`` (engine ``loop``) adds one per iteration and EMITs each value as
``token`` until ``n`` iterations, and ``finish`` (``front``) EMITs the last value as ``total``.
So a finished request's outputs are known exactly: tokens 2x+1 .. 2x+n and total 2x+n.

Each request draws its fate: run to the end, cancelled right after submit (queued), cancelled
after its first token (mid-loop), or cancelled by a canceller thread after 0-2 ms (racing the
workers; the request may have finished by then). At the end the Runtime must hold nothing
(``live`` all 0) and, once closed, its threads must be gone."""

from __future__ import annotations

import heapq
import os
import random
import threading
import time
from typing import Any

import numpy as np

import mstar_rt as m
from mstar_rt import EMIT, DynamicLoop, GraphEdge, GraphNode, Sequential

from soak_proc import Sampler, drift, snapshot, wait_until, window_summary

CLIENTS = 4
MAX_STEPS = 32
FATES = (("finish", 0.7), ("cancel_queued", 0.1), ("cancel_mid_loop", 0.1),
         ("cancel_racing", 0.1))
TIMEOUT_S = 30.0
WINDOWS = 10  # windows of requests, in submission order
WARMUP = 5000  # requests before the baseline: allocator pools, caches


class _Embed(m.NodeSubmodule):
    max_batch = 32

    def forward(self, batch: list) -> list:
        return [{"h": 2 * x["x"]} for x in batch]


class _Gen(m.NodeSubmodule):
    max_batch = 32

    def prepare_inputs(self, ctx: Any, inputs: dict) -> Any:
        return inputs["h"], inputs["n"], ctx.iteration

    def forward(self, batch: list) -> list:
        return [{"h": h + 1, "token": h + 1} for h, _n, _i in batch]

    def check_stop(self, batch: list, outputs: list) -> list:
        return [("gen",) if i + 1 >= n else () for _h, n, i in batch]


class _Finish(m.NodeSubmodule):
    max_batch = 32

    def forward(self, batch: list) -> list:
        return [{"total": x["h"]} for x in batch]


class SoakModel(m.Model):
    inputs = ("x", "n")
    engines = {"embed": "front", "gen": "loop", "finish": "front"}

    def __init__(self) -> None:
        self.nodes = [GraphNode("embed", ["x"], ["h"]),
                      GraphNode("gen", ["h", "n"], ["h", GraphEdge(EMIT, "token")]),
                      GraphNode("finish", ["h"], [GraphEdge(EMIT, "total")])]
        self.walks = {"main": Sequential("embed", DynamicLoop("gen", MAX_STEPS, "gen",
                                                              outputs=["h"]), "finish")}
        self.submodules = {"embed": _Embed(), "gen": _Gen(), "finish": _Finish()}


class _Canceller:
    """Cancels handles at given times from its own thread."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Any]] = []
        self._cv = threading.Condition()
        self._seq = 0
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="soak-canceller", daemon=True)
        self._thread.start()

    def later(self, delay: float, handle: Any) -> None:
        with self._cv:
            self._seq += 1
            heapq.heappush(self._heap, (time.perf_counter() + delay, self._seq, handle))
            self._cv.notify()

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._stop and (not self._heap or
                                          self._heap[0][0] > time.perf_counter()):
                    wait = self._heap[0][0] - time.perf_counter() if self._heap else None
                    self._cv.wait(wait)
                if self._stop and not self._heap:
                    return
                _, _, handle = heapq.heappop(self._heap)
            handle.cancel()

    def close(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()
        self._thread.join()


def _check(out: dict, x: int, n: int) -> None:
    want = list(range(2 * x + 1, 2 * x + n + 1))
    if out.get("token") != want or out.get("total") != [2 * x + n]:
        raise AssertionError(f"request x={x} n={n}: tokens {out.get('token')} total "
                             f"{out.get('total')}, expected {want} and [{2 * x + n}]")


def meet_fate(h: Any, rng: random.Random, canceller: _Canceller, racing_s: float) -> str:
    """Draws the request's fate (FATES) and does it to handle ``h``: cancels it at once, after
    its first output, or from the canceller within ``racing_s`` -- or not at all."""
    fate = rng.choices([f for f, _ in FATES], [w for _, w in FATES])[0]
    if fate == "cancel_queued":
        h.cancel()
    elif fate == "cancel_racing":
        canceller.later(rng.uniform(0.0, racing_s), h)
    elif fate == "cancel_mid_loop":
        try:
            for _name, _value in h:
                h.cancel()
                break
        except (m.RequestCancelled, m.RequestFailed):
            pass
    return fate


def _one(rt: m.Runtime, rng: random.Random, canceller: _Canceller) -> str:
    """One request with a random fate; returns ``"finished"`` (meant to finish: its latency
    counts), ``"finished_anyway"`` (a cancel came too late) or ``"cancelled"``."""
    x, n = rng.randrange(1 << 20), rng.randint(1, MAX_STEPS)
    h = rt.submit({"x": x, "n": n})
    fate = meet_fate(h, rng, canceller, 0.002)
    try:
        out = h.result(timeout=TIMEOUT_S)
    except m.RequestCancelled:
        if fate == "finish":
            raise
        return "cancelled"
    _check(out, x, n)
    return "finished" if fate == "finish" else "finished_anyway"


def _drive(rt: m.Runtime, count: int, latencies: np.ndarray, bar: Any) -> tuple[dict, list]:
    """``count`` requests from CLIENTS threads; a finished request's latency goes into
    ``latencies[i]`` (preallocated: the harness allocates nothing per request that would pass
    for the runtime's growth). Returns the outcome counts and the errors."""
    counts = {"finished": 0, "finished_anyway": 0, "cancelled": 0}
    errors: list[BaseException] = []
    issued = [0]
    lock = threading.Lock()
    canceller = _Canceller()

    def client(k: int) -> None:
        rng = random.Random(k)
        mine = dict.fromkeys(counts, 0)
        while True:
            with lock:
                i = issued[0]
                if i >= count:
                    for key, v in mine.items():
                        counts[key] += v
                    return
                issued[0] += 1
            if bar is not None and i % 1000 == 999:
                bar.update(1000)
            t = time.perf_counter()
            try:
                outcome = _one(rt, rng, canceller)
                mine[outcome] += 1
                if outcome == "finished":
                    latencies[i] = time.perf_counter() - t
            except BaseException as e:
                errors.append(e)

    threads = [threading.Thread(target=client, args=(k,)) for k in range(CLIENTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    canceller.close()
    return counts, errors


def run_runtime(quick: bool, requests: int) -> dict:
    """``requests`` requests from CLIENTS threads through one Runtime (after WARMUP more);
    see the module doc. RSS is sampled over the ``requests`` only."""
    try:
        from tqdm import tqdm
        tqdm.monitor_interval = 0  # no monitor thread: it would count as a leaked thread
    except ImportError:
        tqdm = None
    pid = os.getpid()
    start = snapshot(pid)
    latencies = np.full(requests, np.nan)
    bar = tqdm(total=requests, desc="runtime", unit="req", leave=False) if tqdm else None
    zero = dict(requests=0, handles=0, stored=0, queued=0, inflight=0)
    rt = m.Runtime(SoakModel())
    try:
        _, warm_errors = _drive(rt, WARMUP, np.full(WARMUP, np.nan), None)
        wait_until(lambda: rt.live == zero, 10.0)
        t0 = time.perf_counter()
        with Sampler(pid, 0.25, t0) as sampler:
            counts, errors = _drive(rt, requests, latencies, bar)
            elapsed = time.perf_counter() - t0
            wait_until(lambda: rt.live == zero, 10.0)
        live = rt.live
    finally:
        rt.close()
        if bar is not None:
            bar.close()
    errors = warm_errors + errors
    time.sleep(0.2)
    end = snapshot(pid)
    live_total = sum(live.values())
    summary = window_summary(np.array_split(latencies, WINDOWS), requests / WINDOWS)
    return {
        "requests": requests, "warmup_requests": WARMUP, "clients": CLIENTS,
        "fates": dict(FATES),
        "window_unit": f"{requests // WINDOWS} requests in submission order",
        "windows": summary, "rss_series": sampler.series(),
        "live_at_end": live, "start": start, "end": end,
        "errors_seen": [repr(e) for e in errors[:5]],
        "figures": {
            "requests": requests, "seconds": elapsed, "requests_per_s": requests / elapsed,
            "finished": counts["finished"] + counts["finished_anyway"],
            "cancelled": counts["cancelled"],
            "cancel_came_too_late": counts["finished_anyway"],
            "rss_growth_mb_per_min": sampler.rss_growth_mb_per_min(),
            "rss_growth_mb": sampler.samples[-1].rss_mb - sampler.samples[0].rss_mb,
            "rss_start_mb": start["rss_mb"], "rss_end_mb": end["rss_mb"],
            "fds_start": start["fds"], "fds_end": end["fds"],
            "leaked_fds": end["fds"] - start["fds"],
            "threads_start": start["threads"], "threads_end": end["threads"],
            "leaked_threads": end["threads"] - start["threads"],
            "live_at_end": live_total,
            "p99_drift_ratio": drift(summary),
            "errors": len(errors) + (1 if live_total else 0),
        },
    }

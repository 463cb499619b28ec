#!/usr/bin/env python3
"""Conductor benchmark: runtime overhead per node execution, ours vs a plain asyncio runtime.

    python benchmarks/conductor.py [--quick] [--out benchmarks/results/conductor.json]

Three walks of no-op nodes — (a) a 10-node chain, (b) one node in a Loop of 100 iterations,
(c) a 256-step DynamicLoop stopped by its node — each at 1 and 16 concurrent requests, run
  * with C++ no-op nodes (benchmarks/conductor_bench.cpp, built here: the Conductor alone, no
    Python per node),
  * with Python no-op nodes through mstar_rt.Runtime (worker thread, tensor store, batching),
  * with the same walks written as a straightforward asyncio program (a task per request, an
    engine batching whatever is queued, futures for results), in the same run — with the nodes
    on an engine thread, as a server for real models must run them (a forward pass on the event
    loop would stall every other request, and the socket I/O, for its whole duration): the
    baseline of the headline ratio `py_nodes_16req_vs_asyncio`; and, for reference, with the
    nodes called on the event loop itself (`py_nodes_16req_vs_asyncio_on_loop`), which no thread
    hop burdens but which cannot serve a model whose nodes take time.
Every node does nothing, so time per node execution is pure runtime overhead. Ours and asyncio
alternate; figures are medians. Also times a cold start: a fresh interpreter that imports the
package (and torch, when installed), builds a Runtime for a no-op model and serves one request.
Writes benchmarks/results/conductor.json and a PNG of the per-node costs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import mstar_rt as m  # noqa: E402
from mstar_rt import DynamicLoop, GraphNode, Loop, Sequential  # noqa: E402

from bench_common import build_cpp_driver, machine  # noqa: E402  (benchmarks/ is on sys.path)

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "conductor.json"
DYN_STEPS = 256

try:
    from tqdm import tqdm
except ImportError:
    tqdm = None


# ---- the three walks ----------------------------------------------------------------------------

class Noop(m.NodeSubmodule):
    max_batch = 64

    def __init__(self, out: str, stop_at: int = 0) -> None:
        self.out = out
        self.stop_at = stop_at

    def forward(self, batch):
        out = self.out
        return [{out: 0} for _ in batch]


class StopAt(Noop):
    def prepare_inputs(self, ctx, inputs):
        return ctx.iteration

    def check_stop(self, batch, outputs):
        return [("gen",) if it + 1 >= self.stop_at else () for it in batch]


def chain_model() -> m.Model:
    class Chain(m.Model):
        inputs = ("x0",)
        nodes = [GraphNode(f"n{i}", [f"x{i}"], [f"x{i + 1}"]) for i in range(10)]
        walks = {"chain": Sequential(*[f"n{i}" for i in range(10)])}
        submodules = {f"n{i}": Noop(f"x{i + 1}") for i in range(10)}
    return Chain()


def loop_model() -> m.Model:
    class Looped(m.Model):
        inputs = ("x",)
        nodes = [GraphNode("step", ["x"], ["x"])]
        walks = {"loop": Loop("step", 100, outputs=["x"])}
        submodules = {"step": Noop("x")}
    return Looped()


def dynamic_model() -> m.Model:
    class Dynamic(m.Model):
        inputs = ("x",)
        nodes = [GraphNode("gen", ["x"], ["x"])]
        walks = {"decode": DynamicLoop("gen", 10 * DYN_STEPS, "gen", outputs=["x"])}
        submodules = {"gen": StopAt("x", DYN_STEPS)}
    return Dynamic()


WALKS = {"chain10": (chain_model, 10), "loop100": (loop_model, 100),
         "dynamic256": (dynamic_model, DYN_STEPS)}


# ---- ours ---------------------------------------------------------------------------------------

def run_cpp(walk: str, concurrent: int, rounds: int) -> float:
    """µs per node execution with the Conductor and C++ no-op nodes (conductor_bench)."""
    r = subprocess.run([str(cpp_driver()), walk, str(concurrent), str(rounds)],
                       capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        raise RuntimeError(f"conductor_bench {walk} failed: {r.stderr[-2000:]}")
    return float(r.stdout.split()[1])


_DRIVER: list[Path] = []


def cpp_driver() -> Path:
    if not _DRIVER:
        _DRIVER.append(build_cpp_driver("conductor_bench"))
    return _DRIVER[0]


def run_python(make, nodes_per_request: int, concurrent: int, rounds: int) -> float:
    """µs per node execution through mstar_rt.Runtime with Python no-op nodes."""
    model = make()
    with m.Runtime(model) as rt:
        t0 = time.perf_counter()
        for _ in range(rounds):
            handles = [rt.submit({model.inputs[0]: 1}) for _ in range(concurrent)]
            for h in handles:
                h.result(timeout=120)
        elapsed = time.perf_counter() - t0
        stats = handles[0].stats()
        if len(stats) != nodes_per_request:
            raise AssertionError(f"expected {nodes_per_request} node executions, saw {len(stats)}")
    return elapsed * 1e6 / (rounds * concurrent * nodes_per_request)


# ---- the asyncio baseline -------------------------------------------------------------------------

class AsyncEngine:
    """What one writes by hand: requests await node calls; an engine task batches what is queued."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue = asyncio.Queue()

    async def call(self, fn, value):
        fut = asyncio.get_running_loop().create_future()
        await self.queue.put((fn, value, fut))
        return await fut

    async def run(self) -> None:
        while True:
            first = await self.queue.get()
            batch = [first]
            while not self.queue.empty() and len(batch) < 64:
                batch.append(self.queue.get_nowait())
            by_fn: dict = {}
            for fn, value, fut in batch:
                by_fn.setdefault(fn, []).append((value, fut))
            for fn, items in by_fn.items():
                outs = fn([v for v, _ in items])
                for (_, fut), out in zip(items, outs):
                    fut.set_result(out)


class ThreadedAsyncEngine(AsyncEngine):
    """The same, but nodes run on an engine thread, as they must once they are real models (a
    forward pass on the event loop would stall every other request): calls cross to the thread
    through a queue and come back with call_soon_threadsafe, one hop per batch each way."""

    def __init__(self) -> None:
        import queue as _queue
        import threading as _threading
        self.loop = asyncio.get_running_loop()
        self.inbox: _queue.SimpleQueue = _queue.SimpleQueue()
        self.thread = _threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    async def call(self, fn, value):
        fut = self.loop.create_future()
        self.inbox.put((fn, value, fut))
        return await fut

    def _serve(self) -> None:
        import queue as _queue
        while True:
            first = self.inbox.get()
            if first is None:
                return
            batch = [first]
            while len(batch) < 64:
                try:
                    nxt = self.inbox.get_nowait()
                except _queue.Empty:
                    break
                if nxt is None:
                    self.inbox.put(None)
                    break
                batch.append(nxt)
            by_fn: dict = {}
            for fn, value, fut in batch:
                by_fn.setdefault(fn, []).append((value, fut))
            results = []
            for fn, items in by_fn.items():
                outs = fn([v for v, _ in items])
                results += [(fut, out) for (_, fut), out in zip(items, outs)]
            self.loop.call_soon_threadsafe(_resolve, results)

    async def run(self) -> None:  # the engine lives on its thread; nothing to do on the loop
        await asyncio.Event().wait()

    def stop(self) -> None:
        self.inbox.put(None)
        self.thread.join()


def _resolve(results) -> None:
    for fut, out in results:
        fut.set_result(out)


def _noop(batch):
    return [{"x": 0} for _ in batch]


async def _request(engine: AsyncEngine, walk: str) -> int:
    x, ran = 1, 0
    if walk == "chain10":
        for _ in range(10):
            x = (await engine.call(_noop, x))["x"]
            ran += 1
    elif walk == "loop100":
        for _ in range(100):
            x = (await engine.call(_noop, x))["x"]
            ran += 1
    else:
        for step in range(10 * DYN_STEPS):
            x = (await engine.call(_noop, x))["x"]
            ran += 1
            if step + 1 >= DYN_STEPS:
                break
    return ran


def run_asyncio(walk: str, nodes_per_request: int, concurrent: int, rounds: int,
                threaded: bool = False) -> float:
    async def main() -> float:
        engine = ThreadedAsyncEngine() if threaded else AsyncEngine()
        worker = asyncio.create_task(engine.run())
        t0 = time.perf_counter()
        for _ in range(rounds):
            ran = await asyncio.gather(*[_request(engine, walk) for _ in range(concurrent)])
            assert all(r == nodes_per_request for r in ran)
        elapsed = time.perf_counter() - t0
        worker.cancel()
        if threaded:
            engine.stop()
        return elapsed
    elapsed = asyncio.run(main())
    return elapsed * 1e6 / (rounds * concurrent * nodes_per_request)


# ---- cold start -----------------------------------------------------------------------------------

COLD = r"""
import time
t0 = time.perf_counter()
try:
    import torch  # noqa: F401  (a real model process imports it; count it when it is there)
    has_torch = True
except ImportError:
    has_torch = False
import mstar_rt as m
class Noop(m.NodeSubmodule):
    def forward(self, batch):
        return [{"y": 0} for _ in batch]
class One(m.Model):
    inputs = ("x",)
    nodes = [m.GraphNode("a", ["x"], [m.GraphEdge(m.EMIT, "y")])]
    walks = {"w": "a"}
    submodules = {"a": Noop()}
with m.Runtime(One()) as rt:
    rt.submit({"x": 1}).result(timeout=60)
print(time.perf_counter() - t0, has_torch)
"""


def cold_start() -> tuple[float, bool]:
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", COLD], capture_output=True, text=True, check=True,
                         cwd="/")
    wall = time.perf_counter() - t0  # includes interpreter start
    return wall, out.stdout.split()[1] == "True"


# ---- main -----------------------------------------------------------------------------------------


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer rounds (under a minute)")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = ap.parse_args()
    reps = 3 if args.quick else 9
    rounds = {1: 4 if args.quick else 10, 16: 2 if args.quick else 12}
    cells = [(w, c) for w in WALKS for c in (1, 16)]
    cpp_driver()  # built before anything is timed
    samples: dict = {}
    bar = tqdm(total=len(cells) * reps * 4, desc="conductor") if tqdm else None
    for rep in range(reps):
        for walk, conc in cells:
            make, per = WALKS[walk]
            order = ["cpp", "py", "asyncio", "asyncio_threaded"]
            if rep % 2:
                order.reverse()
            for kind in order:
                if kind == "cpp":
                    us = run_cpp(walk, conc, rounds[conc] * 4)
                elif kind == "py":
                    us = run_python(make, per, conc, rounds[conc])
                else:
                    us = run_asyncio(walk, per, conc, rounds[conc], kind == "asyncio_threaded")
                samples.setdefault(f"{walk}_{conc}req_{kind}", []).append(us)
                if bar:
                    bar.update(1)
    if bar:
        bar.close()
    med = {k: statistics.median(v) for k, v in samples.items()}
    cold = [cold_start() for _ in range(3 if args.quick else 5)]
    cold_s = statistics.median(c[0] for c in cold)

    figures = {f"us_per_node_{k}": round(v, 3) for k, v in med.items()}
    # Headline figures: the mean over the three walks at 16 concurrent requests.
    for kind in ("cpp", "py", "asyncio", "asyncio_threaded"):
        figures[f"us_per_node_{kind}_16req"] = round(statistics.mean(
            med[f"{w}_16req_{kind}"] for w in WALKS), 3)
        figures[f"us_per_node_{kind}_1req"] = round(statistics.mean(
            med[f"{w}_1req_{kind}"] for w in WALKS), 3)
    figures["cold_start_s"] = round(cold_s, 3)
    figures["cold_start_includes_torch"] = int(cold[0][1])
    def ratio(base: str, ours: str) -> float:
        return round(figures[f"us_per_node_{base}"] / figures[f"us_per_node_{ours}"], 3)

    # The baseline is asyncio with nodes on an engine thread, as ours; "on_loop" for reference.
    ratios = {
        "py_nodes_16req_vs_asyncio": ratio("asyncio_threaded_16req", "py_16req"),
        "py_nodes_1req_vs_asyncio": ratio("asyncio_threaded_1req", "py_1req"),
        "cpp_nodes_16req_vs_asyncio": ratio("asyncio_threaded_16req", "cpp_16req"),
        "py_nodes_16req_vs_asyncio_on_loop": ratio("asyncio_16req", "py_16req"),
        "py_nodes_1req_vs_asyncio_on_loop": ratio("asyncio_1req", "py_1req"),
    }
    print(f"\n{'walk':<12}{'requests':>9}{'C++ nodes':>12}{'Py nodes':>11}{'asyncio':>10}"
          f"{'on loop':>10}{'asyncio/py':>12}{'loop/py':>9}"
          f"   (µs of overhead per node execution, medians of {reps}; asyncio: nodes on a thread)")
    for walk, conc in cells:
        c, p, a, t = (med[f"{walk}_{conc}req_{k}"] for k in ("cpp", "py", "asyncio", "asyncio_threaded"))
        print(f"{walk:<12}{conc:>9}{c:>12.2f}{p:>11.2f}{t:>10.2f}{a:>10.2f}{t / p:>12.2f}{a / p:>9.2f}")
    print(f"\ncold start (fresh process: import{' torch +' if cold[0][1] else ''} mstar_rt, build, "
          f"first request): {cold_s:.2f} s")
    for k, v in ratios.items():
        print(f"{k:<30} {v:.2f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    result = {"name": "conductor", "quick": args.quick, "machine": machine(),
              "figures": figures, "ratios": ratios}
    args.out.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(8, 4))
        labels = [f"{w}\n{c} req" for w, c in cells]
        xs = range(len(cells))
        kinds = [("cpp", "tab:green", "C++ nodes"), ("py", "tab:blue", "Python nodes"),
                 ("asyncio_threaded", "tab:red", "asyncio, nodes on a thread (baseline)"),
                 ("asyncio", "tab:orange", "asyncio, nodes on the loop")]
        for i, (kind, color, label) in enumerate(kinds):
            ax.bar([x + (i - 1.5) * 0.2 for x in xs], [med[f"{w}_{c}req_{kind}"] for w, c in cells],
                   0.2, label=label, color=color)
        ax.set_xticks(list(xs))
        ax.set_xticklabels(labels, fontsize=8)
        ax.set_ylabel("µs overhead per node execution")
        ax.set_yscale("log")
        ax.legend()
        ax.set_title("conductor overhead (lower is better)")
        fig.tight_layout()
        fig.savefig(args.out.with_suffix(".png"), dpi=110)
        print(f"wrote {args.out.with_suffix('.png')}")
    except ImportError:
        print("matplotlib not installed: no plot")
    return 0


if __name__ == "__main__":
    sys.exit(main())

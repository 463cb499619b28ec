#!/usr/bin/env python3
"""Ring benchmark: mstar::SpscRing against boost::lockfree::spsc_queue, and mstar_rt.StreamBuffer
against queue.Queue for 20 ms audio chunks between two Python threads.

    python benchmarks/ring.py [--quick] [--out benchmarks/results/ring.json] [--cpp-only]

C++ part: configures build/bench (-DMSTAR_BUILD_BENCHMARKS=ON -DMSTAR_BUILD_PYTHON=OFF, Release),
builds ring_bench and runs it. It measures per-item throughput, bulk transfer (64 items per call)
and ping-pong round trips for 8- and 64-byte items in a 1024-slot and a 2^20-slot ring, with
the two threads pinned to CPUs 0 and 1 where allowed, ours and boost alternating every
repetition. Every measurement checks order and a checksum; a mismatch fails the run.

Python part: a producer thread pushes 320-float32 chunks (20 ms at 16 kHz) that a consumer
thread reads and checks, once through mstar_rt.StreamBuffer and once through queue.Queue of fresh
numpy arrays, alternating. It needs the mstar_rt package (pip install -e . in the venv); without
it the script says so and exits non-zero, unless --cpp-only.

Figures are medians over the repetitions; ratios are > 1 when mstar_rt wins. Writes the JSON
result (format: docs/benchmarks.md), <out stem>_raw.json with every sample, and a bar plot of the
ratios to <out stem>.png when matplotlib is importable.
"""
from __future__ import annotations

import argparse
import json
import os
import queue
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable

# numpy's OpenBLAS starts worker threads that spin on these 2-vCPU machines and steal the very
# cores the two Python threads are measured on; neither side does linear algebra.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

from bench_common import build_cpp_driver, machine  # noqa: E402  (benchmarks/ is on sys.path)

ROOT = Path(__file__).resolve().parent.parent
BUILD_DIR = ROOT / "build" / "bench"
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "ring.json"

# Sizes of one measurement. These machines swing by several times from one run to the next, so
# more alternations beat longer ones; both settings keep at least 9.
FULL = dict(items=4_000_000, bulk_items=16_000_000, roundtrips=100_000, reps=15, py_chunks=40_000)
QUICK = dict(items=1_000_000, bulk_items=4_000_000, roundtrips=20_000, reps=9, py_chunks=10_000)

CAPACITIES = {"small": 1024, "large": 1 << 20}
ITEM_BYTES = (8, 64)
CHUNK_FLOATS = 320  # 20 ms of 16 kHz mono audio
# Chunks the StreamBuffer holds (20 s of 20 ms audio; 1.3 MB). Python threads hand the GIL over only when
# one blocks, so the ring size sets how many chunks each hand-over amortises; queue.Queue is
# unbounded, as in the reference measurement.
PY_CAPACITY = 1024

try:
    from tqdm import tqdm
except ImportError:  # plain progress lines instead
    tqdm = None


class Progress:
    """tqdm when installed, else a line every 10 %."""

    def __init__(self, total: int, desc: str) -> None:
        self.total, self.desc, self.done, self.shown = total, desc, 0, -1
        self.bar = tqdm(total=total, desc=desc, unit="run", leave=False) if tqdm else None

    def step(self, label: str = "") -> None:
        self.done += 1
        if self.bar is not None:
            self.bar.set_postfix_str(label, refresh=False)
            self.bar.update(1)
            return
        tenth = self.done * 10 // max(self.total, 1)
        if tenth != self.shown:
            self.shown = tenth
            print(f"  {self.desc}: {self.done}/{self.total} {label}", flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


# ---- machine ------------------------------------------------------------------------------------


# ---- C++ part -----------------------------------------------------------------------------------


def build_driver() -> Path:
    return build_cpp_driver("ring_bench", BUILD_DIR)


def run_driver(exe: Path, cfg: dict) -> dict:
    cmd = [str(exe), "--items", str(cfg["items"]), "--bulk-items", str(cfg["bulk_items"]),
           "--roundtrips", str(cfg["roundtrips"]), "--reps", str(cfg["reps"]),
           "--capacities", ",".join(str(c) for c in CAPACITIES.values())]
    with tempfile.TemporaryFile("w+") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.PIPE, text=True)
        progress = None
        for line in proc.stderr:
            parts = line.split(maxsplit=3)
            if len(parts) >= 3 and parts[0] == "progress":
                if progress is None:
                    progress = Progress(int(parts[2]), "ring_bench")
                progress.step(parts[3].strip() if len(parts) > 3 else "")
            else:
                sys.stderr.write(line)
        rc = proc.wait()
        if progress is not None:
            progress.close()
        if rc != 0:
            sys.exit(f"ring.py: ring_bench failed (exit {rc}); a verification failure means the ring "
                     "delivered wrong data, and no figures are written")
        out.seek(0)
        return json.load(out)


# ---- Python part --------------------------------------------------------------------------------


def import_mstar_rt():
    """mstar_rt and numpy, or a clear exit."""
    try:
        import numpy  # noqa: F401
        import mstar_rt
    except ImportError as e:
        sys.exit(f"ring.py: cannot import mstar_rt with {sys.executable} ({e}).\n"
                 "  The Python part compares mstar_rt.StreamBuffer with queue.Queue and needs the package:\n"
                 "  build and install it (pip install -e . in the project's venv) and run this script with\n"
                 "  that interpreter, or pass --cpp-only to run the C++ part alone.")
    missing = [n for n in ("StreamBuffer", "Fixed") if not hasattr(mstar_rt, n)]
    if missing:
        sys.exit(f"ring.py: mstar_rt ({getattr(mstar_rt, '__file__', '?')}) has no {', '.join(missing)}; "
                 "this benchmark needs mstar_rt.StreamBuffer and mstar_rt.Fixed")
    return mstar_rt


def _run_threads(producer: Callable[[], None], consumer: Callable[[], None], n: int) -> float:
    """Seconds from starting both threads until both finish; re-raises a thread's exception."""
    errors: list[BaseException] = []

    def guarded(fn):
        def run():
            try:
                fn()
            except BaseException as e:  # reported by the main thread
                errors.append(e)
        return run

    threads = [threading.Thread(target=guarded(f), daemon=True) for f in (consumer, producer)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    deadline = t0 + 60 + n * 1e-3
    for t in threads:
        t.join(max(0.0, deadline - time.perf_counter()))
    elapsed = time.perf_counter() - t0
    if errors:
        raise errors[0]
    if any(t.is_alive() for t in threads):
        raise RuntimeError(f"chunk transfer of {n} chunks did not finish within {elapsed:.0f} s (hung)")
    return elapsed


def _template():
    import numpy as np

    return (np.arange(CHUNK_FLOATS) % 7).astype(np.float32)


def _check(first, last, expected: int, where: str) -> None:
    # The consumer reads the chunk's first and last element: order (element 0 = sequence number)
    # and completeness (element -1 = -sequence number) are checked, while the figures measure the
    # hand-off itself rather than a numpy reduction both sides would pay alike.
    if first != expected or last != -expected:
        raise AssertionError(f"{where}: chunk {expected} arrived wrong (first {first}, last {last})")


def chunks_stream_buffer(mstar_rt, n: int) -> float:
    """µs per chunk through mstar_rt.StreamBuffer."""
    import numpy as np

    buf = mstar_rt.StreamBuffer(np.float32, PY_CAPACITY, mstar_rt.Fixed(1),
                                item_shape=(CHUNK_FLOATS,), overflow="block")
    template = _template()

    def producer():
        for i in range(n):
            template[0], template[-1] = i, -i
            buf.push(template)  # copied straight into the ring
        buf.close()

    def consumer():
        expected = 0
        for chunk in buf:  # each chunk is a zero-copy view, released when the next is taken
            data = chunk.data  # shape (1, 320): one item of 320 samples
            _check(data[0, 0], data[0, -1], expected, "StreamBuffer")
            expected += 1
        if expected != n:
            raise AssertionError(f"StreamBuffer: {expected} chunks arrived, {n} were pushed")

    return _run_threads(producer, consumer, n) * 1e6 / n


def chunks_queue(n: int) -> float:
    """µs per chunk through queue.Queue of fresh numpy arrays."""
    q: queue.Queue = queue.Queue()
    template = _template()

    def producer():
        for i in range(n):
            a = template.copy()
            a[0], a[-1] = i, -i
            q.put(a)
        q.put(None)

    def consumer():
        expected = 0
        while (a := q.get()) is not None:
            _check(a[0], a[-1], expected, "queue.Queue")
            expected += 1
        if expected != n:
            raise AssertionError(f"queue.Queue: {expected} chunks arrived, {n} were put")

    return _run_threads(producer, consumer, n) * 1e6 / n


def run_python_part(mstar_rt, cfg: dict) -> dict:
    n, reps = cfg["py_chunks"], cfg["reps"]
    chunks_stream_buffer(mstar_rt, 200)  # warm-up: imports, first allocations
    chunks_queue(200)
    samples = {"stream_buffer": [], "queue": []}
    progress = Progress(2 * reps, "python chunks")
    for rep in range(reps):
        order = ("stream_buffer", "queue") if rep % 2 == 0 else ("queue", "stream_buffer")
        for which in order:
            us = chunks_stream_buffer(mstar_rt, n) if which == "stream_buffer" else chunks_queue(n)
            samples[which].append(us)
            progress.step(f"{which} rep {rep + 1}")
    progress.close()
    return samples


# ---- summary ------------------------------------------------------------------------------------


def summarize(raw: dict, py: dict | None) -> tuple[dict, dict, list]:
    """figures, ratios and table rows (metric, ours, baseline, ratio)."""
    size_name = {c: name for name, c in CAPACITIES.items()}
    series = {(s["kind"], s["item_bytes"], s["capacity"], s["impl"]): s for s in raw["series"]}
    figures: dict[str, float] = {}
    ratios: dict[str, float] = {}
    rows = []
    for kind in ("throughput", "bulk", "roundtrip"):
        for b in ITEM_BYTES:
            for cap, size in size_name.items():
                ours = statistics.median(series[(kind, b, cap, "ours")]["samples"])
                boost = statistics.median(series[(kind, b, cap, "boost")]["samples"])
                if kind == "roundtrip":
                    o, bo, unit = ours, boost, "ns"
                    ratio = boost / ours
                    rname = f"roundtrip_{b}B_{size}_boost_over_ours"
                    if b == 64 and size == "small":
                        rname = "roundtrip_64B_boost_over_ours"
                else:
                    o, bo, unit = ours / 1e6, boost / 1e6, "Mitems_per_s"
                    ratio = ours / boost
                    rname = f"{kind}_{b}B_{size}_vs_boost"
                    if b == 64 and size == "small":
                        rname = f"{kind}_64B_vs_boost"
                figures[f"{kind}_{b}B_{size}_ours_{unit}"] = round(o, 4)
                figures[f"{kind}_{b}B_{size}_boost_{unit}"] = round(bo, 4)
                ratios[rname] = round(ratio, 4)
                rows.append((f"{kind} {b}B {size} ring [{unit}]", o, bo, ratio, rname))
    if py is not None:
        ours, base = statistics.median(py["stream_buffer"]), statistics.median(py["queue"])
        figures["py_chunk_stream_buffer_us"] = round(ours, 4)
        figures["py_chunk_queue_us"] = round(base, 4)
        ratios["py_chunk_pop_vs_queue"] = round(base / ours, 4)
        rows.append(("py chunk 320xf32 [us/chunk]", ours, base, base / ours, "py_chunk_pop_vs_queue"))
    return figures, ratios, rows


HEADLINE = {"throughput_64B_vs_boost", "bulk_64B_vs_boost", "roundtrip_64B_boost_over_ours",
            "py_chunk_pop_vs_queue"}


def print_table(rows: list) -> None:
    w = max(len(r[0]) for r in rows)
    print(f"\n{'metric':<{w}}  {'ours':>10}  {'boost/base':>10}  {'ratio':>6}  ratio name")
    for metric, o, b, ratio, name in rows:
        mark = " *" if name in HEADLINE else ""
        print(f"{metric:<{w}}  {o:>10.4g}  {b:>10.4g}  {ratio:>6.2f}  {name}{mark}")
    print("(ratio > 1: mstar_rt wins; * = the ratios the issue names; medians over the repetitions)")


def plot(ratios: dict, path: Path, title: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot written")
        return
    names = list(ratios)
    fig, ax = plt.subplots(figsize=(8, 0.35 * len(names) + 1.5))
    colors = ["tab:green" if ratios[n] >= 1 else "tab:red" for n in names]
    ax.barh(names, [ratios[n] for n in names], color=colors)
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.invert_yaxis()
    ax.set_xlabel("ratio (> 1: mstar_rt wins)")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"wrote {path}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer items per measurement (under a minute)")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="result JSON (default %(default)s)")
    ap.add_argument("--reps", type=int, help="alternations of ours and the baseline (default 9)")
    ap.add_argument("--cpp-only", action="store_true", help="skip the Python part (no mstar_rt needed)")
    args = ap.parse_args()
    cfg = dict(QUICK if args.quick else FULL)
    if args.reps is not None:
        if args.reps < 1:
            ap.error("--reps must be at least 1")
        cfg["reps"] = args.reps

    mstar_rt = None if args.cpp_only else import_mstar_rt()  # fail before the long C++ part
    t_start = time.perf_counter()
    exe = build_driver()
    t_built = time.perf_counter()
    raw = run_driver(exe, cfg)
    t_cpp = time.perf_counter()
    py = run_python_part(mstar_rt, cfg) if mstar_rt is not None else None
    t_py = time.perf_counter()

    figures, ratios, rows = summarize(raw, py)
    print_table(rows)
    timings = {"build_s": t_built - t_start, "cpp_s": t_cpp - t_built, "python_s": t_py - t_cpp}
    print(f"pinned threads: {raw['pinned']}; build {timings['build_s']:.1f} s, C++ part "
          f"{timings['cpp_s']:.1f} s, Python part {timings['python_s']:.1f} s")

    out = args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    result = {"name": "ring", "quick": args.quick, "machine": machine(), "figures": figures, "ratios": ratios}
    out.write_text(json.dumps(result, indent=2) + "\n")
    raw_path = out.with_name(out.stem + "_raw.json")
    raw_path.write_text(json.dumps({"config": cfg, "timings_s": timings, "ring_bench": raw,
                                    "python_us_per_chunk": py}, indent=1) + "\n")
    print(f"wrote {out} and {raw_path.name}")
    plot(ratios, out.with_suffix(".png"), f"ring{' (quick)' if args.quick else ''}: {machine()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

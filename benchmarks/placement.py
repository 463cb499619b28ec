"""Cost of a remote node call: in-process vs a node placed in a worker process.

One node (``y = x``: no compute, so only the runtime's own cost is timed) served by a Runtime
in this process and by a PlacedRuntime with the node on worker rank 1 (ZeroMQ control messages,
tensors through the shared-memory arenas).
Requests run one at a time, the two runtimes alternating so machine noise hits both alike; the
difference of the medians is the overhead per remote node call (both directions), for a 1 MiB
tensor and for a 16-byte one.

    python benchmarks/placement.py [--quick]      # table + benchmarks/results/placement.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench_common import use_source_tree  # noqa: E402

use_source_tree()

import torch  # noqa: E402

from mstar_rt import EMIT, GraphEdge, GraphNode, Model, NodeSubmodule, Runtime  # noqa: E402
from mstar_rt.placement import NodeGroup, PlacedRuntime  # noqa: E402

SIZES = {"1mb": 1 << 20, "16b": 16}


class Identity(NodeSubmodule):
    def forward(self, batch: list[dict]) -> list[dict]:
        return [{"y": item["x"]} for item in batch]


class OneNode(Model):
    inputs = ("x",)

    def __init__(self) -> None:
        self.nodes = [GraphNode("work", ["x"], [GraphEdge(EMIT, "y")])]
        self.walks = {"run": "work"}
        self.submodules = {"work": Identity()}


def one_node() -> OneNode:
    """The factory the worker imports (``placement:one_node``, this file on its sys.path)."""
    return OneNode()


def timed(rt: Any, x: torch.Tensor) -> float:
    t0 = time.perf_counter()
    out = rt.submit({"x": x}).result(30)["y"][0]
    took = time.perf_counter() - t0
    assert out.shape == x.shape
    return took


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer requests (well under a minute)")
    args = ap.parse_args()
    n, warm = (150, 20) if args.quick else (1000, 50)
    sys.path.insert(0, str(HERE))  # so this process and the worker import "placement"
    local = Runtime(one_node())
    # A small arena: the warm-up touches all of it, so page faults of first use stay out of
    # the timings (a 64 MiB one would fault in for 64 requests of 1 MiB).
    placed = PlacedRuntime("placement:one_node", [NodeGroup(["work"], rank=1)], progress=False,
                           shm_bytes=4 << 20)
    figures: dict[str, float] = {}
    try:
        for label, nbytes in SIZES.items():
            x = torch.randn(nbytes // 4)
            times: dict[str, list[float]] = {"inprocess": [], "placed": []}
            for i in range(warm + n):
                for name, rt in (("inprocess", local), ("placed", placed)):
                    t = timed(rt, x)
                    if i >= warm:
                        times[name].append(t)
            for name, ts in times.items():
                ts.sort()
                figures[f"{name}_p50_us_{label}"] = statistics.median(ts) * 1e6
                figures[f"{name}_p99_us_{label}"] = ts[int(0.99 * (len(ts) - 1))] * 1e6
            figures[f"overhead_per_remote_call_us_{label}"] = (
                figures[f"placed_p50_us_{label}"] - figures[f"inprocess_p50_us_{label}"])
    finally:
        placed.close()
        local.close()
    ratios = {f"inprocess_vs_placed_p50_{k}": figures[f"inprocess_p50_us_{k}"]
              / figures[f"placed_p50_us_{k}"] for k in SIZES}
    print(f"{'tensor':>7} {'in-process p50':>15} {'placed p50':>11} {'placed p99':>11} "
          f"{'overhead':>9}")
    for k in SIZES:
        print(f"{k:>7} {figures[f'inprocess_p50_us_{k}']:>12.0f} us "
              f"{figures[f'placed_p50_us_{k}']:>8.0f} us {figures[f'placed_p99_us_{k}']:>8.0f} us "
              f"{figures[f'overhead_per_remote_call_us_{k}']:>6.0f} us")
    from bench_common import machine

    out = HERE / "results" / "placement.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"name": "placement", "quick": args.quick, "machine": machine(),
                               "figures": figures, "ratios": ratios}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

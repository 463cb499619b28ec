"""gpu_check section 'placement': CUDA tensors between worker processes.

A pipeline placed over two worker processes on the same GPU (``device: cuda:0`` each; two
processes share one device): ``make`` (worker 1) turns the request's host tensor into a 1 MiB
tensor and a small one on its CUDA device; ``use`` (worker 2) reads both -- the large one worker
to worker through the maker's export arena, the small one through the parent -- and EMITs their
reduction and the devices it found them on. Checks: outputs equal the in-process Runtime's; both
inputs arrived on ``use``'s CUDA device (the codec's CUDA kind, placement/codec.py); the large
one crossed as a handle. Timed: ms per request, placed against in process, alternating. With
--dry-run-cpu the same runs on the CPU (both devices "cpu")."""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch

import gpu_check_common as common
from bench_common import child_pythonpath
from gpu_check_common import Report

HERE = Path(__file__).resolve().parent
N = 1 << 18  # float32 elements: 1 MiB, past direct_bytes


def device() -> torch.device:
    """The node's device in whichever process runs it (a worker sees its GPU as cuda:0)."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def pipe() -> Any:
    """The factory the workers import (``gpu_check_placement:pipe``)."""
    from mstar_rt import EMIT, GraphEdge, GraphNode, Model, NodeSubmodule, Sequential

    class Make(NodeSubmodule):
        def forward(self, batch: list[dict]) -> list[dict]:
            dev = device()
            return [{"big": b["x"].to(dev) * torch.arange(N, device=dev, dtype=torch.float32),
                     "small": b["x"].to(dev) + 1} for b in batch]

    class Use(NodeSubmodule):
        def forward(self, batch: list[dict]) -> list[dict]:
            return [{"y": b["big"].sum().reshape(1) + b["small"],
                     "where": f"{b['big'].device.type},{b['small'].device.type}"}
                    for b in batch]

    class Pipe(Model):
        inputs = ("x",)

        def __init__(self) -> None:
            self.nodes = [GraphNode("make", ["x"], ["big", "small"], submodule=Make()),
                          GraphNode("use", ["big", "small"], [GraphEdge(EMIT, "y"),
                                                              GraphEdge(EMIT, "where")],
                                    submodule=Use())]
            self.walks = {"main": Sequential("make", "use")}

    return Pipe()


def placement_check(report: Report) -> None:
    import mstar_rt
    from mstar_rt.placement import NodeGroup, PlacedRuntime

    os.environ["PYTHONPATH"] = child_pythonpath(str(HERE))  # the workers import this file
    dev = "cuda:0" if common.DEVICE == "cuda" else "cpu"
    groups = [NodeGroup(["make"], rank=1, device=dev), NodeGroup(["use"], rank=2, device=dev)]
    reps = 10 if report.args.quick else 50
    f = report.data["figures"]
    with mstar_rt.Runtime(pipe()) as local, \
            PlacedRuntime("gpu_check_placement:pipe", groups, progress=False) as placed:
        def run(rt: Any, x: float) -> dict:
            return dict(rt.submit({"x": torch.tensor([x])}))

        worst, where = 0.0, set()
        for i in range(3):
            want, got = run(local, float(i)), run(placed, float(i))
            worst = max(worst, float((got["y"].cpu() - want["y"].cpu()).abs().max()))
            where.add(got["where"])
        expect = f"{common.DEVICE},{common.DEVICE}"
        report.log(f"placement: use's inputs arrived on {sorted(where)} (want {expect})")
        report.check("placement_inputs_not_on_the_nodes_device", float(where != {expect}), 0.0)
        report.check("placement_output_vs_in_process_rel",
                     worst / float(want["y"].abs().max().cpu()), 1e-6)
        report.check("placement_large_tensor_not_worker_to_worker",
                     float(placed.workers[1]["exports"] < 3), 0.0)
        times: dict[str, list[float]] = {"inproc": [], "placed": []}
        for rep in range(reps):
            for name, rt in (("inproc", local), ("placed", placed)):
                t0 = time.perf_counter()
                run(rt, float(rep))
                times[name].append(time.perf_counter() - t0)
        for name, v in times.items():
            f[f"placement_ms_per_request_{name}"] = round(statistics.median(v) * 1e3, 3)
        report.log(f"placement: {f['placement_ms_per_request_placed']} ms per request placed "
                   f"(1 MiB worker to worker), {f['placement_ms_per_request_inproc']} in process")


__all__ = ["pipe", "placement_check"]

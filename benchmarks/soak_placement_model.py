"""The model of the placement soak (soak_placement.py), built by import path in the parent and
in each worker process (``soak_placement_model:chaos``).

``pre`` (the parent) doubles ``x``; ``scale`` (worker rank 1) adds one; a DynamicLoop of
``step`` (worker rank 2) adds one per iteration for ``n`` iterations, EMITting the first element
after each as ``tok``; ``finish`` (the parent) EMITs the whole tensor as ``y``. ``x`` holds small
integers in float32, so every output is known exactly: tokens 2 x[0] + 1 + i for i in 1..n and
y = 2 x + 1 + n. Tensors cross parent -> rank 1 -> rank 2 -> parent, worker to worker directly
when large enough (placement/direct.py)."""

from __future__ import annotations

import time
from typing import Any, Mapping

from mstar_rt import EMIT, DynamicLoop, GraphEdge, GraphNode, Model, NodeSubmodule, Sequential

MAX_STEPS = 64
WORKER_NODES = {1: ["scale"], 2: ["step"]}


class Affine(NodeSubmodule):
    max_batch = 8

    def __init__(self, src: str, dst: str, scale: float, shift: float) -> None:
        self.src, self.dst, self.scale, self.shift = src, dst, scale, shift

    def forward(self, batch: list[dict]) -> list[Mapping[str, Any]]:
        return [{self.dst: item[self.src] * self.scale + self.shift} for item in batch]


class Step(NodeSubmodule):
    """g -> g + 1, its first element EMITted; stops after ``n`` iterations, each ``pause`` s."""

    max_batch = 8

    def prepare_inputs(self, ctx: Any, inputs: dict) -> dict:
        time.sleep(inputs["pause"])
        return {**inputs, "iteration": ctx.iteration}

    def forward(self, batch: list[dict]) -> list[Mapping[str, Any]]:
        out = []
        for item in batch:
            g = item["g"] + 1
            out.append({"g": g, "tok": int(g[0])})
        return out

    def check_stop(self, batch: list[dict], outputs: list) -> list:
        return [("steps",) if b["iteration"] + 1 >= b["n"] else () for b in batch]


class Chaos(Model):
    inputs = ("x", "n", "pause")
    input_defaults = {"pause": 0.0}

    def __init__(self) -> None:
        self.nodes = [
            GraphNode("pre", ["x"], ["h"], submodule=Affine("x", "h", 2.0, 0.0)),
            GraphNode("scale", ["h"], ["g"], submodule=Affine("h", "g", 1.0, 1.0)),
            GraphNode("step", ["g", "n", "pause"],
                      [GraphEdge("finish", "g"), GraphEdge(EMIT, "tok")], submodule=Step()),
            GraphNode("finish", ["g"], [GraphEdge(EMIT, "y")],
                      submodule=Affine("g", "y", 1.0, 0.0)),
        ]
        self.walks = {"main": Sequential("pre", "scale",
                                         DynamicLoop("step", MAX_STEPS, "steps", outputs=["g"]),
                                         "finish")}


def chaos() -> Chaos:
    return Chaos()

"""A tiny Python-defined model for the embedding tests (numpy only, no torch).

walk "main": scale (x -> y = factor * x, EMITted) then a Loop of `steps` runs of count, which
EMITs each iteration's index plus y's sum. validate_inputs refuses a non-1-d x; scale raises for
x[0] < 0; `delay_s` slows count down so a test can cancel mid-request; `y_dtype` makes y an
array C++ may not take.
"""

import time

import numpy as np

import mstar_rt as m
from mstar_rt import EMIT, GraphEdge, GraphNode, Loop, Sequential


class Scale(m.NodeSubmodule):
    max_batch = 4

    def __init__(self, factor: float, y_dtype: str) -> None:
        self.factor, self.y_dtype = factor, y_dtype

    def forward(self, batch):
        out = []
        for item in batch:
            x = np.asarray(item["x"])
            if x[0] < 0:
                raise ValueError(f"x[0] is {x[0]}; this model takes x[0] >= 0")
            out.append({"y": (self.factor * x).astype(self.y_dtype)})
        return out


class Count(m.NodeSubmodule):
    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s

    def prepare_inputs(self, ctx, inputs):
        return {"y": inputs["y"], "i": ctx.iteration}

    def forward(self, batch):
        if self.delay_s:
            time.sleep(self.delay_s)
        return [{"step": np.array([item["i"] + float(np.sum(item["y"]))], np.float64)} for item in batch]


class TinyModel(m.Model):
    inputs = ("x",)
    nodes = [GraphNode("scale", ["x"], [GraphEdge(EMIT, "y"), GraphEdge("count", "y")]),
             GraphNode("count", ["y"], [GraphEdge(EMIT, "step")])]

    def __init__(self, factor: float = 2.0, steps: int = 3, delay_s: float = 0.0,
                 y_dtype: str = "float32") -> None:
        self.walks = {"main": Sequential("scale", Loop("count", max_iters=steps))}
        self.submodules = {"scale": Scale(factor, y_dtype), "count": Count(delay_s)}

    def validate_inputs(self, inputs):
        if np.asarray(inputs["x"]).ndim != 1:
            raise ValueError(f"x must be 1-d, got shape {np.asarray(inputs['x']).shape}")

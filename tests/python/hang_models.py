"""A model for test_placement_hangs.py, built by import path in the parent and in a worker:
``work`` (placed in the worker) runs as its input says -- "ok" returns at once, "spin" loops
forever in Python, "sleep" sleeps ``seconds``."""

from __future__ import annotations

import time

from mstar_rt import EMIT, GraphEdge, GraphNode, Model, NodeSubmodule


class Work(NodeSubmodule):
    def forward(self, batch):
        out = []
        for item in batch:
            if item["mode"] == "spin":
                while True:  # a node that never returns (and keeps releasing the GIL)
                    pass
            if item["mode"] == "sleep":
                time.sleep(float(item["seconds"]))
            out.append({"y": item["seconds"] * 2})
        return out


class HangModel(Model):
    inputs = ("mode", "seconds")
    input_defaults = {"seconds": 0.0}
    nodes = [GraphNode("work", ["mode", "seconds"], [GraphEdge(EMIT, "y")])]
    walks = {"main": "work"}

    def __init__(self) -> None:
        self.submodules = {"work": Work()}


def hang_model() -> HangModel:
    return HangModel()

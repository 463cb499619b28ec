"""The Python-defined model the package consumer serves from C++: y = x * gain + offset (numpy)."""

import numpy as np

import mstar_rt as m
from mstar_rt import EMIT, GraphEdge, GraphNode


class Affine(m.NodeSubmodule):
    def __init__(self, gain: float, offset: float) -> None:
        self.gain, self.offset = gain, offset

    def forward(self, batch):
        return [{"y": (np.asarray(item["x"]) * self.gain + self.offset).astype(np.float32)}
                for item in batch]


class AffineModel(m.Model):
    inputs = ("x",)
    nodes = [GraphNode("affine", ["x"], [GraphEdge(EMIT, "y")])]
    walks = {"main": "affine"}

    def __init__(self, gain: float = 1.0, offset: float = 0.0) -> None:
        self.submodules = {"affine": Affine(gain, offset)}

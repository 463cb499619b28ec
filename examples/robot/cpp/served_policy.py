"""The robot demo's chunk policy (examples/robot/policy.py) as the C++ controller loads it:
module path + class + config kwargs (JSON from C++).

    ServedPolicy(weights=None, torch_threads=1)

`weights`: a safetensors file written by ChunkMLP.save (default: the demo's policy.safetensors).
`torch_threads`: torch intra-op threads for the MLP; 1 keeps a small machine's cores for the
control loop (the forward pass is ~0.1 ms, an OpenMP team would only spin).
"""

from __future__ import annotations

import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # examples/robot
from policy import WEIGHTS, ChunkMLP, ChunkPolicyModel  # noqa: E402


class ServedPolicy(ChunkPolicyModel):
    """Request inputs: {"obs": float32 (8,)}; EMITs "actions": float32 (H, 2)."""

    def __init__(self, weights: str | None = None, torch_threads: int = 1) -> None:
        torch.set_num_threads(int(torch_threads))
        super().__init__(ChunkMLP.load(weights or WEIGHTS))

"""Where a sampling model's randomness comes from (flow policies' starting noise, a CEM
planner's candidates): the request's ``seed`` when it gives one -- the same seed, the same
draw -- else a fresh seed for every request, as LeRobot's and openpi's policies draw fresh noise
at every call (a fixed default gave every robot and every request the same noise)."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

_SYSTEM = random.SystemRandom()  # os.urandom: no shared generator state between threads


def whole_number(value: Any, name: str) -> int:
    """Input ``name`` as an int >= 0 (a Python, NumPy or one-element torch integer)."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = int(value)
    if isinstance(value, np.integer):
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"'{name}' must be an integer >= 0; got {value!r}")
    return value


def request_seed(value: Any) -> int:
    """A request's ``seed`` input checked, or a fresh one where it gives none (None)."""
    return _SYSTEM.getrandbits(63) if value is None else whole_number(value, "seed")


__all__ = ["request_seed", "whole_number"]

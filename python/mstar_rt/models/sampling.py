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


def whole_number(value: Any, name: str, minimum: int = 0) -> int:
    """Input ``name`` as an int >= ``minimum``: a Python or NumPy integer, or a one-element
    integer array or tensor (as openpi_client sends one). A float or bool one is refused, not
    truncated: tensor(2.7) served horizon 2."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        integral = not (value.dtype.is_floating_point or value.dtype.is_complex
                        or value.dtype == torch.bool)
        value = int(value.item()) if integral else value.item()
    elif isinstance(value, np.ndarray) and value.size == 1:
        value = int(value.item()) if value.dtype.kind in "iu" else value.item()
    if isinstance(value, np.integer):
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"'{name}' must be an integer >= {minimum}; got {value!r}")
    return value


def request_seed(value: Any) -> int:
    """A request's ``seed`` input checked (below 2**63, which torch's generators take), or a
    fresh one where it gives none (None)."""
    if value is None:
        return _SYSTEM.getrandbits(63)
    seed = whole_number(value, "seed")
    if seed >= 2**63:  # it failed later with "Overflow when unpacking long long"
        raise ValueError(f"'seed' must be below 2**63; got {seed}")
    return seed


__all__ = ["request_seed", "whole_number"]

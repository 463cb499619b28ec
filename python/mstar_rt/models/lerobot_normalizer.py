"""One feature's normalisation as LeRobot's ``NormalizerProcessorStep`` and
``UnnormalizerProcessorStep`` do it, shared by every LeRobot policy we load (pi0, pi0.5,
SmolVLA): MEAN_STD ``(x - mean) / (std + eps)``, MIN_MAX / QUANTILES / QUANTILE10
``2 (x - lo) / (hi - lo) - 1`` (eps where ``hi == lo``), IDENTITY; the inverse for actions.

The statistics are checked when the policy loads, so a checkpoint whose statistics do not fit
its config fails there by name instead of as a shape error in every request.
"""

from __future__ import annotations

import math
from typing import Mapping, Optional

import torch

#: The statistics each normalisation mode reads: (low, high).
NORM_STATS = {"MEAN_STD": ("mean", "std"), "MIN_MAX": ("min", "max"),
              "QUANTILES": ("q01", "q99"), "QUANTILE10": ("q10", "q90"), "IDENTITY": ()}


def step_eps(config: Mapping, where: str) -> float:
    """A normalizer step's ``eps`` (default 1e-8): a finite number >= 0, else a ValueError
    naming ``where`` (the processor file and step)."""
    eps = config.get("eps", 1e-8)
    if type(eps) not in (int, float) or not math.isfinite(eps) or eps < 0:
        raise ValueError(f"{where}: eps {eps!r} must be a finite number >= 0")
    return float(eps)


class Normalizer:
    """``name``'s normalisation with ``mode`` over ``stats``; ``size`` (the feature's length in
    config.json) and ``source`` (where the statistics were read) make the load-time errors
    name what to fix."""

    def __init__(self, name: str, mode: str, stats: Mapping[str, torch.Tensor],
                 eps: float = 1e-8, size: Optional[int] = None,
                 source: str = "the normalizer statistics") -> None:
        if mode not in NORM_STATS:
            raise ValueError(f"normalization mode {mode!r} of '{name}' is not one of "
                             f"{sorted(NORM_STATS)}")
        for k in NORM_STATS[mode]:
            if k not in stats:
                raise ValueError(f"{source} lacks '{name}.{k}', which {mode} normalization "
                                 f"of '{name}' needs")
            t = stats[k]
            if size is not None and tuple(t.shape) != (size,):
                raise ValueError(f"the '{name}' statistic '{k}' has shape {list(t.shape)}, but "
                                 f"config.json gives '{name}' {size} values (statistics read "
                                 f"from {source}); the statistics and the config must come "
                                 "from the same training run")
            if not bool(torch.isfinite(t.float()).all()):
                raise ValueError(f"the '{name}' statistic '{k}' in {source} holds NaN or "
                                 "infinite values (LeRobot's placeholder for statistics never "
                                 "computed); save the policy with its dataset's statistics")
        self.name, self.mode, self.eps = name, mode, eps
        self.stats = {k: stats[k].float() for k in NORM_STATS[mode]}

    def _bounds(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        lo, hi = (self.stats[k].to(x.device, x.dtype) for k in NORM_STATS[self.mode])
        return lo, hi

    def _span(self, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
        """``hi - lo``, eps where it is 0 (a constant feature)."""
        span = hi - lo
        return torch.where(span == 0, torch.tensor(self.eps, dtype=span.dtype,
                                                   device=span.device), span)

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        if self.mode == "IDENTITY":
            return x
        lo, hi = self._bounds(x)
        if self.mode == "MEAN_STD":
            return (x - lo) / (hi + self.eps)
        return 2.0 * (x - lo) / self._span(lo, hi) - 1.0

    def unnormalize(self, y: torch.Tensor) -> torch.Tensor:
        if self.mode == "IDENTITY":
            return y
        lo, hi = self._bounds(y)
        if self.mode == "MEAN_STD":
            return y * hi + lo
        if self.mode == "MIN_MAX":  # LeRobot's two forms round differently; each is kept
            return (y + 1) / 2 * self._span(lo, hi) + lo
        return (y + 1.0) * self._span(lo, hi) / 2.0 + lo

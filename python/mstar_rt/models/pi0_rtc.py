"""Real-time chunking (Black et al. 2025) for the flow-matching action expert, both forms.

Flow time ``tau`` runs from 0 (noise) to 1 (clean). A new chunk is generated while the previous
one still executes: its first ``d`` actions (the delay) will be executed from the previous chunk
whatever the new one says, and the next ones overlap it.

* **trained**: the policy was trained with per-action flow times. The first d actions start as
  the previous chunk's and sit at ``tau = 1`` (clean) while the rest carry the current time; no
  Euler step moves them. No backward pass; exact.
* **guided** (training-free inpainting): every step adds a guidance term, the vector-Jacobian
  product of the weighted error between the previous chunk and the step's clean estimate
  ``x + (1 - tau) v`` through the expert, scaled by ``min(beta, (tau^2 + (1 - tau)^2) /
  (tau (1 - tau)))``. Weights are 1 below d, decay exponentially over the rest of the overlap,
  0 after it. One extra backward pass of the expert per step.

This is the miniature ``Pi0Policy``'s; LeRobot's checkpoints (pi0, pi0.5, SmolVLA) use
LeRobot's guided form, which has no backward pass: :mod:`mstar_rt.models.lerobot_rtc`.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch

RTC_MODES = ("trained", "guided")


def action_times(tau: float, horizon: int, frozen: int, device: Any = None,
                 dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Per-action flow times ``[H]``: ``tau`` everywhere but the ``frozen`` leading actions,
    which are clean (1)."""
    t = torch.full((horizon,), float(tau), device=device, dtype=dtype)
    t[:frozen] = 1.0
    return t


def euler_step(x: torch.Tensor, v: torch.Tensor, num_steps: int, frozen: int) -> torch.Tensor:
    """One Euler step of ``1 / num_steps``; the frozen leading actions do not move."""
    out = x + v / num_steps
    if frozen:
        out[:frozen] = x[:frozen]
    return out


def prefix_weights(delay: int, overlap: int, horizon: int, device: Any = None,
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Guidance weights ``[H]``: 1 for the first ``delay`` actions, an exponential decay over
    ``[delay, overlap)``, 0 from ``overlap`` on (the paper's "exp" schedule with
    ``H - s = overlap``)."""
    w = torch.zeros(horizon, dtype=torch.float64)
    w[:delay] = 1.0
    span = overlap - delay + 1
    for i in range(delay, overlap):
        c = (overlap - i) / span
        w[i] = c * (math.exp(c) - 1) / (math.e - 1)
    return w.to(device=device, dtype=dtype)


def guidance_scale(tau: torch.Tensor, beta: float) -> torch.Tensor:
    """``min(beta, (1 - tau) / (tau * r^2))`` with ``r^2 = (1 - tau)^2 / (tau^2 + (1 - tau)^2)``,
    elementwise; ``beta`` where it is unbounded (tau = 0)."""
    t = tau.double()
    raw = (t * t + (1 - t) ** 2) / (t * (1 - t))
    raw = torch.where(t > 0, raw, torch.full_like(raw, math.inf))
    return raw.clamp(max=beta).to(tau.dtype)


def guided_step(x: torch.Tensor, tau: torch.Tensor, target: torch.Tensor, weights: torch.Tensor,
                beta: float, num_steps: int,
                velocity: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """One guided Euler step over rows ``x [R, A]`` (one or more chunks, flat) with per-row
    times ``tau [R]``, previous actions ``target [R, A]`` and weights ``[R]``. ``velocity(x)``
    must be differentiable in ``x`` (rows of different chunks must not interact in it except
    through attention within a chunk, as the expert's)."""
    with torch.inference_mode(False), torch.enable_grad():
        xg = x.detach().clone().requires_grad_(True)
        v = velocity(xg)
        clean = xg + (1 - tau)[:, None] * v
        error = (target - clean).detach() * weights[:, None]
        (g,) = torch.autograd.grad(clean, xg, grad_outputs=error)
    scale = guidance_scale(tau, beta)
    return (x + (v.detach() + scale[:, None] * g) / num_steps).detach()

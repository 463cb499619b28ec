"""One request to a LeRobot pi0 / pi0.5 policy, checked; and the flow step with LeRobot's
guided real-time chunking (RTC).

Inputs (raw, as a robot gives them): ``images`` (a dict by camera name, a list in the
checkpoint's camera order, or one image; float ``[3, H, W]`` in [0, 1] or uint8; at least one
camera, missing ones are left out as LeRobot masks them), ``state [state_dim]``, ``task`` (the
instruction); optional ``noise [chunk, max_action_dim]`` (else drawn from ``seed``), and for RTC
``delay`` (d) and ``prev_actions [N, action_dim]`` (the previous chunk's actions still to
execute, un-normalised as the policy returned them).

Flow matching in LeRobot's convention: ``t`` runs from 1 (noise) to 0 (actions) in Euler steps
``x <- x + dt * v`` with ``dt = -1 / num_steps``. Guided RTC (LeRobot's ``RTCProcessor``, after
Black et al. 2025): with ``x1 = x - t v`` the clean estimate and ``W`` the prefix weights
(1 below d, decaying to the execution horizon by the schedule, 0 after), the velocity becomes
``v - g * W (prev - x1)`` with ``g = min(max_w, (1 - tau) / tau * ((1 - tau)^2 + tau^2) /
(1 - tau)^2)``, ``tau = 1 - t``. The paper multiplies the error by the Jacobian of ``x1``
(a backward pass through the expert); LeRobot computes ``v`` outside the autograd graph, so
its Jacobian is the identity -- reproduced here, as LeRobot's chunks are the reference.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Optional

import numpy as np
import torch

from mstar_rt.models.lerobot_pi0_config import RtcSettings
from mstar_rt.models.lerobot_pi0_io import PiProcessor


@dataclass
class PiRequest:
    """A request's checked inputs: ``images`` as (camera index, image) in LeRobot's order,
    the normalised ``state``, the prompt's token ``ids`` (unpadded), ``noise [H, D]``, and for
    RTC the ``delay`` and the normalised, padded ``prev [N, D]`` (None: no guidance)."""

    images: list
    state: torch.Tensor
    ids: torch.Tensor
    noise: torch.Tensor
    delay: int
    prev: Optional[torch.Tensor]


def _int(value: Any, name: str, low: int) -> int:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = int(value)
    if isinstance(value, np.integer):
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"'{name}' must be an integer >= {low}; got {value!r}")
    return value


def camera_images(cameras: tuple[str, ...], images: Any) -> list:
    """``images`` as (camera index, image) pairs in the checkpoint's camera order."""
    if images is None:
        images = []
    if isinstance(images, Mapping):
        unknown = [k for k in images if k not in cameras]
        if unknown:
            raise ValueError(f"'images' names cameras {unknown} the policy does not have; its "
                             f"cameras are {list(cameras)}")
        pairs = [(i, images[k]) for i, k in enumerate(cameras) if images.get(k) is not None]
    else:
        if isinstance(images, (np.ndarray, torch.Tensor)) and images.ndim == 3:
            images = [images]
        images = list(images)
        if len(images) > len(cameras):
            raise ValueError(f"'images' holds {len(images)} images; the policy has "
                             f"{len(cameras)} cameras {list(cameras)}")
        pairs = [(i, im) for i, im in enumerate(images) if im is not None]
    if not pairs:
        raise ValueError(f"'images' must hold at least one camera image of {list(cameras)}")
    return pairs


def check_request(processor: PiProcessor, inputs: Mapping[str, Any], device: Any = "cpu",
                  rtc: Optional[RtcSettings] = None) -> PiRequest:
    """Validates a request and prepares what the model needs; ValueError naming the input."""
    c = processor.config
    for key in ("state", "task"):
        if inputs.get(key) is None:
            raise ValueError(f"{c.family} input '{key}' is missing")
    task = inputs["task"]
    if not isinstance(task, str):
        raise ValueError(f"'task' must be a string (the instruction); got {type(task).__name__}")
    images = camera_images(c.cameras, inputs.get("images"))
    state = processor.state_vector(inputs["state"])
    ids = processor.tokens(processor.prompt(task, state))
    shape = (c.chunk_size, c.max_action_dim)
    noise = inputs.get("noise")
    if noise is None:
        g = torch.Generator().manual_seed(_int(inputs.get("seed", 0) or 0, "seed", 0))
        noise = torch.randn(shape, generator=g)
    noise = torch.as_tensor(noise).float()
    if noise.dim() == 3 and noise.shape[0] == 1:
        noise = noise[0]
    if tuple(noise.shape) != shape:
        raise ValueError(f"'noise' must be [{shape[0]}, {shape[1]}] (chunk_size, "
                         f"max_action_dim); got {list(noise.shape)}")
    if not bool(torch.isfinite(noise).all()):
        raise ValueError("'noise' holds NaN or infinite values; give finite numbers")
    delay = _int(inputs.get("delay", 0) or 0, "delay", 0)
    prev = inputs.get("prev_actions")
    if prev is not None:
        if rtc is None or not rtc.enabled:
            raise ValueError("'prev_actions' asks for real-time chunking, which this policy "
                             "serves without (its RtcSettings are disabled)")
        p = torch.as_tensor(np.asarray(prev) if not isinstance(prev, torch.Tensor) else prev)
        if p.dim() != 2 or p.shape[0] < 1 or p.shape[1] != c.action_dim or \
                not p.dtype.is_floating_point or not bool(torch.isfinite(p).all()):
            raise ValueError(f"'prev_actions' must be finite floats [N >= 1, {c.action_dim}] "
                             f"(the previous chunk's actions still to execute); got "
                             f"{p.dtype} {list(p.shape)}")
        prev = processor.normalized_actions(p[: c.chunk_size]).to(device)
    elif delay:
        raise ValueError(f"'delay' {delay} needs 'prev_actions' (the previous chunk's actions "
                         "still to execute, at least d of them)")
    if delay >= c.chunk_size:
        raise ValueError(f"'delay' {delay} must be below the chunk size {c.chunk_size}")
    return PiRequest(images, state.to(device), ids.to(device), noise.to(device), delay, prev)


# ---- real-time chunking ------------------------------------------------------------------------

def prefix_weights(schedule: str, start: int, end: int, total: int) -> torch.Tensor:
    """LeRobot's RTC prefix weights ``[total]``: 1 for the first ``start`` actions, then the
    schedule's decay until ``end`` (the execution horizon), 0 after it."""
    start = min(start, end)
    if schedule == "ZEROS":
        w = torch.zeros(total)
        w[:start] = 1.0
        return w
    if schedule == "ONES":
        w = torch.ones(total)
        w[end:] = 0.0
        return w
    steps = total - max(total - end, 0) - start
    ramp = torch.linspace(1, 0, steps + 2)[1:-1] if end > start and steps > 0 else torch.zeros(0)
    if schedule == "EXP":
        ramp = ramp * torch.expm1(ramp).div(math.e - 1)
    parts = [torch.ones(min(start, total)), ramp, torch.zeros(max(total - end, 0))]
    return torch.cat(parts)


def guidance_weight(tau: torch.Tensor, max_weight: float) -> torch.Tensor:
    """``min(max_w, (1 - tau) / tau * ((1 - tau)^2 + tau^2) / (1 - tau)^2)`` elementwise
    (``tau = 1 - t``, float32 as LeRobot computes it), infinite values replaced by ``max_w``."""
    cap = torch.as_tensor(max_weight)
    one_minus_sq = (1 - tau) ** 2
    inv_r2 = (one_minus_sq + tau ** 2) / one_minus_sq
    c = torch.nan_to_num((1 - tau) / tau, posinf=float(cap))
    return torch.minimum(torch.nan_to_num(c * inv_r2, posinf=float(cap)), cap)


@dataclass
class Guidance:
    """Per flat row of a batch: the target (previous actions, normalised and padded), the
    prefix weight (0 for requests without guidance), the flow time and the guidance weight."""

    target: torch.Tensor
    weights: torch.Tensor
    time: torch.Tensor
    scale: torch.Tensor


def guided_velocity(v: torch.Tensor, x: torch.Tensor, g: Guidance) -> torch.Tensor:
    """LeRobot's guided velocity over rows ``x [R, D]`` with the plain velocity ``v``:
    ``v - scale * W (prev - (x - t v))``. (LeRobot differentiates ``x - t v`` by ``x`` after
    computing ``v`` outside the graph, so its vector-Jacobian product is the weighted error
    itself: no backward pass through the expert.)"""
    x1 = x - g.time[:, None] * v
    err = (g.target - x1) * g.weights[:, None]
    return v - g.scale[:, None] * err


def guidance(requests: list[PiRequest], times: list[float], rtc: Optional[RtcSettings],
             chunk: int, dim: int, device: Any) -> Optional[Guidance]:
    """The :class:`Guidance` of a batch (request i at flow time ``times[i]``), or None when no
    request in it asks for it."""
    if rtc is None or not rtc.enabled or all(r.prev is None for r in requests):
        return None
    targets, weights = [], []
    for r in requests:
        target = torch.zeros(chunk, dim, device=device)
        w = torch.zeros(chunk)
        if r.prev is not None:
            n = r.prev.shape[0]
            target[:n] = r.prev
            w = prefix_weights(rtc.schedule, r.delay, min(rtc.execution_horizon, n), chunk)
        targets.append(target)
        weights.append(w.to(device))
    tau = torch.tensor([1 - t for t in times])  # in float64, then float32, as LeRobot
    rows = lambda v: v.to(device).repeat_interleave(chunk)  # noqa: E731
    return Guidance(torch.cat(targets), torch.cat(weights),
                    rows(torch.tensor(times, dtype=torch.float32)),
                    rows(guidance_weight(tau, rtc.max_guidance_weight)))

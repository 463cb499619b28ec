"""LeRobot's guided real-time chunking (RTC), shared by pi0, pi0.5 and SmolVLA: the settings
(``rtc_config``), the request's ``delay`` and ``prev_actions``, and the guided flow step.

A request gives ``delay`` (d) and ``prev_actions [N, action_dim]``: the previous chunk's actions
still to execute, un-normalised as the policy returned them (normalised and zero-padded here).
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
from typing import Any, Callable, Mapping, Optional, Protocol, Sequence

import numpy as np
import torch

from mstar_rt.models.checkpoint import ConfigFields
from mstar_rt.models.sampling import whole_number

#: LeRobot's ``RTCAttentionSchedule``: how the prefix weights fall from d to the horizon.
RTC_SCHEDULES = ("ZEROS", "ONES", "LINEAR", "EXP")


@dataclass(frozen=True)
class RtcSettings:
    """LeRobot's ``rtc_config`` (guided real-time chunking): the prefix-weight schedule
    (ZEROS, ONES, LINEAR, EXP), the guidance weight's cap and the execution horizon."""

    schedule: str = "LINEAR"
    max_guidance_weight: float = 10.0
    execution_horizon: int = 10
    enabled: bool = True

    def __post_init__(self) -> None:
        # Built by hand, "exp" ran as LINEAR, a NaN cap served NaN actions and a negative
        # horizon failed every request: refused here, naming the field, as config.json is.
        given = self.schedule
        if not isinstance(given, str) or given.upper() not in RTC_SCHEDULES:
            raise ValueError(f"RtcSettings.schedule is {given!r}; LeRobot knows "
                             f"{list(RTC_SCHEDULES)} (any case)")
        object.__setattr__(self, "schedule", given.upper())
        w = self.max_guidance_weight
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not 0 < w < math.inf:
            raise ValueError(f"RtcSettings.max_guidance_weight is {w!r}; give a finite number > 0")
        h = self.execution_horizon
        if isinstance(h, bool) or not isinstance(h, int) or h < 0:
            raise ValueError(f"RtcSettings.execution_horizon is {h!r}; give an integer >= 0")
        if not isinstance(self.enabled, bool):
            raise ValueError(f"RtcSettings.enabled is {self.enabled!r}; give True or False")


def rtc_settings(value: Any, source: str) -> Optional[RtcSettings]:
    """The ``rtc_config`` field of the ``config.json`` ``source`` names: None for null, else
    LeRobot's ``RTCConfig`` fields, checked as it checks them (``max_guidance_weight > 0``) plus
    their types; its ``debug`` fields only record and are ignored. ValueError naming the field."""
    if value is None:
        return None
    r = ConfigFields(ConfigFields({"rtc_config": value}, source).mapping("rtc_config"),
                     f"rtc_config of {source}")
    given = r.text("prefix_attention_schedule", "LINEAR")
    schedule = given.upper()
    if schedule not in RTC_SCHEDULES:
        raise ValueError(f"field 'prefix_attention_schedule' of rtc_config of {source} is "
                         f"{given!r}; LeRobot knows {list(RTC_SCHEDULES)}")
    return RtcSettings(schedule, r.number("max_guidance_weight", 10.0),
                       r.integer("execution_horizon", 10, minimum=0), r.flag("enabled", True))


def guidance_inputs(inputs: Mapping[str, Any], rtc: Optional[RtcSettings], action_dim: int,
                    chunk_size: int, normalize: Callable[[torch.Tensor], torch.Tensor]
                    ) -> tuple[int, Optional[torch.Tensor]]:
    """A request's ``delay`` and ``prev_actions`` (raw ``[N, action_dim]``), checked ->
    (delay, ``normalize(prev_actions[:chunk_size])`` or None: no guidance). ``normalize`` maps
    raw actions to the model's (normalised, zero-padded to ``max_action_dim``, on its device)."""
    delay = whole_number(inputs.get("delay", 0) or 0, "delay")
    prev = inputs.get("prev_actions")
    if prev is not None:
        if rtc is None or not rtc.enabled:
            raise ValueError("'prev_actions' asks for real-time chunking, which this policy "
                             "serves without (its RtcSettings are disabled)")
        p = torch.as_tensor(np.asarray(prev) if not isinstance(prev, torch.Tensor) else prev)
        if p.dim() != 2 or p.shape[0] < 1 or p.shape[1] != action_dim or \
                not p.dtype.is_floating_point or not bool(torch.isfinite(p).all()):
            raise ValueError(f"'prev_actions' must be finite floats [N >= 1, {action_dim}] "
                             f"(the previous chunk's actions still to execute); got "
                             f"{p.dtype} {list(p.shape)}")
        prev = normalize(p[:chunk_size])
    elif delay:
        raise ValueError(f"'delay' {delay} needs 'prev_actions' (the previous chunk's actions "
                         "still to execute, at least d of them)")
    if delay >= chunk_size:
        raise ValueError(f"'delay' {delay} must be below the chunk size {chunk_size}")
    return delay, prev


# ---- the guided flow step ----------------------------------------------------------------------

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


class GuidedRequest(Protocol):
    """What :func:`guidance` reads of a request (pi0's ``PiRequest``, SmolVLA's
    ``SmolVLARequest``): the delay and the normalised, padded ``prev [N, D]`` (None: no
    guidance)."""

    delay: int
    prev: Optional[torch.Tensor]


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


def guidance(requests: Sequence[GuidedRequest], times: list[float],
             rtc: Optional[RtcSettings], chunk: int, dim: int, device: Any
             ) -> Optional[Guidance]:
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

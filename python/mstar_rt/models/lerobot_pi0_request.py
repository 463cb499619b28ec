"""One request to a LeRobot pi0 / pi0.5 policy, checked.

Inputs (raw, as a robot gives them): ``images`` (a dict by camera name, a list in the
checkpoint's camera order, or one image; float ``[3, H, W]`` in [0, 1] or uint8; at least one
camera, missing ones are left out as LeRobot masks them), ``state [state_dim]``, ``task`` (the
instruction); optional ``noise [chunk, max_action_dim]`` (else drawn from ``seed``), and for
guided real-time chunking ``delay`` (d) and ``prev_actions [N, action_dim]`` (the previous
chunk's actions still to execute, un-normalised as the policy returned them).

The guided flow step, shared with SmolVLA, is :mod:`~mstar_rt.models.lerobot_rtc`; its names
are importable from here too, as they were before it was shared.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional

import torch

from mstar_rt.models.lerobot_inputs import camera_images, flow_noise
from mstar_rt.models.lerobot_pi0_io import PiProcessor
from mstar_rt.models.lerobot_rtc import (Guidance, RtcSettings, guidance, guidance_inputs,
                                         guidance_weight, guided_velocity, prefix_weights)

__all__ = ["PiRequest", "camera_images", "check_request", "Guidance", "RtcSettings", "guidance",
           "guidance_weight", "guided_velocity", "prefix_weights"]


@dataclass
class PiRequest:
    """A request's checked inputs: ``images`` as (camera index, image) in LeRobot's order,
    the normalised ``state``, the prompt's token ``ids`` (unpadded), ``noise [H, D]``, and for
    RTC the ``delay`` and the normalised, padded ``prev [N, D]`` (None: no guidance).
    ``prefix_kv``: the cached prefix's K/V as the flow steps read it, once they have copied it
    out of the pages (a new request object comes with each prefix, so it never outlives it)."""

    images: list
    state: torch.Tensor
    ids: torch.Tensor
    noise: torch.Tensor
    delay: int
    prev: Optional[torch.Tensor]
    prefix_kv: Optional[torch.Tensor] = None


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
    noise = flow_noise(inputs, c.chunk_size, c.max_action_dim)
    delay, prev = guidance_inputs(inputs, rtc, c.action_dim, c.chunk_size,
                                  lambda p: processor.normalized_actions(p).to(device))
    return PiRequest(images, state.to(device), ids.to(device), noise.to(device), delay, prev)

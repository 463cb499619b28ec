"""A SmolVLA request's inputs, checked and preprocessed as LeRobot's pipeline does: camera
images (resized with left/top padding, scaled to [-1, 1]), the task (newline, tokenizer), the
state (normalised, zero-padded), the flow's starting noise, and for guided real-time chunking
the delay and the previous chunk's actions still to execute (normalised, zero-padded). Bad input
is a ValueError that names the input and what it needs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional

import numpy as np
import torch

from mstar_rt.models.lerobot_inputs import camera_images as camera_pairs, flow_noise, unit_image
from mstar_rt.models.lerobot_rtc import RtcSettings, guidance_inputs
from mstar_rt.models.smolvla_checkpoint import LeRobotSmolVLA
from mstar_rt.models.smolvla_vision import resize_with_pad


@dataclass
class SmolVLARequest:
    """A request's model inputs: prompt ids ``[L]``, the normalised padded state
    ``[max_state_dim]`` (module dtype), the noise ``[chunk_size, max_action_dim]`` (float32);
    for guided RTC the ``delay`` and ``prev [N, max_action_dim]`` (normalised, padded; None: no
    guidance) -- the fields :func:`~mstar_rt.models.lerobot_rtc.guidance` reads.
    ``prefix_kv``: the cached prefix's K/V as the flow steps read it, once they have copied it
    out of the pages (a new request object comes with each prefix, so it never outlives it)."""

    prompt: torch.Tensor
    state: torch.Tensor
    noise: torch.Tensor
    delay: int = 0
    prev: Optional[torch.Tensor] = None
    prefix_kv: Optional[torch.Tensor] = None


def camera_images(policy: LeRobotSmolVLA, images: Any) -> list[torch.Tensor]:
    """The request's cameras in the config's order, each float32 ``[3, H, W]`` in [0, 1].
    ``images``: a dict by camera key (any non-empty subset of the config's cameras: a missing
    camera contributes nothing, as in LeRobot), a list in the config's order, or one image.
    An image is float ``[3, H, W]`` in [0, 1] (LeRobot's layout) or uint8 ``[3, H, W]`` /
    ``[H, W, 3]``."""
    cams = policy.config.cameras
    return [unit_image(im, f"image '{cams[i]}'") for i, im in camera_pairs(cams, images)]


def pixels(policy: LeRobotSmolVLA, image: torch.Tensor) -> torch.Tensor:
    """One camera image ``[3, H, W]`` in [0, 1] -> the vision input ``[3, S, S]`` in [-1, 1]
    (LeRobot's ``prepare_images``)."""
    w, h = policy.config.resize_imgs_with_padding
    return resize_with_pad(image[None], h, w)[0] * 2.0 - 1.0


def prompt_ids(policy: LeRobotSmolVLA, task: Any) -> torch.Tensor:
    """``task``: the instruction (a string, tokenized as LeRobot does) or token ids."""
    c = policy.config
    if task is None:
        raise ValueError("SmolVLA input 'task' is missing; give the instruction as a string")
    ids = policy.tokenize(task) if isinstance(task, str) else task
    ids = torch.as_tensor(ids).reshape(-1)
    if ids.numel() == 0:
        raise ValueError("'task' has no tokens; give an instruction")
    if ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise ValueError(f"'task' must be a string or integer token ids; got {ids.dtype}")
    if ids.numel() > c.tokenizer_max_length:
        raise ValueError(f"'task' has {ids.numel()} tokens; at most {c.tokenizer_max_length} "
                         "fit (tokenizer_max_length)")
    if int(ids.min()) < 0 or int(ids.max()) >= c.text.vocab_size:
        raise ValueError(f"'task' token ids must lie in [0, {c.text.vocab_size})")
    return ids.long()


def check_request(policy: LeRobotSmolVLA, inputs: Mapping[str, Any],
                  rtc: Optional[RtcSettings] = None) -> SmolVLARequest:
    """Everything but the images (the vision node's), checked and preprocessed; ``rtc``: the
    guidance settings ``prev_actions`` needs."""
    c, m = policy.config, policy.module
    prompt = prompt_ids(policy, inputs.get("task"))
    if inputs.get("state") is None:
        raise ValueError(f"SmolVLA input 'state' is missing; give [{c.state_dim}] floats")
    state = torch.as_tensor(np.asarray(inputs["state"]) if not isinstance(
        inputs["state"], torch.Tensor) else inputs["state"]).float()
    if state.shape != (c.state_dim,):  # (a [3, 2] state was flattened into [6])
        raise ValueError(f"'state' must be [{c.state_dim}]; got {list(state.shape)}")
    if not bool(torch.isfinite(state).all()):
        raise ValueError("'state' holds NaN or infinite values; give finite numbers")
    noise = flow_noise(inputs, c.chunk_size, c.max_action_dim)
    state = policy.normalize_state(state).to(device=m.device, dtype=m.dtype)
    delay, prev = guidance_inputs(inputs, rtc, c.action_dim, c.chunk_size,
                                  lambda p: policy.normalize_actions(p).to(m.device))
    return SmolVLARequest(prompt.to(m.device), state, noise.to(m.device), delay, prev)


def validate(policy: LeRobotSmolVLA, inputs: Mapping[str, Any],
             rtc: Optional[RtcSettings] = None) -> None:
    """Checks a whole request (at submit), so bad input never reaches an engine."""
    camera_images(policy, inputs.get("images"))
    check_request(policy, inputs, rtc)

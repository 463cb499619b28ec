"""Robot observations for the pi0 side-by-side with LeRobot (vla_lerobot.py): imported by both
sides, ours and the LeRobot worker in its own venv, so both serve the same inputs. Torch only."""

from __future__ import annotations

import torch

CAMERAS = ("observation.images.base_0_rgb", "observation.images.left_wrist_0_rgb")
PROMPT = "pick up the red block and put it in the bowl"
RAW_IMAGE_HW = (120, 160)
STATE_DIM = 6
CHUNK = 50
MAX_ACTION_DIM = 32


def observation(seed: int) -> dict:
    """Two smooth camera images (float32 [3, H, W], k/255 values in [0, 1]), a state, the prompt."""
    gen = torch.Generator().manual_seed(seed)
    obs: dict = {}
    for cam in CAMERAS:
        coarse = torch.rand((1, 3, 4, 5), generator=gen)
        img = torch.nn.functional.interpolate(coarse, size=RAW_IMAGE_HW, mode="bilinear",
                                              align_corners=False)[0]
        img = img + 0.15 * torch.rand((3, *RAW_IMAGE_HW), generator=gen)
        obs[cam] = ((img.clamp(0, 1) * 255).round() / 255.0).to(torch.float32)
    obs["observation.state"] = torch.randn(STATE_DIM, generator=gen) * 0.7
    obs["task"] = PROMPT
    return obs


def noise(seed: int) -> torch.Tensor:
    """The flow noise of robot ``seed``: [1, CHUNK, MAX_ACTION_DIM]."""
    return torch.randn((1, CHUNK, MAX_ACTION_DIM), generator=torch.Generator().manual_seed(seed))

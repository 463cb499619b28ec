"""Request inputs that LeRobot's policies (pi0, pi0.5, SmolVLA) take the same way: the cameras
(a dict by camera name, a list in the checkpoint's order, or one image), the flow's starting
noise (given, or drawn from ``seed``) and whole-number inputs. Bad input is a ValueError that
names the input and what it needs; the per-image checks stay with each family, whose
preprocessing differs."""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np
import torch


def whole_number(value: Any, name: str) -> int:
    """Input ``name`` as an int >= 0 (a Python, NumPy or one-element torch integer)."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = int(value)
    if isinstance(value, np.integer):
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"'{name}' must be an integer >= 0; got {value!r}")
    return value


def camera_images(cameras: tuple[str, ...], images: Any) -> list[tuple[int, Any]]:
    """``images`` as (camera index, image) pairs in the checkpoint's camera order, cameras given
    as None left out (LeRobot masks a missing camera, so it adds nothing). ``images``: a dict by
    camera name (any non-empty subset of ``cameras``), a list in their order, or one image."""
    if images is None:
        raise ValueError(f"input 'images' is missing; give at least one camera image of "
                         f"{list(cameras)}")
    if isinstance(images, Mapping):
        unknown = [k for k in images if k not in cameras]
        if unknown:
            raise ValueError(f"'images' has unknown cameras {unknown}; the policy's cameras are "
                             f"{list(cameras)}")
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
        raise ValueError(f"'images' holds no camera image; give at least one camera image of "
                         f"{list(cameras)}")
    return pairs


def flow_noise(inputs: Mapping[str, Any], chunk_size: int, max_action_dim: int) -> torch.Tensor:
    """The flow's starting point, float32 ``[chunk_size, max_action_dim]``: the request's
    ``noise`` (``[1, ...]`` too), else a draw from a generator seeded by its ``seed``."""
    shape = (chunk_size, max_action_dim)
    noise = inputs.get("noise")
    if noise is None:
        g = torch.Generator().manual_seed(whole_number(inputs.get("seed", 0) or 0, "seed"))
        noise = torch.randn(shape, generator=g)
    noise = torch.as_tensor(noise).float()
    if noise.dim() == 3 and noise.shape[0] == 1:
        noise = noise[0]
    if tuple(noise.shape) != shape:
        raise ValueError(f"'noise' must be [{shape[0]}, {shape[1]}] (chunk_size, "
                         f"max_action_dim); got {list(noise.shape)}")
    if not bool(torch.isfinite(noise).all()):
        raise ValueError("'noise' holds NaN or infinite values; give finite numbers")
    return noise

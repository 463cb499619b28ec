"""Request inputs that LeRobot's policies (pi0, pi0.5, SmolVLA) take the same way: the cameras
(a dict by camera name, a list in the checkpoint's order, or one image), each camera's image
in LeRobot's range, the flow's starting noise (given, or drawn from ``seed``; sampling.py).
Bad input is a ValueError that names the input and what it needs; resizing stays with each
family, whose preprocessing differs."""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np
import torch

from mstar_rt.models.sampling import request_seed


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


def unit_image(image: Any, where: str = "image") -> torch.Tensor:
    """A camera image as float32 ``[3, H, W]`` in [0, 1]: uint8 ``[3, H, W]`` / ``[H, W, 3]`` is
    divided by 255, float is taken as it is but must already lie in [0, 1] (LeRobot's range: a
    float image of 0-255 would otherwise pass as a white one)."""
    x = torch.as_tensor(np.asarray(image) if not isinstance(image, torch.Tensor) else image)
    if x.dim() != 3 or 3 not in (x.shape[0], x.shape[-1]) or min(x.shape) < 1:
        raise ValueError(f"{where} must be [3, H, W] or [H, W, 3] with H, W >= 1; got "
                         f"{list(x.shape)}")
    if x.shape[0] != 3:
        x = x.permute(2, 0, 1)
    if x.dtype == torch.uint8:
        return x.float() / 255
    if not x.dtype.is_floating_point:
        raise ValueError(f"{where} must be uint8 or float in [0, 1]; got {x.dtype}")
    x = x.float()
    if not bool(torch.isfinite(x).all()):
        raise ValueError(f"{where} holds NaN or infinite values")
    low, high = float(x.min()), float(x.max())
    if low < 0 or high > 1:
        raise ValueError(f"{where} is float with values in [{low:g}, {high:g}]; a float image "
                         "must lie in [0, 1] (send uint8 for 0-255)")
    return x


def flow_noise(inputs: Mapping[str, Any], chunk_size: int, max_action_dim: int) -> torch.Tensor:
    """The flow's starting point, float32 ``[chunk_size, max_action_dim]``: the request's
    ``noise`` (``[1, ...]`` too), else a draw from a generator seeded by its ``seed`` (a fresh
    seed when it gives none: sampling.py)."""
    shape = (chunk_size, max_action_dim)
    noise = inputs.get("noise")
    if noise is None:
        g = torch.Generator().manual_seed(request_seed(inputs.get("seed")))
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

"""A tiny top-down camera over the reaching scene, drawn from the simulator's state with OpenCV.

The pi0-style policy's prefix starts with image tokens (Pi0Config needs at least one camera), so
the miniature gets a cheap camera: a SIZE x SIZE RGB view of the 0.8 m x 0.8 m workspace with the
target in red and the end effector in green, anti-aliased with sub-pixel centres so that a
position shows as a blend over neighbouring pixels. Drawing it costs ~20 us, where MuJoCo's
offscreen renderer would cost a GL context and a render per observation; and because the view is
a function of the observation alone, training renders it for recorded observations without
replaying the physics. The state token still carries the exact numbers.
"""

from __future__ import annotations

import cv2
import numpy as np

SIZE = 16  # pixels per side
EXTENT = 0.4  # m: the view spans [-EXTENT, EXTENT] in x and y (the arm reaches 0.4 m)
_SHIFT = 4  # OpenCV fixed-point bits: centres at 1/16 pixel


def _pixel(xy: np.ndarray, size: int) -> tuple[int, int]:
    """Workspace xy (m) -> fixed-point pixel (column, row); y points up in the image."""
    scale = size / (2 * EXTENT)
    col = (float(xy[0]) + EXTENT) * scale - 0.5
    row = (EXTENT - float(xy[1])) * scale - 0.5
    return int(round(col * (1 << _SHIFT))), int(round(row * (1 << _SHIFT)))


def topdown_image(obs: np.ndarray, size: int = SIZE) -> np.ndarray:
    """uint8 [size, size, 3] RGB view for one observation (q, qd, target xy, end-effector xy);
    the dots keep their size in metres (one pixel at SIZE)."""
    o = np.asarray(obs, dtype=np.float64)
    image = np.zeros((size, size, 3), np.uint8)
    radius = round((1 << _SHIFT) * size / SIZE)
    cv2.circle(image, _pixel(o[4:6], size), radius, (255, 0, 0), -1, cv2.LINE_AA, _SHIFT)
    cv2.circle(image, _pixel(o[6:8], size), radius, (0, 255, 0), -1, cv2.LINE_AA, _SHIFT)
    return image

"""Robot side: the real-time control loop and the action-chunk buffer that feeds it
(``control``), and camera frame sources that grab into a drop-oldest ring (``camera``).

The control types come from the compiled core and load with the package; the camera sources
load on first use (importing ``camera`` picks MuJoCo's offscreen GL backend, and its sources
import OpenCV / MuJoCo)."""

import importlib
from typing import Any

from mstar_rt.robot.control import (
    ActionChunkBuffer,
    ControlLoop,
    LatencyTracker,
    SimulatedClock,
    TickInfo,
)

_LAZY = {
    "Frame": "camera", "FrameSource": "camera", "MujocoRenderSource": "camera",
    "VideoCaptureSource": "camera",
}

__all__ = ["ActionChunkBuffer", "ControlLoop", "LatencyTracker", "SimulatedClock", "TickInfo",
           *_LAZY]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'mstar_rt.robot' has no attribute {name!r}")
    return getattr(importlib.import_module(f"mstar_rt.robot.{module}"), name)

"""Real-time control: a fixed-rate loop on absolute deadlines and the action-chunk buffer that
feeds it (latest / weighted / real-time-chunking merges), plus inference-latency tracking.

>>> import numpy as np, mstar_rt
>>> actions = mstar_rt.ActionChunkBuffer(horizon=4, action_dim=1)
>>> actions.publish(np.arange(4, dtype=np.float32).reshape(4, 1), obs_tick=0)
True
>>> [float(actions.pop(t)[0][0]) for t in range(4)]
[0.0, 1.0, 2.0, 3.0]
"""

from __future__ import annotations

from mstar_rt._core import ActionChunkBuffer, ControlLoop, LatencyTracker, SimulatedClock, TickInfo

__all__ = ["ActionChunkBuffer", "ControlLoop", "LatencyTracker", "SimulatedClock", "TickInfo"]

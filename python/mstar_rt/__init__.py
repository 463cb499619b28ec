"""mstar_rt — an embeddable runtime for composite multimodal models, served as walk graphs.

This package is a typed face over the compiled core ``mstar_rt._core``. The streaming layer:

>>> import numpy as np, mstar_rt
>>> buf = mstar_rt.StreamBuffer(np.int32, capacity=64, policy=mstar_rt.SlidingWindow(4, 2))
>>> buf.push(np.arange(9, dtype=np.int32)); buf.close()
9
>>> [(c.begin, c.new_begin, c.end) for c in buf]
[(0, 0, 4), (2, 4, 6), (4, 6, 8), (6, 8, 9)]
"""

from mstar_rt._core import ChunkPolicy, Chunk, StreamClosedError
from mstar_rt.robot import ActionChunkBuffer, ControlLoop, LatencyTracker, SimulatedClock, TickInfo
from mstar_rt.graph import (
    EMIT,
    DynamicLoop,
    Part,
    GraphEdge,
    GraphError,
    GraphNode,
    Loop,
    Parallel,
    Sequential,
    StreamingGraphEdge,
)
from mstar_rt.feeds import StreamInput
from mstar_rt.model import Model, NodeSubmodule, RequestContext, StreamChunk, WorkContext
from mstar_rt.runtime import (
    DeadlineExceeded,
    RequestCancelled,
    RequestFailed,
    RequestHandle,
    RequestTooLarge,
    Runtime,
    compile_model,
)
from mstar_rt.streaming import (
    Fixed,
    LeftContext,
    Overflow,
    Ramp,
    Ring,
    SlidingWindow,
    StreamBuffer,
)

__version__ = "0.1.0"

__all__ = [
    "ActionChunkBuffer",
    "ControlLoop",
    "DeadlineExceeded",
    "LatencyTracker",
    "SimulatedClock",
    "TickInfo",
    "EMIT",
    "DynamicLoop",
    "Part",
    "GraphEdge",
    "GraphError",
    "GraphNode",
    "Loop",
    "Model",
    "NodeSubmodule",
    "Parallel",
    "RequestCancelled",
    "RequestContext",
    "RequestFailed",
    "RequestHandle",
    "RequestTooLarge",
    "Runtime",
    "Sequential",
    "StreamChunk",
    "StreamingGraphEdge",
    "StreamInput",
    "WorkContext",
    "compile_model",
    "Chunk",
    "ChunkPolicy",
    "Fixed",
    "LeftContext",
    "Overflow",
    "Ramp",
    "Ring",
    "SlidingWindow",
    "StreamBuffer",
    "StreamClosedError",
]

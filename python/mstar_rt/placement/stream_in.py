"""Streams entering a segment (placement/segments.py): the parent's stand-in takes the stream
whole, one item per window, and each window crosses to the worker as it comes. In the worker's
segment Runtime a *source node* stands for the producer: its one work item stays in flight (its
stream open) while the windows' items are pushed into its stream (``Conductor.push_stream``),
and completes, ending the stream, when the parent's last window says the stream is over. The
consumer inside then reads its windows under its own chunk policy, as in one process.

The parent answers a window that is not the last itself, as it sends it (the worker has nothing
to say about it); the last window's answer is the run's end. A run that fails before its last
window fails its request by id (``failed`` with ``request``)."""

from __future__ import annotations

from typing import Any, Optional

from mstar_rt.engines.held_sources import SOURCE_BATCH, HeldSources
from mstar_rt.model import NodeSubmodule

STREAM_IN_ENGINE = "segment-stream-in"


def source_name(segment: str, stream: str) -> str:
    """The source node of stream ``stream`` entering segment ``segment``."""
    return f"{segment}<{stream}"


def window_lasts(chunk: Any) -> list[bool]:
    """Per stream of a stand-in's work item, whether its window is its stream's last: ``chunk``
    is one stream's window (begin, new_begin, end, last) or (windows, stream_end)."""
    if chunk is None:
        return []
    if type(chunk[0]) is int:
        return [bool(chunk[3])]
    windows, stream_end = chunk
    return [bool(stream_end or w[3]) for w in windows]


class SourceSubmodule(NodeSubmodule):
    """A source node's submodule: never called (StreamInEngine holds its item)."""

    max_batch = SOURCE_BATCH

    def forward(self, batch: list[Any]) -> list[Any]:
        raise RuntimeError("a stream's source node is held by its engine, never run")


class StreamInEngine(HeldSources):
    """Holds the source nodes' work items in flight until :meth:`end` (or the request's end).
    The segment runner calls :meth:`release`: a segment run borrows its cache id, so its
    Runtime does not."""


class Feed:
    """One run's entering streams in the worker: its sources' ids and which have ended."""

    __slots__ = ("sources", "ended", "result")

    def __init__(self, sources: list[tuple[int, int]]) -> None:
        self.sources = sources  # (source node id, stream name id), in the stand-in's order
        self.ended = [False] * len(sources)
        self.result: Optional[tuple] = None  # (error,) once the run ended before its last window


__all__ = ["Feed", "STREAM_IN_ENGINE", "SourceSubmodule", "StreamInEngine", "source_name",
           "window_lasts"]

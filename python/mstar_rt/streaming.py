"""Streaming primitives: lock-free rings and chunked stream buffers over numpy items."""

from __future__ import annotations

from typing import Literal, Sequence

from mstar_rt import _core

Overflow = Literal["block", "drop_oldest", "reject"]


def Fixed(k: int) -> _core.ChunkPolicy:
    """Chunks of exactly ``k`` new items, no overlap."""
    return _core.ChunkPolicy.fixed(k)


def SlidingWindow(window: int, stride: int) -> _core.ChunkPolicy:
    """Windows ``[i*stride, i*stride + window)``: the first after ``window`` items, then every
    ``stride`` (Orpheus LM → SNAC uses 28, 7)."""
    return _core.ChunkPolicy.sliding_window(window, stride)


def LeftContext(context: int, size: int) -> _core.ChunkPolicy:
    """``size`` new items per chunk, preceded by up to ``context`` already-seen items."""
    return _core.ChunkPolicy.left_context(context, size)


def Ramp(first: Sequence[int], steady: int, context: int = 0) -> _core.ChunkPolicy:
    """New-item sizes ``first[0], first[1], ...`` then ``steady`` forever, each chunk with up to
    ``context`` items of left context: small first chunks cut time to first output."""
    return _core.ChunkPolicy.ramp(list(first), steady, context)


class Ring(_core.Ring):
    """Lock-free single-producer / single-consumer ring of fixed-size numpy items.

    ``Ring(dtype, capacity, item_shape=(), overflow="block", mirror=0)``; capacity is a power of
    two. One thread pushes, one pops; blocking calls release the GIL.
    """


class StreamBuffer(_core.StreamBuffer):
    """A ring plus a chunk policy. Iterating yields chunks until the producer closes the stream,
    releasing each chunk when the next is requested (or when the loop is left).

    ``StreamBuffer(dtype, capacity, policy, item_shape=(), overflow="block")``.
    """

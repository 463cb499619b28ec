"""Streaming primitives: lock-free rings and chunked stream buffers over numpy items."""

from __future__ import annotations

import operator
from typing import Any, Literal, Sequence

from mstar_rt import _core

Overflow = Literal["block", "drop_oldest", "reject"]


_SIZE_MAX = 2**64 - 1  # the C++ std::size_t a policy's sizes are held in


def _size(policy: str, what: str, value: Any, least: int) -> Any:
    """``value`` if an integer in ``least`` .. 2**64 - 1 (or not an integer: the binding's
    TypeError names the parameter's type); else a ValueError as the C++ policy words it."""
    try:
        n = operator.index(value)
    except TypeError:
        return value
    if n < least:
        raise ValueError(f"{policy}: {what} must be at least {least}, got {n}")
    if n > _SIZE_MAX:
        raise ValueError(f"{policy}: {what} must be at most {_SIZE_MAX}, got {n}")
    return n


def Fixed(k: int) -> _core.ChunkPolicy:
    """Chunks of exactly ``k`` new items, no overlap."""
    return _core.ChunkPolicy.fixed(_size("Fixed(K)", "K", k, 1))


def SlidingWindow(window: int, stride: int) -> _core.ChunkPolicy:
    """Windows ``[i*stride, i*stride + window)``: the first after ``window`` items, then every
    ``stride`` (Orpheus LM → SNAC uses 28, 7)."""
    name = "SlidingWindow(W, S)"
    return _core.ChunkPolicy.sliding_window(_size(name, "W", window, 1),
                                            _size(name, "S", stride, 1))


def LeftContext(context: int, size: int) -> _core.ChunkPolicy:
    """``size`` new items per chunk, preceded by up to ``context`` already-seen items."""
    name = "LeftContext(C, L)"
    return _core.ChunkPolicy.left_context(_size(name, "C", context, 0), _size(name, "L", size, 1))


def Ramp(first: Sequence[int], steady: int, context: int = 0) -> _core.ChunkPolicy:
    """New-item sizes ``first[0], first[1], ...`` then ``steady`` forever, each chunk with up to
    ``context`` items of left context: small first chunks cut time to first output."""
    name = "Ramp(first, steady, context)"
    if isinstance(first, (str, bytes)) or not hasattr(first, "__iter__"):
        raise TypeError(f"{name}: first must be a list of the first chunks' sizes, e.g. "
                        f"Ramp([1, 2], 4), not {type(first).__name__}")
    sizes = [_size(name, f"first[{i}]", n, 1) for i, n in enumerate(first)]
    return _core.ChunkPolicy.ramp(sizes, _size(name, "steady", steady, 1),
                                  _size(name, "context", context, 0))


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

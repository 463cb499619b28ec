"""Tensor bytes carried in the message itself: the transport when a worker may sit on another
machine (a Ray actor), where no shared-memory segment reaches.

:class:`InlineArena` has the interface the codec and the channels use on a
:class:`~mstar_rt.placement.arena.ShmArena` (``alloc`` / ``address`` / ``mark`` / ``rollback`` /
``publish`` on the sending side, ``check_span`` / ``address`` / ``free_to`` on the receiving
side), so the codec does not know which one it has. Each tensor gets a buffer of its own that
leaves as one extra ZeroMQ frame after the msgpack payload (:meth:`take_frames`); its header's
``offset`` is where that frame starts in the message's frames laid end to end. The sender copies
a tensor into its buffer once (ZeroMQ then sends that buffer without copying it again), the
receiver copies it once out of the received frame: one copy each way, as with shared memory.
"""

from __future__ import annotations

from typing import Any

import numpy as np


class InlineArena:
    """One direction's tensor frames; a side uses it either to send or to receive."""

    name = "inline"
    capacity = 0
    in_use = 0  # nothing outlives its message

    def __init__(self) -> None:
        self._chunks: dict[int, np.ndarray] = {}  # offset -> bytes, of the message in hand
        self._size = 0

    # ---- writer -----------------------------------------------------------------------------

    def mark(self) -> int:
        return self._size

    def rollback(self, mark: int) -> None:
        """Forgets the buffers allocated after ``mark`` (a message that was never sent)."""
        self._chunks = {off: c for off, c in self._chunks.items() if off < mark}
        self._size = mark

    def alloc(self, nbytes: int, timeout_s: float) -> int:
        # np.empty: no zero fill, the codec overwrites every byte at once
        offset = self._size
        self._chunks[offset] = np.empty(nbytes, dtype=np.uint8)
        self._size += nbytes
        return offset

    def publish(self) -> int:
        return self._size

    def take_frames(self) -> list[Any]:
        """The message's tensor buffers, in offset order, to send after its payload."""
        frames = [self._chunks[off] for off in sorted(self._chunks)]
        self._chunks, self._size = {}, 0
        return frames

    # ---- reader -----------------------------------------------------------------------------

    def receive(self, frames: list[Any]) -> None:
        """Takes the tensor frames of the message about to be decoded (buffers, read-only)."""
        self._chunks, offset = {}, 0
        for frame in frames:
            chunk = np.frombuffer(frame, dtype=np.uint8)
            self._chunks[offset] = chunk
            offset += chunk.size

    def check_span(self, offset: int, nbytes: int) -> None:
        chunk = self._chunks.get(offset) if isinstance(offset, int) else None
        if chunk is None or not isinstance(nbytes, int) or not 0 <= nbytes <= chunk.size:
            raise ValueError(f"tensor bytes [{offset}, +{nbytes}) are not one of the message's "
                             f"{len(self._chunks)} tensor frames")

    def address(self, offset: int) -> int:
        return int(self._chunks[offset].ctypes.data)

    def array(self, offset: int, dtype: Any, count: int) -> np.ndarray:
        return np.frombuffer(self._chunks[offset], dtype, count)

    def free_to(self, span_end: int) -> None:
        """The message was decoded: drop its frames."""
        self._chunks, self._size = {}, 0

    # ---- lifetime (nothing to map or remove) -------------------------------------------------

    def close(self) -> None:
        self._chunks = {}

    def unlink(self) -> None:
        pass

"""Messages between the parent and a local worker process, in shared memory, woken by a FIFO.

ZeroMQ over ``ipc://`` hands every message to an I/O thread on each side: four thread wake-ups
per round trip, most of a crossing's transport time on a small machine. Here the sender copies
the message's frames into a byte ring in ``/dev/shm`` and writes one byte into the receiver's
FIFO (its "bell"); the receiver's own thread, asleep in ``poll`` beside its sockets, wakes,
drains the bell, then reads every whole message from the ring: one wake-up per direction.

Ring layout: the header holds ``head`` (the writer's, one 64-bit word in a cache line of its
own) and ``tail`` (the reader's), as in placement/arena.py, which also explains why each is one
8-byte access. Records are 8-byte aligned: ``u32 nbytes, u32 flags`` then the bytes. A message
too large for one record leaves in several (``MORE`` set on all but the last; the writer waits
for the reader to free room between them), so no message is ever too large. ``WRAP`` skips the
end of the ring. A message's bytes are ``u32 nframes, u32 len * nframes`` then the frames.

The bell is drained before the ring is read: a byte written after the drain wakes the reader
again, so a message published after its read is never left waiting. Both sides open a FIFO
read-write and non-blocking: opening never blocks on the other side, a full FIFO means a wake-up
is already pending, and a write to a dead reader's FIFO neither blocks nor raises SIGPIPE.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import struct
import time
from typing import Callable, Optional, Sequence

from mstar_rt.placement.arena import (create_segment, open_segment, reserve, shm_full,
                                      unlink_quietly, unmap)

_MAGIC = 0x6D73_7461_726D_0001  # "mstarm", version 1
_HEAD = 64
_TAIL = 128
_DATA = 192
_RECORD = struct.Struct("<II")
MORE, WRAP = 1, 2


class MailboxError(ValueError):
    """The ring holds what no writer of this protocol makes (a corrupt or foreign segment)."""


def _round8(n: int) -> int:
    return (n + 7) & ~7


class Mailbox:
    """One direction's ring ``/dev/shm/<name>``: the parent creates it (:meth:`create`) and
    unlinks it, the worker maps it (:meth:`attach`). One side writes (:meth:`put`), the other
    reads (:meth:`take`); each side's calls come from one thread at a time (the caller's lock)."""

    def __init__(self, name: str, fd: int, size: int) -> None:
        self.name = name
        try:
            self.mm: Optional[mmap.mmap] = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.capacity = size - _DATA
        self._words: Optional[memoryview] = memoryview(self.mm)[:_DATA].cast("Q")
        self._head = self._words[_HEAD // 8]   # the writer's private copy
        self._tail = self._words[_TAIL // 8]   # the reader's
        self._partial: list[bytes] = []        # a message's records read so far
        # the head word's address, for spin_until_changed (released in close())
        self._pin: Optional[ctypes.c_uint64] = ctypes.c_uint64.from_buffer(self.mm, _HEAD)
        self.largest_record = max(64, self.capacity // 4 - _RECORD.size) & ~7

    @staticmethod
    def create(name: str, capacity: int) -> "Mailbox":
        capacity = max(4096, _round8(capacity))
        fd = create_segment(name, _DATA + capacity)
        try:  # all of it now: a write into a page /dev/shm has no room for is a SIGBUS
            reserve(fd, 0, _DATA + capacity)
        except OSError as e:
            os.close(fd)
            unlink_quietly(name)
            raise MailboxError(shm_full(f"mailbox '{name}'", _DATA + capacity, e)
                               + f"; each local worker needs {2 * (_DATA + capacity)} bytes "
                               "of mailboxes") from None
        box = Mailbox(name, fd, _DATA + capacity)
        struct.pack_into("<QQ", box.mm, 0, _MAGIC, capacity)
        return box

    @staticmethod
    def attach(name: str) -> "Mailbox":
        fd, size = open_segment(name, _MAGIC, _DATA, _DATA + 4096, "mailbox", MailboxError)
        return Mailbox(name, fd, size)

    # ---- writer ------------------------------------------------------------------------------

    def put(self, frames: Sequence[bytes], wait: Callable[[], bool], first_try: bool = False
            ) -> bool:
        """Writes one message. While the ring is full, sleeps as long as ``wait()`` is true
        (the reader lives); False if it gave up. ``first_try``: give up at once, nothing
        written, if the message's first record does not fit now."""
        mm = self.mm
        if mm is None:
            raise ValueError(f"mailbox '{self.name}' is closed")
        data = struct.pack(f"<I{len(frames)}I", len(frames), *map(len, frames)) + b"".join(frames)
        step, start = self.largest_record, 0
        while True:
            chunk = data[start:start + step]
            start += len(chunk)
            if not self._reserve(_RECORD.size + _round8(len(chunk)), wait, first_try):
                return False
            first_try = False
            off = _DATA + self._head % self.capacity
            _RECORD.pack_into(mm, off, len(chunk), MORE if start < len(data) else 0)
            mm[off + _RECORD.size:off + _RECORD.size + len(chunk)] = chunk
            self._head += _RECORD.size + _round8(len(chunk))
            self._words[_HEAD // 8] = self._head  # after the bytes: the reader sees them whole
            if start >= len(data):
                return True

    def _reserve(self, size: int, wait: Callable[[], bool], first_try: bool) -> bool:
        cap, pause = self.capacity, 20e-6
        while True:
            off = self._head % cap
            skip = cap - off if off + size > cap else 0
            if self._head + skip + size - self._words[_TAIL // 8] <= cap:
                break
            if first_try or not wait():
                return False
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)
        if skip:
            _RECORD.pack_into(self.mm, _DATA + off, 0, WRAP)
            self._head += skip
        return True

    # ---- reader ------------------------------------------------------------------------------

    def take(self, limit: int = 1 << 30) -> list[list[bytes]]:
        """Up to ``limit`` whole messages, as lists of frames (copied out; their room is free)."""
        mm, words, cap = self.mm, self._words, self.capacity
        if mm is None or words is None:
            return []
        head, tail, out = words[_HEAD // 8], self._tail, []
        try:
            while tail < head and len(out) < limit:
                off = tail % cap
                if off + _RECORD.size > cap:
                    raise MailboxError(f"a record of mailbox '{self.name}' starts {cap - off} "
                                       "bytes before the ring's end")
                n, flags = _RECORD.unpack_from(mm, _DATA + off)
                if flags & WRAP:
                    tail += cap - off
                    continue
                if flags & ~MORE or off + _RECORD.size + n > cap \
                        or tail + _RECORD.size + n > head:
                    raise MailboxError(f"mailbox '{self.name}' holds a bad record ({n} bytes, "
                                       f"flags {flags}, at {off})")
                start = _DATA + off + _RECORD.size
                self._partial.append(mm[start:start + n])
                tail += _RECORD.size + _round8(n)
                if not flags & MORE:
                    data = self._partial[0] if len(self._partial) == 1 else b"".join(self._partial)
                    self._partial = []
                    out.append(_frames(data, self.name))
        finally:
            self._tail = tail
            words[_TAIL // 8] = tail
        return out

    def watch(self) -> tuple[int, int]:
        """(address, value): the head word's address and the head this reader has read to;
        the word moving away from the value means mail (``_core.spin_until_changed``). Valid
        until :meth:`close`."""
        if self._pin is None:
            raise ValueError(f"mailbox '{self.name}' is closed")
        return ctypes.addressof(self._pin), self._tail

    @property
    def in_use(self) -> int:
        words = self._words
        return 0 if words is None else words[_HEAD // 8] - words[_TAIL // 8]

    # ---- lifetime ----------------------------------------------------------------------------

    def close(self) -> None:
        self._pin = None
        unmap(self._words, self.mm)
        self._words, self.mm = None, None

    def unlink(self) -> None:
        unlink_quietly(self.name)


def _frames(data: bytes, name: str) -> list[bytes]:
    if len(data) < 4:
        raise MailboxError(f"a message in mailbox '{name}' is {len(data)} bytes long")
    (count,) = struct.unpack_from("<I", data)
    at = 4 + 4 * count
    if at > len(data):
        raise MailboxError(f"a message in mailbox '{name}' claims {count} frames")
    lens = struct.unpack_from(f"<{count}I", data, 4)
    if at + sum(lens) != len(data):
        raise MailboxError(f"a message in mailbox '{name}' is {len(data)} bytes, its frames "
                           f"{at + sum(lens)}")
    frames = []
    for n in lens:
        frames.append(data[at:at + n])
        at += n
    return frames


class Bell:
    """A FIFO one side sleeps on (``poll`` it beside sockets) and the other rings."""

    def __init__(self, path: str, create: bool = False) -> None:
        self.path = path
        if create:
            os.mkfifo(path, 0o600)
        self.fd: Optional[int] = os.open(path, os.O_RDWR | os.O_NONBLOCK)

    def ring(self) -> None:
        fd = self.fd
        if fd is None:
            return
        try:
            os.write(fd, b"\0")
        except BlockingIOError:  # full: the reader has wake-ups pending already
            pass

    def drain(self) -> None:
        fd = self.fd
        if fd is None:
            return
        try:
            while len(os.read(fd, 4096)) == 4096:
                pass
        except BlockingIOError:
            pass

    def fileno(self) -> int:
        if self.fd is None:
            raise ValueError(f"bell '{self.path}' is closed")
        return self.fd

    def close(self, unlink: bool = False) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        if unlink:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass


class MailboxSocket:
    """The sending half as the channels use a ZeroMQ socket (``send_multipart``, ``close``):
    a mailbox written into and the receiver's bell rung. ``alive()``: whether the receiver lives
    (a full ring is waited on only while it does). ``owner``: close() also unlinks the ring
    (the parent's side)."""

    def __init__(self, box: Mailbox, bell: Bell, alive: Callable[[], bool],
                 owner: bool = False) -> None:
        self.box, self.bell, self.alive, self.owner = box, bell, alive, owner

    def send_multipart(self, frames: Sequence[bytes], flags: int = 0, copy: bool = True) -> None:
        """``flags`` with zmq.NOBLOCK (1): raises zmq.Again, nothing sent, when the ring has
        no room now. A message left half written (its receiver died) is dropped."""
        import zmq

        if not self.box.put(frames, self.alive, first_try=bool(flags & zmq.NOBLOCK)):
            if flags & zmq.NOBLOCK:
                raise zmq.Again()
            return
        self.bell.ring()

    def close(self, linger: int = 0) -> None:
        self.box.close()
        if self.owner:
            self.box.unlink()
        self.bell.close()


SPIN_US = 200.0  # how long a receiver watches its mailbox before it sleeps (PlacedRuntime)


def spin_default(local_workers: int) -> float:
    """SPIN_US when every process (the parent and each local worker) can have a CPU of its own
    to watch on, else 0: on fewer, a watcher takes the CPU a working process needs (two workers
    and a parent on two vCPUs: a worker-to-worker hop measured 10-25 % slower watching)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return SPIN_US if local_workers and (cpus or 1) >= 1 + local_workers else 0.0
MAIL_BYTES = 8 << 20  # per direction: thousands of small messages; a large one crosses in records


def worker_mail(base: str, bell_path: str, capacity: int = MAIL_BYTES
                ) -> tuple[Mailbox, Mailbox, Bell]:
    """A local worker's mailboxes ``<base>_p2w_mail`` and ``<base>_w2p_mail`` and its bell (none
    of them if one cannot be made)."""
    made: list = []
    try:
        made.append(Mailbox.create(f"{base}_p2w_mail", capacity))
        made.append(Mailbox.create(f"{base}_w2p_mail", capacity))
        made.append(Bell(bell_path, create=True))
    except BaseException:
        for m in made:
            if isinstance(m, Mailbox):
                m.close()
                m.unlink()
            else:
                m.close(unlink=True)
        raise
    return made[0], made[1], made[2]


__all__ = ["Bell", "MAIL_BYTES", "Mailbox", "MailboxError", "MailboxSocket", "spin_default",
           "worker_mail"]

"""A byte ring in POSIX shared memory: how tensors cross between the parent and one worker.

One arena per direction. The sending side owns ``head`` (it alone allocates), the receiving side
owns ``tail`` (it alone frees); each is one aligned 64-bit word in the segment, so neither side
ever takes a lock the other holds. Messages are consumed in the order they were sent (one ZeroMQ
pipe keeps order), so a message only says where its allocations end (``span_end``) and the
receiver frees everything before that point once it has copied the data out.

Each counter is read and written with one 8-byte access, through a memoryview of the header as
native 64-bit words, so the other process sees the old value or the new one, never a mix:
``struct.pack_into`` zeroes its destination before it writes the value, and a reader caught in
between saw a head (or tail) of 0 -- a message's span end then lay "beyond the published head".

Segments are plain files under /dev/shm (no multiprocessing resource tracker, whose extra process
and exit-time unlinking fight a worker that may be killed); the parent creates and unlinks them.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import re
import struct
import time
from typing import Any, Callable, Optional

import numpy as np

SHM_DIR = "/dev/shm"
_MAGIC = 0x6D73_7461_7231_0001  # "mstar1", version 1
_HEAD = 64     # own cache lines: the two sides write them from different processes
_TAIL = 128
_DATA = 192
ALIGN = 64
BACK_STEP = 1 << 20  # an arena's memory is reserved a MiB or more at a time (ShmArena._back)


class ArenaFull(RuntimeError):
    """The receiving side did not free space in time (it is stuck, or the arena is too small)."""


class ReaderGone(ArenaFull):
    """The arena was full and its reader died meanwhile: nothing will free space again."""


def _round_up(n: int) -> int:
    return (max(n, 1) + ALIGN - 1) // ALIGN * ALIGN


class ShmArena:
    """A mapped segment ``/dev/shm/<name>`` of ``capacity`` data bytes plus a small header.

    ``ShmArena.create`` makes it (the parent), ``ShmArena.attach`` maps an existing one (the
    worker). The writer calls :meth:`alloc` / :meth:`publish`; the reader :meth:`view` /
    :meth:`free_to`.
    """

    def __init__(self, name: str, fd: int, size: int, owner: bool) -> None:
        self.name = name
        self.owner = owner
        try:
            self.mm: Optional[mmap.mmap] = mmap.mmap(fd, size)
        except BaseException:
            os.close(fd)
            raise
        # Kept open to back the data with memory before the writer first touches it (alloc).
        self._fd: Optional[int] = fd
        self._backed = 0  # data bytes from the start known backed (by this writer's reserve)
        self.capacity = size - _DATA
        self._head = 0  # the writer's private copy; published to the segment per message
        # (from, to): the writer skipped [from, to) to start over at 0 while the ring was empty
        # (see alloc); until the reader frees past ``from``, nothing there holds data.
        self._skip: Optional[tuple[int, int]] = None
        self._published = 0  # the head this writer last published
        # The header as 64-bit words: one load or store each, never torn (see the module doc).
        self._words: Optional[memoryview] = memoryview(self.mm)[:_DATA].cast("Q")
        # The data's address, for the codec's one memmove per tensor (a torch or numpy copy
        # costs several calls, each dropping and retaking the GIL); released in close().
        self._pin: Optional[ctypes.Array] = (ctypes.c_char * size).from_buffer(self.mm)
        self._base = ctypes.addressof(self._pin) + _DATA

    @staticmethod
    def create(name: str, capacity: int) -> "ShmArena":
        capacity = _round_up(capacity)
        arena = ShmArena(name, create_segment(name, _DATA + capacity), _DATA + capacity,
                         owner=True)
        struct.pack_into("<QQ", arena.mm, 0, _MAGIC, capacity)
        return arena

    @staticmethod
    def attach(name: str) -> "ShmArena":
        fd, size = open_segment(name, _MAGIC, _DATA, _DATA + ALIGN, "arena", ValueError)
        return ShmArena(name, fd, size, owner=False)

    # ---- the two counters ------------------------------------------------------------------

    @property
    def published_head(self) -> int:
        return self._words[_HEAD // 8]

    @property
    def tail(self) -> int:
        return self._words[_TAIL // 8]

    @property
    def in_use(self) -> int:
        """Bytes sent and not yet freed by the receiver (as this side sees them)."""
        tail = self.tail  # first: the head only grows, so it is never behind a tail read before
        return self.published_head - tail

    # ---- writer ------------------------------------------------------------------------------

    def mark(self) -> int:
        return self._head

    def rollback(self, mark: int) -> None:
        """Forgets allocations after ``mark`` (a message that was never sent)."""
        self._head = mark
        if self._skip is not None and mark <= self._skip[0]:
            self._skip = None

    def alloc(self, nbytes: int, timeout_s: float,
              alive: Optional[Callable[[], bool]] = None) -> int:
        """Offset (from the data start) of ``nbytes`` contiguous free bytes; waits up to
        ``timeout_s`` for the receiver to free space, then raises :class:`ArenaFull` --
        :class:`ReaderGone` as soon as ``alive()`` says the receiver died (its death handler
        may be waiting for the lock this sender holds)."""
        size = _round_up(nbytes)
        cap = self.capacity
        if size > cap:
            raise ArenaFull(f"a {nbytes}-byte tensor does not fit the {cap}-byte shared-memory "
                            "arena; raise shm_bytes")
        deadline = None
        pause = 20e-6
        while True:
            head, tail = self._head, self._freed()
            if head % cap and head == tail:
                # Everything sent is freed: start over at 0. Request/reply traffic then keeps
                # reusing the ring's front, whose pages are mapped and whose lines are likely
                # cached; a ring that laps walks every page of the segment, each first touch
                # faulting (0.4-0.65 ms per MiB per process on the 2-vCPU VM), each copy into
                # cold memory. The skipped bytes hold nothing, so they do not count as in use.
                head = tail = head + cap - head % cap
            off = head % cap
            wrap = off + size > cap  # the end is too short: skip it, start over at 0
            need = cap - off + size if wrap else size
            if head + need - tail <= cap:
                break
            # The reader can free what was published, never the message being packed: if that
            # alone leaves no room, waiting cannot help (and would hold the sender's lock). A
            # message with nothing packed yet always fits once the ring empties (it starts over).
            best = self._published
            if self._skip is not None and self._skip[0] == best:
                best = self._skip[1]
            if head != best and head + need - best > cap:
                raise ArenaFull(f"a message's tensors need more than the {cap}-byte "
                                f"shared-memory arena '{self.name}' holds ({head - best + need}"
                                " bytes with this one); raise shm_bytes")
            if alive is not None and not alive():
                raise ReaderGone(f"the reader of shared-memory arena '{self.name}' died")
            now = time.monotonic()
            if deadline is None:
                deadline = now + timeout_s
            elif now > deadline:
                raise ArenaFull(f"the shared-memory arena '{self.name}' stayed full for "
                                f"{timeout_s} s ({self.in_use} of {cap} bytes in flight); the "
                                "other side is not consuming, or shm_bytes is too small")
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)
        start = 0 if wrap else off
        if start + size > self._backed:
            self._back(start + size)  # may raise: nothing has changed yet
        if head != self._head:
            self._skip = (self._head, head)
        self._head = head + (cap - off if wrap else 0) + size
        return start

    def _back(self, end: int) -> None:
        """Memory behind the data up to ``end`` (in steps of BACK_STEP), reserved before the
        bytes are written: a full /dev/shm then refuses the tensor here, where a first write
        into a page it had no room for killed the writing process with SIGBUS -- a worker, or
        the parent application itself."""
        end = min(self.capacity, max(end, self._backed + BACK_STEP))
        if self._fd is None:
            raise ValueError(f"shared-memory arena '{self.name}' is closed")
        try:
            done = reserve(self._fd, _DATA + self._backed, end - self._backed)
        except OSError as e:
            raise ArenaFull(shm_full(f"arena '{self.name}'", end - self._backed, e)
                            + " or lower shm_bytes") from None
        self._backed = end if done else self.capacity

    def _freed(self) -> int:
        """The reader's tail, or the end of the writer's last skip while the reader has not
        freed past its start (the reader frees to span ends only, none of which lies inside)."""
        tail, skip = self.tail, self._skip
        if skip is not None:
            if tail == skip[0]:
                return skip[1]
            self._skip = None
        return tail

    def publish(self) -> int:
        """Makes this side's allocations visible; returns the span end a message carries."""
        self._words[_HEAD // 8] = self._published = self._head
        return self._head

    def take_frames(self) -> list:
        """Frames to send after the payload: none, the bytes are in the segment (an
        InlineArena, placement/inline.py, sends them as frames)."""
        return []

    def data(self, offset: int, nbytes: int) -> memoryview:
        return memoryview(self.mm)[_DATA + offset:_DATA + offset + nbytes]

    def array(self, offset: int, dtype: Any, count: int) -> "np.ndarray":
        """A numpy view of ``count`` items of ``dtype`` at data byte ``offset`` (checked span;
        the codec copies it out at once: one numpy call, where a ctypes copy costs three)."""
        if self.mm is None:
            raise ValueError(f"shared-memory arena '{self.name}' is closed")
        return np.frombuffer(self.mm, dtype, count, _DATA + offset)

    def address(self, offset: int) -> int:
        """The address of data byte ``offset`` (valid until :meth:`close`; the caller checked
        the span: :meth:`alloc` gave it, or :meth:`check_span` passed)."""
        if self._pin is None:
            raise ValueError(f"shared-memory arena '{self.name}' is closed")
        return self._base + offset

    # ---- reader ------------------------------------------------------------------------------

    def receive(self, frames: list) -> None:
        """A message's frames after its payload: none over shared memory (the receiver's
        socket already refused a message with more)."""

    def check_span(self, offset: int, nbytes: int) -> None:
        if not (isinstance(offset, int) and isinstance(nbytes, int) and 0 <= offset
                and 0 <= nbytes and offset + nbytes <= self.capacity):
            raise ValueError(f"tensor bytes [{offset}, +{nbytes}) lie outside the "
                             f"{self.capacity}-byte arena '{self.name}'")

    def free_to(self, span_end: int) -> None:
        """Frees everything sent before ``span_end`` (after the data was copied out)."""
        tail, head = self.tail, self.published_head
        if not isinstance(span_end, int) or not tail <= span_end <= head:
            raise ValueError(f"span end {span_end} is outside [{tail}, {head}] "
                             f"of arena '{self.name}'")
        self._words[_TAIL // 8] = span_end

    # ---- lifetime ----------------------------------------------------------------------------

    def close(self) -> None:
        self._pin = None
        unmap(self._words, self.mm)
        self._words, self.mm = None, None
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def unlink(self) -> None:
        unlink_quietly(self.name)


def arena_pair(base: str, capacity: int) -> tuple[ShmArena, ShmArena]:
    """A worker's two arenas, ``<base>_p2w`` and ``<base>_w2p`` (neither if one fails)."""
    p2w = ShmArena.create(f"{base}_p2w", capacity)
    try:
        return p2w, ShmArena.create(f"{base}_w2p", capacity)
    except BaseException:
        p2w.close()
        p2w.unlink()
        raise


def unmap(words: Optional[memoryview], mm: Optional[mmap.mmap]) -> None:
    """Releases a segment's header view, then its mapping (the caller dropped its ctypes pin
    first: a live export makes ``mmap.close`` fail)."""
    if words is not None:
        words.release()
    if mm is not None:
        try:
            mm.close()
        except BufferError:  # a view is still alive somewhere: the GC unmaps it later
            pass


def reserve(fd: int, offset: int, length: int) -> bool:
    """Backs ``length`` bytes of a segment at ``offset`` with memory now; False where the file
    system cannot (each page then gets memory at its first write). Raises OSError (ENOSPC) when
    /dev/shm has no room."""
    try:
        os.posix_fallocate(fd, offset, length)
    except OSError as e:
        if e.errno in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
            return False
        raise
    return True


def shm_full(what: str, nbytes: int, e: OSError) -> str:
    return (f"shared memory is full: {SHM_DIR} has no room for {nbytes} more bytes of {what} "
            f"({e.strerror}); give it more (a container's default is 64 MiB: docker run "
            "--shm-size=1g)")


def create_segment(name: str, size: int) -> int:
    """An open descriptor of the new file ``/dev/shm/<name>`` of ``size`` bytes (readable and
    writable by this user only); no file is left if it cannot be made whole."""
    path = os.path.join(SHM_DIR, name)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, size)
    except BaseException:
        os.close(fd)
        os.unlink(path)
        raise
    return fd


def open_segment(name: str, magic: int, header: int, least: int, kind: str,
                 error: type[Exception]) -> tuple[int, int]:
    """(descriptor, size) of the existing ``/dev/shm/<name>`` once its first 16 bytes say it is
    a ``kind`` (``magic``, then its capacity: its size less ``header``) of at least ``least``
    bytes; ``error`` otherwise."""
    fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR)
    try:
        size = os.fstat(fd).st_size
        if size < least:
            raise error(f"shared-memory segment '{name}' is not an mstar_rt {kind} "
                        f"({size} bytes)")
        found, capacity = struct.unpack("<QQ", os.pread(fd, 16, 0))
        if found != magic or capacity != size - header:
            raise error(f"shared-memory segment '{name}' is not an mstar_rt {kind} "
                        "(bad magic or size)")
    except BaseException:
        os.close(fd)
        raise
    return fd, size


def unlink_quietly(name: str) -> None:
    try:
        os.unlink(os.path.join(SHM_DIR, name))
    except FileNotFoundError:
        pass


_OURS = re.compile(r"^mstar_(\d+)_[0-9a-f]+_r\d+_g\d+_(p2w|w2p|out|p2w_mail|w2p_mail)$")
_WORKDIR = re.compile(r"^mstar-placement-(\d+)-\w+$")


def _gone(pid: str) -> bool:
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, someone else's
        pass
    return False


def sweep_stale(tmp_dir: Optional[str] = None) -> list[str]:
    """Removes arenas, and socket directories under ``tmp_dir`` (default: the system's), whose
    parent process is gone -- a parent and its workers all killed at once (e.g. by the OOM
    killer) leave them behind; returns their paths. Those of live processes are left alone."""
    import shutil
    import tempfile

    removed = []
    for where, pattern in ((SHM_DIR, _OURS), (tmp_dir or tempfile.gettempdir(), _WORKDIR)):
        try:
            names = os.listdir(where)
        except OSError:
            continue
        for name in names:
            m = pattern.match(name)
            if m is None or not _gone(m.group(1)):
                continue
            path = os.path.join(where, name)
            if where == SHM_DIR:
                unlink_quietly(name)
            else:
                shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed

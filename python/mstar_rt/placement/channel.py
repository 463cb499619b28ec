"""The parent's sending half of its link to one worker process (the receiving half is
placement/inbox.py).

The sending socket -- a local worker's mailbox (placement/mailbox.py, ``MailboxSocket``) or a Ray
actor's DEALER -- and the outgoing arena of the worker's current generation, under one send lock. Batches are packed into the arena and sent by the engine thread that holds the
lock; small messages (release, stats, shutdown) queue in ``pending`` and go out with whichever
thread holds the lock next, so the hub's receiver thread never waits for the worker."""

from __future__ import annotations

import collections
import threading
import time
from typing import Any, Callable, Optional, Union

import zmq

from mstar_rt.placement.arena import ArenaFull, ReaderGone, ShmArena
from mstar_rt.placement.codec import CodecError, Encoder
from mstar_rt.placement.inline import InlineArena
from mstar_rt.placement.protocol import PARENT_ID, TO_WORKER_HEADER, VERSION

Arena = Union[ShmArena, InlineArena]


_HUB = threading.local()


def mark_hub_thread() -> None:
    """Called by the hub's receiver thread: the 'release' messages it causes wait until it has
    woken the request's caller (it flushes them after each reply)."""
    _HUB.deferring = True


def deferring() -> bool:
    """Whether this thread defers its small messages (it is the hub's)."""
    return getattr(_HUB, "deferring", False)


class SendChannel:
    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.lock = threading.Lock()  # the socket, the arena and the encoder
        self.gen = -1
        self.sock: Optional[Any] = None  # a MailboxSocket, or a zmq DEALER (Ray actors)
        self.arena: Optional[Arena] = None
        self.encoder: Optional[Encoder] = None
        self.pending: collections.deque = collections.deque()
        # (gen, field, value) for the next batch message, or a message of their own once the hub
        # is idle (flush_held): requests ended on the hub's thread ("release": a message of its
        # own costs both processes a wake-up while the next request is on its way) and exports
        # whose last handle died ("unexport", placement/direct.py).
        self.held: collections.deque = collections.deque()

    def connect(self, zctx: zmq.Context, gen: int, endpoint: str, arena: Arena) -> None:
        """A DEALER to generation ``gen``'s worker at ``endpoint``, with its outgoing arena."""
        dealer = zctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.ROUTING_ID, PARENT_ID)
        dealer.setsockopt(zmq.IMMEDIATE, 1)   # never queue for a worker that is not connected
        dealer.setsockopt(zmq.SNDHWM, 100_000)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(endpoint)
        self.attach(gen, dealer, arena)

    def attach(self, gen: int, sock: Any, arena: Arena) -> None:
        """Sends to generation ``gen`` through ``sock`` (``send_multipart`` and ``close`` as a
        ZeroMQ socket has them) and ``arena``."""
        with self.lock:
            self.gen, self.sock, self.arena, self.encoder = gen, sock, arena, Encoder(arena)

    def detach(self, gen: Optional[int] = None) -> bool:
        """Closes the socket and unmaps and unlinks the arena, if they are still generation
        ``gen``'s (when given: a restart may have replaced them); False if they were not."""
        with self.lock:
            if gen is not None and gen != self.gen:
                return False
            if self.sock is not None:
                self.sock.close(0)
            if self.arena is not None:
                self.arena.unlink()
                self.arena.close()
            self.sock, self.arena, self.encoder = None, None, None
            return True

    def is_open(self, gen: int) -> bool:
        """Whether generation ``gen`` can be sent to (hold ``lock``)."""
        return self.gen == gen and self.sock is not None

    def send_locked(self, gen: int, msg: dict, alive: Callable[[], bool]) -> Optional[str]:
        """Packs and sends (hold ``lock``); an error text instead of raising. While the worker
        lags or is not connected yet, waits as long as ``alive()`` says its generation lives."""
        arena, sock, encoder = self.arena, self.sock, self.encoder
        assert arena is not None and sock is not None and encoder is not None
        mark = arena.mark()
        try:
            payload = encoder.pack(msg, alive)
        except ReaderGone:
            arena.rollback(mark)
            return None  # its death reports the items
        except (CodecError, ArenaFull) as e:
            arena.rollback(mark)
            return f"cannot send its inputs to worker process rank {self.rank}: {e}"
        span = arena.publish()
        tensors = arena.take_frames()
        frames = [TO_WORKER_HEADER.pack(gen, span), payload, *tensors]
        while True:
            try:  # copy=False: ZeroMQ sends the tensor buffers as they are
                sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=not tensors)
                return None
            except zmq.Again:
                if not alive():
                    return None  # its death reports the items
                time.sleep(0.0005)

    def send_small(self, gen: int, msg: dict, defer: bool,
                   alive: Optional[Callable[[], bool]] = None) -> None:
        """:meth:`defer` or :meth:`post` ``msg``; with ``alive``, sends it now, waiting while the
        worker still connects (a post would be dropped then) as long as ``alive()``."""
        if alive is None:
            (self.defer if defer else self.post)(gen, msg)
            return
        with self.lock:
            if self.is_open(gen):
                self.send_locked(gen, {"v": VERSION, **msg}, alive)
        self.flush()

    def post(self, gen: int, msg: dict) -> None:
        """Queues a small message (no tensors) and sends it if the lock is free; never waits.
        The held fields go first: a caller asking for stats after its request ended must find
        the request released."""
        self._held_to_pending()
        self.pending.append((gen, {"v": VERSION, **msg}))
        self.flush()

    def defer(self, gen: int, msg: dict) -> None:
        """Queues a small message for the next :meth:`flush` (the caller's, or a sender's)."""
        self.pending.append((gen, {"v": VERSION, **msg}))

    def take_held(self, gen: int) -> dict[str, list]:
        """The held fields of generation ``gen`` (the others are dropped), for a message."""
        fields: dict[str, list] = {}
        while self.held:
            g, name, value = self.held.popleft()
            if g == gen:
                fields.setdefault(name, []).append(value)
        return fields

    def flush_held(self) -> None:
        """Sends the held fields as messages of their own (the hub, when idle)."""
        self._held_to_pending()
        self.flush()

    def hurry_held(self) -> None:
        """The held fields are due now: queued as messages of their own, sent at once, or (on
        the hub's thread) once it has handled the reply in hand."""
        self._held_to_pending()
        if not deferring():
            self.flush()

    def _held_to_pending(self) -> None:
        gen = self.gen
        for name, values in self.take_held(gen).items():
            kind, key = ("release", "requests") if name == "release" else (name, "keys")
            self.pending.append((gen, {"v": VERSION, "kind": kind, key: values}))

    def flush(self) -> None:
        # Whoever holds the lock drains; a poster that misses it is drained by the holder, which
        # checks again after letting go.
        while self.pending and self.lock.acquire(blocking=False):
            try:
                while self.pending:
                    gen, msg = self.pending.popleft()
                    if self.is_open(gen):
                        try:
                            self.sock.send_multipart(
                                [TO_WORKER_HEADER.pack(gen, self.arena.mark()),
                                 Encoder(None).pack(msg)], flags=zmq.NOBLOCK)
                        except zmq.Again:
                            pass  # the worker is gone or hopelessly behind; its death cleans up
            finally:
                self.lock.release()

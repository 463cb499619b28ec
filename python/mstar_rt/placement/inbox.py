"""The parent's receiving half of its link to one worker process (the sending half is
placement/channel.py).

The incoming arena, its decoder and, for a local worker, the mailbox its replies arrive in
(placement/mailbox.py), all of the worker's current generation, under one lock: the hub's
thread reads through them while a death or a restart may replace them."""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Iterator, Optional, Union

from mstar_rt.placement.arena import ShmArena
from mstar_rt.placement.codec import CodecError, Decoder
from mstar_rt.placement.inline import InlineArena
from mstar_rt.placement.mailbox import Mailbox, MailboxError
from mstar_rt.placement.protocol import TO_PARENT, ProtocolError, check_header


class Inbox:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.gen = -1
        self.arena: Optional[Union[ShmArena, InlineArena]] = None
        self.decoder: Optional[Decoder] = None
        self.mail: Optional[Mailbox] = None

    def attach(self, gen: int, arena: Union[ShmArena, InlineArena], decoder: Decoder,
               mail: Optional[Mailbox]) -> None:
        with self.lock:
            self.gen, self.arena, self.decoder, self.mail = gen, arena, decoder, mail

    def detach(self, gen: Optional[int] = None, then: Callable[[], None] = lambda: None) -> bool:
        """Unmaps and unlinks the arena and the mailbox if they are still generation ``gen``'s
        (when given), and calls ``then`` under the lock; False if they were not."""
        with self.lock:
            if gen is not None and gen != self.gen:
                return False
            for ring in (self.arena, self.mail):
                if ring is not None:
                    ring.unlink()
                    ring.close()
            self.arena, self.decoder, self.mail = None, None, None
            then()
            return True

    @contextlib.contextmanager
    def watched(self) -> Iterator[Optional[tuple[int, int]]]:
        """The mailbox's :meth:`~mstar_rt.placement.mailbox.Mailbox.watch` pair (None without
        one), kept mapped until the block ends: the lock is held."""
        with self.lock:
            yield None if self.mail is None else self.mail.watch()

    def take_mail(self) -> tuple[list[list[bytes]], Optional[str]]:
        """The replies waiting in the mailbox, and why it cannot be read on if it is corrupt
        (it is then closed and unlinked: ours, and nobody reads it again)."""
        with self.lock:
            if self.mail is None:
                return [], None
            try:
                return self.mail.take(), None
            except MailboxError as e:
                self.mail.unlink()
                self.mail.close()
                self.mail = None
                return [], str(e)

    def decode(self, gen: int, span: int, payload: bytes, tensors: Any
               ) -> tuple[Optional[str], Optional[dict], list[str]]:
        """(kind, message, problems): the reply's kind and message (None if it is of a
        generation that is gone, or malformed) and what was wrong with it. The arena is freed
        up to ``span`` whatever happens: the message's tensors are copied out or unusable."""
        problems: list[str] = []
        with self.lock:
            if gen != self.gen or self.decoder is None or self.arena is None:
                return None, None, problems  # its arena and items went with its generation
            try:
                self.arena.receive(tensors)  # a Ray actor's tensor frames (placement/inline.py)
                msg = self.decoder.unpack(payload)
                return check_header(msg, TO_PARENT), msg, problems
            except (ProtocolError, CodecError) as e:
                problems.append(str(e))
                return None, None, problems
            finally:
                try:
                    self.arena.free_to(span)
                except ValueError as e:
                    problems.append(str(e))


__all__ = ["Inbox"]

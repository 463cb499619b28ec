"""The worker's sending half (the parent's is placement/channel.py): every message to the parent
leaves through one :class:`Outbox`, whose lock keeps the arena's allocations in message order.

Its socket is a local worker's mailbox (placement/mailbox.py: ``MailboxSocket``) or, for a Ray
actor and for a ``fatal`` before the mailbox is open, the ZeroMQ PUSH socket to the parent."""

from __future__ import annotations

import threading
from typing import Any, Optional

from mstar_rt.placement.arena import ArenaFull, ShmArena
from mstar_rt.placement.codec import CodecError, Encoder
from mstar_rt.placement.direct import ExportArena, mark_exports, mark_stream_exports
from mstar_rt.placement.inline import InlineArena
from mstar_rt.placement.protocol import TO_PARENT_HEADER, VERSION


class Outbox:
    """Sends to the parent from any thread: one lock keeps arena allocations in message order."""

    def __init__(self, sock: Any, arena: Optional[ShmArena | InlineArena], rank: int,
                 gen: int, exports: Optional[ExportArena] = None,
                 direct: frozenset = frozenset(), direct_bytes: int = 0) -> None:
        self._sock, self._arena, self.rank, self.gen = sock, arena, rank, gen
        self._exports, self._direct, self._direct_bytes = exports, direct, direct_bytes
        self._encoder = Encoder(arena, exports=exports, rank=rank, gen=gen)
        self._plain = Encoder(None)
        self._lock = threading.Lock()
        self._closed = False

    def send(self, kind: str, **fields: Any) -> None:
        msg = {"v": VERSION, "kind": kind, "rank": self.rank, "gen": self.gen, **fields}
        if self._exports is not None:  # large tensors other workers read
            if kind == "done":
                msg["outputs"] = mark_exports(fields["outputs"], self._direct,
                                              self._direct_bytes)
            if fields.get("emits"):  # items of streams leaving a segment
                msg["emits"] = mark_stream_exports(fields["emits"], self._direct,
                                                   self._direct_bytes)
        with self._lock:
            if self._closed:  # the worker is exiting: nobody reads any more
                return
            if self._arena is None:
                self._sock.send_multipart([TO_PARENT_HEADER.pack(self.rank, self.gen, 0),
                                           self._plain.pack(msg)])
                return
            mark = self._arena.mark()
            try:
                payload = self._encoder.pack(msg)
            except (CodecError, ArenaFull) as e:
                self._arena.rollback(mark)
                if self._exports is not None:  # what it exported will never be read
                    self._exports.free(self._encoder.exported)
                if kind != "done" or len(fields["items"]) == 1:
                    failed = {"v": VERSION, "kind": "failed", "rank": self.rank, "gen": self.gen,
                              "items": list(fields.get("items", ())),
                              "message": f"its outputs cannot go back to the parent: {e}"}
                    payload = self._plain.pack(failed)
                else:
                    payload = None
            if payload is not None:
                span = self._arena.publish()
                tensors = self._arena.take_frames()
                self._sock.send_multipart([TO_PARENT_HEADER.pack(self.rank, self.gen, span),
                                           payload, *tensors], copy=not tensors)
                return
        # isolate the culprit: one message per item, so only its request fails
        if fields.get("emits"):  # outputs folded into the reply go first, on their own
            self.send("emit", emits=fields["emits"], items=fields["items"])
        for i, item in enumerate(fields["items"]):
            stops = fields["stops"]
            self.send("done", node=fields["node"], items=[item], outputs=[fields["outputs"][i]],
                      stops=None if stops is None else [stops[i]], states=fields["states"])

    def close(self, sock: bool) -> None:
        """No more sends; with ``sock``, closes the socket too (a mailbox: the worker closes its
        PUSH socket itself)."""
        with self._lock:
            self._closed = True
            if sock:
                self._sock.close()


__all__ = ["Outbox"]

"""What a worker process holds, as its parent accounts for it: every work item handed to it
(item -> request, node) until it is reported back, and every request whose state it holds
(request -> the last node that ran there), and which of those requests it has been sent
(``open``, once: a second would reset what it holds).

Each item is reported back exactly once -- completed or failed by the worker's reply, failed by
the parent when the worker dies or the request ends first -- because a report happens only for
an item that :meth:`ItemLedger.take` (or :meth:`forget` / :meth:`clear`) removed. The ledger
takes no lock itself: its link calls it under the link's lock, so that recording an item and
seeing the worker alive (or declaring it dead and clearing the ledger) happen together."""

from __future__ import annotations

from typing import Iterable


class ItemLedger:
    def __init__(self) -> None:
        # item -> (request, node, the RemoteTensors its inputs hold: alive until it is reported
        # back, so the worker has read them before their exports can be freed)
        self.inflight: dict[int, tuple[int, str, list]] = {}
        self.by_request: dict[int, set[int]] = {}        # request -> its items in flight
        self.known: dict[int, str] = {}                  # request -> last node
        self.opened: set[int] = set()                    # requests whose 'open' was sent
        # known requests whose state moved to another worker (kv_moves.py): released at their
        # end, but the worker's death no longer fails them
        self.moved: set[int] = set()
        # request -> {item: its RemoteTensors} of items answered before the worker read them
        # (windows into a segment, placement/stream_in.py): held until the worker says it
        # copied their bytes (read) or the request ends
        self.kept: dict[int, dict[int, list]] = {}
        self.kept_by_item: dict[int, int] = {}  # item -> request, for read

    def record(self, item: int, rid: int, node: str, holds: list) -> None:
        """Notes an item handed to the worker."""
        self.inflight[item] = (rid, node, holds)
        self.by_request.setdefault(rid, set()).add(item)
        self.known[rid] = node
        self.moved.discard(rid)  # back here: its state is here again

    def moved_out(self, rid: int) -> None:
        """The request's state moved to another worker (its K/V, at a walk change)."""
        if rid in self.known:
            self.moved.add(rid)

    def unopened(self, requests: Iterable[int]) -> list[int]:
        """Those of ``requests`` the worker has not been sent: the batch about to go must
        carry their inputs and state. Decided as batches leave, in the order they leave (two
        engine threads may record items of one request and send them in the other order)."""
        return [rid for rid in dict.fromkeys(requests) if rid not in self.opened]

    def sent_open(self, requests: Iterable[int]) -> None:
        """A batch opening ``requests`` left (those ended meanwhile are not kept)."""
        self.opened.update(rid for rid in requests if rid in self.known)

    def unsent(self, items: list) -> list:
        """Those of ``items`` (work items that send_batch recorded) still in flight, to be sent.
        One that release() took out since was failed, and its request's 'release' was posted,
        perhaps sent already: a batch that opened the request after that release would leave
        the worker holding the request's state for good."""
        return [it for it in items if it.id in self.inflight]

    def take(self, items: Iterable[int], keep: bool = False) -> set[int]:
        """Removes and returns those of `items` still in flight (each is then reported once);
        ``keep``: their RemoteTensors stay held until their request ends (the worker may not
        have read them yet)."""
        taken = set()
        for i in items:
            entry = self.inflight.pop(i, None)
            if entry is None:
                continue
            taken.add(i)
            if keep and entry[2]:
                self.kept.setdefault(entry[0], {})[i] = entry[2]
                self.kept_by_item[i] = entry[0]
            pending = self.by_request.get(entry[0])
            if pending is not None:
                pending.discard(i)
                if not pending:
                    del self.by_request[entry[0]]
        return taken

    def read(self, items: Iterable[int]) -> list:
        """The worker copied the bytes of these items' RemoteTensors: the handles it returns may
        die (outside the caller's lock: their deaths queue 'unexport' messages). An item not
        answered yet (the worker's word outran the answer) loses its handles too."""
        gone = []
        for i in items:
            rid = self.kept_by_item.pop(i, None)
            if rid is not None:
                mine = self.kept[rid]
                gone += mine.pop(i)
                if not mine:
                    del self.kept[rid]
            elif i in self.inflight:
                entry = self.inflight[i]
                gone += entry[2]
                self.inflight[i] = (entry[0], entry[1], [])
        return gone

    def forget(self, rid: int) -> tuple[bool, set[int]]:
        """The request ended: (whether the worker held state for it, its items in flight)."""
        for i in self.kept.pop(rid, {}):
            self.kept_by_item.pop(i, None)
        if rid not in self.known:
            return False, set()
        del self.known[rid]
        self.opened.discard(rid)
        self.moved.discard(rid)
        items = self.by_request.pop(rid, set())
        for i in items:
            self.inflight.pop(i, None)
        return True, items

    def clear(self) -> tuple[dict[int, tuple[int, str, list]], dict[int, str]]:
        """The worker died: everything it held, (inflight, known -- less the requests whose
        state moved on); the ledger starts empty."""
        inflight = self.inflight
        known = {rid: node for rid, node in self.known.items() if rid not in self.moved}
        self.inflight, self.by_request, self.known, self.opened = {}, {}, {}, set()
        self.kept, self.kept_by_item, self.moved = {}, {}, set()
        return inflight, known

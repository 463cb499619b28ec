"""The requests a host knows, by id: what the Runtime keeps per request (its RequestHandle), or
what a placement worker keeps (the request's context until the parent says it ended)."""

from __future__ import annotations

import threading
from typing import Any, Iterator, Optional

from mstar_rt.model import RequestContext


class RequestRegistry:
    """Request id -> entry; an entry has a ``context`` (:class:`RequestContext`).

    ``by_id`` is the plain dict: the C++ batch path looks contexts up in it without the Python
    layer. Writers hold ``lock``; readers may read without it (dict reads are atomic under the
    GIL) and take it only to settle a race with a submit that queued work before registering."""

    def __init__(self) -> None:
        self.by_id: dict[int, Any] = {}
        self.lock = threading.Lock()

    def add(self, rid: int, entry: Any) -> None:
        self.by_id[rid] = entry

    def pop(self, rid: int) -> Optional[Any]:
        with self.lock:
            return self.by_id.pop(rid, None)

    def get(self, rid: int) -> Optional[Any]:
        return self.by_id.get(rid)

    def knows(self, rid: int) -> bool:
        """Whether the request is registered; submit queues work before it registers the
        request (under the lock), so a miss is checked again under the lock."""
        if rid in self.by_id:
            return True
        with self.lock:
            return rid in self.by_id

    def context(self, rid: int) -> RequestContext:
        """The request's context when ``by_id`` missed it (the batch path reads ``by_id``
        itself): submit queues work before it registers the request (under the lock), so it is
        looked for again under the lock; a request already gone gets a blank one."""
        with self.lock:
            entry = self.by_id.get(rid)
        return entry.context if entry is not None else RequestContext(rid, {})

    def ids(self) -> list[int]:
        with self.lock:
            return list(self.by_id)

    def entries(self) -> list[Any]:
        with self.lock:
            return list(self.by_id.values())

    def __len__(self) -> int:
        return len(self.by_id)

    def __iter__(self) -> Iterator[int]:
        return iter(self.ids())

"""The requests a host knows, by id: what the Runtime keeps per request (its RequestHandle), or
what a placement worker keeps (the request's context until the parent says it ended)."""

from __future__ import annotations

import threading
from typing import Any, Iterator, Optional, Sequence

from mstar_rt._core import WorkItem
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

    def contexts(self, items: Sequence[WorkItem]) -> list[RequestContext]:
        """The context of each work item's request (a blank one for a request already gone)."""
        get = self.by_id.get
        entries = [get(item.request) for item in items]
        if None in entries:
            with self.lock:
                entries = [get(item.request) for item in items]
        return [e.context if e is not None else RequestContext(item.request, {})
                for e, item in zip(entries, items)]

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

"""Which pages of a driver's cache a rebuilt tensor-parallel group no longer holds.

A follower keeps its share of every page's K/V; when the group is rebuilt after losing a rank,
the new followers start with empty mirrors, so every page in use at that moment is *lost*: its
driver share is intact, the followers' shares are zeros. A sequence that reads a lost page
would compute wrong attention without any error, so such a step is refused instead, and only
its request fails. A lost page becomes whole again once a step writes its first slot (a new
owner filling it from the start); a page copied on write inherits its source's state.
"""

from __future__ import annotations

from typing import Iterable, Optional, Sequence

from mstar_rt.engines.attention_base import SeqStep


class LostPages:
    """The lost pages of one cache (see the module doc)."""

    def __init__(self, pages: Iterable[int], page_size: int) -> None:
        self.pages, self.page_size = set(pages), page_size

    def follow_copies(self, copies: Sequence[tuple[int, int]]) -> None:
        """Copies on write since the last step, in order: the copy is lost iff its source is."""
        for src, dst in copies:
            if src in self.pages:
                self.pages.add(dst)
            else:
                self.pages.discard(dst)

    def reader(self, steps: Sequence[SeqStep]) -> Optional[int]:
        """The index of the first sequence of ``steps`` that reads a lost page, if any."""
        ps = self.page_size
        for i, s in enumerate(steps):
            if not self.pages.isdisjoint(s.pages[:-(-s.cached // ps)]):
                return i
        return None

    def written(self, steps: Sequence[SeqStep]) -> None:
        """Marks whole the pages whose first slot ``steps`` write."""
        ps = self.page_size
        for s in steps:
            if s.persist:
                first = -(-s.cached // ps) * ps  # the first page start at or after cached
                for pos in range(first, s.cached + s.new, ps):
                    self.pages.discard(s.pages[pos // ps])

    def __bool__(self) -> bool:
        return bool(self.pages)


__all__ = ["LostPages"]

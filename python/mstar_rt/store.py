"""The tensor store: node outputs held by handle while the Conductor references them."""

from __future__ import annotations

import itertools
from typing import Any, Iterable


class TensorStore:
    """Handle -> value. The Conductor counts references (fan-out, persist, accumulation, stream
    windows) and reports handles it no longer needs; the runtime drops them here."""

    def __init__(self) -> None:
        self._values: dict[int, Any] = {}
        self._next = itertools.count(1)  # next() on a count is atomic under the GIL

    def put(self, value: Any) -> int:
        handle = next(self._next)
        self._values[handle] = value
        return handle

    def get(self, handle: int) -> Any:
        return self._values[handle]

    def drop(self, handles: Iterable[int]) -> None:
        pop = self._values.pop
        for h in handles:
            pop(h, None)

    def __len__(self) -> int:
        return len(self._values)

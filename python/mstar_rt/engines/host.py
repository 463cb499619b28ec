"""What an engine needs from whoever hosts it: the in-process Runtime, or a placement worker."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, Sequence

if TYPE_CHECKING:
    from mstar_rt._core import NodeRunner, WorkItem
    from mstar_rt.nodes import NodeTable
    from mstar_rt.registry import RequestRegistry


class EngineHost(Protocol):
    """An engine pulls batches from ``queue`` (the Conductor, or a worker's ready queue: its
    ``next_batch`` / ``run_batch`` / ``complete`` / ``fail_items``), runs them with ``run`` (or
    with ``runner`` for engines that batch by themselves), and hands every outcome to
    ``report``. Outcomes are ``(emits, walks_done, failed)``."""

    nodes: "NodeTable"
    requests: "RequestRegistry"
    runner: "NodeRunner"
    poll_s: float

    @property
    def queue(self) -> Any: ...

    @property
    def closed(self) -> bool: ...

    def run(self, node: int, items: Sequence[WorkItem]) -> tuple:
        """prepare -> forward -> check_stop for one batch, reported to the queue; the outcome."""

    def report(self, outcome: tuple) -> None:
        """Acts on an outcome; never raises."""

    def requests_ended(self, finished: list) -> None:
        """Requests the queue finished itself: [(request id, timeline bytes)]."""

    def loop_id(self, name: str) -> Any:
        """What the queue takes for the DynamicLoop a node's check_stop named."""

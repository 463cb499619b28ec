"""Engines: what runs a node's batches. One worker thread per engine, fed by the Conductor."""

from __future__ import annotations

import abc
import threading
import traceback
from typing import TYPE_CHECKING, Any, Optional, Sequence

if TYPE_CHECKING:  # hosts import engines, not the other way round
    from mstar_rt.engines.host import EngineHost


class Engine(abc.ABC):
    """Runs the batches of the nodes mapped to it, on one worker thread.

    Its host (:class:`~mstar_rt.engines.host.EngineHost`: the Runtime, or a placement worker)
    calls :meth:`attach` once, then :meth:`serve` on the engine's worker thread (it returns when
    the host closes), and :meth:`release` whenever a request ends.
    """

    #: True when the engine keeps per-request state under ``RequestContext.cache_id`` (not the
    #: request id of its host): a placement worker may then run its nodes inside segments,
    #: whose runs of one request share that state (placement/segments.py).
    keys_by_cache_id = False

    def __init__(self, num_threads: Optional[int] = None) -> None:
        #: torch intra-op threads on this engine's worker (None: leave torch's setting).
        self.num_threads = num_threads
        self.host: Optional["EngineHost"] = None
        self.engine_id = -1
        self.nodes: tuple[int, ...] = ()
        self.name = ""
        self._largest_batch = 0
        # Held while a batch runs: one batch of an engine at a time, on whichever thread runs it
        self.running = threading.Lock()

    def attach(self, host: "EngineHost", engine_id: int, name: str, nodes: Sequence[int]) -> None:
        if self.host is not None and not self.host.closed:
            raise ValueError(f"engine '{name}' ({type(self).__name__}) already serves another "
                             "Runtime; give every Runtime its own engine objects")
        self.host, self.engine_id, self.name, self.nodes = host, engine_id, name, tuple(nodes)
        self._largest_batch = 0  # read on every submit of a placed request: computed once

    def init_worker_thread(self) -> None:
        """Called first on the worker thread: torch's OpenMP pool is per calling thread."""
        if self.num_threads is not None:
            import torch

            # torch gives a thread the process-wide count at its first parallel op (a lazy
            # per-thread init), so a count set before that is lost if any other thread set
            # another meanwhile (another engine, the caller): the 2-thread engine of two ran
            # its GEMMs on one. get_num_threads() makes that init happen now, first.
            torch.get_num_threads()
            torch.set_num_threads(self.num_threads)

    @abc.abstractmethod
    def serve(self) -> None:
        """The worker loop: pull batches, run them, report them; return once the runtime closes."""

    def release(self, request_id: int) -> None:
        """A request ended (finished, failed or cancelled): drop what the engine holds for it."""

    @property
    def max_batch(self) -> int:
        """The largest batch any of its nodes takes."""
        if not self._largest_batch:
            host = self.host
            assert host is not None
            self._largest_batch = max(host.nodes[n].max_batch for n in self.nodes)
        return self._largest_batch


class StatelessEngine(Engine):
    """Batches independent calls of one node: each ``forward`` gets a list of prepared items
    (the submodule stacks or pads them; :func:`mstar_rt.engines.stack_pad` helps)."""

    def serve(self) -> None:
        host = self.host
        assert host is not None
        self.init_worker_thread()
        queue = host.queue
        engine, max_batch, poll = self.engine_id, self.max_batch, host.poll_s
        while not host.closed:
            try:
                got = queue.run_batch(engine, max_batch, poll)
            except Exception:  # a bug in the runtime itself: keep the worker alive
                traceback.print_exc()
                continue
            if got[0] is None:
                self.turn(host, got)
            else:  # a batch for this thread to run; another thread may run this engine's too
                with self.running:
                    self.turn(host, got)

    def turn(self, host: "EngineHost", got: tuple) -> None:
        """Acts on one ``run_batch`` answer: reports what the queue ran itself (the Conductor's
        bound nodes), runs a batch it handed back (hold ``running``)."""
        batch, outcome, finished = got
        if batch is None:
            if outcome is not None:
                self._report(host, [outcome])
            if finished:
                host.requests_ended(finished)
            return
        node, _walk, items = batch
        if isinstance(outcome, str) and len(items) == 1:  # it raised; running it again repeats it
            self._report(host, [host.queue.fail_items([items[0].id], outcome)])
            return
        self.run_items(host, node, items, outcome is None)

    def run_items(self, host: "EngineHost", node: int, items: list, whole: bool = True) -> None:
        """Runs a batch taken from the queue and reports it (hold ``running``); ``whole=False``
        (a hook already failed on the batch): item by item, so only the culprit's request
        fails."""
        if whole:
            try:
                self._report(host, [host.run(node, items)])
                return
            except Exception as e:
                if len(items) == 1:  # the culprit is known: running it again repeats its work
                    self._report(host, [host.queue.fail_items([items[0].id],
                                                              f"{type(e).__name__}: {e}")])
                    return
                # then one by one: only the culprit's request fails
        outcomes = []
        for item in items:
            try:
                outcomes.append(host.run(node, [item]))
            except Exception as e:
                outcomes.append(host.queue.fail_items([item.id], f"{type(e).__name__}: {e}"))
        self._report(host, outcomes)

    @staticmethod
    def _report(host: "EngineHost", outcomes: list) -> None:
        for outcome in outcomes:
            try:
                host.report(outcome)
            except Exception:  # a bug in the runtime itself: keep the worker alive
                traceback.print_exc()


def stack_pad(values: Sequence[Any], pad_value: float = 0) -> tuple[Any, Any]:
    """Stacks tensors whose first dimension differs into ``[B, max_len, ...]`` padded with
    ``pad_value``; returns ``(stacked, lengths)``. Equal lengths stack without padding."""
    import torch

    lengths = torch.tensor([v.shape[0] for v in values], dtype=torch.long)
    first = values[0]
    for v in values[1:]:
        if v.shape[1:] != first.shape[1:] or v.dtype != first.dtype:
            raise ValueError(f"stack_pad: items of shape {tuple(first.shape)} {first.dtype} and "
                             f"{tuple(v.shape)} {v.dtype} differ beyond the first dimension")
    longest = int(lengths.max())
    out = first.new_full((len(values), longest, *first.shape[1:]), pad_value)
    for i, v in enumerate(values):
        out[i, : v.shape[0]] = v
    return out, lengths

"""The worker's side of placement: its engines run the placed nodes exactly as the in-process
Runtime would, fed by a :class:`LocalQueue` that stands in for the Conductor.

:class:`WorkerHost` is an engine host (:class:`~mstar_rt.engines.host.EngineHost`) made of the
same parts as the Runtime -- a node table, a request registry and the node runner -- so a node
behaves bit for bit as it does in one process; it holds the per-request contexts (and, through
its engines, KV pages) until the parent says the request ended. Results leave through ``reply``
(the worker's sender)."""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Optional, Sequence

from mstar_rt import _core
from mstar_rt.engines.base import Engine, StatelessEngine
from mstar_rt.model import NO_DEADLINE, Model, RequestContext
from mstar_rt.nodes import NodeRunner, NodeTable
from mstar_rt.placement.codec import scalar_items
from mstar_rt.placement.segment_runner import SegmentRunner
from mstar_rt.placement.segments import Segment
from mstar_rt.registry import RequestRegistry
from mstar_rt.compiler import compile_model

_EMPTY: tuple = ((), (), ())  # an outcome with nothing for the (absent) Conductor to act on
INLINE_MAX_S = 1e-3  # a node this quick runs on the receiving thread when its engine is idle


class _Request:
    __slots__ = ("context",)

    def __init__(self, context: RequestContext) -> None:
        self.context = context


class LocalQueue:
    """Ready items per engine, in the Conductor's order (the same C++ ready queue: deadline, then
    priority, then request arrival); ``next_batch`` takes the most urgent one and batches it with
    the next most urgent items of the same node and walk."""

    def __init__(self, host: "WorkerHost", num_engines: int, engine_of_node: dict[int, int],
                 reply: Callable[..., None]) -> None:
        self._host = host
        # (one engine at least: a worker whose nodes all run in segments queues nothing here)
        self._ready = _core.ReadyQueue(max(1, num_engines),
                                       [e.max_batch for e in host.nodes.entries])
        self._engine_of_node = engine_of_node
        self._lock = threading.Lock()
        self._item_rid: dict[int, int] = {}  # items handed to an engine -> request
        # engine -> [node, since, items not yet reported]: what the heartbeat says it runs
        self._running: dict[int, list] = {}
        self._reply = reply
        self.batches = 0

    def put(self, node: int, walk: int, items: Sequence[tuple]) -> None:
        engine, get = self._engine_of_node[node], self._host.requests.get
        for item in items:
            entry = get(item.request)
            deadline, priority = ((entry.context.deadline_ns, entry.context.priority)
                                  if entry is not None else (NO_DEADLINE, 0))
            # Request ids are the parent's, given in arrival order.
            self._ready.put(engine, node, walk, item.request, deadline, priority, item.request, item.id,
                            item)

    def run_batch(self, engine: int, max_batch: int, timeout_s: float) -> tuple:
        """What StatelessEngine calls: the batch, for the engine to run (this queue runs no
        node itself, unlike the Conductor's run_batch)."""
        return self.next_batch(engine, max_batch, timeout_s), None, None

    def next_batch(self, engine: int, max_batch: int, timeout_s: float) -> Optional[tuple]:
        batch = self._ready.next_batch(engine, max_batch, timeout_s)
        if batch is not None:
            self.start(engine, batch[0], batch[2])
        return batch

    def start(self, engine: int, node: int, items: Sequence[Any]) -> None:
        """``items`` of ``node`` run now on ``engine`` (taken from the queue or never queued)."""
        with self._lock:
            for item in items:
                self._item_rid[item.id] = item.request
            running = self._running.setdefault(engine, [node, time.monotonic(), set()])
            running[2].update(item.id for item in items)
            self.batches += 1

    def engine_of(self, node: int) -> int:
        return self._engine_of_node[node]

    def idle(self) -> bool:
        """Nothing is queued for any engine."""
        return len(self._ready) == 0

    def hold(self, held: bool) -> None:
        """While held, no engine takes a batch (:meth:`WorkerHost.dispatch`)."""
        self._ready.hold(held)

    def busy(self) -> list[list]:
        """[[node name, seconds it has been running], ...] for each engine that is busy."""
        now, names = time.monotonic(), self._host.node_names
        with self._lock:
            return [[names[node], now - since] for node, since, _ in self._running.values()]

    def purge(self, rid: int) -> None:
        """Drops the queued items of an ended request (the parent already reported them)."""
        self._ready.purge(rid)

    @property
    def queued(self) -> int:
        return len(self._ready)

    def shutdown(self) -> None:
        self._ready.shutdown()

    def _take(self, ids: Sequence[int]) -> list[Optional[int]]:
        with self._lock:
            for engine, running in list(self._running.items()):
                running[2].difference_update(ids)
                if not running[2]:
                    del self._running[engine]
            return [self._item_rid.pop(i, None) for i in ids]

    # ---- what engines report (the Conductor's complete / fail_items) ----------------------------

    def complete(self, node: int, ids: Sequence[int], outputs: list, stops: Any,
                 failed: Sequence[tuple[int, str]] = ()) -> tuple:
        """As the Conductor's: ``failed`` (item id, why) fail, the others complete."""
        for item, why in failed:
            self.fail_items([item], why)
        ids = list(ids)
        if failed and not ids:
            return _EMPTY
        if len(outputs) != len(ids):
            raise ValueError(f"complete: {len(outputs)} results for {len(ids)} items")
        rids = self._take(ids)
        get = self._host.requests.get
        states = {}
        for rid in set(rids):
            handle = get(rid) if rid is not None else None
            if handle is not None:
                states[rid] = scalar_items(handle.context.state)
        self._reply("done", node=node, items=ids, outputs=list(outputs),
                    stops=None if stops is None else [list(s) for s in stops], states=states)
        return _EMPTY

    def fail_items(self, ids: Sequence[int], message: str) -> tuple:
        ids = list(ids)
        self._take(ids)
        self._reply("failed", items=ids, message=message)
        return _EMPTY


class WorkerHost:
    """Runs ``nodes`` of ``model`` on their engines (from ``model.engine_specs``, else
    stateless; ``kv_settings`` names KVCacheEngines to build with other settings), one thread
    per engine, like the Runtime does."""

    def __init__(self, model: Model, nodes: Sequence[str], reply: Callable[..., None],
                 kv_settings: Optional[dict[str, dict]] = None, poll_s: float = 0.05,
                 segments: Sequence[Segment] = (), rank: int = 0) -> None:
        self.model = model
        self.graph = g = compile_model(model)
        self.poll_s = poll_s
        self.nodes = NodeTable(model, g)
        self.requests = RequestRegistry()
        # The Runtime's batch path; check_stop's loop names go back to the parent as names (no
        # loop_ids), and it maps them to its own ids.
        self.runner = NodeRunner(self.nodes.entries, self.requests)
        self.node_names, self.walk_names = self.nodes.names, list(g.walk_ids)
        self._closed = False
        # Nodes of an engine that serves segments only (segment_runner.py) are the segments'.
        in_segments = {e for s in segments if s.rank == rank for e in s.engines}
        self.every = every = [g.node_ids[n] for n in nodes]  # segments' nodes too
        self._submodules = self.nodes.unique_submodules(every)  # cleanup: all, per request
        self.node_ids = [i for i in every if self.nodes[i].engine not in in_segments]
        names = sorted({self.nodes[i].engine for i in self.node_ids})
        engine_of_node = {i: names.index(self.nodes[i].engine) for i in self.node_ids}
        self.conductor = LocalQueue(self, len(names), engine_of_node, reply)
        self.engines: dict[str, Engine] = {}
        built = _kv_engines(kv_settings)
        for engine_id, name in enumerate(names):
            engine: Engine = built.get(name) or model.engine_specs.get(name) or StatelessEngine()
            engine.attach(self, engine_id, name,
                          [i for i in self.node_ids if engine_of_node[i] == engine_id])
            self.engines[name] = engine
        self._engine_list = list(self.engines.values())
        self._node_s: dict[int, float] = {}  # node -> recent seconds per batch (dispatch)
        self._workers = [threading.Thread(target=e.serve, name=f"mstar-engine-{e.name}",
                                          daemon=True) for e in self.engines.values()]
        for t in self._workers:
            t.start()
        # Segment node ids follow the model's own (the parent's view appends them in order).
        self.segments = SegmentRunner(model, segments, len(self.node_names), rank,
                                      self._context, reply,
                                      {e: x for e, x in built.items() if e in in_segments})
        self.segment_names = [s.name for s in segments]

    @property
    def every_engine(self) -> dict[str, Engine]:
        """Its engines and its segments' stateful ones, by name."""
        return {**self.engines, **{e.name: e for e in self.segments.stateful}}

    def submodules_of(self, engine: str) -> list:
        """The submodules of this worker's nodes on ``engine`` (segments' nodes too), once each."""
        return list({id(self.nodes[i].submodule): self.nodes[i].submodule
                     for i in self.every if self.nodes[i].engine == engine}.values())

    def _context(self, rid: int) -> Optional[RequestContext]:
        handle = self.requests.get(rid)
        return None if handle is None else handle.context

    # ---- the engine host (mstar_rt.engines.host.EngineHost) ------------------------------------

    @property
    def queue(self) -> LocalQueue:
        return self.conductor

    @property
    def closed(self) -> bool:
        return self._closed

    def run(self, node: int, items: list) -> tuple:
        t0 = time.perf_counter()
        ids, outputs, stops, failed = self.runner.run(node, items)
        took = time.perf_counter() - t0
        # a node's first batch pays one-time costs (lazy imports, allocator warm-up): not counted
        seen = self._node_s.get(node)
        self._node_s[node] = 0.0 if seen is None else 0.75 * seen + 0.25 * took
        return self.conductor.complete(node, ids, outputs, stops, failed)

    def dispatch(self, node: int, walk: int, items: list, alone: bool = True) -> None:
        """Runs the batch here, on the thread that received it, when it came ``alone``, its
        engine is idle and its node has been quick (under INLINE_MAX_S): waking the engine's
        thread costs more than such a node (100-300 µs on a VM). Otherwise, or for an engine
        with its own batching (a KV cache), it queues for the engine's thread: a burst of
        messages (what piled up meanwhile) is queued whole under :meth:`LocalQueue.hold` and
        then taken in deadline order, as the Conductor would."""
        q = self.conductor
        engine = self._engine_list[q.engine_of(node)]
        if (alone and type(engine) is StatelessEngine
                and self._node_s.get(node, 0.0) < INLINE_MAX_S
                and engine.running.acquire(blocking=False)):
            try:
                if q.idle():  # nothing queued that this batch would overtake
                    q.start(engine.engine_id, node, items)
                    engine.run_items(self, node, items)
                    return
            finally:
                engine.running.release()
        q.put(node, walk, items)

    def busy(self) -> list[list]:
        """[[node name, seconds it has been running]] for the batches its engines and its
        segments' runs have taken (the heartbeat's, for node_timeout_s)."""
        return self.conductor.busy() + self.segments.busy()

    def report(self, outcome: tuple) -> None:
        """Outcomes are the parent's business; the LocalQueue already sent the results."""

    def requests_ended(self, finished: list) -> None:
        """Never called: the LocalQueue finishes no request itself."""

    @staticmethod
    def loop_id(name: str) -> str:
        return name

    # ---- requests, as the parent announces them ------------------------------------------------

    def open(self, rid: int, inputs: Optional[dict], state: dict,
             order: tuple = (2**63 - 1, 0)) -> None:
        """``order``: the request's (deadline_ns, priority)."""
        with self.requests.lock:
            if self.requests.get(rid) is None:
                ctx = RequestContext(id=rid, inputs=inputs or {}, deadline_ns=order[0],
                                     priority=order[1], cache_id=rid)
                ctx.state.update(state)
                self.requests.add(rid, _Request(ctx))

    def set_walk(self, rid: int, walk: int) -> None:
        handle = self.requests.get(rid)
        if handle is not None:
            handle.context.walk = self.walk_names[walk]

    def release(self, rid: int) -> bool:
        """The request ended in the parent: free its pages, queued items and node state."""
        handle = self.requests.pop(rid)
        if handle is None:
            return False
        self.segments.release(rid)
        self.conductor.purge(rid)
        for engine in self.engines.values():
            engine.release(rid)
        for sub in self._submodules:
            try:
                sub.cleanup(handle.context)
            except Exception:  # as in the Runtime: a cleanup failure must not stop the worker
                pass
        return True

    def stats(self) -> dict:
        kv = {}
        for name, engine in self.every_engine.items():
            cache = getattr(engine, "cache", None)
            if cache is not None:
                kv[name] = dict(pages_in_use=cache.num_pages - cache.free_pages,
                                num_pages=cache.num_pages, sequences=cache.live_sequences,
                                steps=getattr(engine, "steps", 0),
                                largest_step=max(getattr(engine, "step_sizes", ()), default=0))
        return dict(live_requests=len(self.requests), queued_items=self.conductor.queued,
                    batches=self.conductor.batches, kv=kv,
                    kv_pages_in_use=sum(v["pages_in_use"] for v in kv.values()),
                    **self.segments.stats())

    def close(self) -> None:
        self._closed = True
        self.segments.close()
        self.conductor.shutdown()
        for t in self._workers:
            t.join(timeout=10)
        for rid in self.requests.ids():
            self.release(rid)


def _kv_engines(settings: Optional[dict[str, dict]]) -> dict[str, Engine]:
    """The KVCacheEngines the config builds with settings of its own, by name."""
    if not settings:
        return {}
    from mstar_rt.engines.kv_engine import KVCacheEngine

    return {name: KVCacheEngine(**kw) for name, kw in settings.items()}

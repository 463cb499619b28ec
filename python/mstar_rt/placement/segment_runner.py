"""The worker's side of segments (placement/segments.py): each segment of this rank is served by
an in-process Runtime over the segment's nodes, so its nodes advance as they would in one
process -- no parent round trip per node. A run is one request of that Runtime per parent work
item; it reports once at its end (``done`` with the segment's outputs, or ``failed``), and its
EMITted outputs go to the parent as they are made (``emit``); those made by the batch that ends
the run ride in its ``done`` (one message, not two, for a walk whose last node EMITs).

Replies leave through one sender thread, in the order they were made (a run's outputs before
its end): the nodes' thread only queues them, and what queued while the sender was busy leaves
in one message (a fast decode loop's tokens then cross a few at a time, never late)."""

from __future__ import annotations

import collections
import threading
import time
from typing import Any, Callable, Optional, Sequence

from mstar_rt.graph import EMIT, GraphEdge
from mstar_rt.model import NO_DEADLINE, Model, RequestContext
from mstar_rt.placement.codec import scalar_items
from mstar_rt.placement.inline_runs import InlineRuns
from mstar_rt.placement.segment_model import SegmentModel
from mstar_rt.placement.segments import Segment, loop_names
from mstar_rt.placement.stream_in import STREAM_IN_ENGINE, Feed, source_name, window_lasts
from mstar_rt.runtime import RequestCancelled, RequestHandle, Runtime


class _Run:
    """One segment run: the parent's work item it answers and the request it belongs to."""

    __slots__ = ("context", "item", "request", "node", "outputs", "released", "last_emits",
                 "feed")

    def __init__(self, context: RequestContext, item: int, request: int, node: int) -> None:
        self.context, self.item, self.request, self.node = context, item, request, node
        self.outputs: dict = {}
        self.released = False
        self.last_emits: list = []  # made by the batch that ends the run: they leave with it
        # streams entering it (placement/stream_in.py), until its last window came: its end's
        # answer then waits for that window's item
        self.feed: Optional[Feed] = None


class _SegmentRuntime(Runtime):
    """A Runtime whose outputs and ends go to the segment runner. Its runs call no ``cleanup``:
    the worker calls it once, as the request ends (WorkerHost.release)."""

    def __init__(self, model: Model, runner: "SegmentRunner",
                 engines: Optional[dict] = None, loops: Sequence[str] = ()) -> None:
        self.segment_runner = runner
        super().__init__(model, engines=engines, request_cleanup=False)
        # A node may stop a DynamicLoop of the model's that no segment here holds (a prefill
        # ending its request names the decode loop of a walk on another worker): an id past
        # every loop's, which the Conductor ignores, as one process does for a loop not running.
        ids, past = self.stop_ids, len(self.graph.names) + len(self.graph.name_ids)
        for name in loops:
            ids.setdefault(name, past + len(ids))

    def report(self, outcome: tuple) -> None:
        if outcome[0]:
            self.segment_runner.forward_emits(self, outcome[0], ending=outcome[1])
        super().report(outcome)

    def ended(self, handle: RequestHandle, error: Optional[BaseException]) -> None:
        self.segment_runner.ended(handle, error)


class SegmentRunner:
    """Runs this rank's segments. ``segments``: every segment of the model, in the order that
    gives their node ids from ``first_id`` on; ``context(rid)``: the worker's context of a
    request; ``reply(kind, **fields)``: the worker's sender; ``engines``: stateful engines built
    with the worker's settings, by name, instead of the model's.

    Each segment has a Runtime of its own, except those whose nodes use a stateful engine: they
    share one, which holds that engine; a request's runs there share its state through the
    request's cache id (RequestContext.cache_id), which is freed when the request ends
    (:meth:`release`)."""

    def __init__(self, model: Model, segments: Sequence[Segment], first_id: int, rank: int,
                 context: Callable[[int], Optional[RequestContext]],
                 reply: Callable[..., None], engines: Optional[dict] = None) -> None:
        self._context, self._send = context, reply
        self._lock = threading.Lock()
        self._outbox: collections.deque = collections.deque()
        self._wake = threading.Condition(threading.Lock())
        self._closing = self._busy = False
        self._runs: dict[int, _Run] = {}           # id(run context) -> run
        self._driver: Optional[int] = None          # the thread running a run inline
        self._pending = threading.local()           # the run that submit() is binding
        self._feeds: dict[tuple[int, int], _Run] = {}  # (segment, request) -> run fed by streams
        # released request -> its runs still going; their stateful engines' state is freed
        # when the last ends, not at the release (a step then may be taking pages)
        self._free_after: dict[int, int] = {}
        self.segments = {first_id + i: s for i, s in enumerate(segments) if s.rank == rank}
        # streams leaving a segment: name -> whether its producer also EMITs it
        emitted = {(n.name, o.name) for n in model.nodes for o in n.outputs
                   if isinstance(o, GraphEdge) and o.to == EMIT}
        self._pushes = {node: {x: any((n, x) in emitted for n in s.nodes) for x in s.pushes}
                        for node, s in self.segments.items()}
        self.runtimes: dict[int, _SegmentRuntime] = {}
        self.stateful: list = []  # the stateful engines: requests' state lives between runs
        shared = {n: s for n, s in self.segments.items() if s.engines}
        loops = sorted({x for w in model.walks.values() for x in loop_names(w)})
        if shared:
            names = {e for s in shared.values() for e in s.engines}
            rt = _SegmentRuntime(SegmentModel(model, list(shared.values()), self._bind,
                                              self._capture), self,
                                 {e: x for e, x in (engines or {}).items() if e in names}, loops)
            self.runtimes.update((n, rt) for n in shared)
            self.stateful = [rt.engines[e] for e in sorted(names)]
        for node, s in self.segments.items():
            if node not in shared:
                self.runtimes[node] = _SegmentRuntime(
                    SegmentModel(model, [s], self._bind, self._capture), self, loops=loops)
        inline = {id(rt): InlineRuns(rt) for rt in self.runtimes.values()}
        self._inline = {node: inline[id(rt)] for node, rt in self.runtimes.items()}
        self._sender = threading.Thread(target=self._send_loop, daemon=True,
                                        name="mstar-segment-replies")
        if self.segments:
            self._sender.start()

    def _reply(self, kind: str, **fields: Any) -> None:
        with self._wake:
            self._outbox.append((kind, fields))
            if kind == "emit":  # outputs go to the sender thread, or wait for the driver's
                if self._driver != threading.get_ident():  # end (placement/inline_runs.py)
                    self._wake.notify()
                return
        # A run's end goes out at once from its own thread, after the outputs queued before
        # it, when the sender is idle (a thread hand-off costs more than the sends).
        self._send_here()

    def _send_here(self) -> None:
        """Sends what the outbox holds from this thread, unless the sender thread is busy
        (then it is told: it takes what queued meanwhile)."""
        with self._wake:
            if self._busy or not self._outbox:
                if self._outbox:
                    self._wake.notify()
                return
            self._busy = True
            batch = list(self._outbox)
            self._outbox.clear()
        try:
            for kind, fields in coalesce(batch):
                self._send(kind, **fields)
        finally:
            with self._wake:
                self._busy = False
                if self._outbox:
                    self._wake.notify()

    def _send_loop(self) -> None:
        while True:
            with self._wake:
                while (not self._outbox or self._busy) and not self._closing:
                    self._wake.wait()
                if not self._outbox:
                    return
                batch = list(self._outbox)
                self._outbox.clear()
                self._busy = True
            try:
                for kind, fields in coalesce(batch):
                    self._send(kind, **fields)
            finally:
                with self._wake:
                    self._busy = False

    # ---- runs ----------------------------------------------------------------------------------

    def submit(self, node: int, items: list, alone: bool = False) -> list[int]:
        """Starts a run per item ``(item, request, inputs, chunk)``; the items it could not start
        (no context for the request) are returned, for the caller to fail. ``alone``: the
        message came with no other waiting; a single short run then runs on this thread
        (placement/inline_runs.py). A segment taking streams gets their windows instead
        (:meth:`_windows`)."""
        if self.segments[node].takes:
            return self._windows(node, items)
        rt, inline = self.runtimes[node], self._inline[node]
        driving = inline.begin(alone and len(items) == 1)
        if driving:
            self._driver = threading.get_ident()  # its outputs wait for its end: one message
        try:
            refused = self._start(rt, node, items)
            if driving:
                inline.drive()
        finally:
            if driving:
                self._driver = None
            inline.end(driving)
            if driving:
                self._send_here()  # what a run going on on the engine thread made here
        return refused

    def _start(self, rt: Runtime, node: int, items: list, feed: Optional[Feed] = None
               ) -> list[int]:
        refused = []
        for it in items:  # (item, request, inputs, ...)
            item, rid, inputs = it[0], it[1], it[2]
            ctx = self._context(rid)
            if ctx is None:
                refused.append(item)
                continue
            run = self._pending.run = _Run(ctx, item, rid, node)
            if feed is not None:
                run.feed = feed
                with self._lock:
                    self._feeds[(node, rid)] = run
            deadline = (None if ctx.deadline_ns == NO_DEADLINE
                        else (ctx.deadline_ns - time.monotonic_ns()) / 1e9)
            try:
                rt.submit(inputs, deadline=deadline, priority=ctx.priority, keep_outputs=False)
            except Exception as e:  # the run never started: only its item (request) fails
                self._forget(run)
                message = f"{type(e).__name__}: {e}"
                if run.feed is not None:  # its later windows are dropped, its last answered
                    run.feed.result = (RuntimeError(message),)
                self._reply("failed", items=[item], message=message,
                            **({"request": rid} if run.feed is not None else {}))
            finally:
                self._pending.run = None
        return refused

    def _windows(self, node: int, items: list) -> list[int]:
        """Windows of the streams entering segment ``node``, one item each (the parent takes
        them with Fixed(1)): the first starts the run, each item is pushed into its stream's
        source node, a stream's last window ends its source, and the run's end is answered
        with the item of the last window of all (placement/stream_in.py)."""
        rt, seg = self.runtimes[node], self.segments[node]
        names = [e.name for _, e in seg.takes]
        refused = []
        for item, rid, inputs, chunk in items:
            lasts = window_lasts(chunk)
            if len(lasts) != len(names) or not all(isinstance(inputs.get(x), list)
                                                   for x in names):
                self._reply("failed", items=[item], request=rid,
                            message=f"segment '{seg.name}' takes streams {names}: each of its "
                                    "items carries one window (a list of values) per stream "
                                    "and the chunk saying which is last")
                continue
            with self._lock:
                run = self._feeds.get((node, rid))
            if run is None:
                plain = {k: v for k, v in inputs.items() if k not in names}
                sources = [(rt.graph.node_ids[source_name(seg.name, x)], rt.graph.name_ids[x])
                           for x in names]
                refused += self._start(rt, node, [(item, rid, plain)], Feed(sources))
                with self._lock:
                    run = self._feeds.get((node, rid))
                if run is None:
                    continue
            feed = run.feed
            assert feed is not None
            sub = run.context.id
            for k, (source, name) in enumerate(feed.sources):
                if feed.result is not None or feed.ended[k]:
                    continue
                for value in inputs[names[k]]:
                    rt.report(rt.conductor.push_stream(sub, source, name, value)[1])
                if lasts[k]:
                    feed.ended[k] = True
                    rt.engines[STREAM_IN_ENGINE].end(sub, source)
            if all(lasts):
                with self._lock:
                    self._feeds.pop((node, rid), None)
                    run.item, run.feed = item, None
                    result = feed.result
                if result is not None:  # the run ended before: answered now
                    self._answer(run, result[0])
        return refused

    def _bind(self, run_ctx: RequestContext) -> Segment:
        """In submit, before the run's first node: its nodes see the request's own inputs, state
        and cache id (the per-node path's context), and the run is known before it can end."""
        run: _Run = self._pending.run
        run_ctx.inputs, run_ctx.state = run.context.inputs, run.context.state
        run_ctx.cache_id = run.request
        run.context = run_ctx
        with self._lock:
            self._runs[id(run_ctx)] = run
        return self.segments[run.node]

    def _capture(self, run_ctx: RequestContext, outputs: dict) -> None:
        run = self._runs.get(id(run_ctx))
        if run is not None:
            run.outputs = outputs

    def _forget(self, run: Optional[_Run]) -> Optional[_Run]:
        if run is None:
            return None
        with self._lock:
            gone = self._runs.pop(id(run.context), None)
            free = gone is not None and self._gone(gone)
        if free:
            self._free_state(run.request)
        return gone

    def forward_emits(self, rt: Runtime, emits: list, ending: Sequence[int] = ()) -> None:
        """``ending``: the runs whose walk this same outcome ends; their outputs wait for the
        run's end (``ended``, at once after this) and leave in its reply. An item of a stream
        leaving the segment goes as ``[request, name, value, stand-in node]``."""
        out, items = [], set()
        for sub_rid, name, value in emits:
            run = self._runs.get(id(rt.requests.context(sub_rid)))
            if run is None or run.released:
                continue
            dest = run.last_emits if sub_rid in ending else out
            emitted = self._pushes[run.node].get(name)
            if emitted is not None:
                dest.append([run.request, name, value, run.node])
            if emitted is not False:
                dest.append([run.request, name, value])
            if dest is out:
                items.add(run.item)
        if out:  # items: what fails if the values cannot cross
            self._reply("emit", emits=out, items=sorted(items))

    def ended(self, handle: RequestHandle, error: Optional[BaseException]) -> None:
        with self._lock:
            run = self._runs.pop(id(handle.context), None)
            feed = run.feed if run is not None else None
            if feed is not None:  # the answer waits for the last window's item
                feed.result = (error,)
            free = run is not None and self._gone(run)
        if free:  # no step of the request runs any more: its pages go
            self._free_state(run.request)
        if feed is not None:  # its sources' items are let go
            self.runtimes[run.node].engines[STREAM_IN_ENGINE].release(handle.context.id)
        if run is not None:
            self._answer(run, error, waiting=feed is not None)

    def _answer(self, run: _Run, error: Optional[BaseException], waiting: bool = False) -> None:
        """The run's end to the parent. ``waiting``: fed by streams whose last window has not
        come, so its outputs and failure go now (the failure by request: the parent answered
        its windows), its ``done`` later with that window's item (:meth:`_windows`)."""
        if run.released:
            return
        if error is None and not waiting:
            extra = {"emits": run.last_emits} if run.last_emits else {}
            self._reply("done", node=run.node, items=[run.item], outputs=[run.outputs],
                        stops=None, states={run.request: scalar_items(run.context.state)},
                        **extra)
            return
        if run.last_emits:
            self._reply("emit", emits=run.last_emits, items=[run.item])
            run.last_emits = []
        if error is not None and not isinstance(error, RequestCancelled):
            self._reply("failed", items=[] if waiting else [run.item], message=str(error),
                        named=True, **({"request": run.request} if waiting else {}))

    def release(self, rid: int) -> None:
        """The request ended in the parent: its runs stop (their pages and values freed)."""
        with self._lock:
            runs = [r for r in self._runs.values() if r.request == rid]
            for r in runs:
                r.released = True
            for key in [k for k in self._feeds if k[1] == rid]:
                self._feeds.pop(key).released = True
            if runs:  # a run's step may be taking pages now: freed when the last run ends
                self._free_after[rid] = len(runs)
        for r in runs:
            handle = self.runtimes[r.node].requests.get(r.context.id)
            if handle is not None:
                handle.cancel()
        if not runs:
            self._free_state(rid)

    def _gone(self, run: _Run) -> bool:
        """A run left (hold ``_lock``): whether it was a released request's last, whose state
        is to be freed now."""
        left = self._free_after.get(run.request) if run.released else None
        if left is None:
            return False
        if left > 1:
            self._free_after[run.request] = left - 1
            return False
        del self._free_after[run.request]
        return True

    def _free_state(self, rid: int) -> None:
        for engine in self.stateful:  # what its runs left for the next (K/V pages)
            engine.release(rid)

    # ---- introspection and lifetime ------------------------------------------------------------

    def busy(self) -> list[list]:
        """[[node name, seconds it has been running]] for the batches the runs have taken."""
        return [[rt.node_names[node], seconds] for rt in self._unique_runtimes()
                for node, seconds in rt.conductor.running()]

    def _unique_runtimes(self) -> list[Runtime]:
        return list({id(rt): rt for rt in self.runtimes.values()}.values())

    def stats(self) -> dict:
        live = {"requests": 0, "handles": 0, "stored": 0, "queued": 0, "inflight": 0}
        for rt in self._unique_runtimes():
            for k, v in rt.live.items():
                live[k] += v
        with self._lock:  # a run fed by streams counts until its last window came
            runs = len(set(map(id, self._runs.values())) | set(map(id, self._feeds.values())))
        return dict(segment_runs=runs, segment_live=live)

    def close(self) -> None:
        for rt in self._unique_runtimes():
            rt.close()
        with self._wake:
            self._closing = True
            self._wake.notify()
        if self._sender.is_alive():
            self._sender.join(timeout=5)


COALESCE_BYTES = 4 << 20  # tensor bytes past which replies leave as messages of their own


def coalesce(batch: list) -> list:
    """Consecutive replies of one kind leave as one message: outputs (``emit``) and ends of
    runs of one segment (``done``) -- up to COALESCE_BYTES of tensors in a message: a fast
    decode loop's tokens gain from it, large items nothing, and a message holding many of them
    could outgrow the arena it must fit (a stream of 1 MiB frames queued while the sender was
    busy failed its request so with a 16 MiB arena)."""
    out: list = []
    held = 0  # tensor bytes of out[-1]
    for kind, fields in batch:
        size = _tensor_bytes(fields)
        last = out[-1] if out and held + size <= COALESCE_BYTES else None
        if last is not None and last[0] == kind == "emit":
            last[1]["emits"] += fields["emits"]
            last[1]["items"] = sorted(set(last[1]["items"]) | set(fields["items"]))
        elif last is not None and last[0] == kind == "done" and \
                last[1]["node"] == fields["node"]:
            last[1]["items"] += fields["items"]
            last[1]["outputs"] += fields["outputs"]
            last[1]["states"].update(fields["states"])
            if fields.get("emits"):
                last[1]["emits"] = last[1].get("emits", []) + fields["emits"]
        else:
            out.append((kind, {k: (list(v) if isinstance(v, list) else
                                   dict(v) if isinstance(v, dict) else v)
                               for k, v in fields.items()}))
            held = 0
        held += size
    return out


def _tensor_bytes(fields: dict) -> int:
    """The bytes of the tensors (and arrays) a reply's outputs and emits hold, lists included."""
    values = [e[2] for e in fields.get("emits") or () if len(e) > 2]
    values += [v for out in fields.get("outputs") or () if isinstance(out, dict)
               for v in out.values()]
    total = 0
    for v in values:
        for x in (v if type(v) in (list, tuple) else (v,)):
            n = getattr(x, "nbytes", 0)
            total += n if type(n) is int else 0
    return total


__all__ = ["COALESCE_BYTES", "SegmentRunner", "coalesce"]

"""In-process Runtime: one worker thread per engine, fed by the C++ Conductor."""

from __future__ import annotations

import contextlib
import json
import operator
import queue
import struct
import traceback
import threading
import time
import weakref
from typing import Any, Iterator, Mapping, Optional

from mstar_rt import _core
from mstar_rt.compiler import compile_model
from mstar_rt.engines.base import Engine, StatelessEngine
from mstar_rt.feeds import FEED_ENGINE, FeedEngine, feeder
from mstar_rt.graph import stop_names
from mstar_rt.lifetime import join_all, refuse_own_thread, track
from mstar_rt.model import NO_DEADLINE, Model, NodeSubmodule, RequestContext
from mstar_rt.nodes import NodeRunner, NodeTable, overrides
from mstar_rt.registry import RequestRegistry
from mstar_rt.request_errors import (  # re-exported: their home was here
    DeadlineExceeded, RequestCancelled, RequestFailed, RequestTooLarge, request_failure)

_TIMELINE_RECORD = "<IIIIqqq"  # the C++ TimelineEvent: node, walk, iteration, batch, 3 clocks
_GATHER = threading.Lock()  # RequestHandle.result() gathering (brief; not one lock per request)

__all__ = ["DeadlineExceeded", "RequestCancelled", "RequestFailed", "RequestHandle",
           "RequestTooLarge", "Runtime", "compile_model", "request_failure"]


def _deadline_ns(deadline: float) -> int:
    """``deadline`` seconds from now on the Conductor's clock (int64 nanoseconds): one past the
    clock's end (or inf) is no deadline, one before its start is its start."""
    if deadline != deadline:
        raise ValueError("submit: deadline=nan; give seconds from now, or None for no deadline")
    now = time.monotonic_ns()
    if deadline >= (NO_DEADLINE - now) / 1e9:
        return NO_DEADLINE
    if deadline <= -now / 1e9:
        return 0
    return now + int(deadline * 1e9)


class RequestHandle:
    """A submitted request: iterate it for EMIT outputs as ``(name, value)``, or wait for
    :meth:`result`; :meth:`cancel` stops it; :meth:`stats` / :meth:`chrome_trace` time it."""

    def __init__(self, runtime: "Runtime", ctx: RequestContext, keep_outputs: bool = True,
                 borrows_cache: bool = False) -> None:
        self._runtime = runtime
        self.context = ctx
        self._events: queue.SimpleQueue = queue.SimpleQueue()
        # A latch: held until the request ends. A Lock costs a twentieth of an Event to make,
        # and every request makes one.
        self._latch = threading.Lock()
        self._latch.acquire()
        self._finished = False
        self._error: Optional[BaseException] = None
        self._emitted: dict[str, list] = {}  # every output, or (not kept) those result() took
        self._keep = keep_outputs
        self._received = 0  # outputs delivered (Runtime._end waits for all of them)
        self.borrows_cache = borrows_cache  # a segment run's: its engine state is not its own
        self._timeline: bytes | list[tuple] = b""

    @property
    def id(self) -> int:
        return self.context.id

    # -- called by the runtime --
    def _emit(self, name: str, value: Any, counted: bool = True) -> None:
        if self._keep:
            self._emitted.setdefault(name, []).append(value)
        self._received += counted  # only the Conductor's own EMITs, which _end waits for
        self._events.put((name, value))

    def _end(self, error: Optional[BaseException], timeline: bytes) -> None:
        if self._finished:
            return
        self._error = error
        self._timeline = timeline
        self._finished = True
        if isinstance(error, RequestCancelled):  # a barge-in: what it made is unwanted, and
            self._emitted = {}  # was yielded after the cancel (stale audio played on)
            with contextlib.suppress(queue.Empty):
                while True:
                    self._events.get_nowait()
        self._latch.release()
        self._events.put(None)

    # -- public --
    def __iter__(self) -> Iterator[tuple[str, Any]]:
        while True:
            event = self._events.get()
            if event is None:
                self._events.put(None)  # later iterations end at once too
                if self._error is not None:
                    raise self._error
                return
            yield event

    def result(self, timeout: Optional[float] = None) -> dict[str, list]:
        """Waits for the end; returns every EMIT output by name, in order (submitted with
        ``keep_outputs=False``: those iterating has not taken). Raises RequestFailed /
        RequestCancelled, or TimeoutError."""
        if not self._finished:
            forever = timeout is None or timeout >= threading.TIMEOUT_MAX  # inf overflowed
            if not self._latch.acquire(timeout=-1 if forever else max(0.0, timeout)):
                raise TimeoutError(f"request {self.id} did not finish within {timeout} s")
            self._latch.release()  # for the next waiter
        if self._error is not None:
            raise self._error
        if self._keep:
            return self._emitted
        with _GATHER:  # two threads may ask at once; the end marker goes back for both
            while True:
                event = self._events.get()
                if event is None:
                    self._events.put(None)
                    break
                self._emitted.setdefault(event[0], []).append(event[1])
        return self._emitted

    @property
    def done(self) -> bool:
        return self._finished

    def cancel(self) -> bool:
        """Stops the request now; its queued work is dropped and its memory freed."""
        return self._runtime.cancel(self)

    def feed(self, name: str, item: Any) -> None:
        """Appends ``item`` to the stream ``name`` of a :func:`~mstar_rt.StreamInput` (feeds.py);
        StreamClosedError once the stream or the request has ended."""
        feeder(self._runtime, "feed", name).feed(self, name, item, self._error)

    def end_stream(self, name: str) -> bool:
        """Ends the fed stream ``name``; False if it had ended already or the request is over."""
        return feeder(self._runtime, "end_stream", name).end_stream(self, name)

    def stats(self) -> list[dict]:
        """One record per node execution: node, walk, iteration, batch size, and the queued,
        started and finished times in seconds (monotonic clock)."""
        timeline = self._timeline if self.done else self._runtime.conductor.timeline(self.id)
        if isinstance(timeline, bytes):
            timeline = list(struct.iter_unpack(_TIMELINE_RECORD, timeline))
        names, walks = self._runtime.node_names, self._runtime.walk_names
        return [dict(node=names[n], walk=walks[w], iteration=it, batch_size=b,
                     queued=q / 1e9, started=s / 1e9, finished=f / 1e9)
                for n, w, it, b, q, s, f in timeline]

    def chrome_trace(self) -> dict:
        """The timeline as Chrome trace JSON (open it in Perfetto or chrome://tracing)."""
        events = [dict(name=rec["node"], cat=rec["walk"], ph="X", pid=self.id,
                       tid=self._runtime.engine_of(rec["node"]), ts=rec["started"] * 1e6,
                       dur=(rec["finished"] - rec["started"]) * 1e6,
                       args=dict(iteration=rec["iteration"], batch_size=rec["batch_size"],
                                 queued_us=(rec["started"] - rec["queued"]) * 1e6))
                  for rec in self.stats()]
        return {"traceEvents": events, "displayTimeUnit": "ms"}

    def save_chrome_trace(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(self.chrome_trace(), f)


class Runtime:
    """Serves a :class:`Model` in this process.

    ``Runtime(model)`` compiles the model, creates the C++ Conductor and starts one worker thread
    per engine (``engines`` maps engine names to :class:`Engine` objects, overriding the
    model's ``engine_specs``; an engine named by neither is a :class:`StatelessEngine`);
    ``submit(inputs)`` returns a :class:`RequestHandle`; ``close()`` stops and joins every
    thread. Use it as a context manager. ``spin_us``: how long an idle worker polls for work
    (without the GIL) before it sleeps. ``fail_late``: the default of :meth:`submit`'s option.
    ``request_cleanup=False``: no ``cleanup`` as requests end (a placement worker's segment runs).
    """

    def __init__(self, model: Model, poll_s: float = 0.05,
                 engines: Optional[Mapping[str, Engine]] = None, spin_us: float = 100.0,
                 fail_late: bool = False, request_cleanup: bool = True) -> None:
        self.model = model
        self.graph = compile_model(model)
        g = self.graph
        # The Conductor routes handles; its Python face holds the values (the tensor store).
        self.conductor = _core.Conductor(g.spec)
        # An idle worker spins this long before sleeping: work that arrives meanwhile costs no
        # wake-up (tens of µs on a VM); 0 saves the CPU time instead.
        self.conductor.set_spin(max(0.0, spin_us) * 1e-6)
        self.fail_late = fail_late
        # Workers clear late work before each batch and hand what they fail to report(); a weak
        # reference, because the Conductor is owned by this Runtime.
        report = weakref.WeakMethod(self.report)
        self.conductor.set_reporter(lambda outcome: (r := report()) is not None and r(outcome))
        self.poll_s = poll_s
        self.nodes = NodeTable(model, g)
        self.requests = RequestRegistry()
        # Signalled after outputs are delivered: a request's end waits until every output it
        # made has reached its handle (another engine thread may still be delivering one).
        self._delivered = threading.Condition(self.requests.lock)
        self._loop_ids = g.name_ids
        # The one batch path of every node: the Conductor's run_batch runs it without leaving
        # C++; run() (an engine's own batches, the item-by-item retry) calls it from Python.
        # A value's name in check_stop was silently ignored: only loops may be named (a
        # segment's runtime also stops loops of its parent's walks, which it does not hold).
        #: name -> id of what a check_stop may name (the runner holds this very dict)
        self.stop_ids = stop_names(g.name_ids, model, g.node_inputs + g.node_outputs)
        self.runner = NodeRunner(self.nodes.entries, self.requests, self.stop_ids)
        self.node_names = self.nodes.names
        self.walk_names = list(g.walk_ids)
        self._input_names = frozenset(model.inputs)
        self._input_defaults = dict(model.input_defaults)
        # Skip the calls a model does not override: submit and walk ends pay per request.
        self._validates = overrides(model, "validate_inputs", Model)
        self._has_next_walk = overrides(model, "next_walk", Model)
        self._has_next_part_walk = overrides(model, "next_part_walk", Model)
        # (walk, Part) -> (its sub-walks' keys, key -> child index)
        self._parts = {k: (keys, {x: i for i, x in enumerate(keys)})
                       for k, keys in g.parts.items()}
        # Without a next_walk, run_batch also finishes requests whose walk ended.
        self.conductor.bind_nodes(self.runner, not self._has_next_walk)
        self._closed = False
        specs = {**model.engine_specs, **(engines or {})}
        unknown = set(specs) - set(g.engines)
        if unknown:
            raise ValueError(f"engines {sorted(unknown)} serve no node; the model's engines are "
                             f"{list(g.engines)} (map nodes to engines in Model.engines)")
        self.engines: dict[str, Engine] = {}
        for engine_id, name in enumerate(g.engines):
            engine = specs.get(name) or (FeedEngine() if name == FEED_ENGINE
                                         else StatelessEngine())
            engine.attach(self, engine_id, name,
                          [i for i, n in enumerate(g.nodes) if n[1] == engine_id])
            self.engines[name] = engine
        # Only those that override the hook are called when a request ends.
        self._releasing_engines = [e for e in self.engines.values()
                                   if overrides(e, "release", Engine)]
        self._cleaning_submodules = [s for s in self.nodes.unique_submodules()
                                     if request_cleanup and overrides(s, "cleanup", NodeSubmodule)]
        self._workers = [threading.Thread(target=e.serve, name=f"mstar-engine-{e.name}",
                                          daemon=True) for e in self.engines.values()]
        for t in self._workers:
            t.start()
        track(self)  # closed at exit if the caller does not (lifetime.py: why)

    # ---- requests ------------------------------------------------------------------------------

    def submit(self, inputs: Mapping[str, Any], deadline: Optional[float] = None,
               priority: int = 0, fail_late: Optional[bool] = None,
               keep_outputs: bool = True) -> RequestHandle:
        """Starts a request. ``deadline`` is seconds from now (earlier deadlines run first);
        ``priority`` breaks ties (higher first); then the earlier request goes first.

        ``fail_late`` (default: the Runtime's) keeps the deadline instead of only ordering by
        it: work that would start after it is not run, and the request fails with
        :class:`DeadlineExceeded` naming the node it had reached; and a request that the work
        already queued ahead of it cannot let start in time is refused here, by raising
        :class:`DeadlineExceeded` with ``refused`` set. A node already running is not
        interrupted.

        ``keep_outputs=False``: the handle holds an output only until iterating takes it (a
        request that streams for hours, e.g. a voice session, would otherwise keep them all);
        ``result()`` then returns what iterating has not taken."""
        if self._closed:
            raise RuntimeError("submit: the runtime is closed")
        if not isinstance(inputs, Mapping):
            raise TypeError(f"submit: inputs is a {type(inputs).__name__}; give a dict of value "
                            f"name -> value, with the names {list(self.model.inputs)}")
        inputs = {**self._input_defaults, **inputs} if self._input_defaults else dict(inputs)
        if inputs.keys() != self._input_names:
            unknown = set(inputs) - self._input_names
            missing = self._input_names - set(inputs)
            raise ValueError(f"submit: inputs {sorted(unknown)} are not declared by the model and "
                             f"{sorted(missing)} are missing; the model takes {list(self.model.inputs)}")
        if self._validates:
            self.model.validate_inputs(inputs)
        deadline_ns = NO_DEADLINE if deadline is None else _deadline_ns(deadline)
        if isinstance(priority, bool) or not hasattr(type(priority), "__index__") or \
                not -2**31 <= operator.index(priority) < 2**31:
            raise ValueError(f"submit: priority={priority!r}; it must be an integer from "
                             f"{-2**31} to {2**31 - 1}")
        ctx = RequestContext(id=0, inputs=inputs, deadline_ns=deadline_ns, priority=priority)
        walk = self.model.initial_walk(ctx)
        if walk not in self.graph.walk_ids:
            raise ValueError(f"initial_walk returned '{walk}', which is not a walk of the model")
        ctx.walk = walk
        name_ids = self._loop_ids
        values = {name_ids[k]: v for k, v in inputs.items()}
        with self.requests.lock:  # known before a worker can report on the request
            rid, outcome = self.conductor.submit(
                self.graph.walk_ids[walk], values, deadline_ns, priority,
                self.fail_late if fail_late is None else fail_late)
            ctx.id = rid
            borrows = ctx.cache_id >= 0  # initial_walk gave it another's (a segment run)
            ctx.cache_id = ctx.cache_id if borrows else rid
            handle = RequestHandle(self, ctx, keep_outputs, borrows)
            self.requests.add(rid, handle)
        if outcome.emits or outcome.walks_done or outcome.failed or outcome.part_choices:
            self.report(outcome)
            for r, node, refused, late_s in outcome.expired:
                if r == rid and refused:
                    raise handle._error  # type: ignore[misc]
        return handle

    def cancel(self, handle: RequestHandle) -> bool:
        """Stops ``handle``'s request now (RequestHandle.cancel)."""
        ok, outcome = self.conductor.cancel(handle.id)
        if ok:
            self._end(handle.id, RequestCancelled(f"request {handle.id} was cancelled"))
        self.report(outcome)
        return ok

    def engine_of(self, node: str) -> str:
        return self.nodes[self.graph.node_ids[node]].engine

    def ended(self, handle: RequestHandle, error: Optional[BaseException]) -> None:
        """Called once per request after it ended (finished: ``error`` is None; failed or
        cancelled); a subclass may override it to pass the end on (mstar_rt.embed does)."""

    # ---- the engine host (mstar_rt.engines.host.EngineHost) ------------------------------------

    @property
    def queue(self) -> Any:
        return self.conductor

    @property
    def closed(self) -> bool:
        return self._closed

    def run(self, node: int, items: list) -> tuple:
        """Runs one batch and reports it to the Conductor; returns the outcome."""
        return self.conductor.complete(node, *self.runner.run(node, items))

    def requests_ended(self, finished: list) -> None:
        """Requests the Conductor finished itself: [(request, timeline bytes, outputs made)]."""
        for rid, timeline, emitted in finished:
            self._end(rid, None, timeline, emitted)

    def loop_id(self, name: str) -> int:
        """The name id of a DynamicLoop; RuntimeError (naming it) for what is not one."""
        return self.runner.loop_id(name)

    def report(self, outcome: tuple) -> None:
        """Acts on a Conductor outcome. Never raises: one request's trouble stays its own."""
        emits, walks_done, failed, expired, part_choices = outcome
        if emits:
            with self._delivered:
                get = self.requests.by_id.get
                for rid, name, value, *forwarded in emits:  # forwarded: a worker's, uncounted
                    handle = get(rid)
                    if handle is not None:
                        handle._emit(name, value, not forwarded)
                self._delivered.notify_all()
        late = {e[0]: e for e in expired}
        for rid, message in failed:
            x = late.get(rid)
            self._end(rid, request_failure(message) if x is None
                      else DeadlineExceeded(message, x[1], x[2], x[3]))
        for rid, section, part, finished in part_choices:
            self._next_part_walk(rid, section, part, finished)
        for rid in walks_done:
            if self._has_next_walk:
                self._next_walk(rid)
            else:  # one walk and done (the default state machine)
                self._finish(rid)

    # ---- request ends ----------------------------------------------------------------------------

    def _end(self, rid: int, error: Optional[BaseException],
             timeline: Optional[bytes] = None, emitted: int = 0) -> None:
        """Ends the request. ``emitted``: the outputs it made (a finished request): another
        engine thread may still be delivering the last of them, so they are waited for."""
        if emitted:
            with self._delivered:
                handle = self.requests.by_id.get(rid)
                if handle is not None and not self._delivered.wait_for(
                        lambda: handle._received >= emitted, timeout=10.0):
                    traceback.print_stack()  # a bug: an outcome with outputs was lost
        handle = self.requests.pop(rid)
        if handle is None:
            return
        if timeline is None:
            timeline = self.conductor.take_timeline(rid)  # decoded by stats(), if ever
        # what engines hold under a borrowed cache id is freed by the request that owns it
        for engine in () if handle.borrows_cache else self._releasing_engines:
            try:
                engine.release(rid)
            except Exception:  # must not take the runtime down; report it
                traceback.print_exc()
        for sub in self._cleaning_submodules:
            try:
                sub.cleanup(handle.context)
            except Exception:  # a cleanup failure must not take the runtime down
                pass
        handle._end(error, timeline)
        self.ended(handle, error)

    def _next_walk(self, rid: int) -> None:
        handle = self.requests.get(rid)
        if handle is None:
            return
        ctx = handle.context
        try:
            walk = self.model.next_walk(ctx, ctx.walk, self.conductor.values(rid))
            if walk is not None and walk not in self.graph.walk_ids:
                raise ValueError(f"next_walk returned '{walk}', which is not a walk of the model")
        except Exception as e:
            self.report(self.conductor.fail(rid, f"next_walk after '{ctx.walk}' raised "
                                                 f"{type(e).__name__}: {e}"))
            return
        if walk is None:
            self._finish(rid)
            return
        ctx.walk = walk
        # A request cancelled meanwhile is skipped by the Conductor (empty outcome).
        self.report(self.conductor.start_walk(rid, self.graph.walk_ids[walk]))

    def _next_part_walk(self, rid: int, section: int, part: str, finished: int) -> None:
        """A Part waits for its next sub-walk: asks the model (Model.next_part_walk) and tells the
        Conductor. An exception or an unknown key fails only this request."""
        handle = self.requests.get(rid)
        if handle is None:
            return
        ctx = handle.context
        keys, index = self._parts.get((ctx.walk, part), ((), {}))
        done = keys[finished] if 0 <= finished < len(keys) else None
        where = (f"next_part_walk for Part '{part}' in walk '{ctx.walk}' "
                 f"{'after ' + repr(done) if done is not None else 'at its start'}")
        try:
            if self._has_next_part_walk:
                key = self.model.next_part_walk(ctx, part, done)
            else:  # the default: each sub-walk once, in declaration order
                key = keys[finished + 1] if finished + 1 < len(keys) else None
        except Exception as e:
            self.report(self.conductor.fail(rid, f"{where} raised {type(e).__name__}: {e}"))
            return
        child = -1 if key is None else index.get(key) if isinstance(key, str) else None
        if child is None:
            self.report(self.conductor.fail(rid, f"{where} returned {key!r}, which is not a walk "
                                                 f"of the Part; its walks are {list(keys)}"))
            return
        # A request cancelled or failed meanwhile is skipped by the Conductor (empty outcome).
        self.report(self.conductor.choose_part(rid, section, child)[1])

    def _finish(self, rid: int) -> None:
        emitted = self.conductor.emitted(rid)  # final: the walk is over
        ended, outcome = self.conductor.finish(rid)
        if ended:  # else it was cancelled meanwhile, and cancel() ended the handle
            self._end(rid, None, emitted=emitted)
        self.report(outcome)

    # ---- lifecycle -----------------------------------------------------------------------------

    def close(self, timeout: Optional[float] = None) -> bool:
        """Cancels what runs, stops the workers, joins them (after the nodes running now);
        False if one still runs a node after ``timeout`` seconds (it stops once that returns)."""
        refuse_own_thread(self._workers)
        if not self._closed:
            for handle in self.requests.entries():
                handle.cancel()
            self._closed = True
            self.conductor.shutdown()
        return join_all(self._workers, timeout)

    def health(self) -> Optional[str]:
        """None while the runtime can serve; else why not (closed, or :meth:`Model.health`)."""
        return "the runtime is closed" if self._closed else self.model.health()

    def __enter__(self) -> "Runtime":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def live(self) -> dict[str, int]:
        """What is still held: requests, handles in the Conductor and values in the store."""
        return dict(requests=self.conductor.live_requests, handles=self.conductor.live_handles,
                    stored=self.conductor.stored, queued=self.conductor.queued_items,
                    inflight=self.conductor.inflight_items)

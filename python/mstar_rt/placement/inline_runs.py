"""A short segment run on the thread that received it: a worker that got one message and has
nothing else in flight for the segment runs it start to end there, instead of waking the
segment Runtime's engine thread (on a VM each wake-up costs the waker ~45 µs and the woken
~20 µs, per run). The engine threads stay asleep while it does (Conductor.take_inline); a run
that outlasts INLINE_BUDGET_S, or a segment whose batches have been slow, goes on there."""

from __future__ import annotations

import time
import traceback

from mstar_rt.engines.base import StatelessEngine
from mstar_rt.runtime import Runtime

INLINE_BUDGET_S = 1e-3  # the longest the receiving thread keeps a run before handing it on
INLINE_MAX_S = 1e-3     # a segment whose batches take longer runs on its engine thread
RETRY_EVERY = 100       # ... except every 100th run, measured again (its first runs warm up)


class InlineRuns:
    """Drives ``rt`` (a segment's Runtime) inline when :meth:`begin` says so. Its engines'
    threads are only woken for work that this thread leaves (:meth:`end`)."""

    def __init__(self, rt: Runtime) -> None:
        self.rt = rt
        self.engines = list(rt.engines.values())
        # (id, batch limit, engine), read once: Engine.max_batch scans the engine's nodes
        self._turns = [(e.engine_id, e.max_batch, e) for e in self.engines]
        # torch's thread settings are per thread: an engine that sets them keeps its own thread
        self.usable = all(type(e) is StatelessEngine and e.num_threads is None
                          for e in self.engines)
        self.batch_s = 0.0  # recent seconds per batch run inline
        self._slow_runs = 0  # runs kept off this thread since batch_s last went over
        for e in self.engines:
            rt.conductor.set_submitter_takes(e.engine_id, True)
        self._held: list[StatelessEngine] = []

    def begin(self, alone: bool) -> bool:
        """Before submitting: whether this thread will run the run (then call :meth:`drive`);
        :meth:`end` in any case."""
        q = self.rt.conductor
        if not (alone and self.usable and q.queued_items == 0 and q.inflight_items == 0):
            return False
        if self.batch_s >= INLINE_MAX_S:
            self._slow_runs += 1
            if self._slow_runs % RETRY_EVERY:
                return False
        for e in self.engines:  # one batch of an engine at a time, on whichever thread
            if not e.running.acquire(blocking=False):
                self._release()
                return False
            self._held.append(e)
        q.take_inline(True)
        return True

    def drive(self) -> None:
        """Runs the segment's ready batches here until none is left or the budget is spent."""
        q, rt = self.rt.conductor, self.rt
        start = time.perf_counter()
        until, batches = start + INLINE_BUDGET_S, 0
        run_batch, turns, now = q.run_batch, self._turns, time.perf_counter
        while q.queued_items and now() < until:
            for engine_id, limit, e in turns:
                try:
                    got = run_batch(engine_id, limit, 0.0)
                except Exception:  # a bug in the runtime itself: the engine thread goes on
                    traceback.print_exc()
                    return
                if got[0] is not None or got[1] is not None or got[2]:
                    e.turn(rt, got)  # all None: nothing came, or it ran with nothing to say
            batches += 1
        if batches:
            took = (time.perf_counter() - start) / batches
            self.batch_s = 0.75 * self.batch_s + 0.25 * took

    def end(self, driving: bool) -> None:
        """Hands what is left to the engine threads (wakes them)."""
        if driving:
            self.rt.conductor.take_inline(False)
            self._release()
            return
        for e in self.engines:
            self.rt.conductor.wake(e.engine_id)

    def _release(self) -> None:
        for e in self._held:
            e.running.release()
        self._held.clear()


__all__ = ["INLINE_BUDGET_S", "INLINE_MAX_S", "RETRY_EVERY", "InlineRuns"]

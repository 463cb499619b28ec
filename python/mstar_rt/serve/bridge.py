"""Runs runtime requests for an asyncio server: admission up to ``max_concurrent_requests``,
submits and waits on worker threads (never on the event loop), outputs handed to the loop as
they come, and a request cancelled whenever its consumer stops early (client gone, timeout)."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, AsyncIterator, Callable, Mapping, Optional

_END = object()


class AtCapacity(RuntimeError):
    """The server already runs ``max_concurrent_requests`` requests."""


class RequestTimeout(TimeoutError):
    """The request ran past the server's ``request_timeout_s`` and was cancelled."""


class Admission:
    """Counts admitted requests; refuses beyond ``limit`` instead of queueing, so a client
    learns at once that the server is full."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._n = 0
        self._lock = threading.Lock()

    @property
    def in_flight(self) -> int:
        return self._n

    def enter(self) -> None:
        with self._lock:
            if self._n >= self.limit:
                raise AtCapacity(f"the server is serving max_concurrent_requests={self.limit} "
                                 "requests; retry shortly or raise max_concurrent_requests")
            self._n += 1

    def leave(self) -> None:
        with self._lock:
            self._n -= 1


class Bridge:
    """Requests on ``runtime`` (anything with ``submit(inputs, deadline=, priority=)`` returning
    an iterable, cancellable handle) for coroutines."""

    def __init__(self, runtime: Any, max_concurrent_requests: int,
                 timeout_s: Optional[float] = None) -> None:
        self.runtime = runtime
        self.admission = Admission(max_concurrent_requests)
        self.timeout_s = timeout_s
        # One blocked thread per streaming request, plus room for submits and decoding.
        workers = max_concurrent_requests + 8
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="mstar-serve")
        # Started up front: a pool that grows on demand adds threads at odd moments under load
        # (seen from outside, a server whose thread count creeps up), and the first requests of
        # a burst would pay for the thread starts.
        started = threading.Barrier(workers + 1)
        for _ in range(workers):
            self._pool.submit(started.wait)
        started.wait()

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` on a worker thread."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def health(self) -> Optional[str]:
        """Why the runtime cannot serve (its ``health()``; a placed one asks its workers), or
        None: what ``/health`` and ``/healthz`` answer 503 with."""
        health = getattr(self.runtime, "health", None)
        return None if health is None else await self.call(health)

    async def submit(self, inputs: Mapping[str, Any], deadline: Optional[float] = None,
                     priority: int = 0, fail_late: bool = False) -> Any:
        """Submits on a worker thread; bad inputs raise the runtime's ValueError / TypeError, a
        kept deadline that cannot be met its DeadlineExceeded."""
        if not fail_late:  # any runtime with submit(inputs, deadline=, priority=) serves
            return await self.call(lambda: self.runtime.submit(inputs, deadline=deadline,
                                                               priority=priority))
        return await self.call(lambda: self.runtime.submit(inputs, deadline=deadline,
                                                           priority=priority, fail_late=True))

    async def outputs(self, handle: Any, started: Optional[float] = None
                      ) -> AsyncIterator[tuple[str, Any]]:
        """The handle's ``(name, value)`` outputs as they come. Ends with the handle's error
        (RequestFailed, RequestCancelled) or :class:`RequestTimeout`; the request is cancelled
        if the consumer stops early, whatever the reason."""
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()

        def put(item: Any) -> None:
            try:
                loop.call_soon_threadsafe(q.put_nowait, item)
            except RuntimeError:  # the loop is closed: the server is going down
                handle.cancel()

        def pump() -> None:
            try:
                for event in handle:
                    put(event)
                put(_END)
            except BaseException as e:  # the request's own error, passed to the consumer
                put(e)

        loop.run_in_executor(self._pool, pump)
        limit = None if self.timeout_s is None else (started or time.monotonic()) + self.timeout_s
        try:
            while True:
                wait = None if limit is None else max(0.0, limit - time.monotonic())
                try:
                    item = await asyncio.wait_for(q.get(), wait)
                except asyncio.TimeoutError:
                    raise RequestTimeout(f"the request ran past request_timeout_s="
                                         f"{self.timeout_s} and was cancelled") from None
                if item is _END:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            if not handle.done:
                handle.cancel()

    async def run(self, inputs: Any, prepare: Optional[Callable[[Any], Mapping[str, Any]]] = None
                  ) -> dict[str, list]:
        """``prepare(inputs)`` (decoding, say), submit, and wait for every output by name — in
        one worker-thread job, since a policy call is short and each hop costs. The request is
        cancelled if the caller is cancelled or it outlives ``request_timeout_s``."""
        holder: list = []
        gone: list = []  # the caller was cancelled (its client left) before the submit

        def job() -> dict[str, list]:
            handle = self.runtime.submit(prepare(inputs) if prepare else inputs)
            holder.append(handle)
            if gone:
                handle.cancel()
            try:
                return handle.result(self.timeout_s)
            except TimeoutError:
                handle.cancel()
                raise RequestTimeout(f"the request ran past request_timeout_s={self.timeout_s} "
                                     "and was cancelled") from None

        try:
            return await self.call(job)
        except asyncio.CancelledError:
            gone.append(True)
            if holder:
                holder[0].cancel()
            raise

"""Tiny numeric models and helpers for the walk-graph tests (test_graph_validation, test_runtime_*).

Every node is a small pure function of its inputs, so every result can be checked exactly.
Everything that waits takes a timeout, so a bug fails a test instead of hanging the suite.
"""

from __future__ import annotations

import threading
import time
import weakref
from typing import Any, Callable, Mapping, Optional

import mstar_rt
from mstar_rt import Model, NodeSubmodule

ENGINE_THREAD_PREFIX = "mstar-engine-"


class Fn(NodeSubmodule):
    """A node computing ``fn(inputs) -> {output: value}`` per item; records each batch's size."""

    def __init__(self, fn: Callable[[dict], Mapping[str, Any]], max_batch: int = 1) -> None:
        self.fn = fn
        self.max_batch = max_batch
        self.batches: list[int] = []

    def forward(self, batch):
        self.batches.append(len(batch))
        return [self.fn(x) for x in batch]


class CtxFn(NodeSubmodule):
    """Like :class:`Fn` but ``fn(inputs, ctx)`` also gets the WorkContext (iteration, request)."""

    def __init__(self, fn: Callable[[dict, Any], Mapping[str, Any]], max_batch: int = 1) -> None:
        self.fn = fn
        self.max_batch = max_batch
        self.batches: list[int] = []

    def prepare_inputs(self, ctx, inputs):
        return (inputs, ctx)

    def forward(self, batch):
        self.batches.append(len(batch))
        return [self.fn(inputs, ctx) for inputs, ctx in batch]


class Stopper(Fn):
    """A DynamicLoop body: ``fn`` per item, and stops loop ``loop`` for items where ``stop(out)``."""

    def __init__(self, fn, stop: Callable[[dict, Mapping[str, Any]], bool], loop: str,
                 max_batch: int = 1) -> None:
        super().__init__(fn, max_batch)
        self.stop = stop
        self.loop = loop

    def check_stop(self, batch, outputs):
        return [(self.loop,) if self.stop(x, o) else () for x, o in zip(batch, outputs)]


_gates: "weakref.WeakSet[Gate]" = weakref.WeakSet()


class Gate(NodeSubmodule):
    """A node that blocks its engine until :meth:`open` (so later requests pile up in the ready
    queue), then computes ``fn`` like :class:`Fn`. ``entered`` is set once a batch is inside."""

    def __init__(self, fn: Callable[[dict], Mapping[str, Any]], max_batch: int = 1,
                 timeout: float = 10.0) -> None:
        self.fn = fn
        self.max_batch = max_batch
        self.timeout = timeout
        self.entered = threading.Event()
        self.opened = threading.Event()
        self.batches: list[int] = []
        _gates.add(self)

    def forward(self, batch):
        self.entered.set()
        if not self.opened.wait(self.timeout):
            raise TimeoutError("the test never opened the gate")
        self.batches.append(len(batch))
        return [self.fn(x) for x in batch]

    def open(self) -> None:
        self.opened.set()

    def wait_entered(self, timeout: float = 5.0) -> None:
        if not self.entered.wait(timeout):
            raise TimeoutError("no request reached the gate")


def open_all_gates() -> None:
    for g in list(_gates):
        g.open()


class WalkModel(Model):
    """A Model built from arguments; ``next_walk`` / ``initial_walk`` are optional callables."""

    def __init__(self, nodes, walks, submodules, inputs=("x",), engines=None,
                 next_walk: Optional[Callable] = None,
                 initial_walk: Optional[Callable] = None) -> None:
        self.nodes = list(nodes)
        self.walks = dict(walks)
        self.submodules = dict(submodules)
        self.inputs = tuple(inputs)
        self.engines = dict(engines or {})
        self._next_walk = next_walk
        self._initial_walk = initial_walk

    def initial_walk(self, request):
        if self._initial_walk is not None:
            return self._initial_walk(request)
        return super().initial_walk(request)

    def next_walk(self, request, finished_walk, persisted):
        if self._next_walk is None:
            return None
        return self._next_walk(request, finished_walk, persisted)


# ---- waiting helpers -----------------------------------------------------------------------------

def wait_until(predicate: Callable[[], bool], timeout: float = 5.0, interval: float = 0.005) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


ZERO_LIVE = dict(requests=0, handles=0, stored=0, queued=0, inflight=0)


def settled(rt: mstar_rt.Runtime, timeout: float = 5.0) -> dict:
    """Waits until the runtime holds nothing (in-flight items of ended requests come back late);
    returns the last ``rt.live``."""
    wait_until(lambda: rt.live == ZERO_LIVE, timeout)
    return rt.live


def engine_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate()
            if t.name.startswith(ENGINE_THREAD_PREFIX) and t.is_alive()]


def close_within(rt: mstar_rt.Runtime, timeout: float = 10.0) -> float:
    """Closes ``rt`` from a helper thread; fails if close() does not return in time. Returns the
    seconds close() took."""
    took: list[float] = []

    def run() -> None:
        t0 = time.monotonic()
        rt.close()
        took.append(time.monotonic() - t0)

    t = threading.Thread(target=run, name="test-close", daemon=True)
    t.start()
    t.join(timeout)
    if t.is_alive():
        raise TimeoutError(f"Runtime.close() did not return within {timeout} s")
    return took[0]


def drain(handle: mstar_rt.RequestHandle, timeout: float = 5.0):
    """Iterates ``handle`` (in a helper thread, so a bug cannot hang the test). Returns
    ``(events, error)``: the (name, value) pairs in arrival order and the exception the iteration
    ended with (None when the request finished)."""
    events: list = []
    error: list = []

    def run() -> None:
        try:
            for ev in handle:
                events.append(ev)
        except BaseException as e:  # noqa: BLE001 - handed back to the test
            error.append(e)

    t = threading.Thread(target=run, name="test-drain", daemon=True)
    t.start()
    t.join(timeout)
    if t.is_alive():
        raise TimeoutError(f"iterating request {handle.id} did not end within {timeout} s")
    return events, (error[0] if error else None)

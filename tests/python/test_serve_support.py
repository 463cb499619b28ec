"""Helpers for the serving tests (test_serve_*.py): a server on a free port around a fresh
Runtime, a small generic walk model, waits that time out instead of hanging."""

from __future__ import annotations

import contextlib
import threading
import time
from types import SimpleNamespace
from typing import Any, Callable, Iterator

import numpy as np

import mstar_rt
from mstar_rt import EMIT, DynamicLoop, GraphEdge, GraphNode, Model, NodeSubmodule
from mstar_rt.serve import Deployment, Server, create_app

WAIT_S = 20.0


@contextlib.contextmanager
def serving(model: Model, runtime: Any = None, **deployment: Any) -> Iterator[SimpleNamespace]:
    """A Runtime (unless given) and a Server on 127.0.0.1:<free port>; both closed after."""
    rt = runtime if runtime is not None else mstar_rt.Runtime(model)
    try:
        dep = Deployment.for_model(model, rt, **deployment)
        app = create_app(dep)
        server = Server(app).start()
        try:
            yield SimpleNamespace(rt=rt, url=server.url, ws_url=server.ws_url, port=server.port,
                                  server=server, state=app.state.serve)
        finally:
            server.stop()
    finally:
        rt.close()


def wait_until(cond: Callable[[], bool], what: str, timeout: float = WAIT_S) -> None:
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def settled(s: SimpleNamespace) -> dict:
    """Waits until the runtime holds nothing and the server admits nothing; returns live."""
    wait_until(lambda: s.rt.live["requests"] == 0 and s.state.bridge.admission.in_flight == 0,
               "the runtime and the server to drop every request")
    return s.rt.live


class _Count(NodeSubmodule):
    """Iteration i EMITs ``step`` = i and ``vec`` = arange(i + 1) (float32); stops after ``n``
    steps; raises at ``fail_at``; with ``hold`` waits for :attr:`release` first."""

    max_batch = 4

    def __init__(self) -> None:
        self.release = threading.Event()
        self.holding = 0

    def prepare_inputs(self, ctx: Any, inputs: dict) -> Any:
        return dict(inputs, i=ctx.iteration)

    def forward(self, batch: list) -> list:
        out = []
        for x in batch:
            if x["hold"]:
                self.holding += 1
                self.release.wait(WAIT_S)
            if x["fail_at"] is not None and x["i"] == x["fail_at"]:
                raise RuntimeError(f"step {x['i']} failed on purpose")
            out.append({"step": x["i"], "vec": np.arange(x["i"] + 1, dtype=np.float32)})
        return out

    def check_stop(self, batch: list, outputs: list) -> list:
        return [("count",) if x["i"] + 1 >= x["n"] else () for x in batch]


class Counter(Model):
    """A generic walk model: inputs ``n`` (int > 0), ``fail_at``, ``hold``."""

    inputs = ("n", "fail_at", "hold")
    input_defaults = {"fail_at": None, "hold": False}

    def __init__(self) -> None:
        self.node = _Count()
        self.nodes = [GraphNode("count", ["n", "fail_at", "hold"],
                                [GraphEdge(EMIT, "step"), GraphEdge(EMIT, "vec")])]
        self.walks = {"count": DynamicLoop("count", 64, "count")}
        self.submodules = {"count": self.node}

    def validate_inputs(self, inputs: Any) -> None:
        n = inputs["n"]
        if not isinstance(n, int) or isinstance(n, bool) or not 0 < n <= 64:
            raise ValueError(f"'n' must be an integer in 1..64, not {n!r}")

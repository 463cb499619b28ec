"""Models for the stream conformance tests (test_stream_conformance.py), importable by path in a
placement worker too: a producer DynamicLoop streaming stream positions to a consumer, with the
delays each execution sleeps given per request, so a test can make any interleaving of the
producer's last iterations and the consumer's windows.

Request inputs: ``n`` (items to stream; 0 streams none), ``pd`` (seconds the producer sleeps at
iteration i), ``cd`` (seconds the consumer sleeps at its k-th call). Each window EMITs
``("window", begin, new_begin, end, last, items)``; an ``end_stream`` call EMITs ``("end",)``.
"""

from __future__ import annotations

import time
from typing import Any, Mapping, Sequence

import mstar_rt
from mstar_rt import (EMIT, DynamicLoop, GraphEdge, GraphNode, Model, NodeSubmodule, Parallel,
                      Sequential, StreamingGraphEdge)

ITEM0 = 100  # stream position p carries the item ITEM0 + p


def _sleep(delays: Sequence[float], k: int) -> None:
    if k < len(delays) and delays[k] > 0:
        time.sleep(delays[k])


class Producer(NodeSubmodule):
    max_batch = 4

    def prepare_inputs(self, ctx, inputs):
        return inputs, ctx.iteration

    def forward(self, batch):
        out = []
        for inputs, i in batch:
            _sleep(inputs["pd"], i)
            out.append({"tok": ITEM0 + i} if i < inputs["n"] else {})  # n = 0: nothing produced
        return out

    def check_stop(self, batch, outputs):
        return [("gen",) if i + 1 >= max(inputs["n"], 1) else () for inputs, i in batch]


class Consumer(NodeSubmodule):
    """Records each window; knows nothing of the end of its stream but what `last` says."""

    max_batch = 2

    def prepare_inputs(self, ctx, inputs):
        calls = ctx.request.state["calls"] = ctx.request.state.get("calls", 0) + 1
        return inputs, calls - 1

    def forward(self, batch):
        out = []
        for inputs, k in batch:
            _sleep(inputs["cd"], k)
            w = inputs["tok"]
            out.append({"win": ("window", w.begin, w.new_begin, w.end, w.last, list(w.items))})
        return out


class EndAwareConsumer(Consumer):
    """Also hears the end of its stream when no window was marked last."""

    def end_stream(self, ctx) -> Mapping[str, Any]:
        return {"win": ("end",)}


POLICIES = {  # name -> (constructor, its arguments)
    "Fixed": mstar_rt.Fixed,
    "SlidingWindow": mstar_rt.SlidingWindow,
    "LeftContext": mstar_rt.LeftContext,
    "Ramp": mstar_rt.Ramp,
}


class StreamModel(Model):
    """One walk per (policy, placement): ``walks`` maps a walk name to (policy name, its
    arguments, "parallel" | "sequential"); a request picks its walk with the input ``walk``."""

    inputs = ("walk", "n", "pd", "cd")

    def __init__(self, walks: Mapping[str, tuple], end_aware: bool = True) -> None:
        self.nodes, self.walks, self.submodules, self.engines = [], {}, {}, {}
        consumer = EndAwareConsumer() if end_aware else Consumer()
        for name, (kind, args, placement) in walks.items():
            p, c = f"gen_{name}", f"consumer_{name}"
            policy = POLICIES[kind](*args)
            self.nodes += [GraphNode(p, ["n", "pd"], [StreamingGraphEdge(c, "tok", policy)]),
                           GraphNode(c, ["tok", "cd"], [GraphEdge(EMIT, "win")])]
            loop = DynamicLoop(p, 1024, "gen")
            self.walks[name] = Parallel(loop, c) if placement == "parallel" else Sequential(loop, c)
            self.submodules.update({p: Producer(), c: consumer})
            self.engines.update({p: "producer", c: "consumer"})

    def initial_walk(self, request) -> str:
        return request.inputs["walk"]


def conformance(walks: Mapping[str, list], end_aware: bool = True) -> StreamModel:
    """The factory a placement worker calls (arguments as JSON: lists, not tuples)."""
    return StreamModel({k: (v[0], tuple(v[1]), v[2]) for k, v in walks.items()}, end_aware)

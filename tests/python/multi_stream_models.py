"""Models for the multi-stream and per-execution stream tests (test_multi_stream.py), importable
by path in a placement worker too.

``TwoStreams``: two producer loops stream ``ta`` and ``tb`` (each under its own policy) into one
node that runs on each pair of windows. ``TalkerShape``: Qwen3-Omni's shape in miniature -- a
"thinker" loop streams tokens and their embeddings into a "talker" loop whose every iteration
reads the next window of each (``continue_after_done``: empty ones after the thinker is done).
"""

from __future__ import annotations

import time
from typing import Any, Optional, Sequence

import mstar_rt
from mstar_rt import (EMIT, DynamicLoop, GraphEdge, GraphNode, Model, NodeSubmodule, Parallel,
                      StreamingGraphEdge)

POLICIES = {"Fixed": mstar_rt.Fixed, "SlidingWindow": mstar_rt.SlidingWindow,
            "LeftContext": mstar_rt.LeftContext, "Ramp": mstar_rt.Ramp}


def policy(spec: Sequence[Any]) -> Any:
    return POLICIES[spec[0]](*spec[1])


def _window(w: Any) -> tuple:
    return (w.begin, w.new_begin, w.end, w.last, list(w.items))


class Counter(NodeSubmodule):
    """Iteration i makes ``base + i`` (and, for the thinker, ``i / 2`` as its embedding) until
    ``count`` items, sleeping ``delays[i]`` seconds first."""

    max_batch = 4

    def __init__(self, base: int, count: str, loop: str, delays: str, emb: bool = False) -> None:
        self.base, self.count, self.loop, self.delays, self.emb = base, count, loop, delays, emb

    def prepare_inputs(self, ctx, inputs):
        return inputs, ctx.iteration

    def forward(self, batch):
        out = []
        for inputs, i in batch:
            d = inputs[self.delays]
            if i < len(d) and d[i] > 0:
                time.sleep(d[i])
            o = {"t" + self.loop[-1]: self.base + i} if not self.emb else \
                {"tok": self.base + i, "emb": i / 2}
            out.append(o if i < inputs[self.count] else {})
        return out

    def check_stop(self, batch, outputs):
        return [(self.loop,) if i + 1 >= max(inputs[self.count], 1) else () for inputs, i in batch]


class PairReader(NodeSubmodule):
    """Records each pair of windows (one per stream)."""

    max_batch = 2

    def forward(self, batch):
        return [{"win": (_window(x["ta"]), _window(x["tb"]))} for x in batch]


class Talker(NodeSubmodule):
    """Iteration k records its windows of ``tok`` and ``emb``; stops after ``steps``."""

    max_batch = 4

    def prepare_inputs(self, ctx, inputs):
        return inputs, ctx.iteration

    def forward(self, batch):
        return [{"step": (k, _window(x["tok"]), _window(x["emb"]))} for x, k in batch]

    def check_stop(self, batch, outputs):
        return [("talk",) if k + 1 >= x["steps"] else () for x, k in batch]


class TwoStreams(Model):
    inputs = ("na", "nb", "da", "db")
    input_defaults = {"da": [], "db": []}

    def __init__(self, a: Sequence[Any] = ("Fixed", (1,)), b: Sequence[Any] = ("Fixed", (1,))) -> None:
        self.nodes = [
            GraphNode("pa", ["na", "da"], [StreamingGraphEdge("c", "ta", policy(a))],
                      submodule=Counter(100, "na", "loop_a", "da"), engine="a"),
            GraphNode("pb", ["nb", "db"], [StreamingGraphEdge("c", "tb", policy(b))],
                      submodule=Counter(200, "nb", "loop_b", "db"), engine="b"),
            GraphNode("c", ["ta", "tb"], [GraphEdge(EMIT, "win")], submodule=PairReader(),
                      engine="c")]
        self.walks = {"w": Parallel(DynamicLoop("pa", 64, "loop_a"),
                                    DynamicLoop("pb", 64, "loop_b"), "c")}


class TalkerShape(Model):
    inputs = ("n", "steps", "delays")
    input_defaults = {"delays": []}

    def __init__(self, continue_after_done: bool = True,
                 tok: Sequence[Any] = ("Fixed", (1,)), emb: Sequence[Any] = ("Fixed", (1,))) -> None:
        c = continue_after_done
        self.nodes = [
            GraphNode("think", ["n", "delays"],
                      [GraphEdge(EMIT, "tok"),
                       StreamingGraphEdge("talk", "tok", policy(tok), continue_after_done=c),
                       StreamingGraphEdge("talk", "emb", policy(emb), continue_after_done=c)],
                      submodule=Counter(0, "n", "think", "delays", emb=True), engine="thinker"),
            GraphNode("talk", ["tok", "emb", "steps"], [GraphEdge(EMIT, "step")],
                      submodule=Talker(), engine="talker")]
        self.walks = {"speak": Parallel(DynamicLoop("think", 64, "think"),
                                        DynamicLoop("talk", 64, "talk"))}


def two_streams(a: Optional[list] = None, b: Optional[list] = None) -> TwoStreams:
    """Factory for a placement worker (arguments as JSON lists)."""
    return TwoStreams(a or ("Fixed", (1,)), b or ("Fixed", (1,)))


def talker_shape(continue_after_done: bool = True) -> TalkerShape:
    return TalkerShape(continue_after_done)

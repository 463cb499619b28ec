"""Random valid walks (graph_fuzz.valid_graphs: sequences, parallels, loops, dynamic loops,
streams; nodes inside a DynamicLoop stopping it on some values; some inside a Part, some followed
by a second walk reading what the first persisted; some nodes failing their request on some
values) with every node placed at random in the parent or one of two workers, segments on:
each request's EMITted outputs (or its failure) equal the in-process Runtime's, also with
concurrent requests half of which are cancelled mid-run, and the workers hold nothing after.
The nodes compute from their inputs (a stream consumer from its window's items), so a value that
went missing, came twice or crossed from the wrong place shows in the outputs."""

from __future__ import annotations

import json
import os
import re
from typing import Any

from hypothesis import assume, given, settings
from hypothesis import strategies as st

from mstar_rt import EMIT, GraphEdge, GraphNode, Part, RequestFailed, Runtime
from mstar_rt.model import StreamChunk
from mstar_rt.placement import NodeGroup, PlacedRuntime

import graph_fuzz as gf
from placement_support import T, idle
from walk_models import Fn, Stopper, WalkModel

CASES = int(os.environ.get("MSTAR_FUZZ_PLACEMENT_CASES", "12"))


def _tuples(x: Any) -> Any:
    """JSON's lists back to graph_fuzz's tuples."""
    if isinstance(x, list):
        return tuple(_tuples(v) for v in x)
    if isinstance(x, dict):
        return {k: _tuples(v) for k, v in x.items()}
    return x


def _compute(k: int, outs: list[str], inputs: dict) -> dict:
    total = float(k + 1)
    for name in sorted(inputs):
        v = inputs[name]
        if isinstance(v, StreamChunk):
            v = sum(v.items) + 0.25 * len(v.items)
        elif isinstance(v, (list, tuple)):  # a loop's accumulated outputs
            v = sum(v) + 0.125 * len(v)
        total = total * 0.5 + float(v)
    if k % 4 == 3 and int(abs(total) * 13) % 7 == 0:  # some requests fail, inside segments too
        raise ValueError("refused")
    return {o: round(total, 6) for o in outs}


def numeric(graph: str) -> WalkModel:
    """The model of ``graph`` (graph_fuzz's plain data, as JSON): node k outputs a number made
    from its inputs (the factory the workers import)."""
    g = _tuples(json.loads(graph))
    # every node's own output EMITted too: each value it makes is compared
    nodes = [GraphNode(n[0], n[1], [gf.dsl_output(o) for o in n[2]]
                       + ([] if ("edge", EMIT, f"v_{n[0]}", False) in n[2]
                          else [GraphEdge(EMIT, f"v_{n[0]}")])) for n in g["nodes"]]
    # every other node inside a DynamicLoop stops it when its value says so (stops inside
    # segments, and loops the parent runs around nodes that stop)
    loop_of = {n: loop for s in g["walks"].values() for n, loop in _innermost_loops(s, None)
               if int(n.lstrip("b")[1:]) % 2 == 0}
    subs = {n[0]: (Stopper if loop_of.get(n[0]) else Fn)(
        lambda d, k=k, outs=gf.outputs_of(n): _compute(k, outs, d),
        *((lambda _d, out: int(next(iter(out.values())) * 7) % 3 == 0, loop_of[n[0]])
          if loop_of.get(n[0]) else ()), max_batch=n[4]) for k, n in enumerate(g["nodes"])}
    walks = {w: gf.dsl_section(s) for w, s in g["walks"].items()}
    if g.get("part"):  # each walk as the one sub-walk of a Part (the model runs it once)
        walks = {w: Part("p", {"only": s}) for w, s in walks.items()}
    return WalkModel(nodes, walks, subs, inputs=g["inputs"],
                     engines={n[0]: n[3] for n in g["nodes"]},
                     initial_walk=lambda request: "main",
                     next_walk=lambda request, finished, persisted:
                     "again" if finished == "main" and "again" in walks else None)


def _innermost_loops(section: Any, loop: Any) -> list[tuple[str, Any]]:
    """(node, the name of the innermost DynamicLoop around it, or None) for ``section``."""
    kind = section[0]
    if kind == "node":
        return [(section[1], loop)]
    if kind in ("seq", "par"):
        return [x for c in section[1] for x in _innermost_loops(c, loop)]
    if kind == "loop":
        return _innermost_loops(section[1], loop)
    return _innermost_loops(section[2], section[1])


def _top_level(section: Any) -> set[str]:
    """Nodes of ``section`` outside every loop (what they make is there at the walk's end)."""
    kind = section[0]
    if kind == "node":
        return {section[1]}
    if kind in ("seq", "par"):
        return set().union(*(_top_level(c) for c in section[1]))
    return set()


def outputs(rt: Any, x: float) -> Any:
    """Each EMITted name's values in the order made (names may interleave differently)."""
    by_name: dict[str, list] = {}
    try:
        for name, value in rt.submit({"x": x}):
            by_name.setdefault(name, []).append(value)
        return by_name
    except RequestFailed as e:  # which node fails first may differ (parallel branches)
        return ("failed", str(e).split(":", 1)[1][:60])


def cancelled_amid(rt: Any, xs: list[float], want: list) -> None:
    """All of ``xs`` at once, every other request cancelled after its first output (or at
    once): the others still give ``want``, and the workers hold nothing after."""
    handles = [rt.submit({"x": x}) for x in xs]
    for i, h in enumerate(handles):
        if i % 2:
            try:
                for _ in h:
                    break
            except RequestFailed:
                pass
            h.cancel()
    for i in range(0, len(xs), 2):
        by_name: dict[str, list] = {}
        try:
            for name, value in handles[i]:
                by_name.setdefault(name, []).append(value)
            got: Any = by_name
        except RequestFailed as e:
            got = ("failed", str(e).split(":", 1)[1][:60])
        assert got == want[i]


def _second(graph: dict, first: dict, persist: list[str], reader: int) -> dict:
    """``graph`` renamed apart from ``first`` as walk ``again``, its node ``reader`` also
    reading what ``first`` persists."""
    text = re.sub(r'"(v_)?(n\d+|t\d+|loop\d+)"', r'"\1b\2"', json.dumps(graph))
    g = _tuples(json.loads(text))
    nodes = [list(n) for n in g["nodes"]]
    nodes[reader][1] = tuple(nodes[reader][1]) + tuple(persist)
    return {"nodes": [tuple(n) for n in nodes], "again": g["walks"]["main"]}


@st.composite
def placed_graphs(draw) -> tuple[dict, list[int]]:
    graph = dict(draw(gf.valid_graphs()), part=draw(st.booleans()))
    if draw(st.booleans()):  # a second walk, after the first, reading what it persisted
        made = sorted(_top_level(graph["walks"]["main"]))
        persist = [f"v_{n}" for n in draw(st.lists(st.sampled_from(made), unique=True,
                                                    min_size=1))] if made else []
        graph["nodes"] = [(n[0], n[1], [("edge", "", o[1], True)
                                         if o[0] == "out" and o[1] in persist else o
                                         for o in n[2]], n[3], n[4]) for n in graph["nodes"]]
        extra = draw(gf.valid_graphs())
        second = _second(extra, graph, persist, draw(st.integers(0, len(extra["nodes"]) - 1)))
        graph["nodes"] += second["nodes"]
        graph["walks"]["again"] = second["again"]
    # mostly worker 1 (runs of nodes on one worker: segments), some on 2 and in the parent
    ranks = draw(st.lists(st.sampled_from([0, 1, 1, 1, 2]), min_size=len(graph["nodes"]),
                          max_size=len(graph["nodes"])))
    return graph, ranks


@settings(max_examples=CASES, **gf.SETTINGS)
@given(placed_graphs())
def test_random_walks_placed_at_random_equal_in_process(case):
    graph, ranks = case
    groups = [NodeGroup([n[0] for n, r in zip(graph["nodes"], ranks) if r == rank], rank=rank)
              for rank in (1, 2) if rank in ranks]
    assume(groups)  # not every node in the parent
    text = json.dumps(graph)
    xs = [1.0, -2.5, 0.75, 3.0]
    with Runtime(numeric(text)) as local:
        want = [outputs(local, x) for x in xs]
    with PlacedRuntime("test_fuzz_placement_segments:numeric", groups, progress=False,
                       model_kwargs={"graph": text}, shm_bytes=1 << 20) as rt:
        got = [outputs(rt, x) for x in xs]
        assert got == want, (graph, ranks, [n for n in rt.node_names if "segment" in n])
        cancelled_amid(rt, xs, want)
        for g in groups:
            stats = idle(rt, g.rank)
            assert stats["segment_runs"] == 0 and not any(stats["segment_live"].values()), stats

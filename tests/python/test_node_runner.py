"""One batch path for Python nodes (issue 15): the in-process Runtime (through the Conductor's
run_batch, without leaving C++) and a placement worker (WorkerHost, through Python) run nodes
with the same NodeRunner: prepare_inputs with the request and iteration, stream chunks made into
StreamChunk values, split_batch's groups, check_stop's loops, end_stream for a stream's end, and
the same errors. A node that splits its batches and reads a stream gives the same outputs, and
the same failure, in both."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from mstar_rt import (EMIT, DynamicLoop, Fixed, GraphEdge, GraphNode, Model, NodeSubmodule,
                      RequestFailed, Runtime, Sequential, StreamingGraphEdge, _core)
from mstar_rt.model import RequestContext, StreamChunk
from mstar_rt.placement import NodeGroup, PlacedRuntime
from mstar_rt.placement.host import WorkerHost
from mstar_rt.registry import RequestRegistry

from walk_models import ZERO_LIVE, settled

T = 30.0
BAD = -1  # a request with this tag makes the consumer's forward answer for no item
CASES = [dict(n=n, tag=t) for n in range(7) for t in (1, 2, 3)]


class Gen(NodeSubmodule):
    """A DynamicLoop streaming ``10 * tag + i`` for i < n (nothing for n = 0)."""

    max_batch = 4

    def prepare_inputs(self, ctx, inputs):
        return inputs["n"], ctx.request.inputs["tag"], ctx.iteration

    def forward(self, batch):
        return [{"tok": 10 * tag + i} if i < n else {} for n, tag, i in batch]

    def check_stop(self, batch, outputs):
        return [("gen",) if i + 1 >= max(n, 1) else () for n, _tag, i in batch]


class SplitConsumer(NodeSubmodule):
    """Reads the stream in Fixed(2) windows; runs requests of odd and even tags apart (forward
    refuses a mixed batch); hears the end of an empty stream."""

    max_batch = 4

    def prepare_inputs(self, ctx, inputs):
        chunk = inputs["tok"]
        assert isinstance(chunk, StreamChunk), chunk
        return ctx.request.inputs["tag"], chunk

    def split_batch(self, batch):
        groups: dict[int, list[int]] = {}
        for i, (tag, _chunk) in enumerate(batch):
            groups.setdefault(tag % 2, []).append(i)
        return list(groups.values())

    def __init__(self) -> None:
        self.forwards: list[list[int]] = []  # the tags of each forward's batch

    def forward(self, batch):
        self.forwards.append([tag for tag, _ in batch])
        if len({tag % 2 for tag, _ in batch}) != 1:
            raise AssertionError(f"split_batch was not honoured: {[t for t, _ in batch]}")
        if any(tag == BAD for tag, _ in batch):
            return []
        return [{"win": (tag, w.begin, w.new_begin, w.end, w.last, list(w.items))}
                for tag, w in batch]

    def end_stream(self, ctx):
        return {"win": (ctx.request.inputs["tag"], "end")}


class SplitStream(Model):
    inputs = ("n", "tag")

    def __init__(self, gen: Gen | None = None) -> None:
        self.nodes = [
            GraphNode("gen", ["n"], [StreamingGraphEdge("consumer", "tok", Fixed(2))],
                      submodule=gen or Gen()),
            GraphNode("consumer", ["tok"], [GraphEdge(EMIT, "win")], submodule=SplitConsumer()),
        ]
        # Sequential: the consumer's windows are cut after the stream ended, so which window is
        # the last (or, for an empty stream, that end_stream is called) does not depend on timing.
        self.walks = {"main": Sequential(DynamicLoop("gen", 64, "gen"), "consumer")}


def split_stream() -> SplitStream:
    """The factory a placement worker calls."""
    return SplitStream()


def expected(n: int, tag: int) -> list:
    if n == 0:
        return [(tag, "end")]
    return [(tag, b, b, min(b + 2, n), b + 2 >= n, [10 * tag + p for p in range(b, min(b + 2, n))])
            for b in range(0, n, 2)]


def outputs(rt) -> list:
    handles = [rt.submit(case) for case in CASES]  # submitted together: batches mix requests
    return [h.result(timeout=T)["win"] for h in handles]


def failure(rt) -> str:
    with pytest.raises(RequestFailed) as e:
        rt.submit(dict(n=3, tag=BAD)).result(timeout=T)
    return str(e.value)


@pytest.fixture(scope="module")
def placed():
    rt = PlacedRuntime("test_node_runner:split_stream", [NodeGroup(["gen", "consumer"], rank=1)],
                       progress=False)
    yield rt
    rt.close()


def test_the_conductor_runs_split_and_stream_nodes_itself_with_the_runtimes_runner():
    with Runtime(split_stream()) as rt:
        assert isinstance(rt.runner, _core.NodeRunner)
        handed_back = []
        run = rt.run
        rt.run = lambda node, items: (handed_back.append(len(items)), run(node, items))[1]
        assert outputs(rt) == [expected(**case) for case in CASES]
        assert handed_back == []  # no batch left C++ for the Python worker loop
        assert settled(rt) == ZERO_LIVE


def test_a_split_stream_node_gives_the_same_outputs_in_the_runtime_and_a_worker(placed):
    with Runtime(split_stream()) as rt:
        here = outputs(rt)
    assert here == [expected(**case) for case in CASES]
    assert outputs(placed) == here


def test_a_forward_answering_for_too_few_items_fails_alike_in_the_runtime_and_a_worker(placed):
    with Runtime(split_stream()) as rt:
        here = failure(rt)
        assert rt.submit(dict(n=3, tag=1)).result(timeout=T)["win"] == expected(3, 1)
        assert settled(rt) == ZERO_LIVE
    assert "node 'consumer'" in here
    assert "SplitConsumer.forward returned 0 results for a batch of 1" in here
    assert failure(placed) == here


def work_item(item: int, request: int, chunk=None, inputs=None) -> _core.WorkItem:
    return _core.WorkItem((item, request, 0, inputs or {"tok": [7, 8]}, chunk))


def own_runner(rt: Runtime) -> _core.NodeRunner:
    """A runner over rt's nodes and a registry of our own that knows requests 5, 6, 7 (tags 4,
    5, 6)."""
    registry = RequestRegistry()
    for rid in (5, 6, 7):
        registry.add(rid, SimpleNamespace(context=RequestContext(rid, {"n": 1, "tag": rid - 1})))
    return _core.NodeRunner(rt.nodes.entries, registry)


def test_the_runner_runs_chunks_first_then_stream_ends_and_checks_what_hooks_answer():
    rt = Runtime(split_stream())
    rt.close()
    gen, consumer = rt.graph.node_ids["gen"], rt.graph.node_ids["consumer"]
    # A request the registry does not know gets a blank context: the hooks see no inputs.
    with pytest.raises(KeyError, match="tag"):
        rt.runner.run(consumer, [work_item(1, 999, (0, 0, 2, False))])
    # A registry entry only needs a context: a runner over a registry of our own, without loop
    # ids (as a placement worker builds it).
    runner = own_runner(rt)
    items = [work_item(1, 5, (3, 3, 3, True)),  # the stream's end: an empty chunk
             work_item(2, 5, (0, 1, 2, False))]  # a chunk: items 0..2, new from 1
    ids, outs, stops, failed = runner.run(consumer, items)
    assert ids == [2, 1] and stops is None and failed == []
    assert outs == [{"win": (4, 0, 1, 2, False, [7, 8])}, {"win": (4, "end")}]
    assert runner.prepare(consumer, items[1:]) == [(4, StreamChunk([7, 8], 0, 1, 2, False))]
    # split_batch's groups run apart, and each item's output lands in its own place.
    consumer_sub = rt.nodes[consumer].submodule
    consumer_sub.forwards.clear()
    chunks = [work_item(i, i + 1, (0, 0, 1, True), {"tok": [i]}) for i in (4, 5, 6)]
    ids, outs, stops, _ = runner.run(consumer, chunks)
    assert consumer_sub.forwards == [[4, 6], [5]]
    assert ids == [4, 5, 6] and [o["win"][0] for o in outs] == [4, 5, 6]
    ids, outs, stops, failed = runner.run(gen, [work_item(3, 5, inputs={"n": 1})])
    assert (ids, outs, stops, failed) == ([3], [{"tok": 40}], [["gen"]], [])  # loop names
    assert rt.runner.loop_id("gen") == rt.graph.name_ids["gen"]
    with pytest.raises(RuntimeError, match="check_stop named loop 'nope', which is not a "
                                           "DynamicLoop of the model"):
        rt.runner.loop_id("nope")


def test_a_worker_host_runs_its_batches_with_the_runner_and_sends_loop_names():
    replies: list = []
    host = WorkerHost(split_stream(), ["gen", "consumer"],
                      lambda kind, **fields: replies.append((kind, fields)))
    try:
        assert isinstance(host.runner, _core.NodeRunner)
        host.open(5, {"n": 1, "tag": 4}, {})
        gen, consumer = host.graph.node_ids["gen"], host.graph.node_ids["consumer"]
        host.run(consumer, [work_item(1, 5, (3, 3, 3, True)), work_item(2, 5, (0, 1, 2, False))])
        host.run(gen, [work_item(3, 5, inputs={"n": 1})])
    finally:
        host.close()
    assert replies == [
        ("done", dict(node=consumer, items=[2, 1], outputs=[{"win": (4, 0, 1, 2, False, [7, 8])},
                                                            {"win": (4, "end")}],
                      stops=None, states={})),
        ("done", dict(node=gen, items=[3], outputs=[{"tok": 40}], stops=[["gen"]], states={}))]


def test_hooks_answering_for_another_number_of_items_are_refused_naming_the_hook():
    class Short(Gen):
        def check_stop(self, batch, outputs):
            return super().check_stop(batch, outputs)[1:]

    rt = Runtime(SplitStream(Short()))
    rt.close()
    items = [work_item(i, 5, inputs={"n": 2}) for i in range(2)]
    # Its forward already ran for both items (running it again would repeat it): check_stop is
    # asked again item by item, and each item it still fails for fails alone, the hook named.
    ids, outs, stops, failed = own_runner(rt).run(rt.graph.node_ids["gen"], items)
    assert ids == [] and outs == [] and stops == []
    assert failed == [(i, "RuntimeError: Short.check_stop returned 0 results for a batch of 1")
                      for i in range(2)]

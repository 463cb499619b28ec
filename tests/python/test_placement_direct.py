"""Tensors worker to worker (placement/direct.py): a large tensor one worker makes and only
another worker reads crosses through shared memory, the parent routing a handle; outputs equal
the in-process run, the producer's export arena empties once the handles are gone (also when
the reader dies), and everything else still goes through the parent."""

from __future__ import annotations

import glob
import os
import signal
import time

import pytest
import torch

from mstar_rt import (EMIT, Fixed, GraphEdge, GraphNode, Loop, Model, NodeSubmodule, Parallel,
                      RequestFailed, Runtime, Sequential, StreamingGraphEdge)
from mstar_rt.placement import NodeGroup, PlacedRuntime
from mstar_rt.placement.codec import CodecError, Decoder, Encoder
from mstar_rt.placement.direct import RemoteTensor, direct_names

from walk_models import wait_until

T = 30.0
N = 1 << 18  # float32 elements: 1 MiB


class Make(NodeSubmodule):
    """``big = x * arange(N)`` (1 MiB), and a small tensor beside it."""

    def forward(self, batch: list[dict]) -> list[dict]:
        return [{"big": b["x"] * torch.arange(N, dtype=torch.float32), "small": b["x"] + 1}
                for b in batch]


class Use(NodeSubmodule):
    """``y = big.sum() + small``; sleeps ``pause_s`` first (a reader that is still busy)."""

    pause_s = 0.0

    def forward(self, batch: list[dict]) -> list[dict]:
        time.sleep(self.pause_s)
        return [{"y": b["big"].sum().reshape(1) + b["small"], "pid": os.getpid()} for b in batch]


class Pipe(Model):
    inputs = ("x",)

    def __init__(self, pause_s: float = 0.0) -> None:
        use = Use()
        use.pause_s = pause_s
        self.nodes = [GraphNode("make", ["x"], ["big", "small"], submodule=Make()),
                      GraphNode("use", ["big", "small"], [GraphEdge(EMIT, "y"),
                                                          GraphEdge(EMIT, "pid")],
                                submodule=use)]
        self.walks = {"main": Sequential("make", "use")}


def pipe(pause_s: float = 0.0) -> Pipe:
    return Pipe(pause_s)


GROUPS = [NodeGroup(["make"], rank=1), NodeGroup(["use"], rank=2)]


def expected(x: float) -> torch.Tensor:
    return (x * torch.arange(N, dtype=torch.float32)).sum().reshape(1) + (x + 1)


def test_direct_names_follow_the_readers():
    class G(Model):
        inputs = ("x",)
        nodes = [GraphNode("a", ["x"], ["v", "w", GraphEdge("c", "u"), GraphEdge("b", "p", True)]),
                 GraphNode("b", ["v", "p"], ["z"]),
                 GraphNode("c", ["w", "u"], [GraphEdge(EMIT, "w2"), "z2"]),
                 GraphNode("d", ["z", "z2"], [GraphEdge(EMIT, "out")])]
        walks = {"main": Sequential("a", "b", "c", "d")}

    ranks = {"a": 1, "b": 2, "c": 3, "d": 0}
    # v: read on rank 2 only; w and u: on rank 3; p is persisted; z, z2: read by the parent
    assert direct_names(G(), ranks, {1, 2, 3}) == {1: ["u", "v", "w"]}
    ranks["c"] = 1  # w and u now read on their maker's own rank
    assert direct_names(G(), ranks, {1, 2, 3}) == {1: ["v"]}
    ranks["b"] = 0  # v read by the parent
    assert direct_names(G(), ranks, {1, 2, 3}) == {}


@pytest.fixture(scope="module")
def placed():
    rt = PlacedRuntime("test_placement_direct:pipe", GROUPS, progress=False, shm_bytes=16 << 20)
    yield rt
    rt.close()


def test_a_large_tensor_goes_worker_to_worker_and_equals_in_process(placed):
    assert placed.workers[1]["direct"] == ["big", "small"]  # small stays below direct_bytes
    with Runtime(pipe()) as local:
        ref = local.submit({"x": torch.tensor([2.0])}).result(T)["y"][0]
    before = placed.workers[1]["exports"]
    handles = [placed.submit({"x": torch.tensor([float(i)])}) for i in range(12)]
    outs = [h.result(T)["y"][0] for h in handles]
    assert torch.equal(outs[2], ref)
    assert all(torch.allclose(o, expected(float(i))) for i, o in enumerate(outs))
    assert placed.workers[1]["exports"] - before == 12  # each big tensor crossed as a handle
    # every handle is gone: the producer's arena empties (the unexports leave when idle)
    assert wait_until(lambda: placed.worker_stats(1)["export_bytes_in_use"] == 0, T)


@pytest.mark.parametrize("direct", [None, 64 << 10])
def test_requests_one_after_another_keep_reusing_the_front_of_each_arena(direct):
    """An emptied arena starts over at its front (placement/arena.py): thirty 1 MiB requests
    one after another leave a few MiB of shared memory touched, where a lapping ring had
    touched every page of the arenas they crossed (16-32 MiB here; 256 MiB with the default
    64 MiB arenas and the benchmark's chain, where a container's /dev/shm is often 64 MiB)."""
    before = set(glob.glob("/dev/shm/mstar_*"))
    rt = PlacedRuntime("test_placement_direct:pipe", GROUPS, progress=False,
                       shm_bytes=16 << 20, direct_bytes=direct)
    try:
        for i in range(30):
            assert torch.allclose(rt.submit({"x": torch.tensor([float(i)])}).result(T)["y"][0],
                                  expected(float(i)))
        # the arenas' files (the mailboxes, 8 MiB each way, are reserved whole at start)
        mine = {p for p in set(glob.glob("/dev/shm/mstar_*")) - before
                if not p.endswith("_mail")}
        assert any(p.endswith("_w2p") for p in mine)
        touched = sum(os.stat(p).st_blocks * 512 for p in mine)
        assert touched <= 8 << 20, f"{touched >> 20} MiB of shared memory touched"
    finally:
        rt.close()


def test_without_direct_every_tensor_goes_through_the_parent():
    """``direct: false`` in the config (``direct_bytes=None`` in Python)."""
    rt = PlacedRuntime.from_config({
        "model": "test_placement_direct:pipe", "direct": False, "progress": False,
        "node_groups": [{"nodes": ["make"], "rank": 1}, {"nodes": ["use"], "rank": 2}]})
    try:
        assert torch.allclose(rt.submit({"x": torch.tensor([3.0])}).result(T)["y"][0],
                              expected(3.0))
        assert rt.workers[1]["direct"] == [] and rt.workers[1]["exports"] == 0
    finally:
        rt.close()


def test_a_dead_reader_frees_the_producers_exports():
    rt = PlacedRuntime("test_placement_direct:pipe", GROUPS, progress=False,
                       model_kwargs={"pause_s": 30.0})
    try:
        handles = [rt.submit({"x": torch.tensor([1.0])}) for _ in range(3)]
        assert wait_until(lambda: rt.workers[1]["exports"] == 3, T)
        assert rt.worker_stats(1)["export_bytes_in_use"] >= 3 * N * 4
        os.kill(rt.workers[2]["pid"], signal.SIGKILL)
        for h in handles:
            with pytest.raises(Exception, match="rank 2"):
                h.result(T)
        assert wait_until(lambda: rt.worker_stats(1)["export_bytes_in_use"] == 0, T)
    finally:
        rt.close()


def test_remote_headers_are_checked():
    enc = Encoder(None)
    freed = []
    handle = RemoteTensor([1, 0, 64, 0, 16, 0, "float32", [4]], lambda g, k: freed.append(k))
    payload = enc.pack({"v": handle})
    with pytest.raises(CodecError, match="cannot arrive here"):
        Decoder(None).unpack(payload)
    got = Decoder(None, remote=lambda h: h).unpack(payload)
    assert got["v"] == [1, 0, 64, 0, 16, 0, "float32", [4]]
    bad = enc.pack({"v": RemoteTensor([1, 0, 64, 0, 12, 0, "float32", [4]], lambda g, k: None)})
    with pytest.raises(CodecError, match="needs 16 bytes"):
        Decoder(None, remote=lambda h: h).unpack(bad)
    del handle
    assert freed == [64]


def test_between_machines_the_reader_fetches_the_bytes_from_the_producer():
    """Ray actors (placement/peer_bytes.py): the header names the producer's endpoint, the
    reader fetches over tcp; a gone export, a restarted producer or a dead one fail clearly."""
    import msgpack
    import zmq

    from mstar_rt.placement.arena import ShmArena
    from mstar_rt.placement.direct import Export, ExportArena
    from mstar_rt.placement.peer_bytes import ExportServer, PeerFetcher

    ctx = zmq.Context()
    arena = ShmArena.create(f"mstar_test_{os.getpid()}_fetch", 1 << 20)
    arena.unlink()
    exports = ExportArena(arena)
    server = ExportServer(ctx, "127.0.0.1", exports, gen=3)
    exports.at = server.endpoint
    fetch = PeerFetcher(ctx, timeout_s=1.0)
    msg_arena = ShmArena.create(f"mstar_test_{os.getpid()}_msg", 1 << 16)
    msg_arena.unlink()
    try:
        t = torch.arange(1000, dtype=torch.float32)
        payload = Encoder(msg_arena, exports=exports, rank=1, gen=3).pack({"v": Export(t)})
        header = Decoder(None, remote=lambda h: h).unpack(payload)["v"]  # the parent's handle
        assert header[0] == 1 and header[8] == server.endpoint
        reader = Decoder(None, remote_arena=fetch)
        got = reader.unpack(Encoder(None).pack({"v": RemoteTensor(header, lambda g, k: None)}))
        assert torch.equal(got["v"], t) and server.served == 1
        with pytest.raises(CodecError, match="generation 2 is gone"):
            fetch([1, 2] + header[2:])
        assert torch.equal(reader.unpack(Encoder(None).pack(
            {"v": RemoteTensor(header, lambda g, k: None)}))["v"], t)  # a fresh socket serves
        bad = ctx.socket(zmq.DEALER)  # malformed fetches are answered, the server lives on
        bad.connect(server.endpoint)
        for junk in (b"\xc1", msgpack.packb([1, 3, [2], 0, 4]), msgpack.packb("x")):
            bad.send(junk)
            assert bad.poll(2000) and "all integers" in msgpack.unpackb(bad.recv())[1]
        bad.close(0)
        exports.free([header[2]])
        with pytest.raises(CodecError, match="no export"):
            fetch(header)
        server.close()
        t0 = time.monotonic()
        with pytest.raises(CodecError, match=r"rank 1 .* did not send its bytes within 1 s"):
            fetch(header)
        assert time.monotonic() - t0 < 3.0
    finally:
        server.close()
        fetch.close()
        ctx.term()
        arena.close()
        msg_arena.close()


# ---- stream items ------------------------------------------------------------------------------

class Frame(NodeSubmodule):
    """One 1 MiB frame per iteration, streamed: ``f = x * arange(N)``, ``x += 1``."""

    def forward(self, batch: list[dict]) -> list[dict]:
        return [{"x": b["x"] + 1, "f": b["x"] * torch.arange(N, dtype=torch.float32)}
                for b in batch]


class Eat(NodeSubmodule):
    """Each window of frames -> their sums, EMITted (after ``pause_s``: a slow consumer)."""

    pause_s = 0.0

    def forward(self, batch: list[dict]) -> list[dict]:
        time.sleep(self.pause_s)
        return [{"sums": torch.stack([f.sum() for f in b["f"].new_items])} for b in batch]


class Frames(Model):
    """``gen`` (a fixed Loop of 5) streams a frame per step into ``eat``, two per window."""

    inputs = ("x",)

    def __init__(self, pause_s: float = 0.0) -> None:
        eat = Eat()
        eat.pause_s = pause_s
        self.nodes = [GraphNode("gen", ["x"], ["x", StreamingGraphEdge("eat", "f", Fixed(2))],
                                submodule=Frame()),
                      GraphNode("eat", ["f"], [GraphEdge(EMIT, "sums")], submodule=eat)]
        self.walks = {"main": Parallel(Loop("gen", 5), "eat")}


def frames(pause_s: float = 0.0) -> Frames:
    return Frames(pause_s)


@pytest.mark.parametrize("segments", [True, False])
def test_stream_items_go_worker_to_worker(segments):
    """A stream whose consumer sits on another worker: each large item leaves its producer as
    a handle (in its reply, or as the producer's segment makes it), the parent's stream holds
    the handles and the windows carry them to the consumer, which reads the bytes from the
    producer's arena; outputs equal in-process, and the arena empties once the requests end."""
    assert direct_names(frames(), {"gen": 1, "eat": 2}, {1, 2}) == {1: ["f"]}
    assert direct_names(frames(), {"gen": 1, "eat": 0}, {1}) == {}  # the parent reads it
    xs = [1.0, 2.0, 3.5, -1.0]
    with Runtime(frames()) as local:
        want = [torch.cat([v for _, v in local.submit({"x": torch.tensor(x)})]) for x in xs]
    with PlacedRuntime("test_placement_direct:frames",
                       [NodeGroup(["gen"], rank=1), NodeGroup(["eat"], rank=2)],
                       progress=False, shm_bytes=32 << 20, segments=segments) as rt:
        assert rt.workers[1]["direct"] == ["f"]
        assert any(n.startswith("segment:") for n in rt.node_names) == segments
        for at_once in (False, True):  # (at once: 20 MiB of frames, within the 32 MiB arena)
            before = rt.workers[1]["exports"]
            if at_once:
                handles = [rt.submit({"x": torch.tensor(x)}) for x in xs]
                got = [torch.cat([v for _, v in h]) for h in handles]
            else:
                got = [torch.cat([v for _, v in rt.submit({"x": torch.tensor(x)})]) for x in xs]
            assert all(torch.equal(g, w) for g, w in zip(got, want))
            assert rt.workers[1]["exports"] - before == 5 * len(xs)  # every frame a handle
        assert wait_until(lambda: rt.worker_stats(1)["export_bytes_in_use"] == 0, T)


@pytest.mark.parametrize("killed", [1, 2])
def test_a_worker_killed_mid_stream_fails_its_requests_and_frees_the_frames(killed):
    """The producer (1) or the slow consumer (2) SIGKILLed while frames are in flight as
    handles: the requests it held fail naming it (one it never held may finish, exactly), the
    restarted worker serves the next requests exactly, and the producer's export arena empties
    (the consumer's kept handles go with its death, the dead producer's arena with it)."""
    with Runtime(frames()) as local:
        want = [torch.cat([v for _, v in local.submit({"x": torch.tensor(float(i))})])
                for i in range(3)]
    with PlacedRuntime("test_placement_direct:frames",
                       [NodeGroup(["gen"], rank=1), NodeGroup(["eat"], rank=2)],
                       progress=False, shm_bytes=32 << 20, restart="auto",
                       model_kwargs={"pause_s": 0.3}) as rt:
        handles = [rt.submit({"x": torch.tensor(float(i))}) for i in range(3)]
        assert wait_until(lambda: rt.workers[1]["exports"] >= 2, T)
        os.kill(rt.workers[killed]["pid"], signal.SIGKILL)
        failed = 0
        for h, w in zip(handles, want):
            try:
                assert torch.equal(torch.cat([v for _, v in h]), w)
            except RequestFailed as e:
                assert f"rank {killed}" in str(e)
                failed += 1
        assert failed >= 1
        assert wait_until(lambda: rt.workers[killed]["state"] == "up"
                          and rt.workers[killed]["restarts"] == 1, T)
        got = torch.cat([v for _, v in rt.submit({"x": torch.tensor(2.0)})])
        assert torch.equal(got, want[2])
        assert wait_until(lambda: rt.worker_stats(1)["export_bytes_in_use"] == 0, T)
        assert rt.live["requests"] == 0


def test_windows_answered_as_sent_keep_their_handles_until_read():
    """The parent answers a window into a segment as it sends it (placement/stream_in.py),
    before the worker has read its handles' bytes: the ledger keeps those handles (so their
    exports stay) until the worker says it copied them ('read'), the request ends, or the
    reading worker dies."""
    from mstar_rt.placement.ledger import ItemLedger

    freed: list = []
    ledger = ItemLedger()
    for item, key in ((1, 10), (2, 20)):
        ledger.record(item, 7, "consume", [RemoteTensor([1, 0, key, 0, 4, 0, "float32", [1]],
                                                        lambda g, k: freed.append(k))])
    ledger.record(3, 8, "consume", [RemoteTensor([1, 0, 30, 0, 4, 0, "float32", [1]],
                                                 lambda g, k: freed.append(k))])
    assert ledger.take([1], keep=True) == {1} and freed == []
    assert ledger.take([2]) == {2} and freed == [20]  # reported back: the worker read it
    assert ledger.take([3], keep=True) == {3} and freed == [20]
    ledger.forget(7)
    assert freed == [20, 10]
    ledger.clear()
    assert freed == [20, 10, 30] and ledger.kept == {}
    freed.clear()
    for item, key in ((4, 40), (5, 50), (6, 60)):
        ledger.record(item, 9, "consume", [RemoteTensor([1, 0, key, 0, 4, 0, "float32", [1]],
                                                        lambda g, k: freed.append(k))])
    assert ledger.take([4, 5], keep=True) == {4, 5}
    gone = ledger.read([5, 99])  # read: its handles go (to die outside the link's lock)
    assert freed == []
    del gone
    assert freed == [50] and list(ledger.kept[9]) == [4]
    gone = ledger.read([6])  # read before it was answered: nothing of it is kept then
    del gone
    assert freed == [50, 60] and ledger.take([6], keep=True) == {6} and list(ledger.kept[9]) == [4]
    ledger.forget(9)
    assert freed == [50, 60, 40] and ledger.kept == {} and ledger.kept_by_item == {}


# ---- a long stream into a segment: windows acknowledged as read --------------------------------

class Camera(NodeSubmodule):
    """A 1 MiB frame per step (``x * arange(N)``), streamed, after ``pause`` seconds."""

    def forward(self, batch: list[dict]) -> list[dict]:
        time.sleep(float(batch[0]["pause"]))
        return [{"x": b["x"] + 1, "f": b["x"] * torch.arange(N, dtype=torch.float32)}
                for b in batch]


class Look(NodeSubmodule):
    """A talker-like step: its window of frames (one item, or none past the stream's end)."""

    def forward(self, batch: list[dict]) -> list[dict]:
        return [{"s": sum((f.sum() for f in b["f"].items), torch.zeros(()))} for b in batch]


class Say(NodeSubmodule):
    def forward(self, batch: list[dict]) -> list[dict]:
        return [{"said": b["s"] * 2} for b in batch]


class Watch(Model):
    """``cam`` streams ``steps`` frames, one per window, into a loop of ``look`` and ``say``:
    with the loop on a worker and ``cam`` on another, the loop is one segment the frames enter
    window by window (placement/stream_in.py), each frame a handle into cam's arena."""

    inputs = ("x", "pause")
    input_defaults = {"pause": 0.0}

    def __init__(self, steps: int = 24) -> None:
        self.nodes = [GraphNode("cam", ["x", "pause"], ["x", StreamingGraphEdge(
                          "look", "f", Fixed(1), continue_after_done=True)], submodule=Camera()),
                      GraphNode("look", ["f"], ["s"], submodule=Look()),
                      GraphNode("say", ["s"], [GraphEdge(EMIT, "said")], submodule=Say())]
        self.walks = {"main": Parallel(Loop("cam", steps), Loop(Sequential("look", "say"), steps))}


def watch(steps: int = 24) -> Watch:
    return Watch(steps)


def test_a_stream_longer_than_the_arena_enters_a_segment_worker_to_worker():
    """24 MiB of frames through an 8 MiB export arena: the reading worker says which windows it
    copied out ('read'), so the parent lets their handles go at once -- not when the request
    ends -- and every frame crosses as a handle, none falling back to the parent for want of
    room; outputs equal in-process, nothing held after."""
    xs = [1.0, -2.5]
    with Runtime(watch()) as local:
        want = [[float(v) for _, v in local.submit({"x": torch.tensor(x)})] for x in xs]
    with PlacedRuntime("test_placement_direct:watch",
                       [NodeGroup(["cam"], rank=1), NodeGroup(["look", "say"], rank=2)],
                       progress=False, shm_bytes=8 << 20) as rt:
        assert rt.workers[1]["direct"] == ["f"]
        assert any(n.startswith("segment:") for n in rt.node_names)
        for x, w in zip(xs, want):
            before = rt.workers[1]["exports"]
            got = [float(v) for _, v in rt.submit({"x": torch.tensor(x), "pause": 0.02})]
            assert got == pytest.approx(w, rel=1e-6)  # (a 1 MiB sum's order: threads)
            assert rt.workers[1]["exports"] - before == 24  # every frame a handle
        assert wait_until(lambda: rt.worker_stats(1)["export_bytes_in_use"] == 0, T)
        assert rt.live["requests"] == 0


@pytest.mark.parametrize("killed", [1, 2])
def test_a_worker_killed_while_frames_enter_a_segment_fails_its_requests_and_frees_them(killed):
    """The camera's worker (1) or the watching segment's (2) SIGKILLed mid-stream: the requests
    fail naming it (or finish exactly), the restarted worker serves the next exactly, and the
    producer's export arena empties (handles not yet read go with the reader's death)."""
    with Runtime(watch()) as local:
        want = [float(v) for _, v in local.submit({"x": torch.tensor(3.0)})]
    with PlacedRuntime("test_placement_direct:watch",
                       [NodeGroup(["cam"], rank=1), NodeGroup(["look", "say"], rank=2)],
                       progress=False, shm_bytes=8 << 20, restart="auto") as rt:
        handles = [rt.submit({"x": torch.tensor(3.0), "pause": 0.05}) for _ in range(2)]
        assert wait_until(lambda: rt.workers[1]["exports"] >= 4, T)
        os.kill(rt.workers[killed]["pid"], signal.SIGKILL)
        for h in handles:
            try:
                assert [float(v) for _, v in h] == pytest.approx(want, rel=1e-6)
            except RequestFailed as e:
                assert f"rank {killed}" in str(e)
        assert wait_until(lambda: rt.workers[killed]["state"] == "up", T)
        got = [float(v) for _, v in rt.submit({"x": torch.tensor(3.0)})]
        assert got == pytest.approx(want, rel=1e-6)
        assert wait_until(lambda: rt.worker_stats(1)["export_bytes_in_use"] == 0, T)
        assert rt.live["requests"] == 0


def test_unexports_hurry_once_a_quarter_of_the_arena_waits_on_them():
    """Dead handles' unexports wait for the worker's next batch or the hub's idle moment; a
    long stream keeps the hub busy, so once the dead handles hold ``hurry_bytes`` they are sent
    at once (``hurry``), before the maker's arena fills."""
    from mstar_rt.placement.direct import LinkExports

    held, hurried = [], []
    exports = LinkExports(1, ["f"], 1, lambda g, name, value: held.append(value),
                          lambda: hurried.append(len(held)), hurry_bytes=3 << 20)
    handles = [exports.handle(0, [1, 0, key, 0, 1 << 20, 0, "float32", [1 << 18]])
               for key in range(7)]
    del handles[:2]
    assert sorted(held) == [0, 1] and hurried == []
    del handles[0]  # the third MiB
    assert hurried == [3]
    del handles[:]
    assert sorted(held) == list(range(7)) and hurried == [3, 6]

"""Placement without processes (issue 9): the codec carries values across the boundary exactly
and refuses, with the fix, what it cannot carry or what is forged; the shared-memory arena
wraps, reports a stuck receiver and is never read half-written; leftovers of dead parents are
swept; node groups and placement configs that cannot work are refused; the public surface."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import msgpack
import numpy as np
import pytest
import torch

import mstar_rt
from mstar_rt.engines import SamplingParams, StatelessEngine
from mstar_rt.placement import CodecError, ModelSpec, NodeGroup, PlacedRuntime, read_config
from mstar_rt.placement.arena import ArenaFull, ReaderGone, ShmArena, sweep_stale
from mstar_rt.placement.codec import INLINE_BYTES, Decoder, Encoder
from mstar_rt.placement.config import make_plan

import placement_models as pm
from placement_support import LM_GROUPS, T, pipeline_inputs, same


# ---- values across the boundary (no processes) ---------------------------------------------------

@pytest.fixture
def arena():
    a = ShmArena.create(f"mstar_{os.getpid()}_test_{os.urandom(3).hex()}", 1 << 16)
    yield a
    a.close()
    a.unlink()


@pytest.mark.parametrize("inline_bytes", [0, INLINE_BYTES])
def test_codec_carries_every_kind_exactly_and_frees_the_arena(arena, inline_bytes):
    value = {"f32": torch.randn(3, 4), "bf16": torch.randn(5).to(torch.bfloat16),
             "i64": torch.arange(6).reshape(2, 3), "bool": torch.tensor([True, False]),
             "scalar_t": torch.tensor(2.5), "empty": torch.zeros(0, 7),
             "strided": torch.arange(12.0).reshape(3, 4).T, "np": np.arange(5, dtype=np.uint16),
             "np_f64": np.linspace(0, 1, 4), "np_scalar": np.float32(1.25),
             "tuple": (1, "a", (2.0, None)), "list": [1, [2, 3]], "bytes": b"\x00\xff",
             "size": torch.Size([2, 3]), "params": SamplingParams(max_tokens=3, top_k=2),
             7: "int key", "big": 2**63 - 1, "neg": -2**63,
             "param": torch.nn.Parameter(torch.ones(2))}
    payload = Encoder(arena, inline_bytes=inline_bytes).pack(value)
    span = arena.publish()
    # every tensor here is small: in the message itself, or (inline_bytes=0) in the arena
    assert (arena.in_use > 0) == (inline_bytes == 0)
    got = Decoder(arena).unpack(payload)
    arena.free_to(span)
    assert arena.in_use == 0
    expect = dict(value, size=(2, 3), strided=value["strided"].contiguous(),
                  param=torch.ones(2))  # a Parameter arrives as a plain tensor
    assert same(got, expect)
    if not inline_bytes:
        assert len(payload) < 1000  # only headers travel in the message


def test_small_tensors_ride_in_the_message_and_large_ones_in_the_arena(arena):
    small, large = torch.arange(INLINE_BYTES // 8), torch.arange(INLINE_BYTES // 8 + 1)
    payload = Encoder(arena).pack({"small": small, "large": large, "np": np.ones(3)})
    assert arena.publish() == -(-large.nbytes // 64) * 64  # only the large one is in the arena
    got = Decoder(arena).unpack(payload)
    arena.free_to(arena.published_head)
    assert same(got, {"small": small, "large": large, "np": np.ones(3)})
    got["small"].add_(1)  # its own memory: writable, not the message's bytes
    assert got["small"][0].item() == 1
    # a forged small tensor: bytes that do not fill its shape, or no bytes at all
    for header, words in [([0, "float32", [4], b"\0" * 12], "needs 16 bytes"),
                          ([0, "float32", [1], 4], "malformed small tensor"),
                          ([0, "object", [1], b"\0" * 8], "not allowed")]:
        with pytest.raises(CodecError, match=words):
            Decoder(arena).unpack(msgpack.packb(msgpack.ExtType(6, msgpack.packb(header))))


@pytest.mark.parametrize("inline_bytes", [0, INLINE_BYTES])
def test_tensor_views_cross_as_their_values_in_one_copy_each_way(arena, inline_bytes):
    # The codec copies a tensor's memory straight into the arena and out again; views whose
    # memory is not their value (conj / neg bits, offsets, strides, CUDA) are resolved first.
    z = torch.randn(2, 3, dtype=torch.complex64)
    base = torch.arange(20.0)
    value = {"conj": z.conj(), "neg_view": z.conj().imag, "offset": base[5:9],
             "stepped": base[::3], "grad": torch.ones(3, requires_grad=True) * 2,
             "bf16_3d": torch.randn(2, 3, 4).to(torch.bfloat16).transpose(0, 2),
             "c128_0d": torch.tensor(1 + 2j, dtype=torch.complex128),
             "i8": torch.tensor([-128, 127], dtype=torch.int8), "f16": torch.randn(3).half(),
             "np_2d_view": np.arange(12, dtype=np.int32).reshape(3, 4)[:, 1]}
    payload = Encoder(arena, inline_bytes=inline_bytes).pack(value)
    got = Decoder(arena).unpack(payload)
    arena.free_to(arena.publish())
    expect = {k: (v.detach().resolve_conj().resolve_neg().contiguous()
                  if isinstance(v, torch.Tensor) else np.ascontiguousarray(v))
              for k, v in value.items()}
    assert same(got, expect)
    assert not got["conj"].is_conj() and not got["neg_view"].is_neg()
    got["offset"].add_(1)  # a received tensor owns its memory: writable, not the arena
    assert same(Decoder(arena).unpack(Encoder(arena).pack(value["offset"])), base[5:9])


def test_a_tensor_twice_in_one_message_crosses_once(arena):
    x = torch.arange(512.0)  # larger than INLINE_BYTES: in the arena
    payload = Encoder(arena).pack({"inputs": {"x": x}, "items": [[1, {"x": x}]], "y": x + 0})
    assert arena.publish() == 2 * x.nbytes  # x once, the different y once
    got = Decoder(arena).unpack(payload)
    arena.free_to(arena.published_head)
    a, b = got["inputs"]["x"], got["items"][0][1]["x"]
    assert same(a, x) and same(b, x) and same(got["y"], x) and a is not b


@pytest.mark.parametrize("inline_bytes", [0, INLINE_BYTES])
def test_a_cuda_tensor_keeps_its_kind_across_host_hops(arena, inline_bytes):
    """(No GPU here: the marked host copy of a CUDA tensor stands in for one, and "cpu" for a
    worker's CUDA device; gpu_check.py's placement section runs the real thing.) It crosses
    as kind CUDA: a process without a device keeps the host copy, marked, so it leaves that
    process as CUDA again (a hop through the parent); a worker on a device puts it there."""
    from mstar_rt.placement.codec import _CUDA, _WAS_CUDA

    made = torch.arange(300.0)  # a CUDA tensor's host copy, as the parent would hold it
    setattr(made, _WAS_CUDA, True)
    plain = torch.arange(300.0)
    payload = Encoder(arena, inline_bytes=inline_bytes).pack({"made": made, "plain": plain})
    kinds = [h[0] for h in _headers(payload)]
    assert kinds == [_CUDA, 0]
    span = arena.publish()
    parent = Decoder(arena).unpack(payload)  # no device: host copies, one marked
    assert same(parent["made"], made) and getattr(parent["made"], _WAS_CUDA, False)
    assert not getattr(parent["plain"], _WAS_CUDA, False)
    worker = Decoder(arena, cuda="cpu").unpack(payload)  # on its device: no mark needed
    arena.free_to(span)
    assert same(worker["made"], made) and not getattr(worker["made"], _WAS_CUDA, False)
    payload = Encoder(arena, inline_bytes=inline_bytes).pack(parent)  # the parent sends it on
    assert [h[0] for h in _headers(payload)] == [_CUDA, 0]
    arena.free_to(arena.publish())


def _headers(payload: bytes) -> list:
    """The tensor headers of a packed map of tensors, in order."""
    out = []
    msgpack.unpackb(payload, strict_map_key=False,
                    ext_hook=lambda code, data: out.append(msgpack.unpackb(data)))
    return out


def test_codec_refuses_what_it_cannot_carry_and_says_what_to_send(arena):
    class Opaque:
        pass

    from dataclasses import dataclass

    @dataclass
    class Unregistered:
        a: int

    for bad, words in [(Opaque(), "cannot send a value of type"), (lambda: 0, "cannot send"),
                       (Unregistered(1), "register_type"), (2**64, "64-bit range"),
                       (np.array(["a"], dtype=object), "dtype"),
                       (torch.randn(2).to_sparse(), "dense")]:
        with pytest.raises(CodecError, match=words):
            Encoder(arena).pack({"v": bad})


def test_decoder_rejects_forged_tensor_headers(arena):
    def ext(header) -> bytes:
        return msgpack.packb({"t": msgpack.ExtType(1, msgpack.packb(header))})

    cases = [([0, "float32", [4], arena.capacity - 8, 16], "outside"),
             ([0, "float32", [4], 0, 12], "needs 16 bytes"),
             ([0, "object", [1], 0, 8], "not allowed"),
             ([1, "float32", [-1], 0, 4], "malformed"),
             ([5, "float32", [1], 0, 4], "malformed")]
    for header, words in cases:
        with pytest.raises(CodecError, match=words):
            Decoder(arena).unpack(ext(header))
    with pytest.raises(CodecError, match="unknown msgpack extension"):
        Decoder(arena).unpack(msgpack.packb(msgpack.ExtType(99, b"")))
    with pytest.raises(CodecError, match="not registered"):
        Decoder(arena).unpack(msgpack.packb(msgpack.ExtType(3, msgpack.packb(["os:system", {}]))))
    with pytest.raises(CodecError, match="not a valid msgpack"):
        Decoder(arena).unpack(b"\xc1garbage")


def test_arena_wraps_around_and_reports_a_stuck_receiver(arena):
    cap = arena.capacity
    for _ in range(5):  # more than the capacity in total: allocations wrap
        off = arena.alloc(cap // 3, timeout_s=0.1)
        assert 0 <= off and off + cap // 3 <= cap
        arena.free_to(arena.publish())
    arena.alloc(cap // 2, timeout_s=0.1)
    arena.publish()
    t0 = time.monotonic()
    with pytest.raises(ArenaFull, match="stayed full"):
        arena.alloc(cap // 2 + 128, timeout_s=0.2)
    assert time.monotonic() - t0 >= 0.2
    with pytest.raises(ArenaFull, match="raise shm_bytes"):
        arena.alloc(cap + 1, timeout_s=0.1)
    with pytest.raises(ValueError, match="outside"):
        arena.free_to(arena.published_head + 64)


def test_a_full_arena_whose_reader_died_gives_up_at_once(arena):
    arena.alloc(arena.capacity // 2, timeout_s=0.1)
    arena.publish()
    reader = {"alive": True}
    timer = threading.Timer(0.05, reader.update, kwargs={"alive": False})
    timer.start()
    t0 = time.monotonic()
    with pytest.raises(ReaderGone, match="died"):
        arena.alloc(arena.capacity // 2 + 128, timeout_s=10.0, alive=lambda: reader["alive"])
    assert time.monotonic() - t0 < 2.0  # not the 10 s meant for a slow reader
    timer.join()


def test_a_sender_waiting_on_a_full_arena_gives_up_when_its_worker_dies():
    """A submit waiting for room in a stopped worker's arena held the link's send lock, which
    the death handler needs: the worker's death was handled, and the submit returned, only when
    the wait timed out 10 s later (a chaos soak: 4 requests in 31,804 took 11.2 s)."""
    big = {"x": torch.ones((1 << 17) // pm.DIM_IN, pm.DIM_IN)}  # 512 KiB a request
    with PlacedRuntime("placement_models:pipeline", [NodeGroup(["encoder"], rank=1)],
                       progress=False, shm_bytes=1 << 20) as rt:
        assert rt.submit(pipeline_inputs(1)[0]).result(T)
        pid = rt.workers[1]["pid"]
        os.kill(pid, signal.SIGSTOP)  # it reads nothing more: the arena fills
        handles: list = []
        sender = threading.Thread(target=lambda: handles.extend(rt.submit(big) for _ in range(4)))
        sender.start()
        seen = -1
        while seen != len(handles):  # until one waits for room (two fill the arena)
            seen = len(handles)
            time.sleep(0.5)
        assert 1 <= seen < 4
        t0 = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        sender.join(T)
        assert time.monotonic() - t0 < 5.0
        for h in handles:
            with pytest.raises(mstar_rt.RequestFailed, match="worker process rank 1"):
                h.result(T)


def test_an_emptied_arena_starts_over_at_its_front_with_all_of_it_free(arena):
    """Request/reply traffic reuses the ring's first pages (mapped, likely cached) instead of
    lapping through the whole segment, and the skipped end never counts as in use: a message
    after the jump may fill the ring."""
    cap = arena.capacity
    assert arena.alloc(cap // 4, timeout_s=0.1) == 0
    arena.free_to(arena.publish())
    # emptied: the next message starts at 0 and may take all of it, in pieces
    assert arena.alloc(cap // 2, timeout_s=0.1) == 0
    assert arena.alloc(cap // 2, timeout_s=0.1) == cap // 2
    span = arena.publish()
    assert arena.published_head % cap == 0 and span == arena.published_head
    arena.free_to(span)
    assert arena.in_use == 0
    # a message still in flight: no jump, the next one goes after it
    assert arena.alloc(cap // 4, timeout_s=0.1) == 0
    first = arena.publish()
    assert arena.alloc(cap // 4, timeout_s=0.1) == cap // 4
    arena.free_to(first)
    arena.free_to(arena.publish())
    # a message that jumped and was never sent is forgotten whole
    mark = arena.mark()
    assert arena.alloc(cap - 64, timeout_s=0.1) == 0
    arena.rollback(mark)
    assert arena.alloc(64, timeout_s=0.1) == 0  # still empty: starts over again
    arena.free_to(arena.publish())
    with pytest.raises(ArenaFull, match="stayed full"):  # in flight and full: waits, then fails
        arena.alloc(cap, timeout_s=0.1)
        arena.publish()
        arena.alloc(64, timeout_s=0.1)


def test_a_message_larger_than_the_arena_is_refused_at_once(arena):
    """The reader can free only what was published: a message whose own tensors overflow the
    arena can never fit, so it fails at once naming shm_bytes, not after the back-pressure wait
    (10 s in the runtime, with the worker's send lock held: every request to that worker
    stalled)."""
    cap = arena.capacity
    arena.alloc(cap // 2, timeout_s=0.1)
    arena.free_to(arena.publish())  # emptied, at cap / 2: the next message starts over
    mark = arena.mark()
    arena.alloc(cap // 2 + 64, timeout_s=5.0)
    t0 = time.monotonic()
    with pytest.raises(ArenaFull, match="raise shm_bytes"):
        arena.alloc(cap // 2, timeout_s=5.0)
    assert time.monotonic() - t0 < 1.0
    arena.rollback(mark)
    # a message in flight that the reader will free: that one is waited for, as before
    arena.alloc(cap // 2 + 64, timeout_s=0.1)
    span = arena.publish()
    threading.Timer(0.2, arena.free_to, (span,)).start()
    t0 = time.monotonic()
    arena.alloc(cap // 2 + 64, timeout_s=5.0)
    assert 0.15 < time.monotonic() - t0 < 5.0


def test_arena_counters_are_never_seen_half_written(arena):
    """Issue 16: another process allocates, publishes and frees as fast as it can while this one
    reads the head and the tail, as the two sides do. Each counter only grows and the head is
    never behind the tail, in every read: struct.pack_into zeroed the word before writing it, so
    a reader now and then saw a head (or tail) of 0 -- a message's span end then looked beyond
    the published head, and the message was refused."""
    import mstar_rt.placement.arena as arena_module

    script = textwrap.dedent(f"""
        import importlib.util, time
        spec = importlib.util.spec_from_file_location("arena", {arena_module.__file__!r})
        arena_module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(arena_module)
        arena = arena_module.ShmArena.attach({arena.name!r})
        print("go", flush=True)
        end = time.monotonic() + 1.0
        while time.monotonic() < end:
            for _ in range(500):
                arena.alloc(arena.capacity // 3 + 8, timeout_s=1.0)
                arena.free_to(arena.publish())
        arena.close()
    """)
    writer = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert writer.stdout.readline() == "go\n"
        reads = backwards = 0
        last_tail = last_head = 0
        while writer.poll() is None:
            for _ in range(1000):
                tail = arena.tail  # first: a head read later is never behind it
                head = arena.published_head
                reads += 1
                if tail < last_tail or head < last_head or head < tail:
                    backwards += 1
                last_tail, last_head = tail, head
    finally:
        writer.kill()
        writer.wait()
    assert last_head > 0 and reads > 1000
    assert backwards == 0, f"{backwards} of {reads} reads saw a counter go back"


def test_leftovers_of_dead_parents_are_swept_and_live_ones_kept(tmp_path):
    gone = subprocess.Popen(["true"])
    gone.wait()  # a pid that no longer runs
    stale = ShmArena.create(f"mstar_{gone.pid}_abc123_r1_g0_p2w", 4096)
    mine = ShmArena.create(f"mstar_{os.getpid()}_abc123_r1_g0_p2w", 4096)
    try:
        stale_dir = tmp_path / f"mstar-placement-{gone.pid}-x1"
        live_dir = tmp_path / f"mstar-placement-{os.getpid()}-x2"
        for d in (stale_dir, live_dir):
            d.mkdir()
            (d / "parent.sock").write_text("")
        removed = sweep_stale(str(tmp_path))
        assert f"/dev/shm/{stale.name}" in removed and str(stale_dir) in removed
        assert not os.path.exists(f"/dev/shm/{stale.name}") and not stale_dir.exists()
        assert os.path.exists(f"/dev/shm/{mine.name}") and live_dir.exists()
    finally:
        for a in (stale, mine):
            a.close()
            a.unlink()


def test_a_request_opens_with_the_first_batch_that_leaves_not_the_first_recorded():
    # Two engine threads record items of one request, then send in the other order: whichever
    # batch leaves first carries the request's inputs and state, once (was: the first
    # recorded, so the worker could get the other batch first and fail it, "holds no state").
    from mstar_rt.placement.ledger import ItemLedger

    ledger = ItemLedger()
    ledger.record(1, 7, "a", [])
    ledger.record(2, 7, "b", [])
    assert ledger.unopened([7, 7]) == [7]  # the batch of item 2, leaving first
    ledger.sent_open([7])
    assert ledger.unopened([7]) == []      # item 1's, after it
    ledger.forget(7)
    ledger.sent_open([7])                  # a batch that left as the request ended
    assert 7 not in ledger.opened and ledger.unopened([7]) == [7]


def test_node_groups_that_cannot_work_are_refused_with_the_fix():
    model = pm.tiny_llama(num_pages=8)
    with pytest.raises(ValueError, match="share engine 'lm'.*one node group"):
        make_plan(model, [NodeGroup(["prefill"], rank=1)])
    with pytest.raises(ValueError, match="does not have"):
        make_plan(model, [NodeGroup(["prefil"], rank=1)])
    walk = pm.pipeline()
    with pytest.raises(ValueError, match="two node groups"):
        make_plan(walk, [NodeGroup(["encoder"], rank=1), NodeGroup(["encoder"], rank=2)])
    with pytest.raises(ValueError, match="rank 0 is the parent"):
        NodeGroup(["encoder"], rank=0)
    with pytest.raises(ValueError, match="only a KVCacheEngine's settings"):
        PlacedRuntime("placement_models:tiny_llama", LM_GROUPS, engines={"lm": StatelessEngine()})
    with pytest.raises(ValueError, match="JSON"):
        ModelSpec("placement_models:pipeline", {"seed": object()})
    plan = make_plan(walk, [NodeGroup(["encoder"], rank=1), NodeGroup(["head"], rank=3,
                                                                       process=False)])
    assert plan.parent_engines == {"encoder": "default@rank1", "embed": "default",
                                   "backbone": "default", "collect": "default",
                                   "head": "default@rank3"}


def test_placement_config_is_read_from_yaml_and_checked(tmp_path):
    path = tmp_path / "placement.yaml"
    path.write_text(textwrap.dedent("""
        model:
          factory: placement_models:tiny_llama
          kwargs: {num_pages: 64, page_size: 8}
        node_groups:
          - {nodes: [prefill, decode], rank: 1, device: cpu}
        restart: auto
        shm_bytes: 1048576
    """))
    kw = read_config(str(path))
    assert kw["model"] == ModelSpec("placement_models:tiny_llama",
                                    {"num_pages": 64, "page_size": 8})
    assert kw["node_groups"] == [NodeGroup(["prefill", "decode"], rank=1)]
    assert (kw["restart"], kw["shm_bytes"]) == ("auto", 1 << 20)
    for bad, words in [({"model": "m:f", "node_groups": [], "workers": 2}, "unknown keys"),
                       ({"node_groups": []}, "factory"),
                       ({"model": "m:f", "node_groups": [{"nodes": ["a"], "rank": 1, "gpu": 0}]},
                        "unknown node group keys"),
                       ({"model": {"factory": "m:f", "kw": {}}}, "unknown model keys")]:
        with pytest.raises(ValueError, match=words):
            read_config(bad)


def test_the_public_surface_is_small():
    import mstar_rt.placement as placement

    assert set(placement.__all__) == {"CodecError", "ModelSpec", "NodeGroup", "PlacedRuntime",
                                      "WorkerStartError", "read_config", "register_type"}
    assert issubclass(PlacedRuntime, mstar_rt.Runtime)

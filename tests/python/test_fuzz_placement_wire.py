"""The placement worker protocol fuzzed from a stranger (issue 16, item 2): random ZeroMQ
frames -- headers, msgpack payloads, forged arena references, broken and deeply nested structures
(wire_frames.py) -- sent to a live worker of a PlacedRuntime by a peer that is not its parent.

What each case must get, as protocol.py says: exactly one 'error' reply whose text says what was
wrong; a stranger claiming the parent's identity is not heard at all. Afterwards the worker still
serves real work bit-equal to one process, and nothing leaks (arena bytes, request state, queued
items, shared-memory segments). The parent's side: test_fuzz_placement_wire_parent.py. The suite
prints how many cases it tried."""

from __future__ import annotations

import time

import msgpack
import pytest
import zmq
from hypothesis import given, settings

from mstar_rt import Runtime
from mstar_rt.placement import NodeGroup, PlacedRuntime
from mstar_rt.placement.protocol import PARENT_ID, TO_WORKER_HEADER

import placement_models as pm
from placement_support import our_segments, pipeline_inputs, same
from walk_models import settled
from wire_frames import SETTINGS, STRANGER_CASES, T, Ids, clear, frames


# ---- a stranger, through a PlacedRuntime's worker ------------------------------------------------

@pytest.fixture(scope="module")
def reference():
    with Runtime(pm.pipeline()) as rt:
        return [rt.submit(inp).result(T) for inp in pipeline_inputs(3)]


@pytest.fixture(scope="module")
def placed():
    rt = PlacedRuntime("placement_models:pipeline", [NodeGroup(["encoder"], rank=1)],
                       progress=False)
    yield rt
    rt.close()
    assert our_segments(rt) == []


def test_random_frames_from_a_stranger_each_get_one_clear_error_and_the_worker_serves_on(
        placed, reference):
    assert same(placed.submit(pipeline_inputs(1)[0]).result(T), reference[0])  # connected now
    worker = placed.workers[1]
    gen, pid = worker["gen"], worker["pid"]
    before = placed.worker_stats(1)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(worker["endpoint"])
    ids, tried, kinds = Ids(1 << 40), [], {}

    @settings(max_examples=STRANGER_CASES, **SETTINGS)
    @given(case=frames(gen, ids, [0, 1, 2, 3]))
    def one(case):
        tried.append(case)
        sock.send_multipart(case)
        assert sock.poll(T * 1000), f"no reply within {T} s to {case!r}"
        reply = msgpack.unpackb(sock.recv())
        assert reply["kind"] == "error" and reply["rank"] == 1 and reply["gen"] == gen, reply
        assert clear(reply["message"]), f"unclear reply {reply['message']!r} to {case!r}"
        assert not sock.poll(0), "two replies to one message"
        reason = reply["message"].split(": ", 1)[-1][:40]
        kinds[reason] = kinds.get(reason, 0) + 1

    t0 = time.monotonic()
    try:
        one()
    finally:
        sock.close(0)
        ctx.term()
    took = time.monotonic() - t0
    print(f"\nplacement wire, stranger: {len(tried)} cases in {took:.1f} s, "
          f"{len(kinds)} distinct refusals")
    assert len(tried) >= STRANGER_CASES * 0.9
    after = placed.worker_stats(1)
    assert after["bad_messages"] == before["bad_messages"] + len(tried)
    assert (after["pid"], placed.workers[1]["state"]) == (pid, "up")
    assert placed.workers[1]["error_replies"] == worker["error_replies"]  # none reached the parent
    for inp, want in zip(pipeline_inputs(3), reference):
        assert same(placed.submit(inp).result(T), want)
    assert settled(placed)["requests"] == 0
    stats = placed.worker_stats(1)
    assert (stats["live_requests"], stats["queued_items"], stats["p2w_bytes_in_use"],
            stats["w2p_bytes_in_use"]) == (0, 0, 0, 0)
    assert our_segments(placed) == sorted(worker["shm"])


def test_a_stranger_claiming_the_parents_identity_is_answered_as_a_stranger(placed, reference):
    """The parent talks to a local worker through its mailbox (placement/mailbox.py), never its
    socket: whoever sends there as the parent is a peer, refused what only the parent may ask."""
    worker = placed.workers[1]
    before = placed.worker_stats(1)["messages"]
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.ROUTING_ID, PARENT_ID)
    sock.connect(worker["endpoint"])
    replies = []
    try:
        for msg in ({"v": 1, "kind": "stats", "token": 5}, {"v": 1, "kind": "shutdown"}):
            sock.send_multipart([TO_WORKER_HEADER.pack(worker["gen"], 0), msgpack.packb(msg)])
            assert sock.poll(int(T * 1000))
            replies.append(msgpack.unpackb(sock.recv()))
    finally:
        sock.close(0)
        ctx.term()
    for reply, kind in zip(replies, ("stats", "shutdown")):
        assert reply["kind"] == "error"
        assert f"only the parent process may send '{kind}' messages" in reply["message"]
    assert placed.worker_stats(1)["messages"] == before + 3  # the two, and this stats call
    assert placed.workers[1]["state"] == "up"
    assert same(placed.submit(pipeline_inputs(1)[0]).result(T), reference[0])

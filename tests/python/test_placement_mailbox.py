"""The parent <-> local worker transport (placement/mailbox.py): messages in a shared-memory ring,
woken through a FIFO, watched briefly before sleeping. Order and bytes survive wraps and messages
larger than the ring; a full ring waits for its reader or gives up; a corrupt ring is named, never
read past; and a placed runtime whose worker corrupts its mailbox kills that worker, fails only
its requests, and serves again after a restart."""

from __future__ import annotations

import os
import random
import select
import threading
import time

import pytest

import mstar_rt
from mstar_rt import RequestFailed, _core
from mstar_rt.placement import NodeGroup, PlacedRuntime
from mstar_rt.placement.mailbox import Bell, Mailbox, MailboxError, MailboxSocket, spin_default

import placement_models as pm
from placement_support import idle, pipeline_inputs, same, wait_until

T = 30.0


@pytest.fixture
def box():
    name = f"mstar_{os.getpid()}_{os.urandom(3).hex()}_r1_g0_p2w_mail"
    writer = Mailbox.create(name, 4096)
    reader = Mailbox.attach(name)
    yield writer, reader
    for b in (writer, reader):
        b.close()
    writer.unlink()


def test_messages_cross_in_order_through_wraps_and_sizes_beyond_the_ring(box):
    writer, reader = box
    rng = random.Random(7)
    # up to 3x the ring: such a message crosses in several records while the reader frees room
    sent = [[rng.randbytes(rng.choice([0, 1, 13, 100, 1000, 12_000])) for _ in range(rng.randint(1, 3))]
            for _ in range(300)]
    got: list = []

    def read() -> None:
        while len(got) < len(sent):
            got.extend(reader.take())

    t = threading.Thread(target=read)
    t.start()
    for frames in sent:
        assert writer.put(frames, lambda: True)
    t.join(T)
    assert not t.is_alive() and got == sent
    assert reader.in_use == 0


def test_take_stops_at_its_limit_and_leaves_the_rest(box):
    writer, reader = box
    for i in range(5):
        writer.put([bytes([i])], lambda: True)
    assert reader.take(2) == [[b"\x00"], [b"\x01"]]
    assert reader.take() == [[b"\x02"], [b"\x03"], [b"\x04"]]


def test_a_full_ring_gives_up_at_once_on_first_try_and_later_when_its_reader_dies(box):
    writer, reader = box
    while writer.put([b"x"], lambda: False, first_try=True):  # the smallest record
        pass
    used = reader.in_use
    assert used > writer.capacity - 32
    assert not writer.put([b"y"], lambda: False, first_try=True)
    assert reader.in_use == used  # nothing of the refused message was written
    calls = []
    t0 = time.monotonic()
    assert not writer.put([b"y"], lambda: calls.append(1) or len(calls) < 5)
    assert len(calls) == 5 and time.monotonic() - t0 < 5.0
    reader.take()
    assert writer.put([b"z"], lambda: False, first_try=True)
    assert reader.take() == [[b"z"]]


def test_a_corrupt_record_is_named_and_never_read_past(box):
    writer, reader = box
    writer.put([b"fine"], lambda: True)
    assert reader.take() == [[b"fine"]]
    writer.put([b"soon broken"], lambda: True)
    # the record's flags: a bit no writer sets
    head = reader.watch()[1]
    writer.mm[192 + head % writer.capacity + 4] = 0x80
    with pytest.raises(MailboxError, match=f"mailbox '{writer.name}' holds a bad record"):
        reader.take()


def test_a_foreign_segment_is_not_taken_for_a_mailbox(tmp_path):
    name = f"mstar_{os.getpid()}_{os.urandom(3).hex()}_r1_g0_w2p_mail"
    with open(f"/dev/shm/{name}", "wb") as f:
        f.write(b"\x01" * 8192)
    try:
        with pytest.raises(MailboxError, match="not an mstar_rt mailbox"):
            Mailbox.attach(name)
    finally:
        os.unlink(f"/dev/shm/{name}")


def test_the_bell_wakes_a_poll_and_drains(tmp_path):
    bell = Bell(str(tmp_path / "b.bell"), create=True)
    ringer = Bell(bell.path)
    poller = select.poll()
    poller.register(bell.fileno(), select.POLLIN)
    try:
        assert poller.poll(0) == []
        for _ in range(70_000):  # past the FIFO's capacity: a full bell is still rung
            ringer.ring()
        assert poller.poll(0)
        bell.drain()
        assert poller.poll(0) == []
    finally:
        ringer.close()
        bell.close(unlink=True)
    assert not os.path.exists(bell.path)


def test_a_sent_batch_wakes_a_sleeping_hub_to_watch_for_its_reply(tmp_path):
    """Hub.expect (PlacedRuntime.submit calls it after sending): a hub asleep in poll is rung,
    so that it watches the mailboxes while the worker runs; one awake, or one that never
    watches (spin_us 0), is left alone: a ring would cost the sender a wake-up for nothing."""
    import zmq

    from mstar_rt.placement.hub import Hub

    zctx = zmq.Context()
    hubs = [Hub(zctx, f"ipc://{tmp_path}/{i}.sock", bell_path=str(tmp_path / f"{i}.bell"),
                spin_us=spin) for i, spin in enumerate((200.0, 0.0))]
    try:
        watching, never = hubs
        poller = select.poll()
        poller.register(watching.bell.fileno(), select.POLLIN)
        watching.expect()  # awake: nothing
        assert poller.poll(0) == []
        watching.sleeping = True
        watching.expect()
        assert poller.poll(0)
        watching.bell.drain()
        never.sleeping = True
        never.expect()
        assert select.select([never.bell.fileno()], [], [], 0)[0] == []
    finally:
        for hub in hubs:
            hub.close()
        zctx.destroy(0)


def test_a_watcher_sees_mail_without_sleeping_and_gives_up_after_its_budget(box):
    writer, reader = box
    address, seen = reader.watch()
    t0 = time.monotonic()
    assert _core.spin_until_changed([address], [seen], 0.002) == -1
    assert time.monotonic() - t0 >= 0.002
    timer = threading.Timer(0.01, lambda: writer.put([b"hi"], lambda: True))
    timer.start()
    assert _core.spin_until_changed([address], [seen], 1.0) == 0
    timer.join()
    assert reader.take() == [[b"hi"]]
    with pytest.raises(ValueError, match="one expected value per address"):
        _core.spin_until_changed([address], [], 0.001)
    with pytest.raises(ValueError, match="8-byte aligned"):
        _core.spin_until_changed([address + 1], [0], 0.001)


def test_the_socket_face_sends_and_rings(box, tmp_path):
    import zmq

    writer, reader = box
    bell = Bell(str(tmp_path / "w.bell"), create=True)
    sock = MailboxSocket(writer, Bell(bell.path), lambda: True)
    poller = select.poll()
    poller.register(bell.fileno(), select.POLLIN)
    sock.send_multipart([b"head", b"body"])
    assert poller.poll(1000) and reader.take() == [[b"head", b"body"]]
    while True:  # fill it: NOBLOCK then refuses, as ZeroMQ does
        try:
            sock.send_multipart([b"x" * 900], flags=zmq.NOBLOCK)
        except zmq.Again:
            break
    sock.bell.close()
    bell.close(unlink=True)


def test_a_worker_that_corrupts_its_mailbox_is_killed_and_only_its_requests_fail():
    with PlacedRuntime("placement_models:pipeline", [NodeGroup(["encoder"], rank=1)],
                       progress=False, restart="manual") as rt:
        assert rt.submit(pipeline_inputs(1)[0]).result(T)
        name = next(n for n in rt.workers[1]["shm"] if n.endswith("_w2p_mail"))
        slow = rt.submit({**pipeline_inputs(1)[0], "delay": 2.0})
        assert wait_until(lambda: rt.workers[1]["inflight_items"] == 1, timeout=T)
        forger = Mailbox.attach(name)
        bell = Bell(os.path.join(os.path.dirname(rt.workers[1]["endpoint"][6:]), "parent.bell"))
        try:  # a record with a flag no writer sets, published as the worker would (the ring's
            # head word is at byte 64, its data from byte 192: placement/mailbox.py)
            head = int.from_bytes(forger.mm[64:72], "little")
            off = 192 + head % forger.capacity
            forger.mm[off:off + 8] = (8).to_bytes(4, "little") + (0x80).to_bytes(4, "little")
            forger.mm[64:72] = (head + 16).to_bytes(8, "little")
            bell.ring()
        finally:
            forger.close()
            bell.close()
        with pytest.raises(RequestFailed, match="worker process rank 1"):
            slow.result(T)
        assert wait_until(lambda: rt.workers[1]["state"] == "down", timeout=T)
        assert rt.workers[1]["error_replies"] >= 1
        assert not os.path.exists(f"/dev/shm/{name}")  # unlinked at once, not left to a sweep
        rt.restart_worker(1)
        assert rt.submit(pipeline_inputs(1)[0]).result(T)


def test_watching_is_on_by_default_only_with_a_cpu_per_process(monkeypatch):
    from mstar_rt.placement import mailbox

    monkeypatch.setattr(mailbox.os, "sched_getaffinity", lambda pid: {0, 1})
    assert spin_default(1) == mailbox.SPIN_US  # the parent and one worker: a CPU each
    assert spin_default(2) == 0.0  # three processes on two CPUs: a watcher takes a worker's
    assert spin_default(0) == 0.0  # nothing local to watch
    monkeypatch.setattr(mailbox.os, "sched_getaffinity", lambda pid: set(range(8)))
    assert spin_default(3) == mailbox.SPIN_US
    with pytest.raises(ValueError, match="spin_us=-1"):
        PlacedRuntime("placement_models:pipeline", [NodeGroup(["encoder"], rank=1)],
                      progress=False, spin_us=-1)


def test_a_flood_of_requests_crosses_whole_with_the_worker_always_asleep():
    """Hundreds of requests at once (more messages than a worker takes per wake-up) with no
    watching: every one is answered, equal to one process, and nothing is left in flight."""
    cases = pipeline_inputs(300)
    with mstar_rt.Runtime(pm.pipeline()) as local:
        want = [local.submit(c).result(T) for c in cases]
    with PlacedRuntime("placement_models:pipeline", [NodeGroup(["encoder", "backbone"], rank=1)],
                       progress=False, spin_us=0, segments=False) as rt:
        assert rt.spin_us == 0
        handles = [rt.submit(c) for c in cases]
        for h, w in zip(handles, want):
            assert same(h.result(T), w)
        assert idle(rt, 1)["live_requests"] == 0


def test_more_messages_than_one_wake_up_takes_are_all_answered_after_one_ring():
    """The parent writes 150 messages and rings once; the worker, not watching, takes 64 per
    wake-up and rings itself for the rest (else they would wait for the parent's next message,
    which here never comes)."""
    from test_fuzz_placement_wire_parent import FakeParent

    parent = FakeParent(spin_us=0.0)
    try:
        tokens = set(range(10**12, 10**12 + 150))
        for token in sorted(tokens):
            assert parent.outbox.box.put(parent.pack({"v": 1, "kind": "stats", "token": token}),
                                         lambda: True)
        parent.outbox.bell.ring()
        got = set()
        while got != tokens:
            msg = parent.recv(T)
            assert msg is not None, f"{len(tokens - got)} of 150 messages were never answered"
            if msg["kind"] == "stats":
                got.add(msg["token"])
    finally:
        parent.close()

"""The placement worker protocol fuzzed as its parent (issue 16, item 2): a worker this test starts
and feeds itself, through a hand-made parent (the two arenas and the two mailboxes with their
bells, as a local worker's parent has them: placement/mailbox.py), so the arena-carrying path is
fuzzed too: random frames and messages
(wire_frames.py), batches that pass the worker's checks with values a node may or may not
accept, and a parent lying about where its arena bytes end.

What each case must get, as protocol.py says: one 'error' for a malformed message, a 'failed' for
every item of a malformed batch it can name, and one 'done' or 'failed' for every item of a batch
the worker took. Afterwards the worker still serves real work bit-equal to one process, and
nothing leaks (arena bytes, request state, queued items, shared-memory segments). The suite
prints how many cases it tried."""

from __future__ import annotations

import collections
import itertools
import json
import os
import select
import shutil
import tempfile
import time
from dataclasses import dataclass, field

import msgpack
import pytest
import torch
import zmq
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from mstar_rt.placement.arena import ShmArena
from mstar_rt.placement.codec import Decoder, Encoder
from mstar_rt.placement.mailbox import Bell, MailboxSocket, worker_mail
from mstar_rt.placement.process import WorkerProcess
from mstar_rt.placement.protocol import TO_PARENT, TO_PARENT_HEADER, TO_WORKER_HEADER

import placement_models as pm
from placement_support import our_segments, pipeline_inputs, same
from wire_frames import (LEAVES, PARENT_CASES, PIPELINE_NODES, SETTINGS, VALUES, T, Ids, clear,
                         frames, messages)


# ---- as the parent: a worker this test starts and feeds ------------------------------------------

@dataclass
class Replies:
    """What the worker sent back for one case."""

    errors: list = field(default_factory=list)
    reported: collections.Counter = field(default_factory=collections.Counter)  # item -> replies
    other: list = field(default_factory=list)


class FakeParent:
    """The parent's half of the protocol, by hand: the two arenas, the two mailboxes, the
    parent's bell and the PULL socket a failed start reports to; the worker is the real one
    (``python -m mstar_rt.placement.worker``) serving every node of placement_models.pipeline."""

    def __init__(self, shm_bytes: int = 1 << 20, spin_us: float = 50.0) -> None:
        self.tag = f"mstar_{os.getpid()}_{os.urandom(3).hex()}"
        self.workdir = tempfile.mkdtemp(prefix=f"mstar-placement-{os.getpid()}-")
        self.p2w = ShmArena.create(f"{self.tag}_r1_g0_p2w", shm_bytes)
        self.w2p = ShmArena.create(f"{self.tag}_r1_g0_w2p", shm_bytes)
        self.encoder, self.decoder = Encoder(self.p2w, timeout_s=5.0), Decoder(self.w2p)
        self.ctx = zmq.Context()
        self.pull = self.ctx.socket(zmq.PULL)
        self.pull.setsockopt(zmq.LINGER, 0)
        self.pull.bind(f"ipc://{self.workdir}/parent.sock")
        self.endpoint = f"ipc://{self.workdir}/rank1-g0.sock"
        to_worker, self.inbox, worker_bell = worker_mail(f"{self.tag}_r1_g0",
                                                         f"{self.workdir}/rank1-g0.bell")
        self.bell = Bell(f"{self.workdir}/parent.bell", create=True)
        self.outbox = MailboxSocket(to_worker, worker_bell,
                                    lambda: self.worker.failure() is None, owner=True)
        self.mail: collections.deque = collections.deque()
        cfg = dict(rank=1, gen=0, parent_pid=os.getpid(), factory="placement_models:pipeline",
                   kwargs={}, nodes=PIPELINE_NODES, device="cpu", engines={},
                   endpoint=self.endpoint, parent=f"ipc://{self.workdir}/parent.sock",
                   p2w=self.p2w.name, w2p=self.w2p.name, spin_us=spin_us,
                   mail=dict(p2w=to_worker.name, w2p=self.inbox.name, bell=worker_bell.path,
                             parent_bell=self.bell.path))
        path = os.path.join(self.workdir, "rank1-g0.json")
        with open(path, "w") as f:
            json.dump(cfg, f)
        self.worker = WorkerProcess(1, path, "cpu", progress=False)
        self.tokens = itertools.count(10**15)
        ready = self.recv(60.0)
        assert ready is not None and ready["kind"] == "ready", (ready, self.worker.last_output())

    def recv(self, timeout: float) -> dict | None:
        """The worker's next message but heartbeats (nobody watches this worker's pulse)."""
        deadline = time.monotonic() + timeout
        poller = select.poll()
        poller.register(self.bell.fileno(), select.POLLIN)
        while self.mail or poller.poll(max(0.0, deadline - time.monotonic()) * 1000):
            if not self.mail:
                self.bell.drain()
                self.mail.extend(self.inbox.take())
                if not self.mail:
                    continue
            head, payload = self.mail.popleft()
            rank, gen, span = TO_PARENT_HEADER.unpack(head)
            msg = self.decoder.unpack(payload)
            self.w2p.free_to(span)
            assert (rank, gen, msg["rank"], msg["gen"]) == (1, 0, 1, 0), msg
            assert msg["kind"] in TO_PARENT, msg
            if msg["kind"] != "heartbeat":
                return msg
        return None

    def pack(self, message: dict, span: int | None = None) -> list[bytes]:
        """The frames of ``message``, its tensors put in the arena; ``span`` overrides the
        header's span end (a lying parent)."""
        mark = self.p2w.mark()
        try:
            payload = self.encoder.pack(message)
        except Exception:
            self.p2w.rollback(mark)
            raise
        end = self.p2w.publish()
        return [TO_WORKER_HEADER.pack(0, end if span is None else span), payload]

    def send(self, message: dict) -> None:
        self.send_raw(self.pack(message))

    def send_raw(self, frames: list[bytes]) -> None:
        self.outbox.send_multipart(frames)

    def sync(self, replies: Replies, timeout: float = T) -> dict:
        """Sends a stats probe and collects every reply before its answer; returns the stats."""
        token = next(self.tokens)
        self.send({"v": 1, "kind": "stats", "token": token})
        deadline = time.monotonic() + timeout
        while True:
            msg = self.recv(max(0.0, deadline - time.monotonic()))
            assert msg is not None, f"the worker did not answer a stats probe in {timeout} s"
            if msg["kind"] == "stats" and msg["token"] == token:
                return msg["stats"]
            self.note(msg, replies)

    def note(self, msg: dict, replies: Replies) -> None:
        if msg["kind"] == "error":
            replies.errors.append(msg["message"])
        elif msg["kind"] in ("done", "failed"):
            assert isinstance(msg["items"], list) and msg["items"], msg
            if msg["kind"] == "done":
                assert len(msg["outputs"]) == len(msg["items"]), msg
            else:  # a node's own error reads "ValueError: ...", as in one process
                assert isinstance(msg["message"], str) and msg["message"], msg
            replies.reported.update(msg["items"])
        else:
            replies.other.append(msg)

    def wait_reported(self, want: set, replies: Replies, timeout: float = T) -> None:
        deadline = time.monotonic() + timeout
        while not want <= set(replies.reported):
            msg = self.recv(max(0.0, deadline - time.monotonic()))
            assert msg is not None, (f"items {sorted(want - set(replies.reported))} were never "
                                     f"reported; got {replies}")
            self.note(msg, replies)

    def close(self) -> None:
        try:
            self.send({"v": 1, "kind": "shutdown"})
            self.worker.stop(graceful=True)
        finally:
            self.outbox.close()
            self.bell.close(unlink=True)
            self.pull.close(0)
            self.ctx.term()
            for arena in (self.p2w, self.w2p, self.inbox):
                arena.close()
                arena.unlink()
            shutil.rmtree(self.workdir, ignore_errors=True)


@pytest.fixture(scope="module")
def fake_parent():
    parent = FakeParent()
    yield parent
    parent.close()
    assert parent.worker.proc.returncode == 0, parent.worker.last_output()
    assert not [n for n in our_segments() if n.startswith(parent.tag)]


def _peek(frames: list[bytes]) -> object:
    """The message a frame list carries as the worker reads its structure (None if unreadable)."""
    if len(frames) != 2 or len(frames[0]) != TO_WORKER_HEADER.size:
        return None
    try:
        return msgpack.unpackb(frames[1], raw=False, strict_map_key=False,
                               ext_hook=lambda code, data: None)
    except Exception:
        return None


def _named_items(frames: list[bytes]) -> collections.Counter:
    """Item ids a parent expects back for what it sent: a batch of its generation names every
    item with an integer id, and each comes back once as done or failed (taken or refused)."""
    msg = _peek(frames)
    if not (isinstance(msg, dict) and type(msg.get("v")) is int and msg["v"] == 1
            and msg.get("kind") == "batch" and isinstance(msg.get("items"), list)
            and TO_WORKER_HEADER.unpack(frames[0])[0] == 0):
        return collections.Counter()
    return collections.Counter(it[0] for it in msg["items"]
                               if isinstance(it, list) and it and type(it[0]) is int)


NODE_INPUTS = {0: ["x", "delay"], 1: ["x"], 2: ["feat", "h", "steps", "pause"], 3: ["tok"],
               4: ["h"]}  # placement_models.pipeline's nodes, by id
TENSOR = st.tuples(st.integers(0, 3), st.sampled_from([pm.DIM_IN, pm.DIM, 3])).map(
    lambda t: torch.arange(t[0] * t[1], dtype=torch.float32).reshape(t) / 10)
INPUT_VALUES = {"x": TENSOR, "feat": TENSOR, "h": TENSOR, "delay": st.sampled_from([0.0, 0, None]),
                "steps": st.integers(0, 3), "pause": st.sampled_from([0.0, 0]),
                "tok": st.lists(st.integers(0, 9), max_size=4)}
CHUNK = st.lists(st.integers(0, 5), min_size=3, max_size=3).map(sorted).flatmap(
    lambda c: st.booleans().map(lambda last: (*c, last)))


@st.composite
def batches(draw, ids: Ids, rids: list[int]) -> dict:
    """Batches that pass the worker's checks, with values a node may or may not accept: they
    are run, and each item must come back once, done or failed."""
    node = draw(st.integers(0, 4))
    items = []
    for _ in range(draw(st.integers(1, 4))):
        names = draw(st.lists(st.sampled_from(NODE_INPUTS[node]), unique=True))
        inputs = {n: draw(st.one_of(INPUT_VALUES[n], VALUES) if draw(st.integers(0, 4)) == 0
                          else INPUT_VALUES[n]) for n in names}
        chunk = draw(CHUNK) if node == 3 and draw(st.integers(0, 3)) else None
        items.append([next(ids), draw(st.sampled_from(rids)), draw(st.integers(0, 3)), inputs,
                      chunk])
    opens = {rid: {"inputs": None, "state": draw(st.dictionaries(st.text(max_size=3), LEAVES,
                                                                 max_size=2)),
                   "order": [draw(st.integers(0, 2**62)), draw(st.integers(-5, 5))]}
             for rid in draw(st.lists(st.sampled_from(rids), unique=True, min_size=1))}
    return {"v": 1, "kind": "batch", "node": node, "walk": draw(st.integers(0, 1)),
            "items": items, "open": opens}


@st.composite
def parent_cases(draw, ids: Ids, rid_base: itertools.count) -> tuple:
    """(frames or None, message or None, span override or None, request ids it may open)."""
    base = next(rid_base) * 4
    rids = [base, base + 1, base + 2, 3]  # fresh ones, and one that many cases share
    choice = draw(st.integers(0, 9))
    if choice == 0:
        return draw(frames(0, ids, rids)), None, None, rids
    msg = draw(batches(ids, rids) if choice >= 6 else messages(ids, rids))
    span = None
    if choice == 1:  # the parent lies about where this message's arena bytes end
        span = draw(st.one_of(st.integers(0, 2**64 - 1), st.integers(-4096, 4096)))
    return None, msg, span, rids


def test_random_messages_from_the_parent_get_the_replies_the_protocol_promises(fake_parent):
    parent = fake_parent
    ids, rid_base, tried, outcomes = Ids(1 << 40), itertools.count(1000), [], {}
    parent.sync(Replies())

    @settings(max_examples=PARENT_CASES, **SETTINGS)
    @given(case=parent_cases(ids, rid_base))
    def one(case):
        raw, msg, span, rids = case
        if raw is None:
            end = None
            if span is not None:
                end = min(max(parent.p2w.tail + span if span <= 4096 else span, 0), 2**64 - 1)
            try:
                raw = parent.pack(msg, end)
            except Exception:  # not packable (a tensor the arena cannot take...): garbage then
                raw = [TO_WORKER_HEADER.pack(0, parent.p2w.mark()), b"\xc1"]
        peeked = _peek(raw)
        assume(not (isinstance(peeked, dict) and peeked.get("kind") == "shutdown"))
        tried.append(case)
        parent.send_raw(raw)
        replies = Replies()
        stats = parent.sync(replies)
        assert len(replies.errors) <= 1, replies.errors
        assert all(clear(e) for e in replies.errors), replies.errors
        expected = _named_items(raw)
        parent.wait_reported(set(expected), replies)
        assert replies.reported == expected, (replies.reported, expected, replies.errors)
        assert stats["p2w_bytes_in_use"] == 0  # the probe's span freed everything sent before
        outcome = ("error" if replies.errors else "taken") + (" batch" if expected else "")
        outcomes[outcome] = outcomes.get(outcome, 0) + 1
        # the parent ends the requests it opened, as it does when they finish
        parent.send({"v": 1, "kind": "release", "requests": rids})

    t0 = time.monotonic()
    one()
    took = time.monotonic() - t0
    print(f"\nplacement wire, parent: {len(tried)} cases in {took:.1f} s; outcomes {outcomes}")
    assert len(tried) >= PARENT_CASES * 0.9
    replies = Replies()
    stats = parent.sync(replies)
    assert not replies.errors and not replies.reported and not replies.other, replies
    assert (stats["live_requests"], stats["queued_items"], stats["p2w_bytes_in_use"],
            stats["w2p_bytes_in_use"], stats["kv_pages_in_use"]) == (0, 0, 0, 0, 0), stats
    assert parent.worker.proc.poll() is None
    assert stats["bad_messages"] == sum(n for k, n in outcomes.items() if k.startswith("error"))

    # and it still serves: the encoder and a stream window, bit-equal to one process
    model = pm.pipeline()
    x = pipeline_inputs(1)[0]["x"]
    item, chunk_item = next(ids), next(ids)
    parent.send({"v": 1, "kind": "batch", "node": 0, "walk": 0, "open": {7: {"inputs": None,
                                                                            "state": {}}},
                 "items": [[item, 7, 0, {"x": x, "delay": 0.0}, None]]})
    parent.send({"v": 1, "kind": "batch", "node": 3, "walk": 0, "open": {},
                 "items": [[chunk_item, 7, 0, {"tok": [4, 5, 6]}, (0, 1, 3, True)]]})
    got: dict = {}
    deadline = time.monotonic() + T
    while len(got) < 2:
        msg = parent.recv(max(0.0, deadline - time.monotonic()))
        assert msg is not None and msg["kind"] == "done", msg
        got[msg["items"][0]] = msg["outputs"][0]
    want = model.submodules["encoder"].forward([{"x": x, "delay": 0.0}])[0]
    assert same(got[item], dict(want))
    assert got[chunk_item] == {"window": (0, 1, 3, True, [4, 5, 6])}
    parent.send({"v": 1, "kind": "release", "requests": [7]})
    stats = parent.sync(Replies())
    assert (stats["live_requests"], stats["p2w_bytes_in_use"]) == (0, 0)

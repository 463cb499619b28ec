"""Walk-level placement of a KV engine's nodes (prefill on one worker, decode on another): when a
request's walk changes from one placed on worker A to one on worker B, its K/V and its LM
node's decode state move from A to B (docs/disaggregation.md, *walk-level placement*).

The parent (:class:`ParentMoves`) sees the walk end before the next walk starts. It queues
``kv_recv`` for B and ``kv_send`` for A (small control messages on the usual links, sent by a
thread of its own) and marks the request's state, then starts the next walk at once: the hub's
thread never waits for a worker. The bytes go straight from A to B over a
:class:`~mstar_rt.distributed.kv_transfer.KVChannel` (gloo send/recv on a two-rank process
group per (sender, receiver) pair and generation, rendezvous on a ``TCPStore`` the parent
opens), not through the parent. B (:class:`WorkerMoves`) holds the next walk's items of a
request whose K/V have not arrived yet, and puts them on its queue when they do; the first one
imports them through ``KVWork.kv_import`` (:meth:`LMNode.resume`).

Failures stay per request: a failed export or a refused import fails that request; a broken
channel (a peer died, a timeout) fails the requests expected on it. A request that ends while
its K/V travel leaves no pages: A freed them at export, B drops a handoff that arrives for a
request it no longer knows.
"""

from __future__ import annotations

import queue
import threading
import time
import traceback
from typing import Any, Callable, Mapping, Optional

from mstar_rt.model import Model, RequestContext, node_engines, node_submodules
from mstar_rt.placement.protocol import ProtocolError, field
from mstar_rt.placement.segments import section_nodes

#: Set in a moving request's state (mirrored to the receiving worker with its first items), so
#: items that overtake the ``kv_recv`` notice are held too.
MOVING = "placement_kv_moving"
HANDOFF_API = ("handoff_state", "resume_state", "handoffs")
#: In the message of every request failed by a broken channel: the parent then meets the two
#: workers on a fresh one (a broken gloo pair cannot be reused).
BROKEN = "the K/V channel broke"


def plan_moves(model: Model, node_rank: Mapping[str, int], workers: set[int],
               groups: Any = ()) -> dict[str, dict[str, int]]:
    """For each KV engine whose nodes sit on several ranks: walk -> the worker rank that runs
    the engine's nodes in that walk. ValueError (naming the node groups) when such a split
    cannot move K/V: a side in the parent, a walk using two ranks, a node without handoff."""
    engine_of, subs = node_engines(model), node_submodules(model)
    ranks: dict[str, set[int]] = {}
    for n, e in engine_of.items():
        ranks.setdefault(e, set()).add(node_rank[n])
    where = "; node groups: " + ", ".join(
        f"{list(g.nodes)} on rank {g.rank}" for g in groups) if groups else ""
    moves: dict[str, dict[str, int]] = {}
    for engine, used in ranks.items():
        if engine not in model.engine_specs or len(used) < 2:
            continue
        members = [n for n, e in engine_of.items() if e == engine]
        from mstar_rt.engines.kv_engine import KVCacheEngine

        if not isinstance(model.engine_specs[engine], KVCacheEngine):
            raise ValueError(f"nodes {members} share engine '{engine}' (its state lives in one "
                             f"process) but are placed on ranks {sorted(used)}; only a "
                             f"KVCacheEngine's requests can move between ranks{where}")
        if not used <= workers:
            raise ValueError(f"nodes {members} share engine '{engine}' but are placed on ranks "
                             f"{sorted(used)}; a request's K/V move between walks only from a "
                             "worker process to another (rank 0 / process=False is the "
                             f"parent): give each walk a worker, or put them in one node "
                             f"group{where}")
        split = [(g, tp_of(g)) for g in groups if tp_of(g) > 1 and set(g.nodes) & set(members)]
        if split:
            g, tp = split[0]
            raise ValueError(f"nodes {members} share KV engine '{engine}' on ranks "
                             f"{sorted(used)}, so a request's K/V move between walks, but "
                             f"the group {list(g.nodes)} on rank {g.rank} has tp_size {tp}: a "
                             f"tensor-parallel cache is split over ranks and cannot be "
                             f"exported; give those groups tp_size 1{where}")
        lacking = sorted({type(subs[n]).__name__ for n in members
                          if not all(hasattr(subs[n], a) for a in HANDOFF_API)})
        if lacking:
            raise ValueError(f"nodes {members} share engine '{engine}' but are placed on ranks "
                             f"{sorted(used)}, so a request's K/V must move between walks, but "
                             f"{lacking} has no KV handoff ({', '.join(HANDOFF_API)}; see "
                             f"LMNode); put them in one node group{where}")
        per_walk: dict[str, int] = {}
        for walk, root in model.walks.items():
            # a Part's sub-walks count: their change is not a walk change
            walk_ranks = {node_rank[n] for n in section_nodes(root, True)
                          if engine_of.get(n) == engine}
            if len(walk_ranks) > 1:
                raise ValueError(f"walk '{walk}' runs nodes of KV engine '{engine}' on ranks "
                                 f"{sorted(walk_ranks)}; K/V move only between walks (not "
                                 f"between a Part's sub-walks), so place each walk's nodes of "
                                 f"one engine on one rank{where}")
            if walk_ranks:
                per_walk[walk] = walk_ranks.pop()
        moves[engine] = per_walk
    return moves


def tp_of(group: Any) -> int:
    """A node group's tensor-parallel size, given as its field or in its model_kwargs."""
    kwargs = getattr(group, "model_kwargs", None) or {}
    return max(int(getattr(group, "tp_size", 1) or 1), int(kwargs.get("tp_size", 1) or 1))


class ParentMoves:
    """The parent's half: decides at each walk change whether a request's K/V move and tells
    both workers. ``links``: rank -> WorkerLink (its ``gen``, ``state``, ``post`` and
    ``moved_out``); ``fail(request, message)`` fails a request whose K/V cannot move."""

    def __init__(self, moves: Mapping[str, Mapping[str, int]], links: Mapping[int, Any],
                 timeout_s: float, host: str = "127.0.0.1",
                 alive: Callable[[int], bool] = lambda rid: True,
                 fail: Callable[[int, str], None] = lambda rid, message: None) -> None:
        from mstar_rt.distributed.group import open_store

        # host: where the workers reach this process's store (a Ray cluster: this node's address)
        self.moves, self.links, self.timeout_s, self.host = moves, links, timeout_s, host
        self.alive = alive  # whether a request has not ended (a cancel races the walk change)
        self.fail = fail
        self.store = open_store(len(links) + 1, timeout_s)
        self.lock = threading.Lock()
        self.receivers: dict[int, set[int]] = {}  # request -> ranks it moved to
        # (request, engine) -> the rank of the last walk that used the engine: a walk between
        # two (one without the engine) must not hide a move
        self.where: dict[tuple[int, str], int] = {}
        self.moved = 0  # requests whose K/V were told to move (tests, stats)
        self.epochs: dict[tuple[int, int], int] = {}  # (sender, receiver) -> channels retired
        self.used: dict[int, tuple[int, int, int]] = {}  # request -> (sender, receiver, epoch)
        # The notices leave from a thread of their own: a post right after a worker started is
        # dropped while its socket connects, a worker restarting is waited for, and the hub's
        # thread must never wait for either.
        self.outbox: "queue.Queue[Any]" = queue.Queue()
        threading.Thread(target=self.send_notices, daemon=True,
                         name="mstar-kv-notices").start()

    def send_notices(self) -> None:
        waiting: list[tuple] = []  # moves whose receiver is restarting: retried, not waited on
        while True:
            try:
                job = self.outbox.get(timeout=0.02 if waiting else None)
            except queue.Empty:
                job = ()
            if job is None:
                return
            try:
                if job and job[0] == "move":
                    waiting.append(job[1:])
                elif job:
                    _, link, msg = job
                    if link.state == "up":  # a generation starting holds nothing to release
                        link.post(msg, None, wait=True)
                waiting = [w for w in waiting if not self.notify(*w)]
            except Exception:  # a closed link: its worker's death failed the requests
                traceback.print_exc()

    def begin(self, request: RequestContext, finished: str, walk: Optional[str]) -> None:
        """Called where ``next_walk`` chose ``walk`` after ``finished`` (before it starts)."""
        if walk is None:
            return
        for engine, ranks in self.moves.items():
            with self.lock:
                src = ranks.get(finished, self.where.get((request.id, engine)))
                dst = ranks.get(walk)
                if dst is not None:
                    self.where[(request.id, engine)] = dst
            if src is None or dst is None or src == dst:
                continue
            request.state[MOVING] = src
            with self.lock:
                self.receivers.setdefault(request.id, set()).add(dst)
                self.moved += 1
            # A cancel on another thread may have ended the request before the line above,
            # its ended() then finding nothing to release: nothing moves, and this cleans up.
            # (Alive here: its ended() comes later and releases the receiver.)
            if not self.alive(request.id):
                self.ended(request.id)
                return
            # its state leaves the sender: the sender's death no longer concerns the request
            # (one before the export is seen below, or by the receiver's channel)
            sender = self.links[src]
            sender.moved_out(request.id)
            self.outbox.put(("move", request.id, engine, src, dst, sender.gen,
                             time.monotonic() + self.timeout_s))

    def notify(self, rid: int, engine: str, src: int, dst: int, src_gen: int,
               deadline: float) -> bool:
        """Tells both workers of a move, on the channel of their current generations; False
        while the receiver is starting (the notices' thread tries again: a notice to a
        generation that is gone would leave the request's next items held on the new one)."""
        a, b = self.links[src], self.links[dst]
        if not self.alive(rid):
            return True
        if a.gen != src_gen or a.state != "up":  # the K/V died with the sender
            self.fail(rid, f"its K/V could not move from worker rank {src} to {dst}: worker "
                           f"rank {src} died at the walk change ({a.state})")
            return True
        gen_b, state_b = b.gen, b.state
        if state_b != "up":
            if state_b in ("down", "closed") or time.monotonic() > deadline:
                why = (f"worker rank {dst} is {state_b}" if state_b != "starting" else
                       f"worker rank {dst} was not up within kv_timeout_s={self.timeout_s:g}")
                self.fail(rid, f"its K/V could not move from worker rank {src} to {dst}: {why}")
                return True
            return False
        with self.lock:
            epoch = self.epochs.get((src, dst), 0)
            self.used[rid] = (src, dst, epoch)
        # a restarted worker, or a channel that broke, meets on a new channel
        key = f"{src}g{src_gen}-{dst}g{gen_b}e{epoch}"
        common = dict(request=rid, engine=engine, key=key, port=self.store.port,
                      host=self.host, timeout_s=self.timeout_s)
        b.post({"kind": "kv_recv", "peer": src, **common}, gen_b, wait=True)
        a.post({"kind": "kv_send", "peer": dst, **common}, src_gen, wait=True)
        return True

    def ended(self, rid: int, error: Optional[BaseException] = None) -> None:
        """The request ended: a receiver that never got its items still frees its handoff; a
        request failed by a broken channel retires that channel."""
        with self.lock:
            ranks = self.receivers.pop(rid, ())
            for engine in self.moves:
                self.where.pop((rid, engine), None)
            used = self.used.pop(rid, None)
            if used is not None and error is not None and BROKEN in str(error):
                src, dst, epoch = used
                if self.epochs.get((src, dst), 0) == epoch:
                    self.epochs[(src, dst)] = epoch + 1
        for rank in ranks:  # after its kv_recv (one queue): never a handoff left behind
            link = self.links[rank]
            # (the generation when it leaves: the kv_recv may have waited for a restart)
            self.outbox.put(("post", link, {"kind": "release", "requests": [rid]}))

    def close(self) -> None:
        self.outbox.put(None)
        self.store = None


class _Entry:
    __slots__ = ("arrived", "error", "held", "since")

    def __init__(self) -> None:
        self.arrived, self.error = False, None
        self.held: list[tuple[int, int, list]] = []  # (node, walk, work items)
        self.since = time.monotonic()


class _Pair:
    """One KVChannel end and the thread that uses it (a channel's constructor waits for the
    peer, and every send or recv may wait: never on the worker's message loop)."""

    def __init__(self, moves: "WorkerMoves", key: str, rank: int, port: int,
                 timeout_s: float, host: str, peer: Any = None) -> None:
        self.moves, self.key, self.rank, self.peer = moves, key, rank, peer
        self.port, self.timeout_s, self.host = port, timeout_s, host
        self.jobs: "queue.Queue[Any]" = queue.Queue()
        self.expected: set[int] = set()  # receiver: requests whose message is still due
        self.broken: Optional[str] = None
        self.thread = threading.Thread(target=self.run, daemon=True, name=f"mstar-kv-{key}")
        self.thread.start()

    def run(self) -> None:
        from mstar_rt.distributed.group import join_store
        from mstar_rt.distributed.kv_transfer import KVChannel

        channel: Any = None
        try:
            store = join_store(self.port, 2, self.timeout_s, self.host)
            channel = KVChannel(store, self.key, self.rank, "cpu", self.timeout_s)
        except Exception as e:
            self.fail_all(f"it could not be set up: {type(e).__name__}: {e}")
            if self.rank == 1:
                return  # (a sender goes on below: each job queued on it fails by name)
        while True:
            job = self.jobs.get()
            if job is None:
                return
            try:
                if self.rank == 0:
                    description, kv = job
                    if self.broken is not None:  # queued as it broke: never sent
                        self.moves.send_failed(description, self.broken, self.peer)
                    elif kv is None:
                        channel.send(description)
                    else:
                        channel.send_kv(description, kv)
                    continue
                description, tensors = channel.recv()
            except Exception as e:  # the channel is broken for good (kv_transfer.py)
                traceback.print_exc()
                self.fail_all(str(e))
                if self.rank == 0:  # a sender goes on: each job queued meanwhile fails too
                    self.moves.send_failed(job[0], self.broken or str(e), self.peer)
                    continue
                return
            try:
                self.moves.received(self, description, tensors)
            except Exception as e:  # one request's bad handoff is its own failure
                traceback.print_exc()
                self.moves.failed(int(description.get("request", -1)),
                                  f"its K/V could not be taken: {type(e).__name__}: {e}")

    def fail_all(self, message: str) -> None:
        with self.moves.lock:  # no notice may add a request this thread will never receive
            self.broken, due = f"{BROKEN} ({self.key}): {message}", list(self.expected)
        for rid in due:
            self.moves.failed(rid, f"its K/V never arrived{self.sender()}: {self.broken}")

    def sender(self) -> str:
        """' from worker rank N' on a receiver's side (N: the sender, usually the one that died)."""
        return f" from worker rank {self.peer}" if self.rank == 1 and self.peer is not None \
            else ""


class WorkerMoves:
    """A worker's half (placement/worker.py): exports and sends on ``kv_send``, receives on
    ``kv_recv``, holds items until their K/V arrived. ``fail(ids, message)`` reports items;
    ``dispatch(node, walk, items)`` queues held items once their K/V are here (a node of this
    worker or one of its segments: the engine may serve either)."""

    def __init__(self, host: Any, rank: int, fail: Callable[[list[int], str], None],
                 dispatch: Callable[[int, int, list], None],
                 fail_request: Callable[[int, str], None] = lambda rid, message: None) -> None:
        self.host, self.rank, self.fail_items, self.dispatch = host, rank, fail, dispatch
        self.fail_request = fail_request
        self.lock = threading.Lock()
        self.incoming: dict[int, _Entry] = {}
        self.pairs: dict[str, _Pair] = {}
        self.sent = self.received_count = 0
        self.timeout_s = 60.0  # the parent's kv_timeout_s, once a notice said it

    def pair(self, key: str, rank: int, msg: dict) -> _Pair:
        p = self.pairs.get(key)
        if p is None:
            # a channel of the same two ranks in older generations is done with: a worker died
            ranks = tuple(part.split("g")[0] for part in key.split("-"))
            for old in [k for k in self.pairs
                        if tuple(part.split("g")[0] for part in k.split("-")) == ranks]:
                self.pairs.pop(old).jobs.put(None)
            p = self.pairs[key] = _Pair(self, key, rank, int(msg["port"]),
                                        float(msg["timeout_s"]), msg.get("host", "127.0.0.1"),
                                        msg.get("peer"))
        return p

    def notice(self, kind: str, msg: dict) -> None:
        rid, engine, key = field(msg, "request", int), field(msg, "engine", str), \
            field(msg, "key", str)
        field(msg, "port", int), field(msg, "timeout_s", (int, float))  # checked, read later
        if not isinstance(msg.get("host", ""), str):
            raise ProtocolError(f"'{kind}' field 'host' must be a string (the store's address)")
        self.timeout_s = float(msg["timeout_s"])
        engines = self.host.every_engine
        if engine not in engines:
            raise ProtocolError(f"'{kind}' names engine '{engine}', which this worker does not "
                                f"run (it runs {sorted(engines)})")
        if kind == "kv_recv":
            for sub in self.host.submodules_of(engine):
                if sub.handoffs is None:  # this worker is a decode side from now on
                    from mstar_rt.distributed.kv_handoff import HandoffTable

                    sub.handoffs = HandoffTable()
            with self.lock:
                self.incoming.setdefault(rid, _Entry())
            p = self.pair(key, 1, msg)
            with self.lock:
                broken = p.broken
                if broken is None:
                    p.expected.add(rid)
            if broken is not None:
                self.failed(rid, f"its K/V cannot arrive{p.sender()}: {broken}")
                return
            p.jobs.put(rid)
            return
        p = self.pair(key, 0, msg)
        if p.broken is not None:  # the K/V could never leave: free them, fail the request
            engines[engine].release(rid)
            self.fail_request(rid, f"its K/V could not be sent to worker rank "
                                   f"{msg.get('peer')}: {p.broken}")
            return
        try:  # on the message loop, not the channel's thread: no later 'release' races it
            handle = self.host.requests.get(rid)
            if handle is None:
                raise RuntimeError(f"worker rank {self.rank} no longer holds request {rid}")
            subs, kv_engine = self.host.submodules_of(engine), engines[engine]
            state = subs[0].handoff_state(handle.context.state)
            kv = kv_engine.export_request(rid, free=True, device="cpu")
            p.jobs.put(({"request": rid, "engine": engine, "state": state}, kv))
            self.sent += 1
        except Exception as e:
            engines[engine].release(rid)
            p.jobs.put(({"request": rid, "engine": engine,
                         "error": f"export on worker rank {self.rank} failed: "
                                  f"{type(e).__name__}: {e}"}, None))

    def received(self, pair: _Pair, description: dict, tensors: list) -> None:
        rid = int(description["request"])
        with self.lock:
            pair.expected.discard(rid)
        if "error" in description:
            self.failed(rid, str(description["error"]))
            return
        from mstar_rt.distributed.kv_handoff import Handoff
        from mstar_rt.engines.paged_kv import SequenceKV

        kv = SequenceKV(tensors[0], int(description["kv"]["reserve"]))
        with self.lock:
            entry = self.incoming.get(rid)
            if entry is None:  # the request ended meanwhile: its K/V take no page here
                return
            for sub in self.host.submodules_of(str(description["engine"])):
                sub.handoffs.put(rid, Handoff(description["state"], kv))
            entry.arrived, held, entry.held = True, entry.held, []
            self.received_count += 1
        for node, walk, items in held:
            self.dispatch(node, walk, items)

    def send_failed(self, description: dict, why: str, peer: Any = None) -> None:
        """A sender's channel broke before this request's K/V left (they were freed at export):
        the request fails, naming the worker they were for (usually the one that died), rather
        than waiting on the receiver's side."""
        rid = int(description.get("request", -1))
        to = f" to worker rank {peer}" if peer is not None else ""
        self.fail_request(rid, description.get("error")
                          or f"its K/V could not be sent{to}: {why}")

    def expire(self) -> None:
        """Fails the requests whose K/V have not arrived within the parent's kv_timeout_s (a
        notice lost to a worker's death, a sender that never came): their items would
        otherwise be held for good. Called every heartbeat."""
        now = time.monotonic()
        with self.lock:
            late = [rid for rid, e in self.incoming.items()
                    if not e.arrived and e.error is None and now - e.since > self.timeout_s]
        for rid in late:
            self.failed(rid, f"its K/V did not arrive within kv_timeout_s={self.timeout_s:g}")

    def failed(self, rid: int, message: str) -> None:
        with self.lock:
            entry = self.incoming.get(rid)
            if entry is None:
                return
            entry.error, held, entry.held = message, entry.held, []
        ids = [w.id for _n, _w, items in held for w in items]
        if ids:
            self.fail_items(ids, message)

    def hold(self, node: int, walk: int, items: list) -> list:
        """The items to queue now; those of requests whose K/V are still travelling are kept
        (and queued when they arrive) or failed (when they never will)."""
        if not self.incoming and not any(self.marked(w.request) for w in items):
            return items
        now, failed = [], []
        with self.lock:
            for w in items:
                entry = self.incoming.get(w.request)
                if entry is None and self.marked(w.request):  # ahead of its kv_recv notice
                    entry = self.incoming[w.request] = _Entry()
                if entry is None or entry.arrived:
                    now.append(w)
                elif entry.error is not None:
                    failed.append((w.id, entry.error))
                else:
                    entry.held.append((node, walk, [w]))
        for item, message in failed:
            self.fail_items([item], message)
        return now

    def marked(self, rid: int) -> bool:
        handle = self.host.requests.get(rid)
        return handle is not None and handle.context.state.get(MOVING) is not None \
            and "params" not in handle.context.state

    def release(self, rid: int) -> None:
        with self.lock:
            entry = self.incoming.pop(rid, None)
        if entry is not None:
            for sub in self.lm_nodes_all():
                sub.handoffs.take(rid)

    def lm_nodes_all(self) -> list:
        host = self.host
        return [host.nodes[i].submodule for i in host.every
                if getattr(host.nodes[i].submodule, "handoffs", None) is not None]

    def stats(self) -> dict:
        with self.lock:
            waiting = sum(1 for e in self.incoming.values() if not e.arrived)
        return dict(kv_sent=self.sent, kv_received=self.received_count, kv_waiting=waiting)

    def close(self) -> None:
        for p in self.pairs.values():
            p.jobs.put(None)
        # A sender's channel is dropped as its thread ends: on a live interpreter, not while
        # the process finalizes (its gloo group's destructor, cut short there, aborted the
        # process: "terminate called without an active exception"). A receiver may wait in a
        # recv for good; it holds no GIL there and never wakes.
        for p in self.pairs.values():
            if p.rank == 0:
                p.thread.join(timeout=5)

"""A worker process: ``python -m mstar_rt.placement.worker CONFIG.json``, or the same loop inside
a rank's Ray actor (placement/ray_rank.py: :func:`start_worker`, then :meth:`Worker.serve`).

Started by the parent (subprocess, never fork: torch's threads survive only a fresh
interpreter). It builds the model from the config's import spec, keeps the engines of its node
group, reports ``ready`` (or ``fatal`` with the reason), then serves messages on its ROUTER
socket until ``shutdown`` or until its parent is gone. Progress goes to stderr, which the parent
prefixes with the rank and forwards.
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import shutil
import sys
import threading
import time
import traceback
from typing import Any, Optional

import msgpack
import zmq

from mstar_rt import _core
from mstar_rt.malloc_tuning import tune_malloc
from mstar_rt.placement.arena import ShmArena, unlink_quietly
from mstar_rt.placement.codec import CodecError, Decoder, Encoder
from mstar_rt.placement.direct import ExportArena
from mstar_rt.placement.config import ModelSpec
from mstar_rt.placement.inline import InlineArena
from mstar_rt.placement.mailbox import Bell, Mailbox, MailboxError, MailboxSocket
from mstar_rt.placement.outbox import Outbox
from mstar_rt.placement.peer_bytes import DirectEnds
from mstar_rt.placement.process import worker_device
from mstar_rt.placement.protocol import (PARENT_ID, TO_WORKER, TO_WORKER_HEADER, check_opens,
                                         VERSION, ProtocolError, check_header, field, int_list)

BURST_MAX = 64  # messages taken off the socket before any of them is handled


def say(text: str) -> None:
    try:
        print(text, file=sys.stderr, flush=True)
    except OSError:  # the parent (reading our output) is gone
        pass


class Worker:
    def __init__(self, cfg: dict) -> None:
        self.cfg = cfg
        self.rank, self.gen = int(cfg["rank"]), int(cfg["gen"])
        self.ctx = zmq.Context()
        self.push = self.ctx.socket(zmq.PUSH)
        self.push.setsockopt(zmq.SNDHWM, 100_000)
        self.push.setsockopt(zmq.LINGER, 2000)
        self.push.connect(cfg["parent"])
        # tcp: the parent may be on another machine, so tensors travel in the messages
        self.inline = cfg.get("transport") == "tcp"
        self.endpoint = ""
        self.p2w: Optional[ShmArena | InlineArena] = None
        self.w2p: Optional[ShmArena | InlineArena] = None
        self.outbox = Outbox(self.push, None, self.rank, self.gen)
        self.exports: Optional[ExportArena] = None
        self.direct: Optional[DirectEnds] = None
        self.router: Optional[zmq.Socket] = None
        # a local worker's messages with the parent (placement/mailbox.py); its router then
        # serves only its peers
        self.mail: Optional[Mailbox] = None
        self.bell: Optional[Bell] = None
        self.spin_s = float(cfg.get("spin_us", 0.0)) * 1e-6
        self.host: Any = None
        self.moves: Any = None
        self.bad_messages = 0
        self.messages = 0
        self.alone = True  # the message being handled came alone (serve)
        self.fetched_now = False  # it carried tensors copied from other workers' arenas
        self.stopping = threading.Event()

    # ---- startup -----------------------------------------------------------------------------

    def start(self) -> None:
        cfg, t0 = self.cfg, time.monotonic()
        if self.inline:
            self.p2w, self.w2p = InlineArena(), InlineArena()
        else:
            self.p2w, self.w2p = ShmArena.attach(cfg["p2w"]), ShmArena.attach(cfg["w2p"])
        sock: Any = self.push
        if cfg.get("mail"):
            mail, ppid = cfg["mail"], cfg["parent_pid"]
            self.mail, self.bell = Mailbox.attach(mail["p2w"]), Bell(mail["bell"])
            sock = MailboxSocket(Mailbox.attach(mail["w2p"]), Bell(mail["parent_bell"]),
                                 lambda: os.getppid() == ppid)
        # tensors this worker makes for other workers, and theirs it reads (placement/direct.py)
        self.direct = DirectEnds(cfg, self.ctx)
        self.exports = self.direct.exports
        self.outbox = Outbox(sock, self.w2p, self.rank, self.gen, self.exports,
                             frozenset(cfg.get("direct") or ()), int(cfg.get("direct_bytes", 0)))
        cuda = worker_device(str(cfg["device"]), self.rank)  # (its visible GPU)
        self.decoder = Decoder(self.p2w, remote_arena=self.direct.reader, cuda=cuda)
        self.plain = Decoder(None)
        say(f"building {cfg['factory']} for nodes {cfg['nodes']} on {cfg['device']}")
        model = ModelSpec(cfg["factory"], cfg["kwargs"]).build()
        from mstar_rt.placement.host import WorkerHost
        from mstar_rt.placement.segments import find_segments

        segments = (find_segments(model, cfg["node_rank"], set(cfg["worker_ranks"]),
                                  cfg.get("moving") or ()).segments
                    if cfg.get("segments") else [])
        self.host = WorkerHost(model, cfg["nodes"], self.outbox.send, cfg.get("engines") or {},
                               segments=segments, rank=self.rank)
        from mstar_rt.placement.kv_moves import WorkerMoves

        # starts (from any thread, see run_items) and releases of requests take turns
        self._starting = threading.RLock()
        self.moves = WorkerMoves(self.host, self.rank, lambda ids, message: self.outbox.send(
            "failed", items=ids, message=message), self.run_items, lambda rid, message:
            self.outbox.send("failed", items=[], message=message, request=rid))
        engines = ", ".join(f"{n}: {type(e).__name__}" for n, e in self.host.every_engine.items())
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.bind(cfg["endpoint"])  # tcp: "tcp://<this node>:*", the port is ours
        self.endpoint = self.router.getsockopt(zmq.LAST_ENDPOINT).decode()
        g = self.host.graph
        self.outbox.send("ready", pid=os.getpid(), nodes=list(g.node_ids) + self.host.segment_names,
                         walks=list(g.walk_ids))
        say(f"ready in {time.monotonic() - t0:.1f} s (engines {engines})")
        threading.Thread(target=self.heartbeat, daemon=True, name="mstar-heartbeat").start()

    def heartbeat(self) -> None:
        """Tells the parent, every heartbeat_s, that this process answers, what its engines run
        (placement/watchdog.py) and its model's health (one that cannot serve is replaced)."""
        period = float(self.cfg.get("heartbeat_s", 1.0))
        while not self.stopping.wait(period):
            try:  # K/V that never came fail their requests (a bug here must not stop the beat)
                self.moves.expire()
            except Exception:
                traceback.print_exc()
            try:
                self.outbox.send("heartbeat", busy=self.host.busy(), health=self.host.model.health())
            except Exception:  # the socket closed under us at shutdown
                return

    # ---- serving -----------------------------------------------------------------------------

    def serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self.router, zmq.POLLIN)
        if self.bell is not None:
            poller.register(self.bell.fileno(), zmq.POLLIN)
        # A Ray actor has no parent pid to watch: Ray ends it with the driver that owns it.
        ppid = self.cfg["parent_pid"]
        while not self.stopping.is_set():  # set by a Ray actor starting a newer generation
            if ppid is not None and os.getppid() != ppid:
                self.orphan_cleanup()
                say("the parent process is gone; exiting")
                return
            if not self.mail_soon() and not poller.poll(200):
                continue
            burst = self.receive_burst()
            # what piled up while this thread ran a batch is queued whole, then taken by deadline
            self.alone = len(burst) == 1
            if not self.alone:
                self.host.conductor.hold(True)
            try:
                for ident, frames in burst:
                    if self.serve_one(ident, frames) == "shutdown":
                        return
            finally:
                if not self.alone:
                    self.host.conductor.hold(False)

    def mail_soon(self) -> bool:
        """Whether the parent's next message arrived within the spin budget (the mailbox's
        head watched without sleeping: placement/mailbox.py)."""
        if self.mail is None or self.spin_s <= 0:
            return False
        address, seen = self.mail.watch()
        return _core.spin_until_changed([address], [seen], self.spin_s) >= 0

    def receive_burst(self) -> list[tuple[Optional[bytes], list]]:
        """Every message already waiting (up to BURST_MAX), as (sender, frames); the sender of
        those from the mailbox is None: the parent."""
        burst: list[tuple[Optional[bytes], list]] = []
        if self.mail is not None and self.bell is not None:
            self.bell.drain()  # before the ring: a message written after this rings again
            try:
                burst = [(None, frames) for frames in self.mail.take(BURST_MAX)]
            except MailboxError as e:  # only a broken parent writes this: nothing to serve
                say(f"exiting: {e}")
                self.stopping.set()
                return []
            if len(burst) == BURST_MAX:  # more may wait: come back after these
                self.bell.ring()
        while len(burst) < BURST_MAX:
            try:
                if self.inline:  # the tensor frames stay in ZeroMQ's buffers until decoded
                    got = self.router.recv_multipart(zmq.NOBLOCK, copy=False)
                    frames = [f.bytes for f in got[:3]] + [f.buffer for f in got[3:]]
                else:
                    frames = self.router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            burst.append((frames[0], frames[1:]))
        return burst

    def serve_one(self, ident: Optional[bytes], frames: list) -> Optional[str]:
        self.messages += 1
        # With a mailbox the parent writes only there: a peer claiming its id is a peer.
        from_parent = ident is None or (ident == PARENT_ID and self.mail is None)
        try:
            return self.handle(from_parent, frames)
        except (ProtocolError, CodecError) as e:
            self.reject(ident, from_parent, str(e))
        except Exception as e:  # a bug here must not take the worker down
            traceback.print_exc()
            self.reject(ident, from_parent, f"{type(e).__name__}: {e}")
        return None

    def reject(self, ident: Optional[bytes], from_parent: bool, message: str) -> None:
        self.bad_messages += 1
        text = f"worker rank {self.rank} rejected a message: {message}"
        if from_parent or ident is None:
            self.outbox.send("error", message=text)
        else:
            reply = {"v": VERSION, "kind": "error", "rank": self.rank, "gen": self.gen,
                     "message": text}
            self.router.send_multipart([ident, Encoder(None).pack(reply)])

    def handle(self, from_parent: bool, frames: list) -> Optional[str]:
        if ((len(frames) != 2 and not (self.inline and from_parent)) or len(frames) < 2
                or len(frames[0]) != TO_WORKER_HEADER.size):
            raise ProtocolError(f"a message is two frames, a {TO_WORKER_HEADER.size}-byte header "
                                f"(generation, span end) and a msgpack map; got {len(frames)} "
                                "frames")
        gen, span = TO_WORKER_HEADER.unpack(frames[0])
        if gen != self.gen:
            raise ProtocolError(f"generation {gen} is not this worker's ({self.gen})")
        if not from_parent:  # only the parent may hand over arena bytes
            msg = self.plain.unpack(frames[1])
        else:
            try:
                try:
                    if self.inline:
                        self.p2w.receive(frames[2:])
                    fetched = self.decoder.fetched
                    msg = self.decoder.unpack(frames[1])
                    self.fetched_now = self.decoder.fetched != fetched
                finally:  # copied out (or unusable): free the parent's arena up to here
                    try:
                        self.p2w.free_to(span)
                    except ValueError as e:
                        raise ProtocolError(str(e)) from None
            except (ProtocolError, CodecError) as e:
                self.fail_named_items(frames[1], e)
                raise
        kind = check_header(msg, TO_WORKER)
        if kind == "batch":
            if msg.get("release"):  # requests that ended since the last batch
                self.release(int_list(msg, "release"), from_parent, kind)
            if msg.get("unexport"):
                self.unexport(int_list(msg, "unexport"), from_parent, kind)
            self.batch(msg, from_parent)
        elif kind == "release":
            self.release(int_list(msg, "requests"), from_parent, kind)
        elif kind == "unexport":
            self.unexport(int_list(msg, "keys"), from_parent, kind)
        elif kind == "stats":
            token = field(msg, "token", int)
            self.only_parent(from_parent, kind)
            self.outbox.send("stats", token=token, stats=self.stats())
        elif kind == "shutdown":
            self.only_parent(from_parent, kind)
            return "shutdown"
        elif kind in ("kv_send", "kv_recv"):
            self.only_parent(from_parent, kind)
            self.moves.notice(kind, msg)
        return None

    def release(self, rids: list[int], from_parent: bool, kind: str) -> None:
        self.only_parent(from_parent, kind)
        for rid in rids:
            with self._starting:
                self.host.release(rid)
                self.moves.release(rid)

    def unexport(self, keys: list[int], from_parent: bool, kind: str) -> None:
        """The parent holds no handle of these exports any more: their bytes are free."""
        self.only_parent(from_parent, kind)
        if self.exports is not None:
            self.exports.free(keys)

    def fail_named_items(self, payload: bytes, error: Exception) -> None:
        """The parent's message could not be taken as a whole (its tensors, or its span end, are
        bad): if it is a batch, its items are failed by id, so they do not wait forever."""
        try:
            msg = msgpack.unpackb(payload, raw=False, strict_map_key=False,
                                  ext_hook=lambda code, data: None)
        except Exception:  # not even the structure is readable: no item can be named
            return
        batch = (isinstance(msg, dict) and type(msg.get("v")) is int and msg["v"] == VERSION
                 and msg.get("kind") == "batch")
        ids = _item_ids(msg.get("items")) if batch else []
        if ids:
            self.outbox.send("failed", items=ids, message=f"malformed batch: {error}")

    @staticmethod
    def only_parent(from_parent: bool, kind: str) -> None:
        # Checked after the message's own fields, so a stranger learns what was malformed.
        if not from_parent:
            raise ProtocolError(f"only the parent process may send '{kind}' messages")

    def batch(self, msg: dict, from_parent: bool) -> None:
        host = self.host
        items = field(msg, "items", list)
        ids = _item_ids(items)
        try:
            node = field(msg, "node", int)
            walk = field(msg, "walk", int)
            segment = host.segments.segments.get(node)
            if node not in host.node_ids and segment is None:
                names = [host.node_names[i] for i in host.node_ids]
                raise ProtocolError(f"node id {node} is not one of this worker's nodes {names}")
            if not 0 <= walk < len(host.walk_names):
                raise ProtocolError(f"walk id {walk} is out of range")
            if segment is not None:  # the streams entering it come in windows
                inputs, stream_input = set(segment.reads), segment.stream_input
                node_name = segment.name
            else:
                inputs = set(host.graph.node_inputs[node])
                stream_input = host.nodes[node].stream_input
                node_name = host.node_names[node]
            work = []
            for it in items:
                # ids are 64-bit and iterations 32-bit in the C++ queue and WorkContext
                if not (isinstance(it, list) and len(it) == 5
                        and all(type(x) is int and x >= 0 for x in it[:3]) and it[2] < 2**32
                        and isinstance(it[3], dict) and set(it[3]) <= inputs):
                    raise ProtocolError("a batch item must be [item, request, iteration, "
                                        "{input: value}, chunk or None] with the node's inputs")
                chunk = _chunk(it[4], stream_input, node_name)
                work.append(_core.WorkItem((it[0], it[1], it[2], it[3], chunk)))
            opens = check_opens(field(msg, "open", dict))
            self.only_parent(from_parent, "batch")
        except (ProtocolError, CodecError) as e:
            if from_parent and ids:  # tell the parent so those items do not wait forever
                self.outbox.send("failed", items=ids, message=f"malformed batch: {e}")
            raise
        if segment is not None and segment.takes and self.fetched_now:
            # Windows the parent answered as it sent them: it holds their handles (the makers'
            # bytes) only until told that they were copied out (ItemLedger.read).
            self.outbox.send("read", items=ids)
        for rid, o in opens.items():
            host.open(rid, o.get("inputs"), o.get("state") or {},
                      tuple(o.get("order", (2**63 - 1, 0))))
        known, unknown = [], []
        for w in work:
            (known if host.requests.get(w.request) is not None else unknown).append(w)
        if unknown:
            self.outbox.send("failed", items=[w.id for w in unknown],
                             message=f"worker rank {self.rank} holds no state for this request "
                                     "(it ended, or the worker restarted)")
        for w in known:
            host.set_walk(w.request, walk)
        known = self.moves.hold(node, walk, known)  # K/V still on the way from another rank
        if known:
            self.run_items(node, walk, known, self.alone)

    def run_items(self, node: int, walk: int, items: list, alone: bool = False) -> None:
        """Queues work items of a node or a segment of this worker (any thread; ``alone``: the
        message loop's, with nothing else waiting, where a short run may run inline)."""
        with self._starting:  # else a release between check and run would leave its pages
            if node not in self.host.segments.segments:
                self.host.dispatch(node, walk, items, alone)
                return
            refused = self.host.segments.submit(
                node, [(w.id, w.request, w.inputs, w.chunk) for w in items], alone)
        if refused:
            self.outbox.send("failed", items=refused, message="the request ended")

    def stats(self) -> dict:
        return dict(self.host.stats(), **self.moves.stats(), pid=os.getpid(), rank=self.rank,
                    gen=self.gen, messages=self.messages, bad_messages=self.bad_messages,
                    p2w_bytes_in_use=self.p2w.in_use, w2p_bytes_in_use=self.w2p.in_use,
                    export_bytes_in_use=0 if self.exports is None else self.exports.in_use,
                    exports_served=self.direct.served if self.direct is not None else 0)

    # ---- shutdown ----------------------------------------------------------------------------

    def orphan_cleanup(self) -> None:  # a local worker process only
        """The parent died without closing us: remove what it would have removed -- our arenas
        and its socket directory (everything in it was the dead parent's)."""
        mail = self.cfg.get("mail") or {}
        for arena in (self.p2w, self.w2p, self.exports and self.exports.arena):
            if arena is not None:
                arena.unlink()
        for name in filter(None, (mail.get("p2w"), mail.get("w2p"))):
            unlink_quietly(name)
        workdir = os.path.dirname(self.cfg["endpoint"].removeprefix("ipc://"))
        if os.path.basename(workdir).startswith(f"mstar-placement-{self.cfg['parent_pid']}-"):
            shutil.rmtree(workdir, ignore_errors=True)

    def close(self) -> None:
        self.stopping.set()
        if self.moves is not None:
            self.moves.close()
        if self.host is not None:
            self.host.close()
        if self.router is not None:
            self.router.close(0)
        if self.direct is not None:
            self.direct.close()
        self.outbox.close(sock=self.mail is not None)
        self.push.close(2000)
        self.ctx.term()
        for ring in (self.p2w, self.w2p, self.exports and self.exports.arena, self.mail,
                     self.bell):
            if ring is not None:
                ring.close()


def _item_ids(items: Any) -> list[int]:
    """The ids a batch's items name (what a parent waits for), however malformed the rest."""
    if not isinstance(items, list):
        return []
    return [it[0] for it in items if isinstance(it, list) and it and type(it[0]) is int]


def _window(value: Any) -> bool:
    return (isinstance(value, (list, tuple)) and len(value) == 4
            and all(type(v) is int for v in value[:3]) and type(value[3]) is bool
            and 0 <= value[0] <= value[1] <= value[2])


def _chunk(value: Any, stream_input: Any, node: str) -> Optional[tuple]:
    """A batch item's stream chunk, checked, as the Conductor makes them: one stream's window
    (begin, new_begin, end, last), or (windows, stream_end) with one window per stream the node
    reads."""
    if value is None:
        return None
    if stream_input is None:
        raise ProtocolError(f"a batch item for node '{node}' carries a stream chunk, but the "
                            "node reads no stream; send chunk None")
    streams = len(stream_input) if isinstance(stream_input, tuple) else 1
    if streams == 1 and _window(value):
        return tuple(value)
    if (isinstance(value, (list, tuple)) and len(value) == 2 and type(value[1]) is bool
            and isinstance(value[0], (list, tuple)) and len(value[0]) == streams
            and all(_window(w) for w in value[0])):
        return (tuple(tuple(w) for w in value[0]), value[1])
    raise ProtocolError(f"the stream chunk of a batch item for node '{node}' must be "
                        "(begin, new_begin, end, last) with 0 <= begin <= new_begin <= end "
                        f"and last a bool, or (windows, stream_end) with {streams} such "
                        "windows")


def start_worker(cfg: dict) -> Worker:
    """A started worker (model built, socket bound, ``ready`` sent), or, after telling the
    parent why (``fatal``), the exception."""
    tune_malloc(arenas=False)  # tensors copied out of the arena land in warm heap pages
    worker = Worker(cfg)
    try:
        worker.start()
    except BaseException as e:
        detail = "".join(traceback.format_exception_only(type(e), e)).strip()
        traceback.print_exc()
        worker.outbox.send("fatal", message=f"could not build {cfg['factory']} for nodes "
                                            f"{cfg['nodes']}: {detail}")
        worker.push.close(2000)
        worker.ctx.term()
        raise
    return worker


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        say("usage: python -m mstar_rt.placement.worker CONFIG.json (the parent writes it)")
        return 2
    with open(argv[0]) as f:
        cfg = json.load(f)
    cfg["config_path"] = argv[0]
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the parent's watchdog, on a hang
    try:
        worker = start_worker(cfg)
    except BaseException:
        return 3
    try:
        worker.serve()
    finally:
        worker.close()
    # Closed: no finalization, where a K/V receiver woken in gloo's recv aborted the process.
    sys.stdout.flush()  # (stderr is line-buffered)
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())

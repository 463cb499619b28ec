"""The parent's end of one worker process: start and restart it, send it batches, account for
every work item it holds (:class:`~mstar_rt.placement.ledger.ItemLedger`: each reported back
exactly once), and when it dies fail exactly its items and the requests it held state for.

Threads: engine threads call :meth:`send_batch`; the hub's receiver thread calls
:meth:`on_message` and :meth:`release` and never waits for the worker (placement/channel.py); a
monitor, a pump and a watchdog thread per process (placement/watchdog.py). Launchers: a local
process (placement/process.py; ``ipc://``, shared memory) or a Ray actor anywhere in a cluster
(placement/ray_rank.py; ``tcp://``, tensors inline or fetched).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import traceback
from typing import TYPE_CHECKING, Optional, Sequence

import zmq

from mstar_rt.placement.arena import arena_pair
from mstar_rt.placement.asks import Asks
from mstar_rt.placement.inline import InlineArena
from mstar_rt.placement.codec import CodecError, Decoder
from mstar_rt.placement.config import ModelSpec, RankPlan
from mstar_rt.placement.channel import SendChannel, deferring
from mstar_rt.placement.direct import LinkExports, remote_values
from mstar_rt.placement.hub import bell_path
from mstar_rt.placement.ledger import ItemLedger
from mstar_rt.placement.inbox import Inbox
from mstar_rt.placement.mailbox import MailboxSocket, worker_mail
from mstar_rt.placement.replies import (answer_windows, complete_from_reply, deliver_emits,
                                        fail_for_death, open_entry)
from mstar_rt.placement.watchdog import Watchdog, heartbeat_period
from mstar_rt.placement.process import ProcessLauncher, WorkerProcess, WorkerStartError, say
from mstar_rt.placement.protocol import VERSION, ProtocolError, field, int_list

if TYPE_CHECKING:
    from mstar_rt.placement.ray_rank import RayLauncher, RayWorker
    from mstar_rt.placement.runtime import PlacedRuntime


class WorkerLink:
    def __init__(self, runtime: "PlacedRuntime", plan: RankPlan, spec: ModelSpec,
                 zctx: zmq.Context, workdir: str, parent_endpoint: str, tag: str,
                 shm_bytes: int, ready_timeout_s: float, progress: bool,
                 engines: Optional[dict[str, dict]] = None,
                 ray: Optional["RayLauncher"] = None, direct: Sequence[str] = (),
                 direct_bytes: int = 0) -> None:
        self.rt, self.rank, self.plan, self.spec = runtime, plan.rank, plan, spec
        self._zctx, self._workdir, self._parent_endpoint, self._tag = zctx, workdir, \
            parent_endpoint, tag
        self.shm_bytes, self.ready_timeout_s, self.progress = shm_bytes, ready_timeout_s, progress
        self.engine_settings = dict(engines or {})
        self.exports = LinkExports(self.rank, list(direct), direct_bytes, lambda gen, name, value:
                                   self._channel.held.append((gen, name, value)),  # to workers
                                   lambda: self._channel.hurry_held(), max(1, shm_bytes // 4))
        self.state = "new"  # new | starting | up | down | closed
        self.gen = -1
        self._local = ray is None
        self._launcher = ray or ProcessLauncher(self.rank, workdir, plan.device, progress)
        self.worker: Optional[WorkerProcess | RayWorker] = None
        self._p2w_next: Optional[InlineArena] = None
        self.endpoint = ""
        self.last_exit: Optional[str] = None
        self.restarts = self.error_replies = 0
        self.last_error: Optional[str] = None
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._restart_lock = threading.Lock()
        self.inbox = Inbox()  # the incoming arena and mailbox
        self._channel = SendChannel(self.rank)  # the mailbox (or DEALER) and outgoing arena
        self._ledger = ItemLedger()  # under _lock
        self._watchdog: Optional[Watchdog] = None
        self._hang: tuple[int, str] = (-1, "")  # (generation, why it counts as hung)
        self._dead_gen = -1
        self._ready = threading.Event()
        self._fatal: Optional[str] = None
        self._threads: list[threading.Thread] = []
        self._asks = Asks(self.rank)
        self.feeds: set[int] = set()  # stand-ins taking streams: a window not last is answered here

    # ---- lifecycle -----------------------------------------------------------------------------

    def spawn(self) -> None:
        """Starts a worker process (a new generation) without waiting for it."""
        with self._lock:
            if self.state == "closed":
                raise RuntimeError("the placed runtime is closed")
            self.gen += 1
            gen = self.gen
            self.state = "starting"
            self._ready.clear()
            self._fatal = None
        # tensor bytes: in shared memory for a local process, in the messages for a Ray actor
        base = f"{self._tag}_r{self.rank}_g{gen}"
        p2w, w2p = ((InlineArena(), InlineArena()) if not self._local
                    else arena_pair(base, self.shm_bytes))
        out = self.exports.create(base, self.shm_bytes) if self._local else None  # (Ray: its own)
        to_worker, from_worker, bell = (worker_mail(base, f"{self._workdir}/rank{self.rank}-g{gen}"
                                                    ".bell") if self._local else (None,) * 3)
        if to_worker is not None:  # messages through shared memory; its socket serves its peers
            self.endpoint = f"ipc://{self._workdir}/rank{self.rank}-g{gen}.sock"
            self._channel.attach(gen, MailboxSocket(to_worker, bell, lambda: self._alive(gen),
                                                    owner=True), p2w)
        else:  # the actor picks its port: connect once it says which (wait_ready)
            self.endpoint, self._p2w_next = "", p2w
        self.inbox.attach(gen, w2p, Decoder(w2p, remote=lambda h: self.exports.handle(gen, h)),
                           from_worker)
        cfg = dict(rank=self.rank, gen=gen, factory=self.spec.factory,
                   kwargs={**self.spec.args, **self.plan.model_kwargs}, nodes=self.plan.nodes,
                   device=self.plan.device, engines=self.engine_settings, endpoint=self.endpoint,
                   parent=self._parent_endpoint, p2w=p2w.name, w2p=w2p.name,
                   mail=None if bell is None else dict(
                       p2w=to_worker.name, w2p=from_worker.name, bell=bell.path,
                       parent_bell=bell_path(self._workdir)),
                   spin_us=self.rt.spin_us, heartbeat_s=heartbeat_period(self.rt.heartbeat_timeout_s),
                   node_rank=self.rt.plan.node_rank, worker_ranks=sorted(self.rt.plan.workers),
                   segments=self.rt.segments_enabled, moving=sorted(self.rt.plan.kv_moves),
                   shm_prefix=self._tag,
                   out=out, direct=self.exports.names, direct_bytes=self.exports.min_bytes,
                   export_bytes=self.shm_bytes if self.exports.names else 0, transport="ipc"
                   if self._local else "tcp", parent_pid=os.getpid() if self._local else None)
        self.worker = worker = self._launcher.start(cfg)
        if self.progress:
            say(self.rank, f"started ({f'pid {worker.pid}' if self._local else 'its Ray actor'}) "
                      f"for nodes {self.plan.nodes}")
        monitor = threading.Thread(target=self._monitor, args=(worker, gen), daemon=True,
                                   name=f"mstar-worker{self.rank}-monitor")
        self._threads = [t for t in self._threads if t.is_alive()] + worker.threads + [monitor]
        monitor.start()
        with self._lock:
            closed = self.state == "closed"
        if closed:  # close() ran meanwhile and could not see this process: stop it here
            worker.stop(graceful=False)
            self._disconnect(gen)
            raise RuntimeError("the placed runtime is closed")

    def wait_ready(self) -> None:
        """Blocks until the worker spawned last reports ready; WorkerStartError otherwise."""
        worker, gen = self.worker, self.gen
        assert worker is not None
        deadline = time.monotonic() + self.ready_timeout_s
        while not self._ready.wait(0.05):
            failure = worker.failure()
            if failure is not None or self._fatal is not None:
                worker.stop(graceful=True)
                self._fail_start(gen)
                raise WorkerStartError(f"worker process rank {self.rank} failed to start: "
                                       f"{self._fatal or failure}\n{worker.last_output()}")
            if time.monotonic() > deadline:
                worker.kill()
                self._fail_start(gen)
                raise WorkerStartError(f"worker process rank {self.rank} did not report ready "
                                       f"within {self.ready_timeout_s} s (ready_timeout_s)\n"
                                       f"{worker.last_output()}")
        if not self._local:  # the actor picked its port; its start() returned as it got ready
            self.endpoint = worker.endpoint(max(1.0, deadline - time.monotonic()))
            self._channel.connect(self._zctx, gen, self.endpoint, self._p2w_next)
        with self._lock:
            if self.gen == gen and self.state == "starting":
                self.state = "up"
                self._watchdog = Watchdog(self.rt.heartbeat_timeout_s, self.rt.node_timeout_s,
                                          lambda why: self._on_hang(gen, why),
                                          f"mstar-worker{self.rank}-watchdog")
                self._watchdog.start()
            self._cond.notify_all()
            if self.state != "up":
                raise WorkerStartError(f"worker process rank {self.rank} died right after "
                                       f"starting ({self.last_exit})")

    def _fail_start(self, gen: int) -> None:
        with self._lock:
            if self.gen == gen and self.state == "starting":
                self.state, self.last_exit = "down", "failed to start"
            self._cond.notify_all()

    def restart(self) -> None:
        """Stops the current worker (its requests fail) and starts a fresh one."""
        gen = self.gen
        with self._restart_lock:  # two callers at once get one new worker, not two
            if self.gen != gen and self.state == "up":
                return
            self._restart()

    def _restart(self) -> None:
        with self._lock:
            state = self.state
        if state == "closed":
            raise RuntimeError("the placed runtime is closed")
        if state in ("up", "starting") and self.worker is not None:
            old = self.gen
            self.worker.stop(graceful=False)
            deadline = time.monotonic() + 10.0 + self.ready_timeout_s
            with self._lock:  # its death is handled; with restart="auto" a new one is coming
                while (self._dead_gen < old or (self.state == "starting" and self.gen == old)
                       or (self.gen > old and self.state == "starting")):
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    self._cond.wait(left)
                if self.gen > old and self.state == "up":
                    return
        self.spawn()
        self.wait_ready()

    def close(self) -> None:
        worker = self.worker
        with self._lock:
            self.state = "closed"
            self._cond.notify_all()
            if self._watchdog is not None:
                self._watchdog.stop()
        if worker is not None and worker.failure() is None:
            self._channel.post(self.gen, {"kind": "shutdown"})
            worker.stop(graceful=True)
        self._launcher.close()  # no Ray actor outlives its runtime
        for t in self._threads:
            t.join(timeout=5)
        self._disconnect()

    def _disconnect(self, gen: Optional[int] = None) -> None:
        """Closes the socket and unmaps and unlinks both arenas and mailboxes (only if they are
        still those of generation ``gen``, when given: a restart may have replaced them)."""
        if not self._channel.detach(gen) or not self.inbox.detach(gen, self.exports.remove):
            return
        if self.endpoint.startswith("ipc://"):
            with contextlib.suppress(OSError):
                os.unlink(self.endpoint.removeprefix("ipc://"))

    # ---- death ---------------------------------------------------------------------------------

    def _monitor(self, worker: "WorkerProcess | RayWorker", gen: int) -> None:
        how = worker.wait_exit()
        try:
            self._on_exit(worker, gen, how)
        except Exception:
            traceback.print_exc()

    def _on_hang(self, gen: int, why: str, stacks: bool = True) -> None:
        """The watchdog says generation `gen` hangs, or its heartbeat that its model cannot
        serve (Model.health): kill it; its death (a restart, with restart="auto") does the rest."""
        with self._lock:
            if gen != self.gen or self.state != "up" or self.worker is None:
                return
            self._hang, worker = (gen, why), self.worker
        say(self.rank, f"pid {worker.pid} {why}; killing it" + " (its thread stacks follow)" * stacks)
        worker.kill(stacks=stacks)

    def _on_exit(self, proc: "WorkerProcess | RayWorker", gen: int, how: str) -> None:
        with self._lock:
            if self._watchdog is not None:
                self._watchdog.stop()
            if self._hang[0] == gen:
                how = f"{self._hang[1]} and was killed"
            if gen != self.gen or self.state in ("closed", "new"):
                return  # an older generation, or a close that expected it
            was = self.state
            restart = (self.rt.restart_policy == "auto" and was == "up" and not self.rt.closed
                       and self.restarts < self.rt.max_restarts)
            # while an automatic restart is coming, new work waits for it instead of failing
            self.state = "starting" if restart else "down"
            self.last_exit = f"pid {proc.pid} {how}"
            self._dead_gen = gen
            inflight, known = self._ledger.clear()
            self._cond.notify_all()
        rt = self.rt
        fix = "it is being restarted" if restart else rt.restart_hint.format(rank=self.rank)
        # Fail first: the promise is within a second of the death.
        fail_for_death(rt, f"worker process rank {self.rank} (pid {proc.pid}) {how}", fix,
                       inflight, known)
        if self.progress and was == "up":
            say(self.rank, f"pid {proc.pid} {how}")
        self._disconnect(gen)
        if rt.restart_policy == "auto" and was == "up" and not restart:
            say(self.rank, f"not restarting rank {self.rank}: restarted {self.restarts} times "
                      "(max_restarts)")
        while restart:  # a generation dying as it starts is followed by another, within max
            self.restarts += 1
            try:
                self.spawn()
                self.wait_ready()
                break
            except Exception as e:  # keep the reason for whoever looks at the link
                with self._lock:
                    restart = self.state != "closed" and self.restarts < self.rt.max_restarts
                    self.state = "starting" if restart else "down" if self.state != "closed" \
                        else "closed"
                    self.last_exit = f"restart failed: {e}"
                    self._cond.notify_all()
                say(self.rank, self.last_exit + ("; starting another" if restart else ""))

    # ---- sending ------------------------------------------------------------------------------

    def send_batch(self, node: int, walk: int, items: list) -> None:
        """Hands a batch from the parent's Conductor to the worker (engine thread)."""
        rt = self.rt
        node_name = rt.node_names[node]
        rejected: Optional[str] = None
        live, ended = [], []
        with self._lock:
            while self.state == "starting" and not rt.closed:
                self._cond.wait(0.2)
            gen = self.gen
            if self.state != "up":
                rejected = (f"worker process rank {self.rank} is not running "
                            f"({self.last_exit or self.state}); "
                            + rt.restart_hint.format(rank=self.rank))
            else:
                for item in items:
                    rid = item.request
                    if not self.rt.requests.knows(rid):
                        ended.append(item.id)
                        continue
                    live.append(item)
                    self._ledger.record(item.id, rid, node_name, remote_values(item.inputs))
        if rejected is not None:
            rt.report(rt.conductor.fail_items([it.id for it in items], rejected))
            return
        if ended:
            rt.report(rt.conductor.fail_items(ended, "the request ended"))
        if live:
            self._transmit(gen, node, walk, live)
            if node in self.feeds:
                answer_windows(rt, node, live, lambda ids: self._take(ids, keep=True))

    def _transmit(self, gen: int, node: int, walk: int, items: list) -> None:
        failures: list[tuple[list[int], str]] = []
        channel = self._channel
        with channel.lock:
            with self._lock:  # not the items of requests ended since (ItemLedger.unsent); a
                # 'release' posted after this check queues behind the batch (post / flush)
                alive = self.gen == gen and channel.is_open(gen)  # else its death failed them
                items = self._ledger.unsent(items) if alive else []
            groups = [items] if items else []
            while groups:
                group = groups.pop()
                with self._lock:
                    opens = self._ledger.unopened(it.request for it in group)
                group_opens = {rid: open_entry(self.rt, self.plan, rid) for rid in opens}
                msg = {"v": VERSION, "kind": "batch", "node": node, "walk": walk,
                       "items": [[it.id, it.request, it.iteration, it.inputs, it.chunk] for it in group],
                       "open": group_opens, **channel.take_held(gen)}
                error = channel.send_locked(gen, msg, lambda: self._alive(gen))
                if error is None:
                    with self._lock:
                        self._ledger.sent_open(opens)
                    continue
                if len(group) > 1:  # isolate: one by one, so only the culprit's request fails
                    groups.extend([it] for it in group)
                else:
                    failures.append(([group[0].id], error))
        channel.flush()
        for ids, message in failures:
            self._report_failed(ids, message)

    def _alive(self, gen: int) -> bool:
        with self._lock:
            return self.gen == gen and self._dead_gen < gen and self.state != "closed"

    def release(self, rid: int) -> None:
        """The request ended in the parent: its items still out are reported as failed (their
        results, if any come, are ignored) and the worker frees what it holds for it."""
        with self._lock:
            held, ids = self._ledger.forget(rid)
            if not held:
                return
            gen = self.gen
        if ids:
            self.rt.report(self.rt.conductor.fail_items(sorted(ids), "the request ended"))
        if deferring():  # the hub's: with the next batch, or once the hub is idle
            self._channel.held.append((gen, "release", rid))
        else:
            self.post({"kind": "release", "requests": [rid]}, gen)

    def moved_out(self, rid: int) -> None:
        """The request's state moved to another worker (kv_moves.py): this one's death spares it."""
        with self._lock:
            self._ledger.moved_out(rid)

    def post(self, msg: dict, gen: Optional[int] = None, wait: bool = False) -> None:
        """A small message (release, kv_moves.py's); the hub's thread sends it after waking;
        ``wait`` (not on the hub's thread): until the worker took it or its generation ended."""
        gen = self.gen if gen is None else gen
        alive = (lambda: self._alive(gen)) if wait else None
        self._channel.send_small(gen, msg, deferring(), alive)

    @property
    def holds(self) -> bool:
        return bool(self._channel.held)

    def flush_posts(self, held: bool = False) -> None:
        """Sends the small messages queued meanwhile (the hub, after each reply), and with
        ``held`` the held fields (the hub, when idle)."""
        if held and self._channel.held:
            self._channel.flush_held()
        if self._channel.pending:
            self._channel.flush()

    def stats(self, timeout: float = 5.0) -> dict:
        with self._lock:
            if self.state != "up":
                raise RuntimeError(f"worker process rank {self.rank} is not running "
                                   f"({self.last_exit or self.state})")
            gen = self.gen
        return self._asks.ask(lambda msg: self._channel.post(gen, msg), "stats", timeout)

    # ---- receiving (the hub's receiver thread) ------------------------------------------------

    def take_mail(self) -> list[list[bytes]]:
        """A local worker's replies; a corrupt mailbox kills it (its death fails its requests)."""
        replies, error = self.inbox.take_mail()
        if error is not None:
            self._bad_reply(f"{error}; killing the worker")
            if self.worker is not None:
                self.worker.kill()
        return replies

    def on_message(self, gen: int, span: int, payload: bytes, tensors: list | tuple = ()) -> None:
        kind, msg, problems = self.inbox.decode(gen, span, payload, tensors)
        for text in problems:
            self._bad_reply(text)
        if kind is None or msg is None or gen != self.gen:
            return
        try:
            self._dispatch(kind, msg)
        except (ProtocolError, CodecError) as e:
            self._bad_reply(str(e))
            ids = msg.get("items")
            if kind in ("done", "failed") and isinstance(ids, list):
                self._report_failed([i for i in ids if type(i) is int],
                                    f"worker process rank {self.rank} sent a malformed reply: {e}")

    def _bad_reply(self, text: str) -> None:
        self.error_replies, self.last_error = self.error_replies + 1, text
        say(self.rank, f"malformed message from the worker: {text}")

    def _dispatch(self, kind: str, msg: dict) -> None:
        if kind == "done":
            complete_from_reply(self.rt, msg, self._take)
        elif kind == "failed":  # named: the message names the node (a segment's)
            self._report_failed(int_list(msg, "items"), field(msg, "message", str),
                                msg.get("named") is True, field(msg, "request", int, True))
        elif kind == "emit":
            deliver_emits(self.rt, msg)
        elif kind == "read":
            with self._lock:
                gone = self._ledger.read(int_list(msg, "items"))
            gone.clear()  # the handles die here, outside the lock: each queues an 'unexport'
        elif kind == "ready":
            nodes, walks = field(msg, "nodes", list), field(msg, "walks", list)
            if nodes != self.rt.node_names or walks != self.rt.walk_names:
                self._fatal = (f"it built a model whose nodes {nodes} / walks {walks} differ "
                               f"from the parent's {self.rt.node_names} / "
                               f"{self.rt.walk_names}; build the same model in every process")
                if self.worker is not None:
                    self.worker.kill()
                return
            self._ready.set()
        elif kind == "heartbeat":
            if self._watchdog is not None:
                self._watchdog.beat(field(msg, "busy", list))
            if field(msg, "health", str, optional=True):  # e.g. a tensor-parallel rank lost
                self._on_hang(self.gen, f"could not serve ({msg['health']})", stacks=False)
        elif kind == "fatal":
            self._fatal = field(msg, "message", str)
        elif kind == "stats":
            self._asks.answer(field(msg, "token", int), field(msg, "stats", dict))
        elif kind == "error":
            self.error_replies, self.last_error = self.error_replies + 1, field(msg, "message", str)
            say(self.rank, self.last_error)

    def _take(self, ids: list[int], keep: bool = False) -> set[int]:
        with self._lock:
            return self._ledger.take(ids, keep)

    def _report_failed(self, ids: list[int], message: str, named: bool = False,
                       request: Optional[int] = None) -> None:
        taken = self._take(ids)
        if taken:
            self.rt.report(self.rt.conductor.fail_items(sorted(taken), message, named=named))
        elif request is not None:  # a run fed by streams failed before its last window came
            self.rt.report(self.rt.conductor.fail(request, message))

    # ---- introspection ------------------------------------------------------------------------

    def info(self) -> dict:
        worker = self.worker
        with self._lock:
            inflight, known = len(self._ledger.inflight), len(self._ledger.known)
        shm = [f"{self._tag}_r{self.rank}_g{self.gen}_{d}"
               for d in ("p2w", "w2p", "p2w_mail", "w2p_mail")] * self._local
        return dict(rank=self.rank, nodes=list(self.plan.nodes), device=self.plan.device,
                    state=self.state, pid=None if worker is None else worker.pid, gen=self.gen,
                    node=None if worker is None else worker.node, endpoint=self.endpoint,
                    shm=shm, restarts=self.restarts, last_exit=self.last_exit,
                    error_replies=self.error_replies, inflight_items=inflight, known_requests=known,
                    direct=list(self.exports.names), exports=self.exports.handed_out)

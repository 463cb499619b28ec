"""The parent's end of one worker process: start and restart it, send it batches, account for
every work item it holds, and fail exactly those requests when it dies.

Accounting: each work item the parent's Conductor hands to a :class:`RemoteEngine` is reported
back exactly once, through the link's :class:`~mstar_rt.placement.ledger.ItemLedger`; a death
fails the items and the requests the worker held state for, and an ended request tells the
worker to free its pages.

Threads: engine threads call :meth:`send_batch`; the hub's receiver thread calls
:meth:`on_message` and :meth:`release` (through the Runtime) and must never wait for the
worker, so small messages go through ``_pending``, sent by whichever thread holds the send lock;
a monitor thread per process waits for it to exit; a pump thread forwards its output.
"""

from __future__ import annotations

import collections
import itertools
import json
import os
import subprocess
import threading
import time
import traceback
from typing import TYPE_CHECKING, Optional

import zmq

from mstar_rt.placement.arena import ArenaFull, ShmArena
from mstar_rt.placement.codec import CodecError, Decoder, Encoder, scalar_items
from mstar_rt.placement.config import ModelSpec, RankPlan
from mstar_rt.placement.ledger import ItemLedger
from mstar_rt.placement.process import WorkerProcess, WorkerStartError, describe_exit, say
from mstar_rt.placement.protocol import (
    PARENT_ID,
    TO_PARENT,
    TO_WORKER_HEADER,
    VERSION,
    ProtocolError,
    check_header,
    field,
    int_list,
)

if TYPE_CHECKING:
    from mstar_rt.placement.runtime import PlacedRuntime


class WorkerLink:
    def __init__(self, runtime: "PlacedRuntime", plan: RankPlan, spec: ModelSpec,
                 zctx: zmq.Context, workdir: str, parent_endpoint: str, tag: str,
                 shm_bytes: int, ready_timeout_s: float, progress: bool,
                 engines: Optional[dict[str, dict]] = None) -> None:
        self.rt = runtime
        self.rank = plan.rank
        self.plan = plan
        self.spec = spec
        self._zctx, self._workdir, self._parent_endpoint, self._tag = zctx, workdir, \
            parent_endpoint, tag
        self.shm_bytes, self.ready_timeout_s, self.progress = shm_bytes, ready_timeout_s, progress
        self.engine_settings = dict(engines or {})
        self.state = "new"  # new | starting | up | down | closed
        self.gen = -1
        self.proc: Optional[subprocess.Popen] = None
        self.worker: Optional[WorkerProcess] = None
        self.endpoint = ""
        self.last_exit: Optional[str] = None
        self.restarts = 0
        self.error_replies = 0
        self.last_error: Optional[str] = None
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._restart_lock = threading.Lock()
        self._tx = threading.Lock()   # the DEALER socket and the outgoing arena
        self._rx = threading.Lock()   # the incoming arena
        self._pending: collections.deque = collections.deque()
        self._ledger = ItemLedger()  # under _lock
        self._dealer: Optional[zmq.Socket] = None
        self._res_gen = self._rx_gen = self._dead_gen = -1
        self._p2w: Optional[ShmArena] = None
        self._w2p: Optional[ShmArena] = None
        self._encoder: Optional[Encoder] = None
        self._decoder: Optional[Decoder] = None
        self._ready = threading.Event()
        self._fatal: Optional[str] = None
        self._threads: list[threading.Thread] = []
        self._waiters: dict[int, list] = {}
        self._tokens = itertools.count(1)

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
        base = f"{self._tag}_r{self.rank}_g{gen}"
        p2w = ShmArena.create(f"{base}_p2w", self.shm_bytes)
        try:
            w2p = ShmArena.create(f"{base}_w2p", self.shm_bytes)
        except BaseException:
            p2w.close()
            p2w.unlink()
            raise
        self.endpoint = f"ipc://{self._workdir}/rank{self.rank}-g{gen}.sock"
        dealer = self._zctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.ROUTING_ID, PARENT_ID)
        dealer.setsockopt(zmq.IMMEDIATE, 1)   # never queue for a worker that is not connected
        dealer.setsockopt(zmq.SNDHWM, 100_000)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(self.endpoint)
        with self._tx:
            self._dealer, self._p2w, self._encoder = dealer, p2w, Encoder(p2w)
            self._res_gen = gen
        with self._rx:
            self._w2p, self._decoder = w2p, Decoder(w2p)
            self._rx_gen = gen
        cfg = dict(rank=self.rank, gen=gen, parent_pid=os.getpid(), factory=self.spec.factory,
                   kwargs={**self.spec.args, **self.plan.model_kwargs}, nodes=self.plan.nodes,
                   device=self.plan.device, engines=self.engine_settings, endpoint=self.endpoint,
                   parent=self._parent_endpoint, p2w=p2w.name, w2p=w2p.name)
        config_path = os.path.join(self._workdir, f"rank{self.rank}-g{gen}.json")
        with open(config_path, "w") as f:
            json.dump(cfg, f)
        worker = WorkerProcess(self.rank, config_path, self.plan.device, self.progress)
        self.proc, self.worker = worker.proc, worker
        if self.progress:
            self._say(f"started (pid {worker.pid}) for nodes {self.plan.nodes}")
        monitor = threading.Thread(target=self._monitor, args=(worker.proc, gen), daemon=True,
                                   name=f"mstar-worker{self.rank}-monitor")
        self._threads = [t for t in self._threads if t.is_alive()] + [worker.pump, monitor]
        monitor.start()
        with self._lock:
            closed = self.state == "closed"
        if closed:  # close() ran meanwhile and could not see this process: stop it here
            worker.stop(graceful=False)
            self._disconnect(gen)
            raise RuntimeError("the placed runtime is closed")

    def wait_ready(self) -> None:
        """Blocks until the worker spawned last reports ready; WorkerStartError otherwise."""
        proc, gen = self.proc, self.gen
        assert proc is not None
        deadline = time.monotonic() + self.ready_timeout_s
        while not self._ready.wait(0.05):
            if proc.poll() is not None or self._fatal is not None:
                try:
                    proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    proc.kill()
                reason = self._fatal or describe_exit(proc.returncode)
                self._fail_start(gen)
                raise WorkerStartError(f"worker process rank {self.rank} failed to start: "
                                       f"{reason}\n{self.worker.last_output()}")
            if time.monotonic() > deadline:
                proc.kill()
                self._fail_start(gen)
                raise WorkerStartError(f"worker process rank {self.rank} did not report ready "
                                       f"within {self.ready_timeout_s} s (ready_timeout_s)\n"
                                       f"{self.worker.last_output()}")
        with self._lock:
            if self.gen == gen and self.state == "starting":
                self.state = "up"
            self._cond.notify_all()
            if self.state != "up":
                raise WorkerStartError(f"worker process rank {self.rank} died right after "
                                       f"starting ({self.last_exit})")

    def _fail_start(self, gen: int) -> None:
        with self._lock:
            if self.gen == gen and self.state == "starting":
                self.state = "down"
                self.last_exit = "failed to start"
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
        proc = self.proc
        with self._lock:
            self.state = "closed"
            self._cond.notify_all()
        if proc is not None and proc.poll() is None:
            self._post(self.gen, {"kind": "shutdown"})
            self.worker.stop(graceful=True)
        for t in self._threads:
            t.join(timeout=5)
        self._disconnect()

    def _disconnect(self, gen: Optional[int] = None) -> None:
        """Closes the socket and unmaps and unlinks both arenas (only if they are still those
        of generation ``gen``, when given: a restart may have replaced them)."""
        with self._tx:
            if gen is not None and gen != self._res_gen:
                return
            if self._dealer is not None:
                self._dealer.close(0)
            if self._p2w is not None:
                self._p2w.unlink()
                self._p2w.close()
            self._dealer, self._p2w, self._encoder = None, None, None
        with self._rx:
            if gen is not None and gen != self._rx_gen:
                return
            if self._w2p is not None:
                self._w2p.unlink()
                self._w2p.close()
            self._w2p, self._decoder = None, None
        if self.endpoint:
            try:
                os.unlink(self.endpoint.removeprefix("ipc://"))
            except OSError:
                pass

    def _say(self, text: str) -> None:
        say(self.rank, text)

    # ---- death ---------------------------------------------------------------------------------

    def _monitor(self, proc: subprocess.Popen, gen: int) -> None:
        code = proc.wait()
        try:
            self._on_exit(proc, gen, code)
        except Exception:
            traceback.print_exc()

    def _on_exit(self, proc: subprocess.Popen, gen: int, code: int) -> None:
        how = describe_exit(code)
        with self._lock:
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
        rt, conductor = self.rt, self.rt.conductor
        fix = ("it is being restarted" if restart
               else f"restart it with restart_worker({self.rank})")
        failed = set()
        # Fail first: the promise is within a second of the death.
        for item, (rid, node) in inflight.items():
            failed.add(rid)
            rt.report(conductor.fail_items(
                [item], f"worker process rank {self.rank} (pid {proc.pid}) {how} while running "
                        f"it; {fix}"))
        for rid, node in known.items():
            if rid not in failed:
                rt.report(conductor.fail(
                    rid, f"worker process rank {self.rank} (pid {proc.pid}) {how}; it held this "
                         f"request's state of node '{node}'; {fix}"))
        if self.progress and was == "up":
            self._say(f"pid {proc.pid} {how}")
        self._disconnect(gen)
        if rt.restart_policy == "auto" and was == "up" and not restart:
            self._say(f"not restarting rank {self.rank}: it was restarted {self.restarts} times "
                      "(max_restarts)")
        if restart:
            self.restarts += 1
            try:
                self.spawn()
                self.wait_ready()
            except Exception as e:  # keep the reason for whoever looks at the link
                with self._lock:
                    self.state = "down" if self.state != "closed" else "closed"
                    self.last_exit = f"restart failed: {e}"
                    self._cond.notify_all()
                self._say(self.last_exit)

    # ---- sending ------------------------------------------------------------------------------

    def send_batch(self, node: int, walk: int, items: list) -> None:
        """Hands a batch from the parent's Conductor to the worker (engine thread)."""
        rt = self.rt
        node_name = rt.node_names[node]
        rejected: Optional[str] = None
        live, ended, opens = [], [], []
        with self._lock:
            while self.state == "starting" and not rt.closed:
                self._cond.wait(0.2)
            gen = self.gen
            if self.state != "up":
                rejected = (f"worker process rank {self.rank} is not running "
                            f"({self.last_exit or self.state}); restart it with "
                            f"restart_worker({self.rank})")
            else:
                for item in items:
                    rid = item[1]
                    if not self._live(rid):
                        ended.append(item[0])
                        continue
                    live.append(item)
                    if self._ledger.record(item[0], rid, node_name):
                        opens.append(rid)
        if rejected is not None:
            rt.report(rt.conductor.fail_items([it[0] for it in items], rejected))
            return
        if ended:
            rt.report(rt.conductor.fail_items(ended, "the request ended"))
        if live:
            self._transmit(gen, node, walk, live, opens)

    def _live(self, rid: int) -> bool:
        return self.rt.requests.knows(rid)

    def _open(self, rid: int) -> dict:
        handle = self.rt.requests.get(rid)
        if handle is None:
            return {"inputs": None, "state": {}}
        ctx = handle.context
        return {"inputs": dict(ctx.inputs) if self.plan.request_inputs else None,
                "state": scalar_items(ctx.state), "order": list(self.rt.order_of(ctx))}

    def _transmit(self, gen: int, node: int, walk: int, items: list, opens: list) -> None:
        failures: list[tuple[list[int], str]] = []
        with self._tx:
            if self.gen != gen or self._dealer is None:
                return  # the worker died meanwhile: its death failed these items
            groups = [items]
            while groups:
                group = groups.pop()
                group_opens = {rid: self._open(rid) for rid in opens
                               if any(it[1] == rid for it in group)}
                msg = {"v": VERSION, "kind": "batch", "node": node, "walk": walk,
                       "items": [[it[0], it[1], it[2], it[3], it[4]] for it in group],
                       "open": group_opens}
                error = self._send_locked(gen, msg)
                if error is None:
                    continue
                if len(group) > 1:  # isolate: one by one, so only the culprit's request fails
                    groups.extend([it] for it in group)
                else:
                    failures.append(([group[0][0]], error))
        self._flush()
        for ids, message in failures:
            self._report_failed(ids, message)

    def _send_locked(self, gen: int, msg: dict) -> Optional[str]:
        """Packs and sends under the send lock; returns an error text instead of raising."""
        arena, dealer, encoder = self._p2w, self._dealer, self._encoder
        assert arena is not None and dealer is not None and encoder is not None
        mark = arena.mark()
        try:
            payload = encoder.pack(msg)
        except (CodecError, ArenaFull) as e:
            arena.rollback(mark)
            return f"cannot send its inputs to worker process rank {self.rank}: {e}"
        span = arena.publish()
        frames = [TO_WORKER_HEADER.pack(gen, span), payload]
        while True:
            try:
                dealer.send_multipart(frames, flags=zmq.NOBLOCK)
                return None
            except zmq.Again:  # not connected yet or the worker lags: wait while it lives
                with self._lock:
                    if self.gen != gen or self._dead_gen >= gen or self.state == "closed":
                        return None  # its death reports the items
                time.sleep(0.0005)

    def _post(self, gen: int, msg: dict) -> None:
        """Queues a small message (no tensors) and sends it if the send lock is free; never
        waits, so the receiver thread may call it."""
        self._pending.append((gen, {"v": VERSION, **msg}))
        self._flush()

    def _flush(self) -> None:
        # Whoever holds the send lock drains; a poster that misses it is drained by the holder,
        # which checks again after letting go.
        while self._pending and self._tx.acquire(blocking=False):
            try:
                while self._pending:
                    gen, msg = self._pending.popleft()
                    if gen == self.gen and self._dealer is not None:
                        try:
                            self._dealer.send_multipart(
                                [TO_WORKER_HEADER.pack(gen, self._p2w.mark()),
                                 Encoder(None).pack(msg)], flags=zmq.NOBLOCK)
                        except zmq.Again:
                            pass  # the worker is gone or hopelessly behind; its death cleans up
            finally:
                self._tx.release()

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
        self._post(gen, {"kind": "release", "requests": [rid]})

    def stats(self, timeout: float = 5.0) -> dict:
        with self._lock:
            if self.state != "up":
                raise RuntimeError(f"worker process rank {self.rank} is not running "
                                   f"({self.last_exit or self.state})")
            gen = self.gen
        token = next(self._tokens)
        waiter: list = [threading.Event(), None]
        self._waiters[token] = waiter
        try:
            self._post(gen, {"kind": "stats", "token": token})
            if not waiter[0].wait(timeout):
                raise TimeoutError(f"worker process rank {self.rank} did not answer a stats "
                                   f"request within {timeout} s")
            return waiter[1]
        finally:
            self._waiters.pop(token, None)

    # ---- receiving (the hub's receiver thread) ------------------------------------------------

    def on_message(self, gen: int, span: int, payload: bytes) -> None:
        with self._rx:
            if gen != self.gen or self._decoder is None or self._w2p is None:
                return  # from a generation that is gone: its arena and items went with it
            try:
                msg = self._decoder.unpack(payload)
                kind = check_header(msg, TO_PARENT)
            except (ProtocolError, CodecError) as e:
                self._bad_reply(str(e))
                return
            finally:
                try:
                    self._w2p.free_to(span)
                except ValueError as e:
                    self._bad_reply(str(e))
        try:
            self._dispatch(kind, msg)
        except (ProtocolError, CodecError) as e:
            self._bad_reply(str(e))
            ids = msg.get("items")
            if kind in ("done", "failed") and isinstance(ids, list):
                self._report_failed([i for i in ids if type(i) is int],
                                    f"worker process rank {self.rank} sent a malformed reply: {e}")

    def _bad_reply(self, text: str) -> None:
        self.error_replies += 1
        self.last_error = text
        self._say(f"malformed message from the worker: {text}")

    def _dispatch(self, kind: str, msg: dict) -> None:
        rt = self.rt
        if kind == "done":
            self._done(msg)
        elif kind == "failed":
            self._report_failed(int_list(msg, "items"), field(msg, "message", str))
        elif kind == "ready":
            nodes, walks = field(msg, "nodes", list), field(msg, "walks", list)
            if nodes != rt.node_names or walks != rt.walk_names:
                self._fatal = (f"it built a model whose nodes {nodes} / walks {walks} differ "
                               f"from the parent's {rt.node_names} / {rt.walk_names}; build "
                               "the same model in every process")
                if self.proc is not None:
                    self.proc.kill()
                return
            self._ready.set()
        elif kind == "fatal":
            self._fatal = field(msg, "message", str)
        elif kind == "stats":
            waiter = self._waiters.get(field(msg, "token", int))
            if waiter is not None:
                waiter[1] = field(msg, "stats", dict)
                waiter[0].set()
        elif kind == "error":
            self.error_replies += 1
            self.last_error = field(msg, "message", str)
            self._say(self.last_error)

    def _done(self, msg: dict) -> None:
        rt = self.rt
        node = field(msg, "node", int)
        ids = int_list(msg, "items")
        outputs = field(msg, "outputs", list)
        stops = field(msg, "stops", list, optional=True)
        states = field(msg, "states", dict)
        if len(outputs) != len(ids) or (stops is not None and len(stops) != len(ids)):
            raise ProtocolError("'done' needs one output map (and stop list) per item")
        if not 0 <= node < len(rt.node_names):
            raise ProtocolError(f"node id {node} is out of range")
        taken = self._take(ids)
        if not taken:
            return
        for rid, state in states.items():  # before complete(): next_walk may read it
            handle = rt.requests.get(rid)
            if handle is not None and isinstance(state, dict):
                handle.context.state.update(state)
        keep_ids, keep_out, keep_stops = [], [], []
        for i, item in enumerate(ids):
            if item not in taken:
                continue
            try:
                stop_ids = [] if stops is None else [rt.loop_id(s) for s in stops[i]]
            except Exception as e:
                rt.report(rt.conductor.fail_items([item], str(e)))
                continue
            keep_ids.append(item)
            keep_out.append(outputs[i])
            keep_stops.append(stop_ids)
        if not keep_ids:
            return
        try:
            outcome = rt.conductor.complete(node, keep_ids, keep_out,
                                            None if stops is None else keep_stops)
        except Exception as e:  # e.g. outputs the node does not declare: fail those items
            outcome = rt.conductor.fail_items(keep_ids, f"{type(e).__name__}: {e}")
        rt.report(outcome)

    def _take(self, ids: list[int]) -> set[int]:
        with self._lock:
            return self._ledger.take(ids)

    def _report_failed(self, ids: list[int], message: str) -> None:
        taken = self._take(ids)
        if taken:
            self.rt.report(self.rt.conductor.fail_items(sorted(taken), message))

    # ---- introspection ------------------------------------------------------------------------

    @property
    def inflight_items(self) -> int:
        with self._lock:
            return len(self._ledger.inflight)

    @property
    def known_requests(self) -> int:
        with self._lock:
            return len(self._ledger.known)

    def info(self) -> dict:
        proc = self.proc
        return dict(rank=self.rank, nodes=list(self.plan.nodes), device=self.plan.device,
                    state=self.state, pid=None if proc is None else proc.pid, gen=self.gen,
                    endpoint=self.endpoint, shm=[f"{self._tag}_r{self.rank}_g{self.gen}_{d}"
                                                 for d in ("p2w", "w2p")],
                    restarts=self.restarts, last_exit=self.last_exit,
                    error_replies=self.error_replies, inflight_items=self.inflight_items,
                    known_requests=self.known_requests)

"""Prefill/decode disaggregation of a causal LM over two processes on one host.

:class:`DisaggregatedLM` runs the ``prefill`` walk in this process (a Runtime over a
:class:`~mstar_rt.distributed.kv_handoff.PrefillSide`, with its own KV engine) and the
``decode`` walk in a decode process it starts
(:mod:`~mstar_rt.distributed.disagg_worker`, a Runtime over a ``DecodeSide`` with another KV
engine). Both build the LM from the same factory. When a request's prefill ends, its K/V (used
tokens only) and decode state are lifted out of this process's cache, the pages freed, and the
bytes sent on a :class:`~mstar_rt.distributed.kv_transfer.KVChannel` (gloo on CPU); the decode
process writes them into pages of its own and decodes. Tokens (and logits) stream back over a
socket pair. :meth:`DisaggregatedLM.submit` returns a :class:`DisaggHandle` that reads like a
:class:`~mstar_rt.runtime.RequestHandle`: the prefill's outputs, then the decode's.

    with DisaggregatedLM.from_pretrained("path/to/llama", emit_logits=True) as lm:
        for name, value in lm.submit({"prompt": [1, 2, 3], "params": {"max_tokens": 32}}):
            ...

A decode process that dies fails the requests it holds at once, naming its pid and exit code;
a transfer that stops answering is given up after ``timeout_s``. With ``restart="auto"`` (the
default) a new decode process starts at once (at most ``max_restarts`` times) and the requests
past their prefill that it did not hold yet are sent to it; with ``"manual"`` every later
request fails too, until the DisaggregatedLM is started again.
"""

from __future__ import annotations

import itertools
import os
import queue
import subprocess
import threading
import time
from multiprocessing.connection import Connection
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence, Union

from mstar_rt.distributed import disagg_worker as dw
from mstar_rt.distributed.child import spawn_child
from mstar_rt.distributed.disagg_args import check_args
from mstar_rt.distributed.group import open_store
from mstar_rt.distributed.kv_handoff import PrefillSide
from mstar_rt.distributed.kv_transfer import KVChannel
from mstar_rt.runtime import (RequestCancelled, RequestFailed, RequestHandle, Runtime,
                              request_failure)

_links = itertools.count()
_RESTART = object()  # on the outbox: start a new decode process before the next handoff


class DisaggHandle:
    """One request of a :class:`DisaggregatedLM`: iterate it for ``(name, value)`` outputs, or
    wait for :meth:`result`; :meth:`cancel` stops it wherever it runs."""

    def __init__(self, owner: "DisaggregatedLM", key: int) -> None:
        self.owner, self.key = owner, key
        self.prefill: Optional[RequestHandle] = None
        self.sent = False  # its handoff went to the decode process
        self.events: queue.SimpleQueue = queue.SimpleQueue()
        self.outputs: dict[str, list] = {}
        self.error: Optional[BaseException] = None
        self.ended = threading.Event()
        self.lock = threading.Lock()

    def push(self, name: str, value: Any) -> None:
        with self.lock:
            if self.ended.is_set():
                return
            self.outputs.setdefault(name, []).append(value)
            self.events.put((name, value))

    def finish(self, error: Optional[BaseException]) -> bool:
        """Ends the request (the first call wins); True if this call ended it."""
        with self.lock:
            if self.ended.is_set():
                return False
            self.error = error
            self.ended.set()
            self.events.put(None)
        self.owner.forget(self)
        return True

    @property
    def done(self) -> bool:
        return self.ended.is_set()

    def __iter__(self) -> Iterator[tuple[str, Any]]:
        while True:
            event = self.events.get()
            if event is None:
                self.events.put(None)
                if self.error is not None:
                    raise self.error
                return
            yield event

    def result(self, timeout: Optional[float] = None) -> dict[str, list]:
        """Every output by name, in order; raises RequestFailed / RequestCancelled, or
        TimeoutError."""
        if not self.ended.wait(timeout):
            raise TimeoutError(f"disaggregated request {self.key} did not finish within "
                               f"{timeout} s")
        if self.error is not None:
            raise self.error
        return self.outputs

    def cancel(self) -> bool:
        return self.owner.cancel(self)


class PrefillRuntime(Runtime):
    """The prefill side's Runtime: tells its owner when each request ends."""

    def __init__(self, model: PrefillSide, owner: "DisaggregatedLM") -> None:
        self.owner = owner
        super().__init__(model)

    def ended(self, handle: RequestHandle, error: Optional[BaseException]) -> None:
        self.owner.prefill_ended(handle, error)


class DisaggregatedLM:
    """A CausalLM whose prefill runs here and whose decode runs in a decode process (see the
    module doc). ``factory`` (``"package.module:callable"``) is called in both processes as
    ``factory(**kwargs, engine=KVCacheEngine(**engine_settings))`` and returns a
    :class:`~mstar_rt.models.causal_lm.CausalLM`; ``prefill_engine`` / ``decode_engine`` are
    each side's KVCacheEngine settings (page sizes may differ). ``devices``: where each side's
    K/V travel from (``cuda:N`` on both selects NCCL, which has never run). ``timeout_s``
    bounds one transfer, ``start_timeout_s`` the decode process's start; ``num_threads``:
    torch threads in the decode process (default: 1 on a CPU with at most 4 cores);
    ``import_path``: directories the decode process imports from (before its PYTHONPATH), for
    the factory; ``restart``: ``"auto"`` replaces a decode process that died (at most
    ``max_restarts`` times), ``"manual"`` does not."""

    def __init__(self, factory: str, kwargs: Optional[Mapping[str, Any]] = None,
                 prefill_engine: Optional[Mapping[str, Any]] = None,
                 decode_engine: Optional[Mapping[str, Any]] = None,
                 devices: tuple[str, str] = ("cpu", "cpu"), timeout_s: float = 60.0,
                 start_timeout_s: float = 120.0, num_threads: Optional[int] = None,
                 import_path: Sequence[str] = (), restart: str = "auto",
                 max_restarts: int = 3) -> None:
        kwargs = dict(kwargs or {})
        check_args(kwargs, devices, restart, max_restarts,
                   dict(timeout_s=timeout_s, start_timeout_s=start_timeout_s))
        if num_threads is None and (os.cpu_count() or 1) <= 4:
            num_threads = 1
        self.lock = threading.RLock()
        self.handles: dict[int, DisaggHandle] = {}
        self.by_prefill: dict[int, DisaggHandle] = {}
        self.early: dict[int, tuple[RequestHandle, Optional[BaseException]]] = {}
        self.keys = itertools.count()
        self.broken: Optional[str] = None
        self.closed = False
        self.send_lock = threading.Lock()
        self.outbox: queue.SimpleQueue = queue.SimpleQueue()
        self.stats_replies: queue.SimpleQueue = queue.SimpleQueue()
        self.worker_said = ""
        self.restart, self.max_restarts, self.restarts = restart, max_restarts, 0
        self.restarting = False  # a new decode process is being started
        self.generation = 0  # of the decode process: a dead one's receiver breaks no newer one
        self.settings = dict(device=devices[1], timeout_s=timeout_s, factory=factory,
                             kwargs=kwargs, engine=dict(decode_engine or {}),
                             threads=num_threads)
        self.import_path, self.devices = import_path, devices
        self.timeout_s, self.start_timeout_s = timeout_s, start_timeout_s

        built: list = []  # the prefill LM, built while the decode process builds its own
        try:
            self.open_link(lambda: built.append(dw.build_lm(factory, kwargs,
                                                            dict(prefill_engine or {}))))
        except BaseException:
            for lm in built:  # the decode side failed after ours was built
                if callable(getattr(lm, "close", None)):
                    lm.close()
            raise
        self.lm = built[0]
        try:
            self.side = PrefillSide(self.lm, export_device=devices[0])
            self.runtime = PrefillRuntime(self.side, self)
        except BaseException:
            self.stop_process(wait_s=1.0)
            self.close_lm()
            raise
        self.sender = threading.Thread(target=self.send_handoffs, daemon=True,
                                       name="mstar-disagg-send")
        self.sender.start()

    def open_link(self, meanwhile: Optional[Callable[[], None]] = None) -> None:
        """Starts a decode process and joins its KV channel (``meanwhile`` runs while it
        builds its LM); raises, having stopped it, when it fails or is late."""
        store = open_store(2, self.start_timeout_s)
        key = f"{os.getpid()}-{next(_links)}"
        proc, conn = spawn_decode_process({**self.settings, "port": store.port, "key": key},
                                          self.import_path)
        with self.send_lock:
            self.proc, self.conn, self.worker_said = proc, conn, ""
        try:
            deadline = time.monotonic() + self.start_timeout_s
            self.await_message(dw.JOINING, deadline, "joining the KV channel")
            channel = KVChannel(store, key, 0, self.devices[0], self.timeout_s)
            if meanwhile is not None:
                meanwhile()
            self.await_message(dw.READY, deadline, "building the LM")
        except BaseException:
            self.stop_process(wait_s=1.0)
            raise
        self.store = store  # serves the decode process's client until both are gone
        self.channel = channel
        self.generation += 1
        self.receiver = threading.Thread(target=self.receive, args=(conn, proc, self.generation),
                                         daemon=True, name="mstar-disagg-receive")
        self.receiver.start()

    def may_restart(self) -> bool:
        """Whether a dead decode process is (being) replaced: the last restart allowed counts
        until it has failed, so requests meanwhile wait for it rather than fail."""
        return self.restart == "auto" and not self.closed and (
            self.restarting or self.restarts < self.max_restarts)

    def why(self) -> str:
        """What broke the link to the decode process, and what comes next."""
        return f"{self.broken}; {self.remedy()}"

    def remedy(self) -> str:
        if self.may_restart():
            return "a new decode process is starting"
        if self.restart == "manual":
            return "close this DisaggregatedLM and start it again"
        return (f"it was restarted {self.restarts} times (max_restarts {self.max_restarts}): "
                "close this DisaggregatedLM and start it again")

    def restart_link(self) -> None:
        """A new decode process in place of the dead one (on the sender's thread, so the
        handoffs wait for it)."""
        if self.broken is None or not self.may_restart():
            return
        with self.lock:  # one step: may_restart() stays True from the first to the last
            self.restarting = True
            self.restarts += 1
        cause = self.broken
        try:
            self.open_link()
        except Exception as e:
            with self.lock:
                self.broken = (f"{cause}; restart {self.restarts} of {self.max_restarts} "
                               f"failed: {type(e).__name__}: {e}")
                self.restarting = False
            return
        with self.lock:
            self.broken, self.restarting = None, False

    @staticmethod
    def from_pretrained(path: Union[str, os.PathLike], **kwargs: Any) -> "DisaggregatedLM":
        """Serves the Llama checkpoint at ``path`` (CausalLM.from_pretrained in both
        processes); ``kwargs`` go to :class:`DisaggregatedLM` when they are its own, the rest
        to ``CausalLM.from_pretrained`` (JSON data: ``emit_logits``, ``max_batch``...)."""
        own = {k: kwargs.pop(k) for k in ("prefill_engine", "decode_engine", "devices",
                                          "timeout_s", "start_timeout_s", "num_threads",
                                          "import_path", "restart", "max_restarts")
               if k in kwargs}
        return DisaggregatedLM("mstar_rt.models.causal_lm:CausalLM.from_pretrained",
                               {"path": os.path.abspath(os.fspath(path)), "progress": False,
                                **kwargs}, **own)

    # ---- requests ----------------------------------------------------------------------------

    def submit(self, inputs: Mapping[str, Any], deadline: Optional[float] = None,
               priority: int = 0) -> DisaggHandle:
        """Starts a request (``prompt``, ``params``): prefill here, decode there."""
        if self.closed:
            raise RuntimeError("submit: the disaggregated LM is closed")
        with self.lock:  # reentrant: a prefill that ends inside submit reports early
            handle = DisaggHandle(self, next(self.keys))
            prefill = self.runtime.submit(inputs, deadline=deadline, priority=priority)
            handle.prefill = prefill
            self.handles[handle.key] = handle
            self.by_prefill[prefill.id] = handle
            early = self.early.pop(prefill.id, None)
        if early is not None:
            self.prefill_ended(*early)
        return handle

    def prefill_ended(self, prefill: RequestHandle, error: Optional[BaseException]) -> None:
        """The prefill Runtime's request ended: pass its outputs on and queue its handoff."""
        with self.lock:
            handle = self.by_prefill.pop(prefill.id, None)
            if handle is None:
                self.early[prefill.id] = (prefill, error)
                return
        if error is not None:
            handle.finish(error)
            return
        outputs = prefill.result(0)
        for i in range(max((len(v) for v in outputs.values()), default=0)):
            for name, values in outputs.items():  # interleaved, as one step emits them
                if i < len(values):
                    handle.push(name, values[i])
        handoff = prefill.context.state.get("handoff")
        if handoff is None:  # done after prefill: nothing to decode
            handle.finish(None)
        elif self.broken is not None and not self.may_restart():
            handle.finish(RequestFailed(self.why()))
        else:
            self.outbox.put((handle, handoff))

    def cancel(self, handle: DisaggHandle) -> bool:
        if not handle.finish(RequestCancelled(f"request {handle.key} was cancelled")):
            return False
        if handle.prefill is not None:
            handle.prefill.cancel()
        with self.send_lock:
            if handle.sent and self.broken is None:
                try:
                    dw.put(self.conn, (dw.CANCEL, handle.key))
                except OSError:
                    pass
        return True

    def forget(self, handle: DisaggHandle) -> None:
        with self.lock:
            self.handles.pop(handle.key, None)

    # ---- the link to the decode process ------------------------------------------------------

    def send_handoffs(self) -> None:
        while True:
            item = self.outbox.get()
            if item is None:
                return
            if item is _RESTART:
                self.restart_link()
                continue
            handle, handoff = item
            if handle.done:
                continue  # cancelled while it waited
            if self.broken is not None:
                self.restart_link()
            if self.broken is not None:
                handle.finish(RequestFailed(self.why()))
                continue
            try:
                with self.send_lock:
                    handle.sent = True
                    dw.put(self.conn, (dw.HANDOFF,))
                self.channel.send_kv({"key": handle.key, "state": handoff.state}, handoff.kv)
            except Exception as e:
                self.break_link(f"sending request {handle.key}'s KV failed: "
                                f"{type(e).__name__}: {e}")

    def receive(self, conn: Connection, proc: Any, generation: int) -> None:
        """Outputs and ends of one decode process's requests, until its connection closes."""
        while True:
            try:
                msg = dw.get(conn)
            except (EOFError, OSError):
                break
            kind = msg[0]
            if kind == dw.EMIT:
                handle = self.handles.get(msg[1])
                if handle is not None:
                    handle.push(msg[2], msg[3])
            elif kind == dw.END:
                handle = self.handles.get(msg[1])
                if handle is not None:
                    handle.finish(None if msg[2] is None else request_failure(
                        f"decode of request {msg[1]} in process {proc.pid} failed: "
                        f"{msg[2]}"))
            elif kind == dw.STATS:
                self.stats_replies.put(msg[1])
            elif kind == dw.ERROR:
                self.worker_said = f" after raising {msg[1]}"
        if not self.closed and generation == self.generation:
            self.break_link("")

    def break_link(self, cause: str) -> None:
        """The decode process or the channel failed: the requests it held fail now. With a
        restart coming the others wait for the new process; else every request past prefill
        fails now, later ones after their prefill."""
        with self.lock:
            if self.broken is None:
                try:
                    self.proc.wait(0.5)
                except subprocess.TimeoutExpired:
                    pass
                self.broken = (f"the decode process of the disaggregated LM failed"
                               f"{': ' + cause if cause else ''} [{self.process_status()}]")
            restart = self.may_restart()
            failed = [h for h in self.handles.values()
                      if h.sent or (not restart and (h.prefill is None or h.prefill.done))]
            why = self.why()
        for handle in failed:
            handle.finish(RequestFailed(why))
        self.stop_process(wait_s=1.0)
        if restart:
            self.outbox.put(_RESTART)

    def process_status(self) -> str:
        code = self.proc.poll()
        state = "is running" if code is None else f"exited with code {code}"
        return f"pid {self.proc.pid} {state}{self.worker_said}"

    def await_message(self, want: str, deadline: float, what: str) -> None:
        while not self.conn.poll(0.05):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                late = "" if self.proc.poll() is not None else " in time (start_timeout_s)"
                raise RuntimeError(f"the decode process failed{late} while {what} "
                                   f"[{self.process_status()}]")
        msg = dw.get(self.conn)
        if msg[0] != want:
            raise RuntimeError(f"the decode process failed while {what}: {msg[-1]} "
                               f"[{self.process_status()}]")

    def stop_process(self, wait_s: float) -> None:
        try:
            with self.send_lock:
                dw.put(self.conn, (dw.CLOSE,))
        except OSError:
            pass
        try:
            self.proc.wait(wait_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    # ---- state and lifecycle -----------------------------------------------------------------

    def health(self) -> Optional[str]:
        """None while the decode process serves, or while a new one will replace it (restart
        auto); else why not, naming the fix (as ``Runtime.health``: for an orchestrator that
        replaces what will not recover)."""
        if self.closed:
            return "this DisaggregatedLM is closed; start it again"
        with self.lock:
            if self.may_restart():
                return None
            if self.broken is not None:
                return self.why()
            if self.proc.poll() is not None:  # dead; its receiver has not seen it yet
                return (f"the decode process of the disaggregated LM failed "
                        f"[{self.process_status()}]; {self.remedy()}")
        return None

    def decode_stats(self, timeout: float = 10.0) -> dict:
        """The decode process's cache and Runtime: ``free_pages``, ``num_pages``,
        ``pending_handoffs``, ``received`` (transfers), ``live`` (Runtime.live)..."""
        if self.broken is not None:
            raise RuntimeError(self.why())
        with self.send_lock:
            dw.put(self.conn, (dw.STATS,))
        try:
            return self.stats_replies.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"the decode process did not report its stats within {timeout} s "
                               f"[{self.process_status()}]") from None

    def prefill_stats(self) -> dict:
        cache = self.side.engine.attached_cache()
        return dict(free_pages=cache.free_pages, num_pages=cache.num_pages,
                    page_size=cache.page_size, sent=self.channel.sent, live=self.runtime.live)

    def close(self) -> None:
        """Cancels what runs, stops the prefill Runtime and the decode process."""
        if self.closed:
            return
        self.closed = True
        for handle in list(self.handles.values()):
            handle.cancel()
        self.runtime.close()
        self.outbox.put(None)
        self.sender.join(10)
        self.stop_process(wait_s=5.0)
        self.receiver.join(10)
        self.conn.close()
        self.close_lm()

    def close_lm(self) -> None:
        """The prefill side's LM holds processes of its own when a factory made it so."""
        close = getattr(self.lm, "close", None)
        if callable(close):
            close()

    def __enter__(self) -> "DisaggregatedLM":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def spawn_decode_process(settings: dict,
                         import_path: Sequence[str] = ()) -> tuple[subprocess.Popen, Connection]:
    """Starts ``python -m mstar_rt.distributed.disagg_worker FD`` and sends it ``settings``."""
    proc, conn = spawn_child("mstar_rt.distributed.disagg_worker", import_path)
    dw.put(conn, settings)
    return proc, conn

"""The decode process of a :class:`~mstar_rt.distributed.disagg.DisaggregatedLM`.

Started as ``python -m mstar_rt.distributed.disagg_worker FD`` (FD: this end of a socket pair to
the prefill process). Over it the worker gets its settings, joins the KV channel as rank 1,
builds the LM from the same factory as the prefill side (its own KV engine) and serves a
:class:`~mstar_rt.distributed.kv_handoff.DecodeSide` Runtime: for each ``handoff`` message it
receives the request's description and K/V on the channel, submits the decode walk, and streams
every output back (``emit``), then the request's end (``end``, with the error text if it
failed). It exits on ``close``, at EOF (the prefill process died), when its parent changes, and
on any error of its own, which it reports first.
"""

from __future__ import annotations

import importlib
import os
import pickle
import signal
import sys
import threading
import traceback
from multiprocessing.connection import Connection
from typing import Any, Callable

import torch

#: Messages from the prefill process.
HANDOFF, CANCEL, STATS, CLOSE = "handoff", "cancel", "stats", "close"
#: Messages from the decode process.
JOINING, READY, EMIT, END, ERROR = "joining", "ready", "emit", "end", "error"


def put(conn: Connection, msg: Any) -> None:
    """Sends ``msg`` by plain pickle: ``Connection.send`` would share tensors through file
    descriptors (torch's multiprocessing reducers), which only multiprocessing's own children
    can take."""
    conn.send_bytes(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL))


def get(conn: Connection) -> Any:
    return pickle.loads(conn.recv_bytes())


def resolve(spec: str) -> Callable[..., Any]:
    """The callable named ``"package.module:attr.attr"``."""
    module, _, attr = spec.partition(":")
    if not module or not attr:
        raise ValueError(f"factory {spec!r} must read 'package.module:attribute'")
    obj: Any = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def build_lm(factory: str, kwargs: dict, engine: dict) -> Any:
    """The CausalLM that ``factory(**kwargs, engine=KVCacheEngine(**engine))`` returns."""
    from mstar_rt.engines.kv_engine import KVCacheEngine
    from mstar_rt.models.causal_lm import CausalLM

    lm = resolve(factory)(**kwargs, engine=KVCacheEngine(**engine))
    if not isinstance(lm, CausalLM):
        raise TypeError(f"factory {factory} returned {type(lm).__name__}, not a CausalLM")
    return lm


class DecodeServer:
    """The worker's loop: handoffs in, outputs out (see the module doc)."""

    def __init__(self, conn: Connection, channel: Any, lm: Any) -> None:
        from mstar_rt.distributed.kv_handoff import DecodeSide
        from mstar_rt.runtime import Runtime

        self.conn, self.channel = conn, channel
        self.side = DecodeSide(lm)
        self.runtime = Runtime(self.side)
        self.send_lock = threading.Lock()
        self.handles: dict[int, Any] = {}

    def send(self, msg: tuple) -> None:
        with self.send_lock:
            put(self.conn, msg)

    def serve(self) -> None:
        from mstar_rt.distributed.kv_handoff import Handoff

        while True:
            msg = get(self.conn)
            kind = msg[0]
            if kind == HANDOFF:
                description, kv = self.channel.recv_kv()
                key = int(description["key"])
                try:
                    inputs = self.side.request(key, Handoff(description["state"], kv))
                    handle = self.runtime.submit(inputs)
                except Exception as e:
                    self.side.pending.take(key)
                    self.send((END, key, f"{type(e).__name__}: {e}"))
                    continue
                self.handles[key] = handle
                threading.Thread(target=self.forward, args=(key, handle), daemon=True,
                                 name=f"mstar-decode-{key}").start()
            elif kind == CANCEL:
                running = self.handles.get(msg[1])
                if running is not None:
                    running.cancel()
            elif kind == STATS:
                self.send((STATS, self.stats()))
            elif kind == CLOSE:
                return

    def forward(self, key: int, handle: Any) -> None:
        try:
            for name, value in handle:
                self.send((EMIT, key, name, value))
            self.send((END, key, None))
        except Exception as e:  # the request failed or was cancelled
            try:
                self.send((END, key, str(e)))
            except OSError:
                pass
        finally:
            self.handles.pop(key, None)

    def stats(self) -> dict:
        cache = self.side.engine.attached_cache()
        return dict(pid=os.getpid(), free_pages=cache.free_pages, num_pages=cache.num_pages,
                    page_size=cache.page_size, live_sequences=cache.live_sequences,
                    pending_handoffs=len(self.side.pending), received=self.channel.received,
                    live=self.runtime.live)

    def close(self) -> None:
        self.runtime.close()


def main(fd: int) -> int:
    from mstar_rt.distributed.follower import watch_parent
    from mstar_rt.distributed.group import join_store
    from mstar_rt.distributed.kv_transfer import KVChannel

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C is the prefill process's to handle
    watch_parent(os.getppid())
    conn = Connection(fd)
    server = None
    try:
        s = get(conn)
        if s.get("threads"):
            torch.set_num_threads(int(s["threads"]))
        store = join_store(s["port"], 2, s["timeout_s"])
        put(conn, (JOINING,))
        channel = KVChannel(store, s["key"], 1, s["device"], s["timeout_s"])
        server = DecodeServer(conn, channel, build_lm(s["factory"], s["kwargs"], s["engine"]))
        put(conn, (READY, os.getpid()))
        server.serve()
        return 0
    except (EOFError, BrokenPipeError, ConnectionResetError):
        return 0  # the prefill process is gone: nothing left to serve
    except BaseException as e:
        traceback.print_exc()
        try:
            put(conn, (ERROR, f"{type(e).__name__}: {e}"))
        except OSError:
            pass
        return 1
    finally:
        if server is not None:
            server.close()


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1])))

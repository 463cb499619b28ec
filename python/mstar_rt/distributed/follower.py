"""A tensor-parallel follower: one rank of a model whose driver is another process.

Started by the driver as ``python -m mstar_rt.distributed.follower FD``, where FD is this end of
a socket pair. Over it the follower gets its settings, then one message per step: the cache
geometry when the driver's cache changed, the pages the driver copied on write, and the step's
sequences (block tables chosen by the driver's allocator), and the caches the driver dropped. The step's token ids (or embeddings)
come by broadcast on the process group; the follower runs its share of the forward, whose
all-reduces meet the driver's, and keeps nothing else. It holds no allocator of its own: its
cache mirrors the driver's page for page.

It exits when the driver says ``close``, when the socket reaches EOF (the driver died), when its
parent process changes (belt and braces for a socket some other child inherited), and on any
error, which it reports over the socket first: a rank that fails cannot rejoin its group.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
import traceback
from multiprocessing.connection import Connection
from typing import Any

import torch

#: Messages the driver sends after the settings.
STEP, CLOSE = "step", "close"
#: Messages a follower sends.
JOINING, READY, ERROR = "joining", "ready", "error"


def watch_parent(parent: int, every_s: float = 0.5) -> None:
    """Exits this process once its parent is gone (it is then re-parented)."""
    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(every_s)
        os._exit(0)

    threading.Thread(target=watch, daemon=True, name="mstar-tp-parent-watch").start()


def serve_steps(conn: Connection, group: Any, module: torch.nn.Module, device: str) -> None:
    """Runs the driver's steps until it says close. The follower mirrors one cache per cache
    of the driver's (one per engine that serves the model), dropped when the driver's goes."""
    from mstar_rt.engines.attention import select_backend
    from mstar_rt.engines.kv_engine import KVStep
    from mstar_rt.engines.paged_kv import PagedKVCache

    caches: dict[int, tuple[PagedKVCache, Any]] = {}
    while True:
        msg = conn.recv()
        if msg[0] == CLOSE:
            return
        _kind, cache_id, geometry, dropped, copies, steps, inputs, shape, dtype = msg
        for gone in dropped:
            caches.pop(gone, None)
        if geometry is not None:  # a cache the driver has not served before: an empty mirror
            page_size, num_pages, backend_name = geometry
            cache = PagedKVCache(module.kv_layout(), page_size, num_pages)
            caches[cache_id] = (cache, select_backend(backend_name, cache))
        cache, backend = caches[cache_id]
        for src, dst in copies:
            cache.copy_page(src, dst)
        x = group.broadcast(torch.empty(shape, dtype=getattr(torch, dtype), device=device))
        with torch.inference_mode():
            step = KVStep(backend, steps)
            if inputs == "ids":
                module(x, step)
            else:
                module(None, step, embeds=x)


def main(fd: int) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C is the driver's to handle
    watch_parent(os.getppid())
    return serve(Connection(fd))


def serve(conn: Connection) -> int:
    """The follower over ``conn`` (a socket pair's end, or a Ray follower's TCP connection,
    distributed/launch.py) until the driver closes it; the exit code."""
    from mstar_rt.distributed.group import TPGroup, join_store
    from mstar_rt.distributed.split import TensorSplit
    from mstar_rt.distributed.tp_driver import shard_loader

    try:
        s = conn.recv()
        if s.get("threads"):
            torch.set_num_threads(int(s["threads"]))
        device = s["device"]
        if torch.device(device).type == "cuda":
            torch.cuda.set_device(torch.device(device))
        store = join_store(s["port"], s["size"], s["timeout_s"], s.get("host", "127.0.0.1"))
        conn.send((JOINING,))
        group = TPGroup(store, s["key"], s["rank"], s["size"], device, s["timeout_s"])
        split = TensorSplit(s["rank"], s["size"], group.all_reduce)
        load = shard_loader(s["loader"])
        module = load(s["path"], split, getattr(torch, s["dtype"]), device)
        conn.send((READY,))
        serve_steps(conn, group, module, device)
        return 0
    except (EOFError, BrokenPipeError, ConnectionResetError):
        return 0  # the driver is gone: nothing left to serve
    except BaseException as e:
        text = f"{type(e).__name__}: {e}"
        traceback.print_exc()
        try:
            conn.send((ERROR, text))
        except OSError:
            pass
        return 1
    finally:
        conn.close()


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1])))

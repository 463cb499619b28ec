"""Tensors worker to worker between Ray actors, which may sit on different machines and share no
memory: the reader fetches the bytes from the producer over ZeroMQ ``tcp://``; the parent still
routes only the handle (placement/direct.py), so a large tensor never crosses the parent's
network link or CPU.

* The producing actor keeps its exports in a private export arena (the same
  :class:`~mstar_rt.placement.direct.ExportArena` a local worker uses, in shared memory that no
  other process maps; its file is unlinked at once, so a killed actor leaves nothing behind) and
  runs an :class:`ExportServer`: a ROUTER socket on its node's address, served by a thread of its
  own (a reader's fetch never waits behind the producer's receiving thread, and two actors
  fetching from each other cannot deadlock). Its endpoint rides as a ninth field of every
  remote header it makes: ``[rank, gen, key, offset, nbytes, kind, dtype, shape, endpoint]``.
* The reading actor's decoder calls :class:`PeerFetcher` for such a header: one request, one
  reply with the bytes (or why not), copied once into the tensor.
* Lifetime is the local path's: the parent holds the handle until the reader's item is
  reported, so the bytes are there while it fetches; then ``unexport`` frees them. A producer
  that died, restarted or stopped answering fails the reading batch with an error naming it.
"""

from __future__ import annotations

import ctypes
import itertools
import os
import threading
import uuid
from typing import Any, Optional

import msgpack
import zmq

from mstar_rt.placement.arena import ShmArena
from mstar_rt.placement.codec import CodecError
from mstar_rt.placement.direct import ExportArena, PeerArenas
from mstar_rt.placement.inline import InlineArena

FETCH_TIMEOUT_S = 10.0


class ExportServer:
    """The producer's side: answers ``[request id, gen, key, offset, nbytes]`` with
    ``[request id, b""]`` and the bytes, or ``[request id, reason]``."""

    def __init__(self, ctx: zmq.Context, host: str, exports: ExportArena, gen: int) -> None:
        self.exports, self.gen = exports, gen
        self.served = 0
        self._sock = ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(f"tcp://{host}:*")
        self.endpoint = self._sock.getsockopt(zmq.LAST_ENDPOINT).decode()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True,
                                        name="mstar-export-server")
        self._thread.start()

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(100):
                continue
            frames = self._sock.recv_multipart()
            ident, req = frames[0], frames[-1]
            self._sock.send_multipart([ident, *self._answer(req)], copy=False)

    def _answer(self, req: bytes) -> list:
        try:
            rid, gen, key, offset, nbytes = fields = msgpack.unpackb(req)
        except Exception:
            fields = None
        if fields is None or not all(type(x) is int for x in fields):  # never kills the thread
            return [msgpack.packb([-1, "a fetch is [request id, gen, key, offset, nbytes], "
                                       "all integers"])]
        if gen != self.gen:
            return [msgpack.packb([rid, f"generation {gen} is gone (now {self.gen}): the "
                                        "worker restarted"])]
        with self.exports.lock:  # an unexport cannot free the block while it is copied
            if not self.exports.holds(key, offset, nbytes):
                return [msgpack.packb([rid, f"no export {key} at [{offset}, +{nbytes})"])]
            data = ctypes.string_at(self.exports.arena.address(offset), nbytes)
        self.served += 1
        return [msgpack.packb([rid, ""]), data]

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2.0)
        self._sock.close(0)


class PeerFetcher:
    """The reader's side: the bytes of a remote header, fetched from the endpoint it names (one
    DEALER per producer, made on first use; one fetch at a time)."""

    def __init__(self, ctx: zmq.Context, timeout_s: float = FETCH_TIMEOUT_S) -> None:
        self._ctx, self.timeout_s = ctx, timeout_s
        self._socks: dict[str, zmq.Socket] = {}
        self._ids = itertools.count()
        self._lock = threading.Lock()

    def __call__(self, h: list) -> tuple[InlineArena, int]:
        rank, gen, key, offset, nbytes, endpoint = h[0], h[1], h[2], h[3], h[4], h[8]
        with self._lock:
            sock = self._socks.get(endpoint)
            if sock is None:
                sock = self._socks[endpoint] = self._ctx.socket(zmq.DEALER)
                sock.setsockopt(zmq.LINGER, 0)
                sock.connect(endpoint)
            rid = next(self._ids)
            sock.send(msgpack.packb([rid, gen, key, offset, nbytes]))
            while True:  # skip the late answers of fetches that timed out
                if not sock.poll(self.timeout_s * 1000):
                    self._socks.pop(endpoint).close(0)
                    raise CodecError(f"an input tensor was made by worker rank {rank} "
                                     f"(generation {gen}, {endpoint}), which did not send its "
                                     f"bytes within {self.timeout_s:g} s: it died or hangs")
                frames = sock.recv_multipart(copy=False)
                got, why = msgpack.unpackb(frames[0].bytes)
                if got == rid:
                    break
            if why:  # a restarted maker listens elsewhere: this socket is done
                self._socks.pop(endpoint).close(0)
        if why or len(frames) != 2 or len(frames[1]) != nbytes:
            raise CodecError(f"worker rank {rank} could not send an input tensor's bytes: "
                             f"{why or 'wrong length'}")
        arena = InlineArena()
        arena.receive([frames[1].buffer])
        return arena, 0

    def close(self) -> None:
        with self._lock:
            for sock in self._socks.values():
                sock.close(0)
            self._socks = {}


class DirectEnds:
    """A worker's ends of the direct path: its export arena (or None) and the reader its decoder
    uses for other workers' exports -- shared memory between local processes, fetches over
    ``tcp://`` between Ray actors (``cfg['transport'] == 'tcp'``)."""

    def __init__(self, cfg: dict, ctx: zmq.Context) -> None:
        self.exports: Optional[ExportArena] = None
        self.server: Optional[ExportServer] = None
        self.reader: Any = None
        if cfg.get("transport") != "tcp":
            if cfg.get("out"):  # made by the parent, on this host
                self.exports = ExportArena(ShmArena.attach(cfg["out"]))
            if cfg.get("shm_prefix"):
                self.reader = PeerArenas(cfg["shm_prefix"])
            return
        if cfg.get("export_bytes"):
            arena = ShmArena.create(f"mstar_x{os.getpid()}_{uuid.uuid4().hex[:8]}_r{cfg['rank']}",
                                    int(cfg["export_bytes"]))
            arena.unlink()  # ours alone: the mapping lives on, the name is gone
            self.exports = ExportArena(arena)
            host = cfg["endpoint"].removeprefix("tcp://").rsplit(":", 1)[0]
            self.server = ExportServer(ctx, host, self.exports, int(cfg["gen"]))
            self.exports.at = self.server.endpoint
        self.reader = PeerFetcher(ctx)

    @property
    def served(self) -> int:
        """Exports whose bytes another machine fetched."""
        return self.server.served if self.server is not None else 0

    def close(self) -> None:
        """Closes the sockets (before the context ends) and the peers' mappings."""
        if self.server is not None:
            self.server.close()
        if self.reader is not None:
            self.reader.close()

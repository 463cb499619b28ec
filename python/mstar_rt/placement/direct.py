"""Tensors worker to worker: a large tensor that one worker makes and only other workers read
goes to them without passing through the parent; the parent routes a handle, as the Conductor
does in one process.

* Which values: :func:`direct_names` -- per worker rank, the names whose every reader is a node
  on another worker (never an EMIT, a persisted value or a model input), decided once from the
  graph and the placement. A stream's items qualify when its consumer sits on another worker:
  they leave the producer one by one (in a reply, or as a segment makes them), the parent's
  stream holds their handles, and the windows carry the handles to the consumer.
* The producing worker (rank A) copies such a tensor, if at least ``direct_bytes`` long, into its
  *export arena* (``<shm prefix>_r<A>_g<gen>_out``, created and unlinked by the parent) and
  replies with its header instead of its bytes (:class:`Export` -> codec ``EXT_REMOTE``).
* The parent decodes that header into a :class:`RemoteTensor` and routes it like any value; a
  worker that gets one in a batch copies the bytes straight out of A's arena.
* Lifetime: the parent's link holds the handles of every item in flight until the item is
  reported back, so the reader has copied them before the handle can die; when the last
  reference dies, A is told to free the bytes (``unexport``, in its next batch message or on its
  own once the hub is idle). A death of A fails its requests anyway; its arena goes with it.

Between local worker processes the bytes are in shared memory; between Ray actors the reader
fetches them from the producer over ``tcp://`` (placement/peer_bytes.py).
"""

from __future__ import annotations

import collections
import threading
from typing import Any, Callable, Mapping, Optional

from mstar_rt.graph import EMIT, GraphEdge, StreamingGraphEdge
from mstar_rt.placement.arena import ArenaFull, ShmArena

DIRECT_BYTES = 64 << 10  # below this a tensor rides in the message through the parent


def direct_names(model: Any, node_rank: Mapping[str, int], workers: set[int]
                 ) -> dict[int, list[str]]:
    """Worker rank -> the value names its nodes make that only nodes on other workers read."""
    readers: dict[str, set[int]] = collections.defaultdict(set)
    makers: dict[str, set[int]] = collections.defaultdict(set)
    barred = set(model.inputs)
    for n in model.nodes:
        for x in n.inputs:
            readers[x].add(node_rank[n.name])
        for o in n.outputs:
            if isinstance(o, str):
                makers[o].add(node_rank[n.name])
            elif (type(o) is GraphEdge and o.to != EMIT and not o.persist) or (
                    type(o) is StreamingGraphEdge):
                makers[o.name].add(node_rank[n.name])
                readers[o.name].add(node_rank[o.to])
            else:  # an EMIT or a persisted value: the parent needs it
                barred.add(o.name)
    out: dict[int, list[str]] = {}
    for name, ranks in makers.items():
        if name in barred or len(ranks) != 1 or not readers.get(name):
            continue
        (maker,) = ranks
        if maker in workers and all(r in workers and r != maker for r in readers[name]):
            out.setdefault(maker, []).append(name)
    return {r: sorted(names) for r, names in out.items()}


class Export:
    """A tensor the codec should put in the export arena (marks an output before packing)."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: Any) -> None:
        self.tensor = tensor


def mark_exports(outputs: list, names: frozenset, min_bytes: int) -> list:
    """``outputs`` (a reply's [{name: value}]) with the large tensors named in ``names`` marked."""
    if not names:
        return outputs
    marked = []
    for out in outputs:
        if isinstance(out, dict) and not names.isdisjoint(out):
            out = {k: (Export(v) if k in names and getattr(v, "nbytes", 0) >= min_bytes
                       and hasattr(v, "data_ptr") else v) for k, v in out.items()}
        marked.append(out)
    return marked


def mark_stream_exports(emits: list, names: frozenset, min_bytes: int) -> list:
    """A segment's ``emits`` with the large items of the streams named in ``names`` marked
    (``[request, name, value, node]``: a stream leaving the segment; ``[request, name, value]``
    is an EMIT, which the parent needs)."""
    if not names:
        return emits
    return [[*e[:2], Export(e[2]), e[3]] if len(e) == 4 and e[1] in names
            and getattr(e[2], "nbytes", 0) >= min_bytes and hasattr(e[2], "data_ptr") else e
            for e in emits]


class ExportArena:
    """The producing worker's side: bytes stay until the parent says ``unexport`` (out of order,
    so the ring's tail advances over every freed block at its front)."""

    def __init__(self, arena: ShmArena) -> None:
        self.arena = arena
        self.at = ""  # where other machines fetch the bytes (placement/peer_bytes.py)
        self.lock = threading.Lock()
        self._order: collections.deque = collections.deque()  # [key, freed, offset, nbytes], in ring order
        self._live: dict[int, list] = {}  # key (the block's end in the ring) -> its entry

    def put(self, nbytes: int) -> Optional[tuple[int, int]]:
        """(key, offset) of ``nbytes`` free bytes, or None when the arena is full (the tensor
        then goes through the parent: never wait here, this may be the thread that frees)."""
        with self.lock:
            try:
                offset = self.arena.alloc(nbytes, 0.0)
            except ArenaFull:
                return None
            key = self.arena.publish()
            entry = [key, False, offset, nbytes]
            self._order.append(entry)
            self._live[key] = entry
            return key, offset

    def holds(self, key: int, offset: int, nbytes: int) -> bool:
        """Whether export ``key`` is live and spans exactly these bytes (under :attr:`lock`)."""
        entry = self._live.get(key)
        return entry is not None and entry[2] == offset and entry[3] == nbytes

    def free(self, keys: list[int]) -> None:
        with self.lock:
            for key in keys:
                entry = self._live.pop(key, None)
                if entry is not None:
                    entry[1] = True
            end = None
            while self._order and self._order[0][1]:
                end = self._order.popleft()[0]
            if end is not None:
                self.arena.free_to(end)

    @property
    def in_use(self) -> int:
        return self.arena.in_use


class RemoteTensor:
    """The parent's handle of a tensor left in worker ``rank``'s export arena: routed like any
    value, resolved by the worker that reads it. ``header``: ``[rank, gen, key, offset, nbytes,
    kind, dtype, shape]`` (codec ``EXT_REMOTE``); ``on_free(gen, key)`` when it dies."""

    __slots__ = ("header", "_on_free")

    def __init__(self, header: list, on_free: Callable[[int, int], None]) -> None:
        self.header, self._on_free = header, on_free

    def __repr__(self) -> str:
        return (f"RemoteTensor(rank={self.header[0]}, dtype={self.header[6]}, "
                f"shape={list(self.header[7])})")

    def __del__(self) -> None:
        try:
            self._on_free(self.header[1], self.header[2])
        except Exception:  # interpreter shutdown: the arena goes with its worker
            pass


class LinkExports:
    """The parent's side for one worker: its direct value names, its export arena (one per
    generation, made before the worker starts, removed with it) and the handles it hands out;
    ``hold(gen, field, value)`` queues an ``unexport`` for its next message (or the hub's idle
    moment). Once the handles that died since the last ``hurry()`` held ``hurry_bytes`` (a
    quarter of the arena, by default), ``hurry()`` sends the held unexports now: a long stream
    keeps the hub busy, and the maker's arena would fill while they wait for a quiet moment."""

    def __init__(self, rank: int, names: list[str], min_bytes: int,
                 hold: Callable[[int, str, Any], None],
                 hurry: Callable[[], None] = lambda: None, hurry_bytes: int = 1 << 62) -> None:
        self.rank, self.names, self.min_bytes, self._hold = rank, list(names), min_bytes, hold
        self._hurry, self.hurry_bytes, self.freed_bytes = hurry, hurry_bytes, 0
        self.arena: Optional[ShmArena] = None
        self.handed_out = 0  # handles made, for stats and tests

    def create(self, base: str, capacity: int) -> Optional[str]:
        """A new generation's arena (None: this worker exports nothing)."""
        if not self.names:
            return None
        self.remove()  # a generation that was never disconnected
        self.arena = ShmArena.create(f"{base}_out", capacity)
        return self.arena.name

    def remove(self) -> None:
        if self.arena is not None:
            self.arena.unlink()
            self.arena.close()
            self.arena = None

    def handle(self, gen: int, header: list) -> RemoteTensor:
        """The handle of an export the worker of generation ``gen`` replied with."""
        if header[0] != self.rank or header[1] != gen:
            from mstar_rt.placement.codec import CodecError

            raise CodecError(f"worker rank {self.rank} sent a remote tensor of rank {header[0]} "
                             f"generation {header[1]}; a worker hands out its own exports only")
        self.handed_out += 1
        return RemoteTensor(header, lambda g, key, n=header[4]: self._freed(g, key, n))

    def _freed(self, gen: int, key: int, nbytes: int) -> None:
        self._hold(gen, "unexport", key)
        self.freed_bytes += nbytes  # (threads may race here: it only decides when to hurry)
        if self.freed_bytes >= self.hurry_bytes:
            self.freed_bytes = 0
            self._hurry()


class PeerArenas:
    """A reading worker's side: the other workers' export arenas, mapped on first use."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self._arenas: dict[tuple[int, int], ShmArena] = {}

    def __call__(self, h: list) -> tuple[ShmArena, int]:
        """The arena and offset of remote header ``h``'s bytes."""
        if len(h) > 8:
            from mstar_rt.placement.codec import CodecError

            raise CodecError(f"an input tensor was made by worker rank {h[0]} on another machine "
                             "(a Ray actor); this worker reads shared memory only")
        return self._arena(h[0], h[1]), h[3]

    def _arena(self, rank: int, gen: int) -> ShmArena:
        arena = self._arenas.get((rank, gen))
        if arena is None:
            try:
                arena = ShmArena.attach(f"{self.prefix}_r{rank}_g{gen}_out")
            except (OSError, ValueError) as e:
                from mstar_rt.placement.codec import CodecError

                raise CodecError(f"an input tensor was made by worker rank {rank} (generation "
                                 f"{gen}), whose memory is gone: it died or restarted ({e})"
                                 ) from None
            self._arenas[(rank, gen)] = arena
        return arena

    def close(self) -> None:
        for arena in self._arenas.values():
            arena.close()
        self._arenas = {}


def remote_values(values: Mapping[str, Any]) -> list:
    """The RemoteTensors among an item's input values (and in their lists)."""
    found = []
    for v in values.values():
        if type(v) is RemoteTensor:
            found.append(v)
        elif type(v) in (list, tuple):
            found += [x for x in v if type(x) is RemoteTensor]
    return found


__all__ = ["DIRECT_BYTES", "Export", "ExportArena", "LinkExports", "PeerArenas", "RemoteTensor",
           "direct_names", "mark_exports", "mark_stream_exports", "remote_values"]

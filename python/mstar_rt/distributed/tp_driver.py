"""The driver of a tensor-parallel LM: rank 0 in this process, ranks 1.. in followers.

:func:`load_tp` starts ``tp_size - 1`` follower processes (:mod:`mstar_rt.distributed.follower`),
joins them in a process group, and returns a :class:`TensorParallelLM`: a module with the face
of the LM it splits (``forward(ids, step, embeds=None, **kw)`` / ``embed`` / ``logits`` /
``kv_layout``), so the node that served the whole LM on a KVCacheEngine serves it unchanged.
Which LM is a *loader*, ``"module:function"`` building one rank's shard from a checkpoint
(``function(path, split, dtype, device)``): :func:`~mstar_rt.distributed.llama_tp.load_llama_tp`
splits a Llama, :func:`~mstar_rt.models.qwen3_omni.thinker_tp.load_thinker_tp` Qwen3-Omni's
thinker. The engine's cache holds rank 0's share of the KV heads and its allocator decides every
page; each step, the driver sends the followers the step's block tables (and any page copied on
write), broadcasts the token ids (or input embeddings), and runs its own share; the all-reduces
inside meet the followers'. Logits are computed on the driver alone (the LM head is
replicated), so sampling stays there.

A follower that dies or fails breaks the group: the step in flight raises with a message naming
the rank and what it said, and its requests fail; the Runtime stays up. With ``restart="auto"``
(the default) the next step first rebuilds the group (new followers, a new process group; rank
0's weights and cache stay), and a request whose K/V was built before that fails alone when it
next reads it (distributed/kv_loss.py); ``"eager"`` rebuilds it as soon as the loss is seen
(distributed/tp_watch.py); with ``"manual"``, or after ``max_restarts`` rebuilds,
every later step fails until the model is loaded again. Followers exit when the driver is
closed, collected or dies.
"""

from __future__ import annotations

import itertools
import os
import subprocess
import threading
import time
import weakref
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, Callable, Optional, Union

import torch
from torch import nn

from mstar_rt.distributed import follower as fl
from mstar_rt.distributed.child import spawn_child
from mstar_rt.distributed.group import TPGroup, open_store
from mstar_rt.distributed.kv_loss import LostPages
from mstar_rt.distributed.launch import RayFollowers, ray_followers
from mstar_rt.distributed.split import TensorSplit
from mstar_rt.distributed.tp_watch import watch_group
from mstar_rt.engines.kv_engine import KVStep
from mstar_rt.engines.paged_kv import KVLayout

_groups = itertools.count()


@dataclass
class Follower:
    rank: int
    proc: Any  # subprocess.Popen, or a Ray follower's launch.ActorProc (the same calls)
    conn: Connection

    def status(self) -> str:
        """What became of the follower, for error messages."""
        said = ""
        try:
            while self.conn.poll(0):
                msg = self.conn.recv()
                if msg[0] == fl.ERROR:
                    said = f" after raising {msg[1]}"
        except (EOFError, OSError):
            pass
        code = self.proc.poll()
        state = "is running" if code is None else f"exited with code {code}"
        where = f" on {self.proc.node}" if getattr(self.proc, "node", None) else ""
        return f"rank {self.rank} (pid {self.proc.pid}{where}) {state}{said}"


def stop_followers(followers: list[Follower], wait_s: float = 5.0) -> None:
    """Asks each follower to exit, then kills what is left after ``wait_s``."""
    for f in followers:
        try:
            f.conn.send((fl.CLOSE,))
        except OSError:
            pass
    deadline = time.monotonic() + wait_s
    for f in followers:
        try:
            f.proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            f.proc.kill()
            f.proc.wait()
        f.conn.close()
    followers.clear()


def spawn_follower(rank: int, settings: dict[str, Any]) -> Follower:
    """Starts rank ``rank``'s process and sends it its settings."""
    proc, conn = spawn_child("mstar_rt.distributed.follower")
    f = Follower(rank, proc, conn)
    f.conn.send({**settings, "rank": rank})
    return f


def await_all(followers: list[Follower], want: str, deadline: float, what: str) -> None:
    """Waits until every follower has sent ``want``; a follower that exits, reports an error or
    stays silent past ``deadline`` is a RuntimeError naming it."""
    waiting = list(followers)
    while waiting:
        for f in list(waiting):
            if f.conn.poll(0.02):
                try:
                    msg = f.conn.recv()
                except (EOFError, OSError):
                    msg = (fl.ERROR, "closed its connection")
                if msg[0] == want:
                    waiting.remove(f)
                    continue
                raise RuntimeError(f"tensor-parallel {f.status()} while {what}: {msg[-1]}")
            if f.proc.poll() is not None:
                raise RuntimeError(f"tensor-parallel {f.status()} while {what}")
        if waiting and time.monotonic() > deadline:
            names = ", ".join(f.status() for f in waiting)
            raise RuntimeError(f"tensor-parallel followers did not finish {what} in time: "
                               f"{names}; raise start_timeout_s")


@dataclass(frozen=True)
class GroupSpec:
    """What starting (or restarting) a group's followers takes."""

    path: str
    size: int
    loader: str  # "module:function" building one rank's shard (see the module doc)
    name: str  # what the LM is called in messages ("Llama", "Qwen3-Omni thinker")
    dtype: str
    device: str
    timeout_s: float
    start_timeout_s: float
    threads: Optional[int]
    remote: Optional[RayFollowers]  # followers as Ray actors (distributed/launch.py), or None


class GroupRef:
    """The group rank 0's collectives go through, so a rebuild swaps it under the loaded shard."""

    def __init__(self) -> None:
        self.group: Optional[TPGroup] = None

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        assert self.group is not None
        return self.group.all_reduce(t)


def start_group(spec: GroupSpec, load: Optional[Callable[[TPGroup], nn.Module]] = None
                ) -> tuple[list[Follower], TPGroup, Optional[nn.Module]]:
    """Starts ranks 1.. and joins them with this process as rank 0 in a fresh process group;
    ``load(group)`` builds rank 0's shard meanwhile (the followers load theirs in parallel).
    Raises, having stopped what it started, when a follower fails or is late."""
    store = open_store(spec.size, spec.start_timeout_s)
    key = f"{os.getpid()}-{next(_groups)}"
    settings = dict(size=spec.size, port=store.port, key=key, path=spec.path, dtype=spec.dtype,
                    timeout_s=spec.timeout_s, threads=spec.threads, loader=spec.loader)
    followers: list[Follower] = []
    remote, index = spec.remote, torch.device(spec.device).index or 0
    try:
        if remote is not None:  # each on its own node: the first device there
            followers = remote.spawn(spec.size, {**settings, "device": spec.device},
                                     spec.start_timeout_s)
        for rank in range(1, spec.size if remote is None else 0):
            where = (f"cuda:{index + rank}" if torch.device(spec.device).type == "cuda"
                     else spec.device)
            followers.append(spawn_follower(rank, {**settings, "device": where}))
        deadline = time.monotonic() + spec.start_timeout_s
        await_all(followers, fl.JOINING, deadline, "starting")
        group = TPGroup(store, key, 0, spec.size, spec.device, spec.timeout_s)
        shard = load(group) if load is not None else None
        await_all(followers, fl.READY, deadline, "loading its share of the weights")
    except BaseException:
        stop_followers(followers, wait_s=1.0)
        raise
    return followers, group, shard


class TensorParallelLM(nn.Module):
    """Rank 0 of a tensor-parallel LM and the handle on its followers (see the module doc).
    Build it with :func:`load_tp` (or a family's loader); :meth:`close` stops the followers (so
    does garbage collection or the end of this process)."""

    def __init__(self, shard: nn.Module, ref: GroupRef, followers: list[Follower],
                 spec: GroupSpec, restart: str = "auto", max_restarts: int = 3) -> None:
        super().__init__()
        self.shard = shard
        self.config: Any = shard.config
        self.tp_size = spec.size
        self.ref, self.followers, self.spec, self.path = ref, followers, spec, spec.path
        self.restart, self.max_restarts, self.restarts = restart, max_restarts, 0
        self.broken: Optional[str] = None  # what broke the group (why() adds what comes next)
        self.loss: Optional[str] = None  # what the last rebuild replaced
        self.lost: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # cache -> LostPages
        self.closed = False
        self.lock = threading.Lock()
        # The driver's caches the followers mirror (by number), and those collected since the
        # last step, whose mirrors the followers drop.
        self.cache_ids: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.dropped: list[int] = []
        self.cache_numbers = itertools.count()
        self.finalizer = weakref.finalize(self, stop_followers, followers)
        self.watcher = watch_group(self) if restart == "eager" else None

    @property
    def group(self) -> TPGroup:
        assert self.ref.group is not None
        return self.ref.group

    @property
    def model(self) -> nn.Module:
        """The rank-0 body (its embedding is whole: the engine reads its device from it)."""
        return self.shard.model

    def kv_layout(self) -> KVLayout:
        """Rank 0's share of the cache: ``num_key_value_heads / tp_size`` heads."""
        return self.shard.kv_layout()

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.shard.embed(token_ids)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.shard.logits(hidden)

    def forward(self, token_ids: Optional[torch.Tensor], step: KVStep,
                embeds: Optional[torch.Tensor] = None, **kwargs: Any) -> Any:
        """The shard's forward; ``kwargs`` reach rank 0's alone (what it returns beside the
        hidden states, e.g. the thinker's ``hidden_layer``: the followers' outputs are unused)."""
        x = token_ids if embeds is None else embeds
        assert x is not None
        with self.lock:
            self.check_usable()
            self.check_kept(step)  # before the cache is mirrored: a refused step sends nothing
            cache_id, geometry = self.follow_cache(step)  # a wrong step breaks nothing yet
            try:
                cache = step.backend.cache
                copies, cache.copy_log = cache.copy_log or [], []
                dropped = self.dropped[:]  # the list stays: finalizers append to it
                del self.dropped[:len(dropped)]
                msg = (fl.STEP, cache_id, geometry, dropped, copies, list(step.steps),
                       "ids" if embeds is None else "embeds", tuple(x.shape),
                       str(x.dtype).removeprefix("torch."))
                for f in self.followers:
                    f.conn.send(msg)
                self.group.broadcast(x.contiguous())
                return self.shard(token_ids, step, embeds, **kwargs)
            except Exception as e:
                raise self.break_group(f"{type(e).__name__}: {e}") from None

    def follow_cache(self, step: KVStep) -> tuple[int, Optional[tuple[int, int, str]]]:
        """The number of the step's cache, and its geometry when the followers do not mirror
        it yet (a new engine), else None."""
        backend = step.backend
        cache = getattr(backend, "cache", None)
        if cache is None or not hasattr(backend, "plan"):
            raise TypeError(f"a tensor-parallel {self.spec.name} runs eager steps only; its decode cannot "
                            "go through static CUDA-graph buckets (drop cuda_graphs/compile)")
        known = self.cache_ids.get(cache)
        if known is not None:
            return known, None
        number = next(self.cache_numbers)
        self.cache_ids[cache] = number
        weakref.finalize(cache, self.dropped.append, number)
        cache.copy_log = []
        return number, (cache.page_size, cache.num_pages, backend.name)

    def check_kept(self, step: KVStep) -> None:
        """Refuses a step that would read K/V built before the last rebuild (the followers'
        share of it is gone); else notes the pages it makes whole again."""
        cache = getattr(step.backend, "cache", None)
        lost: Optional[LostPages] = self.lost.get(cache) if cache is not None else None
        if not lost:
            return
        lost.follow_copies(cache.copy_log or [])
        if lost.reader(step.steps) is not None:
            raise RuntimeError(f"this request's K/V was built before the tensor-parallel group "
                               f"of {self.path} was restarted ({self.loss}); the new followers "
                               "do not hold their share of it: submit the request again")
        lost.written(step.steps)

    def check_usable(self) -> None:
        """Raises when no step can run; rebuilds a broken group first when allowed."""
        if self.closed:
            raise RuntimeError(f"the tensor-parallel {self.spec.name} of {self.path} is closed; "
                               "load it again")
        if self.broken is None and any(f.proc.poll() is not None for f in self.followers):
            self.break_group("")
        if self.broken is None:
            return
        if not self.may_restart():
            raise RuntimeError(self.why())
        self.rebuild()

    def may_restart(self) -> bool:
        return self.restart in ("auto", "eager") and self.restarts < self.max_restarts

    def heal(self) -> None:
        """Rebuilds now a group that lost a rank, when it may be (``restart="eager"``'s watcher
        calls it; a step in flight finishes first)."""
        if self.broken is None and all(f.proc.poll() is None for f in self.followers):
            return
        if self.broken is not None and not self.may_restart():
            return
        with self.lock:
            if not self.closed:
                self.check_usable()

    def rebuild(self) -> None:
        """A new group in place of the broken one: fresh followers and process group; rank 0
        keeps its weights, and every page its caches hold now is lost to the followers."""
        cause, self.restarts = self.broken, self.restarts + 1
        try:
            followers, group, _ = start_group(self.spec)
        except Exception as e:
            self.broken = (f"{cause}; restart {self.restarts} of {self.max_restarts} failed: "
                           f"{type(e).__name__}: {e}")
            raise RuntimeError(self.why()) from None
        self.ref.group = group
        self.followers[:] = followers  # the finalizer's list
        # and those lost at an earlier rebuild that no step has mirrored since (a refused step
        # or the eager watcher's rebuild): forgetting them let a later step read them, wrong
        caches = list(self.cache_ids) + [c for c in list(self.lost) if c not in self.cache_ids]
        self.lost = weakref.WeakKeyDictionary(
            {c: LostPages(c.pages_in_use(), c.page_size) for c in caches})
        self.cache_ids = weakref.WeakKeyDictionary()  # the new followers mirror no cache yet
        del self.dropped[:]
        self.loss, self.broken = cause, None

    def health(self) -> Optional[str]:
        """None while every rank can step, or while a lost rank will be restarted by the next
        step; else why not (no side effect: the group is marked broken by the next step)."""
        if self.closed:
            return f"the tensor-parallel {self.spec.name} of {self.path} is closed; load it again"
        gone = [f.status() for f in self.followers if f.proc.poll() is not None]
        if (self.broken is None and not gone) or self.may_restart():
            return None
        if self.broken is None:
            return (f"the tensor-parallel group of {self.path} (tp_size {self.tp_size}) lost "
                    f"a rank [{'; '.join(gone)}]; {self.remedy()}")
        return self.why()

    def why(self) -> str:
        """What broke the group, and what comes next."""
        return f"{self.broken}; {self.remedy()}"

    def remedy(self) -> str:
        if self.may_restart():
            return "the next step restarts it" if self.restart == "auto" else "being restarted"
        if self.restart == "manual":
            return ("a group with restart='manual' cannot take a rank back: close this model "
                    "and load it again")
        return (f"it was restarted {self.restarts} times (max_restarts {self.max_restarts}): "
                "close this model and load it again")

    def break_group(self, cause: str) -> RuntimeError:
        """Marks the group broken (no step runs until it is rebuilt), stops the followers and
        returns the error that says what happened."""
        for f in self.followers:  # a killed rank's socket closes before it can be reaped
            try:
                f.proc.wait(0.5)
            except subprocess.TimeoutExpired:
                pass
        states = "; ".join(f.status() for f in self.followers)
        self.broken = (f"the tensor-parallel group of {self.path} (tp_size {self.tp_size}) "
                       f"failed{': ' + cause if cause else ''} [{states}]")
        stop_followers(self.followers, wait_s=1.0)
        return RuntimeError(self.why())

    def close(self) -> None:
        """Stops the followers (waits for a step in flight) and lets the process group go (its
        threads and sockets end with it, not with this object); later steps raise."""
        if self.watcher is not None:
            self.watcher.set()
        with self.lock:
            self.closed = True
            self.finalizer()
            self.ref.group = None

    def __enter__(self) -> "TensorParallelLM":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def load_tp(path: Union[str, os.PathLike], tp_size: int, loader: str, name: str,
            dtype: torch.dtype, device: str = "cpu", timeout_s: float = 60.0,
            start_timeout_s: float = 300.0, num_threads: Optional[int] = None,
            restart: str = "auto", max_restarts: int = 3) -> TensorParallelLM:
    """The checkpoint at ``path`` split over ``tp_size`` ranks by ``loader`` (see the module
    doc; the caller has checked that ``tp_size`` splits it): this process is rank 0 (on
    ``device``), ranks 1.. are follower processes (on ``cuda:N+rank`` when ``device`` is
    ``cuda:N``; gloo on CPU, NCCL on CUDA). ``timeout_s`` bounds each collective (a rank that
    stopped answering), ``start_timeout_s`` the followers' start. ``num_threads``: torch threads
    in each follower (default: 1 on a CPU with at most 4 cores, else torch's). ``restart``:
    ``"auto"`` rebuilds a group that lost a rank at its next step (at most ``max_restarts``
    times), ``"eager"`` as soon as the loss is seen (distributed/tp_watch.py), ``"manual"``
    leaves it failing until loaded again."""
    path = os.fspath(path)
    if restart not in ("auto", "eager", "manual"):
        raise ValueError(f"restart must be 'auto', 'eager' or 'manual', not {restart!r}")
    local = ray_followers() is None  # (Ray actors may find their GPUs on other nodes)
    if local and torch.device(device).type == "cuda" and torch.cuda.device_count() < tp_size + (
            torch.device(device).index or 0):  # each follower died of a torch._C error
        raise ValueError(f"device={device!r} with tp_size {tp_size} needs CUDA devices "
                         f"{device} and the {tp_size - 1} after it; this process sees "
                         f"{torch.cuda.device_count()}: give device='cpu' or a smaller tp_size")
    if num_threads is None and torch.device(device).type == "cpu":
        num_threads = 1 if (os.cpu_count() or 1) <= 4 else None
    spec = GroupSpec(os.path.abspath(path), tp_size, loader, name,
                     str(dtype).removeprefix("torch."), device, timeout_s, start_timeout_s,
                     num_threads, ray_followers())
    ref = GroupRef()
    load_shard = shard_loader(loader)

    def load(group: TPGroup) -> nn.Module:
        ref.group = group
        return load_shard(path, TensorSplit(0, tp_size, ref.all_reduce), dtype, device)

    followers, _group, shard = start_group(spec, load)
    assert shard is not None
    return TensorParallelLM(shard, ref, followers, spec, restart, max_restarts)


def shard_loader(loader: str) -> Callable[..., nn.Module]:
    """The function ``"module:function"`` names."""
    import importlib

    module, _, function = loader.partition(":")
    return getattr(importlib.import_module(module), function)

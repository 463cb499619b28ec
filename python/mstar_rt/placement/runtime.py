"""PlacedRuntime: a Runtime whose nodes may run in worker processes.

The parent keeps the Conductor, the state machine and every node no NodeGroup sends away; each
worker process runs its group's nodes on their own engines (a KV cache lives with its engine, in
the worker). The caller sees the Runtime's interface unchanged: ``submit`` returns a
RequestHandle, results and errors arrive the same way.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import tempfile
import traceback
from typing import Any, Mapping, Optional, Sequence, Union

import zmq

from mstar_rt.engines.base import Engine
from mstar_rt.placement.arena import sweep_stale
from mstar_rt.placement.config import ModelSpec, NodeGroup, make_plan, read_config
from mstar_rt.placement.channel import deferring
from mstar_rt.placement.direct import DIRECT_BYTES, direct_names
from mstar_rt.placement.hub import Hub, bell_path
from mstar_rt.placement.mailbox import spin_default
from mstar_rt.placement.link import WorkerLink
from mstar_rt.placement.ray_rank import RayLauncher, connect_ray, disconnect_ray
from mstar_rt.placement.remote import PlacedModel, RemoteEngine
from mstar_rt.model import RequestContext, node_engines
from mstar_rt.placement.segments import SEGMENT_ENGINE, SegmentPlan, find_segments, section_nodes
from mstar_rt.compiler import compile_model
from mstar_rt.config.errors import ConfigError, KeyProblem
from mstar_rt.config.placement import refuse_tp_args_beside_workers
from mstar_rt.runtime import Runtime

_STAND_IN = re.compile(r"node 'segment:[^']*'")  # how a failure names a segment's stand-in


def split_engines(model: Any, plan: Any, engines: Mapping[str, Engine]
                  ) -> tuple[dict[str, Engine], dict[int, dict[str, dict]]]:
    """``engines`` overrides (Runtime(engines=...)) for the parent, and for each worker rank the
    settings of the KVCacheEngines it should build instead of the model's (an engine object
    cannot cross processes; its settings can)."""
    engine_of = node_engines(model)
    ranks_of: dict[str, set[int]] = {}  # several when a KV engine's walks are split
    for n, r in plan.node_rank.items():
        if r in plan.workers:
            ranks_of.setdefault(engine_of[n], set()).add(r)
    local: dict[str, Engine] = {}
    remote: dict[int, dict[str, dict]] = {}
    for name, engine in engines.items():
        if name not in ranks_of:
            local[name] = engine
            continue
        from mstar_rt.engines.kv_engine import KVCacheEngine

        if type(engine) is not KVCacheEngine:
            raise ValueError(f"engine '{name}' serves nodes placed in worker rank "
                             f"{sorted(ranks_of[name])}; only a KVCacheEngine's settings can be "
                             "sent "
                             f"there, not a {type(engine).__name__}; configure it in the "
                             "model's engine_specs, which every worker builds")
        for rank in ranks_of[name]:
            remote.setdefault(rank, {})[name] = dict(
                page_size=engine.page_size, num_pages=engine.num_pages,
                max_batch=engine.max_batch, max_tokens_per_step=engine.max_tokens_per_step,
                attention_backend=engine.attention_backend,
                num_threads="auto" if engine.auto_threads else engine.num_threads)
    return local, remote


#: The ZeroMQ contexts of runtimes not closed yet, held here: one that the garbage collector
#: reached first, before its sockets (a runtime never closed, in a reference cycle), waited in
#: term() for them for good and froze the whole process.
_OPEN_CONTEXTS: set = set()


class PlacedRuntime(Runtime):
    """Serves a model with some node groups in worker processes.

    ``model``: a :class:`ModelSpec` or its ``"package.module:factory"`` string (with
    ``model_kwargs``); every process builds it from there. ``node_groups``: where nodes run
    (:class:`NodeGroup`); nodes in no group run in this process. ``shm_bytes``: size of each
    shared-memory arena (one per direction per worker; a tensor larger than it cannot cross).
    ``ready_timeout_s``: how long a worker may take to build the model. ``restart``:
    ``"manual"`` (:meth:`restart_worker`) or ``"auto"`` (at most ``max_restarts`` times per
    worker). ``progress``: forward worker output, prefixed with its rank, to stderr.
    ``heartbeat_timeout_s``: a worker whose heartbeats stop this long counts as hung;
    ``node_timeout_s`` (default None: no limit): so does one whose node runs longer; a hung
    worker is killed and handled as a death (placement/watchdog.py).
    ``engines`` overrides engines as the Runtime's does; a KVCacheEngine for nodes placed in a
    worker travels as its settings (page size, pages, ...) and is rebuilt there. Other
    arguments are the :class:`~mstar_rt.Runtime`'s. ``segments`` (default True): walk sections
    whose nodes all sit on one worker run there whole, one round trip each
    (placement/segments.py); False sends every node across on its own.

    A KV engine's walks may sit on different workers (``NodeGroup(["prefill"], rank=1)``,
    ``NodeGroup(["decode"], rank=2)``): when a request's walk moves to the other worker its K/V
    and decode state move with it, over a gloo channel between the two workers that gives up
    after ``kv_timeout_s`` (placement/kv_moves.py, docs/disaggregation.md).

    ``direct_bytes``: a tensor of at least this many bytes that a worker makes and only other
    workers read goes to them through shared memory, not through this process (the parent
    routes a handle; placement/direct.py); None: every tensor through the parent. Ray actors
    fetch such a tensor's bytes from the actor that made it (placement/peer_bytes.py).

    ``launcher``: ``"process"`` (local worker processes) or ``"ray"``: each worker rank is a
    Ray actor on any node of the cluster at ``ray_address`` (None: the cluster this process is
    connected to, or Ray's default) with the CPUs, GPUs and resources its NodeGroup asks for;
    control over ``tcp://``, tensors inside the messages or fetched from the actor that made
    them (placement/ray_rank.py).

    ``spin_us``: how long this process and each local worker watch for the next message
    before they sleep (placement/mailbox.py): waking a sleeper costs tens of microseconds on a
    VM, watching costs a core meanwhile. Default: 200 when the CPUs this process may use are at
    least one per process (this one and each local worker), else 0.

    A worker that dies fails the requests it was serving or held state for (RequestFailed
    naming the rank, node and exit status) within a second; other requests continue.
    """

    def __init__(self, model: Union[ModelSpec, str], node_groups: Sequence[NodeGroup],
                 model_kwargs: Optional[Mapping[str, Any]] = None, poll_s: float = 0.05,
                 engines: Optional[Mapping[str, Engine]] = None, shm_bytes: int = 64 << 20,
                 ready_timeout_s: float = 120.0, restart: str = "manual", max_restarts: int = 3,
                 progress: bool = True, heartbeat_timeout_s: float = 10.0,
                 node_timeout_s: Optional[float] = None, segments: bool = True,
                 launcher: str = "process", ray_address: Optional[str] = None,
                 kv_timeout_s: float = 60.0, direct_bytes: Optional[int] = DIRECT_BYTES,
                 spin_us: Optional[float] = None) -> None:
        self._links: dict[int, WorkerLink] = {}
        self._remote_engines: list[RemoteEngine] = []
        self.kv_moves: Any = None
        self._hub: Optional[Hub] = None
        self._zctx: Optional[zmq.Context] = None
        self._workdir: Optional[str] = None
        self._runtime_started = False
        self._closed = False
        self._ray_owned, self._host = False, "127.0.0.1"  # the host: where workers reach us
        self.shm_prefix = ""
        #: How a down worker is brought back, as error messages say it ({rank}: its rank); a
        #: server that holds this runtime words it for its operator.
        self.restart_hint = "restart it with restart_worker({rank})"
        if launcher not in ("process", "ray"):
            raise ValueError(f"launcher={launcher!r}; use 'process' (local worker processes) "
                             "or 'ray' (Ray actors)")
        self.launcher = launcher
        if heartbeat_timeout_s <= 0 or (node_timeout_s is not None and node_timeout_s <= 0):
            raise ValueError(f"heartbeat_timeout_s ({heartbeat_timeout_s}) and node_timeout_s "
                             f"({node_timeout_s}) must be > 0 seconds (node_timeout_s may be None)")
        self.heartbeat_timeout_s, self.node_timeout_s = heartbeat_timeout_s, node_timeout_s
        if spin_us is not None and not 0 <= spin_us <= 10_000:
            raise ValueError(f"spin_us={spin_us}: give 0 (always sleep) to 10000 microseconds")
        if restart not in ("manual", "auto"):
            raise ValueError(f"restart={restart!r}; use 'manual' or 'auto'")
        self.restart_policy, self.max_restarts = restart, max_restarts
        if isinstance(model, str):
            model = ModelSpec(model, dict(model_kwargs or {}))
        elif model_kwargs:
            raise ValueError("give model_kwargs inside the ModelSpec, not beside it")
        self.spec = model
        try:  # before the parent builds a tensor-parallel group too
            refuse_tp_args_beside_workers(model, node_groups)
        except KeyProblem as e:
            raise ConfigError(f"model: {e}") from None
        self.user_model = model.build(model.parent_kwargs)
        self.plan = plan = make_plan(self.user_model, node_groups)
        self.spin_us = float(spin_us if spin_us is not None else
                             spin_default(0 if launcher == "ray" else len(plan.workers)))
        if launcher != "ray" and any(p.follower_options for p in plan.workers.values()):
            raise ValueError("tp_resources places tensor-parallel followers as Ray actors; "
                             "set launcher='ray' (placement.launcher: ray), or drop tp_resources")
        local_engines, worker_engines = split_engines(self.user_model, plan, engines or {})
        direct = ({} if direct_bytes is None
                  else direct_names(self.user_model, plan.node_rank, set(plan.workers)))
        self.direct_names = direct
        seg_plan = self._segment_plan(plan) if segments else None
        self.segments_enabled = seg_plan is not None
        # a deadline that stops a stand-in before it starts names the node it would have run;
        # a failure of the whole stand-in (its worker died) names the nodes it runs
        segs = seg_plan.segments if seg_plan is not None else ()
        self._first_node = {s.name: section_nodes(s.section, True)[0] for s in segs}
        self._segment_label = {  # keyed as _STAND_IN matches it
            f"node '{s.name}'": "nodes " + ", ".join(f"'{n}'" for n in s.nodes)
            + f" (run together on worker rank {s.rank})" for s in segs}
        sweep_stale()
        try:
            self._workdir = tempfile.mkdtemp(prefix=f"mstar-placement-{os.getpid()}-")
            self._zctx = zmq.Context()
            _OPEN_CONTEXTS.add(self._zctx)
            if launcher == "ray":  # workers anywhere in the cluster reach this node's address
                self._ray_owned, self._host = connect_ray(ray_address)
                self._hub = Hub(self._zctx, f"tcp://{self._host}:*", inline=True)
            else:
                self._hub = Hub(self._zctx, f"ipc://{self._workdir}/parent.sock",
                               bell_path=bell_path(self._workdir), spin_us=self.spin_us)
            self.shm_prefix = tag = f"mstar_{os.getpid()}_{secrets.token_hex(3)}"
            for rank, rank_plan in plan.workers.items():
                ray = (RayLauncher(rank, rank_plan.ray_options, rank_plan.follower_options)
                       if launcher == "ray" else None)
                self._links[rank] = WorkerLink(self, rank_plan, model, self._zctx, self._workdir,
                                               self._hub.endpoint, tag, shm_bytes,
                                               ready_timeout_s, progress,
                                               worker_engines.get(rank, {}), ray,
                                               direct.get(rank, []), direct_bytes or 0)
            remote: dict[str, Engine] = {}
            for n, rank in plan.node_rank.items():
                if rank in plan.workers:
                    remote.setdefault(plan.parent_engines[n], RemoteEngine(self._links[rank]))
            for seg in seg_plan.segments if seg_plan is not None else ():
                remote.setdefault(SEGMENT_ENGINE.format(rank=seg.rank),
                                  RemoteEngine(self._links[seg.rank]))
            placed = PlacedModel(self.user_model, plan.node_rank, set(plan.workers),
                                 plan.parent_engines, seg_plan)
            if plan.kv_moves:
                from mstar_rt.placement.kv_moves import ParentMoves

                self.kv_moves = placed.kv_moves = ParentMoves(
                    plan.kv_moves, self._links, kv_timeout_s, self._host,
                    lambda rid: self.requests.get(rid) is not None,
                    lambda rid, message: self.report(self.conductor.fail(rid, message)))
            super().__init__(placed, poll_s, {**remote, **local_engines})
            for seg in seg_plan.segments if seg_plan is not None else ():
                if seg.takes:  # its windows not last are answered as sent (stream_in.py)
                    self._links[seg.rank].feeds.add(self.graph.node_ids[seg.name])
            self._remote_engines = list(remote.values())
            for engine in self._remote_engines:  # submit() sends their first batch (below)
                self.conductor.set_submitter_takes(engine.engine_id, True)
            self._runtime_started = True
            self._hub.start(self._links)
            for link in self._links.values():  # in parallel: each builds its model meanwhile
                link.spawn()
            for link in self._links.values():
                link.wait_ready()
        except BaseException:
            self.close()
            raise

    def _segment_plan(self, plan: Any) -> Optional[SegmentPlan]:
        """The walks' segments (placement/segments.py), or None when there are none or the
        rewritten walks do not compile (then every node crosses on its own, as before)."""
        seg_plan = find_segments(self.user_model, plan.node_rank, set(plan.workers),
                                 plan.kv_moves)
        if not seg_plan.segments:
            return None
        try:
            compile_model(PlacedModel(self.user_model, plan.node_rank, set(plan.workers),
                                      plan.parent_engines, seg_plan))
        except ValueError:  # GraphError is one
            return None
        return seg_plan

    def report(self, outcome: tuple) -> None:
        expired = outcome[3]
        if expired and any(x[1] in self._first_node for x in expired):
            first = self._first_node
            late = {x[0]: x[1] for x in expired if x[1] in first}
            failed = [(rid, m.replace(f"node '{late[rid]}'", f"node '{first[late[rid]]}'", 1)
                       if rid in late else m) for rid, m in outcome[2]]
            expired = [(x[0], first.get(x[1], x[1]), *x[2:]) for x in expired]
            outcome = (outcome[0], outcome[1], failed, expired, outcome[4])
        if outcome[2] and self._segment_label:
            outcome = (outcome[0], outcome[1], [(rid, self._named(m)) for rid, m in outcome[2]],
                       *outcome[3:])
        super().report(outcome)

    def _named(self, message: str) -> str:
        """``message`` with each segment stand-in's name replaced by the nodes it runs."""
        if "node 'segment:" not in message:
            return message
        return _STAND_IN.sub(lambda m: self._segment_label.get(m.group(0), m.group(0)), message)

    # ---- requests ------------------------------------------------------------------------------

    @staticmethod
    def order_of(ctx: RequestContext) -> tuple[int, int]:
        """``(deadline_ns, priority)`` the request was submitted with (workers order by it)."""
        return ctx.deadline_ns, ctx.priority

    @classmethod
    def from_config(cls, source: Union[str, Mapping[str, Any]],
                    **overrides: Any) -> "PlacedRuntime":
        """Starts a PlacedRuntime from a placement config (YAML path or mapping; see
        :func:`mstar_rt.placement.read_config`); ``overrides`` win over the config."""
        return cls(**{**read_config(source), **overrides})

    def submit(self, *args: Any, **kwargs: Any) -> Any:
        handle = super().submit(*args, **kwargs)
        # The request's first batch leaves from this thread: a RemoteEngine's thread woken to
        # send it costs 100-300 µs on a VM, and woken only to find nothing it still contends
        # for the GIL while this thread packs (so submit leaves them asleep). Not from the hub's
        # thread (a callback submitting), which must never wait for a worker; the engine
        # threads are woken for whatever is left.
        inline, sent = not deferring(), False
        for engine in self._remote_engines:
            try:
                if inline and engine.link.state == "up":
                    batch = self.conductor.next_batch(engine.engine_id, engine.max_batch, 0.0)
                    if batch is not None:
                        engine.link.send_batch(*batch)
                        sent = True
            finally:
                self.conductor.wake(engine.engine_id)
        if sent and self._hub is not None:
            self._hub.expect()
        return handle

    def ended(self, handle: Any, error: Optional[BaseException]) -> None:
        if self.kv_moves is not None:
            self.kv_moves.ended(handle.context.id, error)
        super().ended(handle, error)

    # ---- workers -------------------------------------------------------------------------------

    def restart_worker(self, rank: int) -> None:
        """Stops worker ``rank`` if it runs (its requests fail) and starts a fresh one; returns
        once it is ready (WorkerStartError if it cannot start)."""
        self._link(rank).restart()

    def worker_stats(self, rank: int, timeout: float = 5.0) -> dict:
        """What worker ``rank`` holds now: ``live_requests``, ``queued_items``,
        ``kv_pages_in_use`` (and per engine in ``kv``), arena bytes in use each way
        (``p2w_bytes_in_use``, ``w2p_bytes_in_use``), ``bad_messages``, ``pid``."""
        return self._link(rank).stats(timeout)

    def health(self) -> Optional[str]:
        """:meth:`Runtime.health`, or a worker down with no restart coming. (A worker whose
        model cannot serve, :meth:`Model.health`, says so in its heartbeat and is killed: it is
        then down, or restarting with ``restart="auto"``.)"""
        own = super().health()
        if own is not None:
            return own
        for rank, info in self.workers.items():
            if info["state"] == "down":
                return (f"worker process rank {rank} is down ({info['last_exit']}); "
                        + self.restart_hint.format(rank=rank))
        return None

    @property
    def workers(self) -> dict[int, dict]:
        """Per worker rank: nodes, device, state (up / starting / down), pid, endpoint, shared
        memory segments, restarts, last exit, items in flight, requests whose state it holds,
        the value names it hands to other workers directly (``direct``) and how many such
        tensors it has (``exports``)."""
        return {rank: link.info() for rank, link in self._links.items()}

    def _link(self, rank: int) -> WorkerLink:
        link = self._links.get(rank)
        if link is None:
            raise ValueError(f"rank {rank} is not a worker process; worker ranks are "
                             f"{sorted(self._links)}")
        return link

    # ---- lifecycle -----------------------------------------------------------------------------

    def close(self, timeout: Optional[float] = None) -> bool:
        """Cancels what runs, stops the engine threads, shuts every worker down (killing one
        that does not exit within 5 s) and removes its sockets and shared memory; False if an
        engine thread of this process still ran a node after ``timeout`` seconds."""
        if getattr(self, "_placement_closed", False):
            return True
        self._placement_closed = True
        joined = super().close(timeout) if self._runtime_started else True
        self._closed = True
        for link in self._links.values():
            try:
                link.close()
            except Exception:
                traceback.print_exc()
        if self._hub is not None:
            self._hub.close()
        if self.kv_moves is not None:
            self.kv_moves.close()
        if self._zctx is not None:
            self._zctx.term()
            _OPEN_CONTEXTS.discard(self._zctx)
        if self._workdir is not None:
            shutil.rmtree(self._workdir, ignore_errors=True)
        if self._ray_owned:
            disconnect_ray()
        close = getattr(getattr(self, "user_model", None), "close", None)
        if callable(close):  # the parent's own model may hold processes (tensor-parallel)
            close()
        return joined

    def __enter__(self) -> "PlacedRuntime":
        return self


__all__ = ["PlacedRuntime"]

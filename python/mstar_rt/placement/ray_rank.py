"""Placement ranks as Ray actors: each worker rank runs in a Ray actor, on whichever node of the
cluster has the CPUs, GPUs and custom resources its NodeGroup asks for.

The actor runs the same worker loop as a local worker process (placement/worker.py), in a thread
of its own, with two differences a machine boundary forces: control goes over ZeroMQ ``tcp://``
(the worker binds on its node's address at a port it picks; :meth:`RankActor.start` returns the
endpoint to the parent through Ray) and tensors travel inside the messages
(placement/inline.py), since no shared memory reaches another machine -- except a large one that
one actor makes for another, which the reader fetches from its maker (placement/peer_bytes.py).

Ray restarts an actor whose process dies (``max_restarts=-1``: the process comes back whenever
it dies); the parent's link sees the death through :meth:`RankActor.wait`, a call that returns
only when the worker loop ends, so a killed actor fails that call at once. Rebuilding the model
in the restarted actor is the link's restart policy (``restart="auto"``, or
``restart_worker(rank)``), as for a local process.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any, Optional


def connect_ray(address: Optional[str]) -> tuple[bool, str]:
    """Joins the Ray cluster at ``address`` unless this process already did (None: Ray's own
    default: ``RAY_ADDRESS`` or a running local cluster). Returns (whether we connected, so
    we disconnect at close; this node's address, where the parent's socket listens)."""
    try:
        import ray
    except ImportError:
        raise ImportError("launcher='ray' needs Ray: pip install 'ray>=2.9'") from None
    ours = not ray.is_initialized()
    if ours:
        ray.init(address=address, logging_level="error", log_to_driver=False)
    return ours, ray.util.get_node_ip_address()


def disconnect_ray() -> None:
    import ray

    ray.shutdown()


class RankActor:
    """The body of one rank's actor. Ray starts it with the rank's resources; :meth:`start`
    builds the model and serves (one generation at a time), :meth:`wait` returns when that
    generation's loop ends."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self._done: dict[int, threading.Event] = {}
        self._lock = threading.Lock()
        self._serving: Any = None  # the generation's Worker, while its loop runs

    def start(self, cfg: dict) -> dict:
        import ray

        from mstar_rt.distributed.launch import followers_on_ray
        from mstar_rt.placement.worker import start_worker

        host = ray.util.get_node_ip_address()
        cfg = {**cfg, "endpoint": f"tcp://{host}:*"}
        with self._lock:
            done = self._done.setdefault(int(cfg["gen"]), threading.Event())
            old, self._serving = self._serving, None
        if old is not None:  # the parent gave it up (it lost touch): one model at a time
            old.stopping.set()
            self._done[int(old.gen)].wait(5.0)
        try:  # followers of a tensor-parallel model it builds: Ray actors where asked
            with followers_on_ray(cfg.get("tp_followers") or [], host):
                worker = start_worker(cfg)  # raises, after telling the parent why, if it cannot
        except BaseException:
            done.set()
            raise

        def serve() -> None:
            try:
                worker.serve()
            finally:
                worker.close()
                done.set()

        self._serving = worker
        threading.Thread(target=serve, daemon=True, name="mstar-worker-serve").start()
        return {"endpoint": worker.endpoint, "pid": os.getpid(), "node": host}

    def ping(self) -> int:
        return os.getpid()

    def wait(self, gen: int) -> str:
        with self._lock:
            done = self._done.setdefault(gen, threading.Event())
        done.wait()
        return "exited"


def _short(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}".strip()


class RayWorker:
    """The parent's handle on one generation of a rank started in its actor (the interface of
    placement/process.py's WorkerProcess)."""

    def __init__(self, actor: Any, cfg: dict) -> None:
        self.actor = actor
        self.gen = int(cfg["gen"])
        self.pid: Optional[int] = None
        self.node = ""
        self.threads: list[threading.Thread] = []
        self._start = actor.start.remote(cfg)
        self._wait = actor.wait.remote(self.gen)
        self._error: Optional[str] = None

    def endpoint(self, timeout: float) -> Optional[str]:
        """Where its worker listens (once :meth:`RankActor.start` returned); raises what
        start raised."""
        import ray

        info = ray.get(self._start, timeout=timeout)
        self.pid, self.node = info["pid"], info["node"]
        return info["endpoint"]

    def failure(self) -> Optional[str]:
        import ray

        if not ray.is_initialized():  # e.g. Ray's exit hook ran before ours
            return "this process is no longer connected to Ray"
        for ref in (self._start, self._wait):
            ready, _ = ray.wait([ref], timeout=0)
            if ready:
                try:
                    ray.get(ref)
                except Exception as e:
                    self._error = self._error or _short(e)
                    return self._error
                if ref is self._wait:
                    return "exited"
        return None

    def wait_exit(self) -> str:
        import ray

        try:
            return ray.get(self._wait)
        except Exception as e:  # the actor died (killed, crashed, its node gone)
            return f"died (its Ray actor: {_short(e)})"

    def kill(self, stacks: bool = False) -> None:
        """Kills the actor's process; Ray starts a fresh one (a restart of the rank builds
        its model there). ``stacks`` is for local processes only (Ray's own ``ray stack``
        shows an actor's)."""
        import ray

        try:
            ray.kill(self.actor, no_restart=False)
        except Exception:  # it is gone already
            pass

    def stop(self, graceful: bool) -> None:
        """Waits up to 5 s for its loop to end (after a ``shutdown``), else kills the actor."""
        import ray

        if graceful and ray.is_initialized():
            ready, _ = ray.wait([self._wait], timeout=5.0)
            if ready:
                return
        self.kill()

    def last_output(self) -> str:
        if self._error is None:
            return "its output is in the Ray logs of its actor"
        try:
            import ray

            ray.get(self._start, timeout=0)
        except Exception as e:
            return f"Ray reported:\n  {str(e).strip()[-2000:]}"
        return ""


class RayLauncher:
    """One rank's actor, made on the first start and removed at close."""

    def __init__(self, rank: int, options: dict, followers: Optional[list] = None) -> None:
        self.rank, self.options = rank, dict(options)
        self.followers = list(followers or ())  # Ray options of its tensor-parallel followers
        self.actor: Any = None

    def start(self, cfg: dict, timeout_s: float = 120.0) -> RayWorker:
        import ray

        if self.actor is None:  # calls to an actor Ray has yet to place wait for it
            self.actor = ray.remote(RankActor).options(
                max_restarts=-1, max_task_retries=0, max_concurrency=4,
                **self.options).remote(self.rank)
        else:  # calls to one Ray is restarting fail: wait until it answers
            deadline = time.monotonic() + timeout_s
            while True:
                try:
                    left = max(0.1, deadline - time.monotonic())
                    ray.get(self.actor.ping.remote(), timeout=left)
                    break
                except (ray.exceptions.ActorUnavailableError, ray.exceptions.GetTimeoutError):
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.1)
        return RayWorker(self.actor, {**cfg, "tp_followers": self.followers})

    def close(self) -> None:
        import ray

        if self.actor is not None and ray.is_initialized():
            try:
                ray.kill(self.actor, no_restart=True)
            except Exception:
                pass
            self.actor = None


def actor_options(num_cpus: Optional[float], num_gpus: Optional[float],
                  resources: dict[str, float], device: str) -> dict:
    """Ray actor options for a rank: what its group asks for; a group on ``cuda`` asks for
    one GPU unless it says ``num_gpus``."""
    opts: dict[str, Any] = {}
    if num_cpus is not None:
        opts["num_cpus"] = num_cpus
    gpus = num_gpus if num_gpus is not None else (1 if device.startswith("cuda") else 0)
    if gpus:
        opts["num_gpus"] = gpus
    if resources:
        opts["resources"] = dict(resources)
    return opts

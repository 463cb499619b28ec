"""Where a tensor-parallel model's followers run: beside the driver (child processes, the
default) or, inside :func:`followers_on_ray`, each as a Ray actor of its own on the node its
resources name -- one model's ranks on several hosts.

A Ray follower connects back to the driver over TCP at the driver's node address (a listening
socket the driver opens per group; the follower proves it holds the group's random key, handed
to it through Ray, before the driver trusts it) and then runs the same follower loop as a child
process (:func:`mstar_rt.distributed.follower.serve`); the group's rendezvous store is reached at
that address too. A follower actor that dies closes its socket (gloo fails the step at once) and
ends its Ray call (the driver's liveness check before each step); the driver's ``close`` ends
the loop and frees the actor's resources.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import socket
import struct
import subprocess
import time
from contextvars import ContextVar
from multiprocessing.connection import Connection, answer_challenge, deliver_challenge
from typing import Any, Iterator, Optional, Sequence

_RAY: ContextVar[Optional["RayFollowers"]] = ContextVar("mstar_tp_followers", default=None)
POLL_EVERY_S = 0.05  # a liveness check asks Ray at most this often


@contextlib.contextmanager
def followers_on_ray(options: Sequence[dict], host: str) -> Iterator[None]:
    """Inside: a tensor-parallel model built here starts follower rank r as a Ray actor with
    ``options[r - 1]`` (``ray.remote(...).options``), reaching this process at ``host``. An
    empty ``options`` changes nothing."""
    token = _RAY.set(RayFollowers(list(options), host) if options else None)
    try:
        yield
    finally:
        _RAY.reset(token)


def ray_followers() -> Optional["RayFollowers"]:
    """The Ray placement in effect here (:func:`followers_on_ray`), if any."""
    return _RAY.get()


class ActorProc:
    """A follower actor, with the part of ``subprocess.Popen``'s face the driver uses."""

    def __init__(self, actor: Any, done: Any, pid: int, node: str) -> None:
        self.actor, self.done, self.pid, self.node = actor, done, pid, node
        self.code: Optional[int] = None
        self._checked = 0.0

    def poll(self) -> Optional[int]:
        if self.code is None and time.monotonic() - self._checked >= POLL_EVERY_S:
            self._checked = time.monotonic()
            self._settle(0)
        return self.code

    def wait(self, timeout: Optional[float] = None) -> int:
        if self.code is None and not self._settle(timeout):
            raise subprocess.TimeoutExpired(f"tensor-parallel follower actor (pid {self.pid})",
                                            timeout or 0)
        assert self.code is not None
        return self.code

    def kill(self) -> None:
        import ray

        with contextlib.suppress(Exception):
            ray.kill(self.actor, no_restart=True)

    def _settle(self, timeout: Optional[float]) -> bool:
        """Whether the follower loop ended (within ``timeout``); then its actor goes, and its
        resources with it."""
        import ray

        ready, _ = ray.wait([self.done], timeout=timeout)
        if not ready:
            return False
        try:
            self.code = int(ray.get(self.done))
        except Exception:  # the actor died
            self.code = -9
        self.kill()
        return True


class FollowerActor:
    """The body of a follower's Ray actor: connect to the driver, then the follower loop."""

    def run(self, host: str, port: int, key: bytes, rank: int, timeout_s: float) -> int:
        import ray

        from mstar_rt.distributed import follower

        sock = socket.create_connection((host, port), timeout=timeout_s)
        sock.settimeout(None)
        conn = Connection(sock.detach())
        try:
            answer_challenge(conn, key)
            conn.send((rank, os.getpid(), ray.util.get_node_ip_address()))
        except (OSError, EOFError):
            return 1
        return follower.serve(conn)


def check_feasible(options: Sequence[dict], cluster: dict[str, float]) -> None:
    """Refuses at once a follower whose resources no node of the cluster has at all (Ray would
    keep its actor pending forever), naming the resource and what the cluster offers."""
    for rank, opts in enumerate(options, start=1):
        wants = dict(opts.get("resources", {}))
        for key, name in (("num_cpus", "CPU"), ("num_gpus", "GPU")):
            if opts.get(key):
                wants[name] = opts[key]
        for name, amount in wants.items():
            if cluster.get(name, 0.0) < amount:
                offered = sorted(k for k in cluster if not k.startswith("node:"))
                raise ValueError(f"tensor-parallel follower rank {rank} asks for {amount:g} "
                                 f"{name!r}, which the Ray cluster does not have (it has "
                                 f"{offered}); fix tp_resources or the cluster's resources")


def _handshake(sock: socket.socket, key: bytes, timeout_s: float) -> Optional[Connection]:
    """The connection of a follower that proved it holds ``key`` (and sent its hello), else
    None. A peer silent for ``timeout_s`` fails too (a receive timeout on the socket)."""
    sock.setblocking(True)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO,
                    struct.pack("ll", int(timeout_s), int(timeout_s % 1 * 1e6)))
    conn = Connection(os.dup(sock.fileno()))
    try:
        deliver_challenge(conn, key)
        if not conn.poll(timeout_s):
            raise TimeoutError
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", 0, 0))
        return conn
    except Exception:
        conn.close()
        return None
    finally:
        sock.close()


class RayFollowers:
    """Starts a group's followers as Ray actors (see the module doc)."""

    def __init__(self, options: list[dict], host: str) -> None:
        self.options, self.host = options, host

    def spawn(self, tp_size: int, settings: dict, timeout_s: float) -> list[Any]:
        """One Follower per rank 1..tp_size-1, connected and sent ``settings`` (plus its rank
        and the store's host); raises, having stopped what it started, if one does not connect
        within ``timeout_s``."""
        import ray

        from mstar_rt.distributed.tp_driver import Follower, stop_followers

        if len(self.options) != tp_size - 1:
            raise ValueError(f"tp_resources gives {len(self.options)} follower placements for "
                             f"tp_size {tp_size}; give one per follower rank ({tp_size - 1})")
        check_feasible(self.options, ray.cluster_resources())
        key = secrets.token_bytes(32)
        server = socket.create_server((self.host, 0))
        port = server.getsockname()[1]
        started: dict[int, tuple[Any, Any]] = {}
        followers: list[Any] = []
        try:
            for rank, opts in enumerate(self.options, start=1):
                actor = ray.remote(FollowerActor).options(max_restarts=0, **opts).remote()
                started[rank] = (actor, actor.run.remote(self.host, port, key, rank, timeout_s))
            deadline = time.monotonic() + timeout_s
            while len(followers) < len(started):
                server.settimeout(max(0.1, deadline - time.monotonic()))
                try:
                    sock, _ = server.accept()
                except socket.timeout:
                    missing = sorted(set(started) - {f.rank for f in followers})
                    raise RuntimeError(
                        f"tensor-parallel follower ranks {missing} did not connect within "
                        f"{timeout_s:.0f} s; their Ray actors ask for "
                        f"{[self.options[r - 1] for r in missing]}: does the cluster have "
                        "them free?") from None
                conn = _handshake(sock, key, timeout_s)
                if conn is None:  # not one of ours: dropped; keep waiting
                    continue
                rank, pid, node = conn.recv()
                actor, done = started[rank]
                followers.append(Follower(rank, ActorProc(actor, done, pid, node), conn))
                conn.send({**settings, "rank": rank, "host": self.host})
        except BaseException:
            stop_followers(followers, wait_s=1.0)
            for actor, _ in started.values():
                with contextlib.suppress(Exception):
                    ray.kill(actor, no_restart=True)
            raise
        finally:
            server.close()
        return sorted(followers, key=lambda f: f.rank)


__all__ = ["ActorProc", "FollowerActor", "RayFollowers", "check_feasible", "followers_on_ray",
           "ray_followers"]

"""A two-node Ray cluster on this machine, for the Ray tests (test_serve_ray.py,
test_placement_ray.py): ``ray start --head`` on 127.0.0.2 plus ``ray start --address`` on
127.0.0.3 with resources of its own, every address on the loopback interface. Its processes
(found by the cluster's own temp dir and GCS address) are ended when the context exits, even
after a failure.

Importing this module sets this run's own Ray token (token auth): Ray's servers listen on every
interface, and a ~/.ray/auth_token left by some local ``ray.init()`` must not decide the mode.
Import it before Ray: Ray reads the mode and token once per process."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Iterator

from child_env import child_env

AUTH = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}
os.environ.update(AUTH)

RAY = str(Path(sys.executable).parent / "ray")
HEAD_IP, NODE2_IP = "127.0.0.2", "127.0.0.3"  # loopback; 127.0.0.1 itself Ray swaps for the LAN IP


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pythonpath_absolute(env: dict[str, str]) -> dict[str, str]:
    # Ray's workers start in their own directory: a relative entry would point nowhere.
    parts = [str(Path(p).resolve()) for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    return {**env, "PYTHONPATH": os.pathsep.join(parts)}


def _processes() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, command line) of every process we can read."""
    out = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        out[int(d.name)] = (ppid, cmd)
    return out


def cluster_pids(marks: tuple[str, ...]) -> set[int]:
    """The processes of a cluster: those whose command line names its temp dir or GCS address
    (GCS, raylets, monitors, client server), and everything under them (workers, agents)."""
    procs = _processes()
    found = {pid for pid, (_, cmd) in procs.items()
             if any(m in cmd for m in marks) and pid != os.getpid()}
    grew = True
    while grew:
        more = {pid for pid, (ppid, _) in procs.items() if ppid in found} - found
        found |= more
        grew = bool(more)
    return found


def _end(pids: set[int], grace_s: float = 5.0) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        end = time.monotonic() + grace_s
        while time.monotonic() < end and any(Path(f"/proc/{p}").exists() for p in pids):
            time.sleep(0.1)


def _ray_start(args: list[str], env: dict[str, str]) -> None:
    r = subprocess.run([RAY, "start", *args], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, f"ray start {' '.join(args)} failed:\n{r.stdout}\n{r.stderr}"


@contextlib.contextmanager
def local_cluster(head_resources: dict[str, float], node2_resources: dict[str, float],
                  num_cpus: int = 2, **env_overrides: str) -> Iterator[SimpleNamespace]:
    """Starts the two nodes (each with ``num_cpus`` CPUs and the given custom resources),
    connects this process (``ray.init``) and yields ``address``, ``env`` (for child processes
    that join it) and ``temp``; at exit disconnects and ends every process of the cluster,
    asserting none is left."""
    import ray

    temp = tempfile.mkdtemp(prefix="mstar-ray-", dir="/tmp")  # short: Ray's socket paths
    port = free_port()
    address = f"{HEAD_IP}:{port}"
    # Ray's workers import the tests' model modules (placement_models): CI sets no PYTHONPATH.
    env = _pythonpath_absolute(child_env(Path(__file__).resolve().parent,
                                         RAY_USAGE_STATS_ENABLED="0", **AUTH, **env_overrides))
    common = [f"--num-cpus={num_cpus}", "--object-store-memory=100000000",
              "--disable-usage-stats", f"--temp-dir={temp}"]
    try:
        _ray_start(["--head", f"--node-ip-address={HEAD_IP}", f"--port={port}",
                    "--include-dashboard=false", f"--ray-client-server-port={free_port()}",
                    f"--dashboard-agent-listen-port={free_port()}",
                    f"--resources={json.dumps(head_resources)}", *common], env)
        _ray_start([f"--address={address}", f"--node-ip-address={NODE2_IP}",
                    f"--dashboard-agent-listen-port={free_port()}",
                    f"--resources={json.dumps(node2_resources)}", *common], env)
        ray.init(address=address, logging_level="error")
        yield SimpleNamespace(address=address, env=env, temp=temp)
    finally:
        ray.shutdown()
        marks = (temp, address)
        _end(cluster_pids(marks))
        left = cluster_pids(marks)
        shutil.rmtree(temp, ignore_errors=True)
        assert not left, f"Ray processes left behind: {sorted(left)}"

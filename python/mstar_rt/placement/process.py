"""A worker's operating-system process: how it is started, what it prints, how it ended.

:class:`WorkerProcess` is one of the two launchers' handles on a started worker (the other is
placement/ray_rank.py's ``RayWorker``); the link uses only ``pid``, ``node``, ``threads``,
``failure``, ``wait_exit``, ``kill``, ``stop`` and ``last_output``."""

from __future__ import annotations

import collections
import json
import os
import signal
import subprocess
import sys
import threading
from typing import Optional


class WorkerStartError(RuntimeError):
    """A worker process did not come up (it could not import or build the model, crashed, or
    missed the ready timeout); the message says which and quotes its last output."""


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = "unknown signal"
        return f"killed by signal {-code} ({name})"
    return f"exited with code {code}"


def worker_device(device: str, rank: int) -> Optional[str]:
    """Inside the worker: "cuda" when its group is placed on a GPU (the one it sees), else None.
    A GPU asked for where this process sees none is refused: the group would otherwise run on
    the CPU without a word (on Ray the GPU may sit on another node, so only the worker knows)."""
    if not device.startswith("cuda"):
        return None
    import socket

    import torch

    if not torch.cuda.is_available():
        seen = os.environ.get("CUDA_VISIBLE_DEVICES")
        raise RuntimeError(
            f"node group rank {rank} is placed on device '{device}', but this worker process "
            f"(host {socket.gethostname()}, CUDA_VISIBLE_DEVICES={seen!r}) sees no CUDA device "
            f"(torch {torch.__version__}, torch.cuda.is_available() is False); place the group "
            "on 'cpu', or on a machine with a GPU and a CUDA build of torch")
    return "cuda"


def say(rank: int, text: str) -> None:
    print(f"[mstar worker rank {rank}] {text}", file=sys.stderr, flush=True)


class WorkerProcess:
    """``python -m mstar_rt.placement.worker CONFIG`` in a session of its own (Ctrl-C at a
    terminal reaches the parent, which then shuts the worker down), with the parent's sys.path,
    and the given GPU alone visible for ``cuda:N``. Its output is kept (the last lines explain
    a failed start) and, with ``progress``, forwarded to stderr prefixed with the rank."""

    def __init__(self, rank: int, config_path: str, device: str, progress: bool) -> None:
        self.rank = rank
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        if device.startswith("cuda:"):
            env["CUDA_VISIBLE_DEVICES"] = device.split(":")[1]
        # subprocess, never fork: torch's thread pools survive only a fresh interpreter
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mstar_rt.placement.worker", config_path],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
            start_new_session=True)
        self.pid: Optional[int] = self.proc.pid
        self.node = "local"
        self._output: collections.deque = collections.deque(maxlen=30)
        self._progress = progress
        self._forward_all = False  # set when it is killed as hung: its stacks reach stderr
        self.pump = threading.Thread(target=self._pump, daemon=True,
                                     name=f"mstar-worker{rank}-output")
        self.pump.start()
        self.threads = [self.pump]

    def _pump(self) -> None:
        stdout = self.proc.stdout
        assert stdout is not None
        for raw in stdout:
            line = raw.decode(errors="replace").rstrip()
            self._output.append(line)
            if self._progress or self._forward_all:
                say(self.rank, line)
        stdout.close()

    def last_output(self) -> str:
        self.pump.join(timeout=1.0)  # after an exit: let it read the last lines
        lines = list(self._output)
        return ("its last output:\n  " + "\n  ".join(lines)) if lines else "it printed nothing"

    def endpoint(self, timeout: float) -> None:
        return None  # the parent chose its ipc endpoint before starting it

    def failure(self) -> Optional[str]:
        """How it ended, or None while it runs."""
        code = self.proc.poll()
        return None if code is None else describe_exit(code)

    def wait_exit(self) -> str:
        return describe_exit(self.proc.wait())

    def kill(self, stacks: bool = False) -> None:
        """``stacks``: first the worker prints every thread's stack (faulthandler on SIGUSR1,
        placement/worker.py), forwarded to stderr, so that a hang can be read afterwards."""
        if stacks:
            self._forward_all = True
            try:
                os.kill(self.proc.pid, signal.SIGUSR1)
                self.proc.wait(timeout=0.2)  # printed from the signal handler, at once
            except (ProcessLookupError, subprocess.TimeoutExpired):
                pass
        self.proc.kill()

    def stop(self, graceful: bool) -> None:
        """Waits up to 5 s for a graceful exit (if asked), then kills."""
        if graceful:
            try:
                self.proc.wait(timeout=5)
                return
            except subprocess.TimeoutExpired:
                pass
        self.proc.kill()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass


class ProcessLauncher:
    """One rank's local worker processes: each start writes its generation's config into the
    parent's private directory and runs the worker on it."""

    def __init__(self, rank: int, workdir: str, device: str, progress: bool) -> None:
        self.rank, self.workdir, self.device, self.progress = rank, workdir, device, progress

    def start(self, cfg: dict) -> WorkerProcess:
        path = os.path.join(self.workdir, f"rank{self.rank}-g{cfg['gen']}.json")
        with open(path, "w") as f:
            json.dump(cfg, f)
        return WorkerProcess(self.rank, path, self.device, self.progress)

    def close(self) -> None:
        pass  # each process was stopped by its link

"""Shared helpers of the placement tests (test_placement*.py): exact comparison, the shared-memory
segments and worker processes of this process, the single-process reference outputs and the
bodies of the module-scoped ``placed_walk`` / ``placed_lm`` fixtures (each test file wraps them
in its own fixture, so every file gets fresh workers)."""

from __future__ import annotations

import os
import signal
import time
from typing import Optional

import numpy as np
import torch

import pytest

from mstar_rt import RequestFailed, Runtime
from mstar_rt.engines import KVCacheEngine, SamplingParams
from mstar_rt.placement import NodeGroup, PlacedRuntime

import placement_models as pm
from walk_models import wait_until

T = 30.0  # seconds: the longest any single wait may take
PIPELINE_GROUPS = [NodeGroup(["encoder"], rank=1), NodeGroup(["backbone", "collect"], rank=2)]
LM_GROUPS = [NodeGroup(["prefill", "decode"], rank=1)]
PROMPTS = [[1, 2, 3], [5] * 9, [7, 8, 9, 10, 11], [100, 3, 64, 2, 9, 17, 40]]


def our_segments(rt=None) -> list[str]:
    """Shared-memory segments of ``rt`` (or of every runtime of this process)."""
    prefix = rt.shm_prefix + "_" if rt is not None else f"mstar_{os.getpid()}_"
    return sorted(n for n in os.listdir("/dev/shm") if n.startswith(prefix))


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie has exited)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie of ours still answers kill(0); it is dead for our purposes
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):  # it went meanwhile
        return False


def same(a, b) -> bool:
    """Deep, exact equality that also compares types, dtypes and shapes."""
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b)
    if isinstance(a, dict):
        if "window" in a and "window" in b:
            # A window's `last` flag depends on timing: the stream contract lets the end come
            # as the last chunk or as a stream-end call (test_stream_conformance checks that).
            a = {**a, "window": [w[:3] + w[4:] for w in a["window"]]}
            b = {**b, "window": [w[:3] + w[4:] for w in b["window"]]}
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def pipeline_inputs(n: int) -> list[dict]:
    g = torch.Generator().manual_seed(7)
    return [{"x": torch.randn(1 + i % 3, pm.DIM_IN, generator=g), "steps": 1 + i % 4}
            for i in range(n)]


def generate(rt, prompts, max_tokens=12, concurrent=False) -> list[dict]:
    params = SamplingParams(max_tokens=max_tokens)
    if concurrent:
        handles = [rt.submit({"prompt": p, "params": params}) for p in prompts]
        return [h.result(T) for h in handles]
    return [rt.submit({"prompt": p, "params": params}).result(T) for p in prompts]


def reference_outputs() -> dict:
    """Single-process outputs of both models (the ``reference`` fixture of each test file)."""
    with Runtime(pm.pipeline()) as rt:
        walk = [rt.submit(inp).result(T) for inp in pipeline_inputs(6)]
    with Runtime(pm.tiny_llama()) as rt:
        lm = generate(rt, PROMPTS)
    return {"walk": walk, "lm": lm}


def start_placed_walk():
    """Body of the ``placed_walk`` fixture: the pipeline over two workers; checks close()."""
    rt = PlacedRuntime("placement_models:pipeline", PIPELINE_GROUPS, progress=False)
    pids = [w["pid"] for w in rt.workers.values()]
    yield rt
    rt.close()
    pids += [w["pid"] for w in rt.workers.values()]
    assert not [p for p in pids if alive(p)], "worker processes outlived close()"
    assert our_segments(rt) == []


def start_placed_lm():
    """Body of the ``placed_lm`` fixture: the tiny Llama on one worker; checks close()."""
    # the KV cache's settings cross to the worker (an engine object cannot)
    rt = PlacedRuntime("placement_models:tiny_llama", LM_GROUPS, progress=False,
                       engines={"lm": KVCacheEngine(page_size=4, num_pages=96, max_batch=8)})
    yield rt
    pid = rt.workers[1]["pid"]
    rt.close()
    assert not alive(pid)
    assert our_segments(rt) == []


def idle(rt: PlacedRuntime, rank: int) -> dict:
    """Waits until worker ``rank`` holds nothing; returns its last stats. (A K/V receiver
    learns of a request's end after the request's other workers: its release follows its
    ``kv_recv`` notice, placement/kv_moves.py.)"""
    stats: dict = {}

    def check() -> bool:
        stats.update(rt.worker_stats(rank))
        return (stats["live_requests"] == 0 and stats["queued_items"] == 0
                and stats["kv_pages_in_use"] == 0 and stats["p2w_bytes_in_use"] == 0
                and stats["w2p_bytes_in_use"] == 0 and stats.get("kv_waiting", 0) == 0)

    wait_until(check, timeout=T, interval=0.02)
    return stats


def kill_mid_run(rt: PlacedRuntime, rank: int, handle) -> None:
    """Kills worker ``rank`` once ``handle``'s segment run is in it: the request fails within
    5 s, naming the segment's nodes (not its stand-in) and the signal, and the rank restarts."""
    assert wait_until(lambda: rt.worker_stats(rank)["segment_runs"] == 1, T)
    t0 = time.monotonic()
    os.kill(rt.workers[rank]["pid"], signal.SIGKILL)
    with pytest.raises(RequestFailed, match="killed by signal 9") as failed:
        handle.result(T)
    assert f"(run together on worker rank {rank})" in str(failed.value)
    assert "segment:" not in str(failed.value)
    assert time.monotonic() - t0 < 5
    rt.restart_worker(rank)


def worker_children(parent: Optional[int] = 0,
                    running: bytes = b"mstar_rt.placement.worker") -> set[int]:
    """Live processes of ``parent`` (0: this process; None: any) whose command line holds
    ``running`` (read from /proc): by default, its placement workers."""
    parent, found = (os.getpid() if parent == 0 else parent), set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read()
        except OSError:
            continue
        if parent in (None, int(fields[1])) and fields[0] != "Z" and running in cmd:
            found.add(int(entry))
    return found

"""The tensor-parallel soak section: a small random Llama checkpoint served at tp_size 2 in this
process (rank 0 here, rank 1 a follower process) under chaos -- cancels at random points and
the follower SIGKILLed every few seconds -- while the group rebuilds itself at its next step
(restart auto, distributed/llama_tp.py; with ``MSTAR_SOAK_TP_RESTART=eager`` at once, by its
watcher). Every finished request's greedy tokens are checked against the same checkpoint at
tp_size 1 in this process: a request that read K/V built before a rebuild would get wrong
tokens, not an error, if that K/V were not refused.

Allowed outcomes: the reference's tokens; a cancel; RequestFailed naming the broken group or
K/V built before the rebuild. After the chaos: the group serving again, 50 clean requests, no
K/V page or request held, one follower running (none after close)."""

from __future__ import annotations

import os
import random
import signal
import sys
import tempfile
import threading
import time
from typing import Any

from mstar_rt import Runtime
from mstar_rt.distributed.llama_tp import load_llama_tp
from mstar_rt.distributed.tp_driver import TensorParallelLM
from mstar_rt.models.llama import load_llama

from bench_common import ROOT
from soak_disagg import GreedyReference, _params, greedy_one
from soak_placement import CLIENTS, KILL_EVERY_S, TIMEOUT_S, Chaos, _drive
from soak_proc import snapshot

sys.path.insert(0, str(ROOT / "tests" / "python"))  # the tensor-parallel tests' tiny Llama
CLEAN_AFTER = 50
PAGES = 256


class _FollowerKiller:
    """SIGKILLs the group's follower every KILL_EVERY_S (0.5x-1.5x) until stopped; the face of
    soak_placement's worker killer."""

    def __init__(self, module: TensorParallelLM, seed: int) -> None:
        self.module, self.rng, self.kills = module, random.Random(seed), 0
        self.times: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="soak-killer", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(KILL_EVERY_S * self.rng.uniform(0.5, 1.5)):
            for f in list(self.module.followers):
                try:
                    os.kill(f.proc.pid, signal.SIGKILL)
                    self.kills += 1
                    self.times.append((time.perf_counter(), f.rank))
                except ProcessLookupError:
                    pass

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def _request(rng: random.Random) -> tuple[list[int], int]:
    return [rng.randrange(1, 128) for _ in range(rng.randint(1, 24))], rng.randint(1, 40)


def _killed(text: str) -> bool:
    return "tensor-parallel group" in text


def run_tp(quick: bool, seconds: float) -> dict:
    from llama_ref import make_lm
    from tp_support import save_llama

    try:
        from tqdm import tqdm
        tqdm.monitor_interval = 0  # no monitor thread: it would count as a leaked thread
    except ImportError:
        tqdm = None
    directory = tempfile.mkdtemp(prefix="mstar_soak_tp_")
    save_llama(directory)
    ref = GreedyReference(make_lm(load_llama(directory, progress=False), page_size=4,
                                  num_pages=PAGES, emit_logits=False))
    from mstar_rt.distributed.group import open_store
    open_store(2, 5.0)  # libuv's process-wide pipe pair opens with the first store, never closes
    start = snapshot(os.getpid())
    # MSTAR_SOAK_TP_RESTART=eager: the group rebuilt by its watcher, between steps
    restart = os.environ.get("MSTAR_SOAK_TP_RESTART", "auto")
    module = load_llama_tp(directory, 2, max_restarts=1_000_000, restart=restart)
    rt = Runtime(make_lm(module, page_size=4, num_pages=PAGES, emit_logits=False))
    one = greedy_one(ref, _killed, 0.02, _request)

    def serving() -> bool:  # a request steps the group, which rebuilds it if it must
        try:
            rt.submit({"prompt": [1, 2, 3], "params": _params(1)}).result(TIMEOUT_S)
            return True
        except Exception:
            return False

    errors: list[BaseException] = []
    passed = 0
    engine: Any = rt.engines["lm"]
    try:
        errors += _drive(rt, 5.0, CLIENTS, 0, None, one)[1]
        bar = tqdm(desc="tp chaos", unit="req", leave=False, mininterval=2.0) if tqdm else None
        chaos = Chaos(rt, seconds, bar, one, (), seed=4, killer=_FollowerKiller(module, 4),
                      up=serving)
        errors += chaos.errors
        rng = random.Random(9)
        for _ in range(CLEAN_AFTER):
            prompt, n = _request(rng)
            try:
                ref.check(prompt, n, rt.submit({"prompt": prompt, "params": _params(n)})
                          .result(timeout=TIMEOUT_S))
                passed += 1
            except BaseException as e:
                errors.append(e)
        deadline = time.monotonic() + 10
        while engine.cache.free_pages < PAGES and time.monotonic() < deadline:
            time.sleep(0.05)
        held = {"driver": {"kv_pages_in_use": PAGES - engine.cache.free_pages,
                           "live_requests": rt.live["requests"]}}
        followers = [f.proc for f in module.followers]
    finally:
        rt.close()
        module.close()
        ref.rt.close()
    time.sleep(0.5)
    result = chaos.result(errors, passed == CLEAN_AFTER, held, start, snapshot(os.getpid()))
    result["figures"]["group_restarts"] = module.restarts
    result["figures"]["workers_left"] = sum(p.poll() is None for p in followers)
    result["figures"]["followers_at_end"] = len(followers)
    return result

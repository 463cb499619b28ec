"""The placement soak section: a PlacedRuntime under chaos -- requests of random sizes, cancels
at random points, and worker processes killed with SIGKILL at random times (restart auto) --
with every finished request's outputs checked exactly.

The model (soak_placement_model.py) runs in the parent and two worker processes; tensors of
1 element to 1.6 MB cross parent -> rank 1 -> rank 2 -> parent, through arenas of
``SHM_BYTES`` (small, so that they lap and fill). CLIENTS threads submit back to back; each
request draws its fate as soak_runtime.py's do. A killer thread SIGKILLs worker 1 or 2 every
KILL_EVERY_S (jittered). Allowed outcomes: the exact outputs; RequestCancelled for a request
that was cancelled; RequestFailed naming a worker process rank, for a request in flight when a
worker died. Anything else -- a wrong output, another error, a request that hangs -- counts as an
error. After the chaos: both workers up, CLEAN_AFTER requests that must all finish, nothing held
(``live``), and once closed no /dev/shm file of ours, no worker process, no thread or fd more
than at the start."""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import torch

import mstar_rt as m
from mstar_rt.placement import NodeGroup, PlacedRuntime

from bench_common import child_pythonpath
from soak_proc import Sampler, snapshot, wait_until
from soak_runtime import FATES, _Canceller, meet_fate
from soak_placement_model import MAX_STEPS, WORKER_NODES

HERE = Path(__file__).resolve().parent
CLIENTS = 4
SHM_BYTES = 4 << 20
MAX_ELEMENTS = 400_000  # 1.6 MB of float32: a few fill an arena
KILL_EVERY_S = 4.0
TIMEOUT_S = 60.0
CLEAN_AFTER = 50
SLOW_S = 3.0  # a request this slow is listed with the kills around it


def _inputs(rng: random.Random) -> tuple[torch.Tensor, int, float]:
    size = int(round(2 ** rng.uniform(0, np.log2(MAX_ELEMENTS))))
    x = torch.randint(-1000, 1000, (size,), dtype=torch.float32,
                      generator=torch.Generator().manual_seed(rng.randrange(1 << 30)))
    pause = rng.choice([0.0, 0.0, 0.0, 0.001])
    return x, rng.randint(1, MAX_STEPS // 4), pause


def _check(out: dict, x: torch.Tensor, n: int) -> None:
    first = int(x[0]) * 2 + 1
    want = list(range(first + 1, first + n + 1))
    y = out.get("y")
    if out.get("tok") != want or not y or len(y) != 1 or not torch.equal(y[0], x * 2 + 1 + n):
        raise WrongOutput(f"a request of {x.numel()} elements and {n} steps: tokens "
                          f"{out.get('tok')} (expected {want}); y "
                          f"{'missing' if not y else 'differs'}")


class WrongOutput(AssertionError):
    pass


class _Killer:
    """SIGKILLs worker 1 or 2 every KILL_EVERY_S (0.5x-1.5x) until stopped."""

    def __init__(self, rt: PlacedRuntime, seed: int, ranks: Any = tuple(WORKER_NODES)) -> None:
        self.ranks = sorted(ranks)
        self.rt, self.rng, self.kills = rt, random.Random(seed), 0
        self.times: list[tuple[float, int]] = []  # (perf_counter, rank) of each kill
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="soak-killer", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(KILL_EVERY_S * self.rng.uniform(0.5, 1.5)):
            rank = self.rng.choice(self.ranks)
            info = self.rt.workers[rank]
            if info["state"] == "up" and info["pid"]:
                try:
                    os.kill(info["pid"], signal.SIGKILL)
                    self.kills += 1
                    self.times.append((time.perf_counter(), rank))
                except ProcessLookupError:
                    pass

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def _one(rt: PlacedRuntime, rng: random.Random, canceller: _Canceller) -> str:
    x, n, pause = _inputs(rng)
    h = rt.submit({"x": x, "n": n, "pause": pause})
    out = settle(h, meet_fate(h, rng, canceller, 0.005), lambda e: "worker process rank" in e)
    if isinstance(out, str):
        return out
    _check(out, x, n)
    return "finished"


def settle(h: Any, fate: str, by_kill: Callable[[str], bool]) -> "dict | str":
    """The request's outputs, or ``"cancelled"`` / ``"failed_by_kill"`` (``by_kill`` says
    whether a failure's text is a killed worker's); anything else raises."""
    try:
        return h.result(timeout=TIMEOUT_S)
    except m.RequestCancelled:
        if fate == "finish":
            raise
        return "cancelled"
    except m.RequestFailed as e:
        if not by_kill(str(e)):
            raise
        return "failed_by_kill"


def _drive(rt: PlacedRuntime, seconds: float, clients: int, seed: int, bar: Any,
           one: Callable[[PlacedRuntime, random.Random, _Canceller], str] = _one,
           ) -> tuple[dict, list, list, list]:
    """Clients submit for ``seconds``; (outcome counts, errors, latencies of finished ones,
    (start, seconds, outcome) of each request slower than SLOW_S)."""
    counts = {"finished": 0, "cancelled": 0, "failed_by_kill": 0}
    errors: list[BaseException] = []
    slow: list[tuple[float, float, str]] = []
    latencies: list[float] = []
    lock = threading.Lock()
    canceller = _Canceller()
    end = time.monotonic() + seconds

    def client(k: int) -> None:
        rng = random.Random(seed * 100 + k)
        while time.monotonic() < end:
            t = time.perf_counter()
            try:
                outcome = one(rt, rng, canceller)
            except BaseException as e:
                with lock:
                    errors.append(e)
                continue
            took = time.perf_counter() - t
            with lock:
                if took > SLOW_S:
                    slow.append((t, took, outcome))
                counts[outcome] += 1
                if outcome == "finished":
                    latencies.append(time.perf_counter() - t)
            if bar is not None:
                bar.update(1)

    threads = [threading.Thread(target=client, args=(k,)) for k in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    canceller.close()
    return counts, errors, latencies, slow


class Chaos:
    """``seconds`` of CLIENTS driving ``one`` while a killer SIGKILLs ``ranks`` (then stops),
    RSS sampled; afterwards it waits (60 s at most) until every worker is up again. ``killer``
    and ``up`` replace the worker killer and that wait's test (soak_tp.py kills a follower)."""

    def __init__(self, rt: Any, seconds: float, bar: Any, one: Callable,
                 ranks: Any, seed: int, killer: Any = None,
                 up: Optional[Callable[[], bool]] = None) -> None:
        self.killer = killer if killer is not None else _Killer(rt, seed, ranks=ranks)
        self.t0 = time.perf_counter()
        try:
            with Sampler(os.getpid(), 1.0, self.t0) as self.sampler:
                self.counts, self.errors, self.latencies, self.slow = _drive(
                    rt, seconds, CLIENTS, 1, bar, one)
        finally:
            self.killer.stop()
            if bar is not None:
                bar.close()
        self.elapsed = time.perf_counter() - self.t0
        self.recovered = wait_until(
            up or (lambda: all(w["state"] == "up" for w in rt.workers.values())), 60.0)

    def result(self, errors: list, clean_ok: bool, held: dict, start: dict, end: dict) -> dict:
        """A model section's result (soak_disagg.py, soak_omni.py): ``errors`` over the whole
        section, whether its clean requests all passed, what each worker still ``held``
        (held_on) and the process snapshots around it."""
        counts, latencies, t0 = self.counts, self.latencies, self.t0
        pages = sum(h.get("kv_pages_in_use", 0) for h in held.values())
        still = sum(v for h in held.values() for k, v in h.items() if k != "kv_pages_in_use")
        ok = self.recovered and clean_ok
        return {
            "clients": CLIENTS, "held_at_end": held, "shm_files_left": _our_shm_files(),
            "kills_at_s": [(round(k - t0, 2), r) for k, r in self.killer.times],
            "slow_requests": [(round(a - t0, 2), round(b, 2), c) for a, b, c in self.slow[:20]],
            "errors_seen": [repr(e)[:300] for e in errors[:5]],
            "figures": {
                "seconds": self.elapsed, "requests": sum(counts.values()),
                "requests_per_s": sum(counts.values()) / self.elapsed,
                "finished": counts["finished"], "cancelled": counts["cancelled"],
                "failed_by_kill": counts["failed_by_kill"], "kills": self.killer.kills,
                "recovered": int(ok), "requests_over_3s": len(self.slow),
                "latency_p50_ms": (1e3 * sorted(latencies)[len(latencies) // 2] if latencies
                                   else None),
                "wrong_outputs": sum(isinstance(e, WrongOutput) for e in errors),
                "kv_pages_in_use_at_end": pages, "requests_or_items_held_at_end": still,
                "rss_start_mb": start["rss_mb"], "rss_end_mb": end["rss_mb"],
                "rss_growth_mb_per_min": self.sampler.rss_growth_mb_per_min(
                    after=min(30.0, self.elapsed / 2)),
                "fds_start": start["fds"], "fds_end": end["fds"],
                "leaked_fds": end["fds"] - start["fds"],
                "threads_start": start["threads"], "threads_end": end["threads"],
                "leaked_threads": end["threads"] - start["threads"],
                "shm_files_left": len(_our_shm_files()),
                "errors": len(errors) + (0 if ok else 1) + (1 if pages or still else 0),
            },
        }


def model_section(rt: PlacedRuntime, name: str, seconds: float, seed: int, one: Callable,
                  clean: list[Callable[[], None]], held_keys: tuple[str, ...], start: dict,
                  close: Callable[[], None]) -> dict:
    """A model section's run (soak_disagg.py, soak_omni.py) once ``rt`` is up: 5 s of warm-up,
    ``seconds`` of chaos on ranks 1 and 2, then each of ``clean`` (a request checked, raising
    if wrong), what the workers hold (``held_keys``, 0 wanted), and its result once ``rt`` and
    the reference (``close``) are closed."""
    try:
        from tqdm import tqdm
        tqdm.monitor_interval = 0  # no monitor thread: it would count as a leaked thread
    except ImportError:
        tqdm = None
    errors: list[BaseException] = []
    try:
        errors += _drive(rt, 5.0, CLIENTS, 0, None, one)[1]
        bar = tqdm(desc=f"{name} chaos", unit="req", leave=False, mininterval=2.0) if tqdm \
            else None
        chaos = Chaos(rt, seconds, bar, one, (1, 2), seed=seed)
        errors += chaos.errors
        passed = 0
        for request in clean:
            try:
                request()
                passed += 1
            except BaseException as e:
                errors.append(e)
        held = {rank: held_on(rt, rank, held_keys) for rank in (1, 2)}
    finally:
        rt.close()
        close()
    time.sleep(0.5)
    return chaos.result(errors, passed == len(clean), held, start, snapshot(os.getpid()))


def held_on(rt: PlacedRuntime, rank: int, keys: tuple[str, ...]) -> dict:
    """Worker ``rank``'s ``keys`` of its stats once all are 0 (a K/V receiver learns of an end
    last), or after 10 s."""
    stats: dict = {}

    def empty() -> bool:
        stats.update(rt.worker_stats(rank))
        return not any(stats.get(k, 0) for k in keys)

    wait_until(empty, 10.0)
    return {k: stats.get(k, 0) for k in keys}


def _our_shm_files() -> list[str]:
    prefix = f"mstar_{os.getpid()}_"
    return sorted(n for n in os.listdir("/dev/shm") if n.startswith(prefix))


def run_placement(quick: bool, seconds: float) -> dict:
    """``seconds`` of chaos (after a clean warm-up), then the recovery and leak checks."""
    try:
        from tqdm import tqdm
        tqdm.monitor_interval = 0  # no monitor thread: it would count as a leaked thread
    except ImportError:
        tqdm = None
    os.environ["PYTHONPATH"] = child_pythonpath(str(HERE))  # the workers import the model
    (torch.ones(1 << 20) * 2).sum()  # torch's intra-op pool starts now, not as a "leak"
    pid = os.getpid()
    start = snapshot(pid)
    groups = [NodeGroup(nodes, rank=rank) for rank, nodes in WORKER_NODES.items()]
    rt = PlacedRuntime("soak_placement_model:chaos", groups, progress=False, restart="auto",
                       max_restarts=1_000_000, shm_bytes=SHM_BYTES)
    pids_seen: set[int] = set()
    errors: list[BaseException] = []
    try:
        warm, warm_errors, _, _ = _drive(rt, 5.0, CLIENTS, 0, None)  # allocator pools, arenas
        errors += warm_errors
        pids_seen |= {w["pid"] for w in rt.workers.values()}
        bar = tqdm(desc="placement chaos", unit="req", leave=False, mininterval=2.0) if tqdm else None
        chaos = Chaos(rt, seconds, bar, _one, (1, 2), seed=1)
        counts, latencies, slow, sampler, killer = (chaos.counts, chaos.latencies, chaos.slow,
                                                    chaos.sampler, chaos.killer)
        elapsed, t0, recovered = chaos.elapsed, chaos.t0, chaos.recovered
        errors += chaos.errors
        clean, clean_errors, _ = _drive_count(rt, CLEAN_AFTER)
        errors += clean_errors
        zero = dict(requests=0, handles=0, stored=0, queued=0, inflight=0)
        wait_until(lambda: rt.live == zero, 10.0)
        live = rt.live
        restarts = sum(w["restarts"] for w in rt.workers.values())
        pids_seen |= {w["pid"] for w in rt.workers.values()}
    finally:
        rt.close()
    time.sleep(0.5)
    end = snapshot(pid)
    files_left = _our_shm_files()
    workers_left = sorted(p for p in pids_seen if p and _running(p))
    live_total = sum(live.values())
    lat = np.array(latencies) if latencies else np.array([np.nan])
    return {
        "clients": CLIENTS, "shm_bytes": SHM_BYTES, "max_elements": MAX_ELEMENTS,
        "kill_every_s": KILL_EVERY_S, "fates": dict(FATES), "live_at_end": live,
        "rss_series": sampler.series(), "start": start, "end": end,
        "kills_at_s": [(round(k - t0, 2), rank) for k, rank in killer.times],
        "slow_requests": [(round(a - t0, 2), round(b, 2), c) for a, b, c in slow[:20]],
        "shm_files_left": files_left, "errors_seen": [repr(e)[:300] for e in errors[:5]],
        "figures": {
            "seconds": elapsed, "requests": sum(counts.values()),
            "requests_per_s": sum(counts.values()) / elapsed,
            "finished": counts["finished"], "cancelled": counts["cancelled"],
            "failed_by_kill": counts["failed_by_kill"], "kills": killer.kills,
            "restarts": restarts, "warmup_requests": sum(warm.values()),
            "recovered": int(recovered and clean == CLEAN_AFTER),
            "latency_p50_ms": float(np.nanpercentile(lat, 50) * 1e3),
            "latency_p99_ms": float(np.nanpercentile(lat, 99) * 1e3),
            "latency_max_ms": float(np.nanmax(lat) * 1e3),
            "requests_over_3s": len(slow),
            "wrong_outputs": sum(isinstance(e, WrongOutput) for e in errors),
            "rss_growth_mb_per_min": sampler.rss_growth_mb_per_min(after=min(30.0, seconds / 2)),
            "rss_start_mb": start["rss_mb"], "rss_end_mb": end["rss_mb"],
            "fds_start": start["fds"], "fds_end": end["fds"],
            "leaked_fds": end["fds"] - start["fds"],
            "threads_start": start["threads"], "threads_end": end["threads"],
            "leaked_threads": end["threads"] - start["threads"],
            "shm_files_left": len(files_left), "workers_left": len(workers_left),
            "live_at_end": live_total,
            "errors": len(errors) + (0 if recovered and clean == CLEAN_AFTER else 1)
                      + (1 if live_total else 0),
        },
    }


def _drive_count(rt: PlacedRuntime, count: int) -> tuple[int, list, None]:
    """``count`` plain requests one after another; (how many finished right, errors, None)."""
    rng, ok, errors = random.Random(7), 0, []
    for _ in range(count):
        x, n, _pause = _inputs(rng)
        try:
            _check(rt.submit({"x": x, "n": n}).result(timeout=TIMEOUT_S), x, n)
            ok += 1
        except BaseException as e:
            errors.append(e)
    return ok, errors, None


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False

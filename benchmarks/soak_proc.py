"""What the soak sections share: a process's RSS, open fds and threads read from /proc, a
sampler that records them over time, latencies bucketed into fixed windows, and a served model
started as a `mstar-rt serve` subprocess whose /metrics can be scraped."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from bench_common import ROOT, child_pythonpath

START_TIMEOUT_S = 60.0


# ---- one process, seen through /proc ------------------------------------------------------------

def rss_mb(pid: int) -> float:
    """Resident set size in MiB (VmRSS of /proc/<pid>/status)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024.0
    raise RuntimeError(f"/proc/{pid}/status has no VmRSS line")


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def threads(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


def cpu_s(pid: int) -> float:
    """CPU time the process used so far (user + system), in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def snapshot(pid: int) -> dict:
    return {"rss_mb": rss_mb(pid), "fds": open_fds(pid), "threads": threads(pid)}


@dataclass
class Sample:
    t: float  # seconds after the sampler's t0
    rss_mb: float
    fds: int
    threads: int
    cpu_s: float  # the process's CPU time so far
    load1: float  # the machine's 1-minute load average (other tenants show here)


class Sampler:
    """Samples a process's RSS, fds, threads and CPU time, and the load average, every
    ``period`` seconds on a thread, with times relative to ``t0`` (perf_counter)."""

    def __init__(self, pid: int, period: float, t0: float) -> None:
        self.pid, self.period, self.t0 = pid, period, t0
        self.samples: list[Sample] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="soak-sampler", daemon=True)

    def __enter__(self) -> "Sampler":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while True:
            try:
                s = snapshot(self.pid)
                cpu = cpu_s(self.pid)
            except (OSError, RuntimeError):  # the process ended
                return
            self.samples.append(Sample(time.perf_counter() - self.t0, s["rss_mb"], s["fds"],
                                       s["threads"], cpu, os.getloadavg()[0]))
            if self._stop.wait(self.period):
                return

    def rss_growth_mb_per_min(self, after: float = 0.0, before: float = float("inf")) -> float:
        """Least-squares slope of RSS over the samples taken between ``after`` and ``before``
        seconds, in MiB per minute (robust to the allocator's steps in a way that last minus
        first is not)."""
        picked = [(x.t, x.rss_mb) for x in self.samples if after <= x.t < before]
        if len(picked) < 2:
            return float("nan")
        t, y = np.array(picked).T
        return float(np.polyfit(t / 60.0, y, 1)[0])

    def series(self) -> list[list[float]]:
        """``[t, rss_mb, fds, threads, cpu_s, load1]`` per sample."""
        return [[round(x.t, 2), round(x.rss_mb, 2), x.fds, x.threads, round(x.cpu_s, 2),
                 x.load1] for x in self.samples]

    def threads_last_change_s(self) -> Optional[float]:
        """When the thread count last changed (None: never): a pool reaching its high-water
        mark changes early and stays; a leak keeps changing."""
        last = None
        for a, b in zip(self.samples, self.samples[1:]):
            if b.threads != a.threads:
                last = round(b.t, 1)
        return last


# ---- latencies per window -----------------------------------------------------------------------

@dataclass
class Windows:
    """Latencies bucketed by when their request started (seconds after the soak began)."""

    window_s: float
    count: int
    _lat: list[list[float]] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self._lat = [[] for _ in range(self.count)]

    def add(self, started_at: float, seconds: float) -> None:
        i = min(max(int(started_at // self.window_s), 0), self.count - 1)
        with self._lock:
            self._lat[i].append(seconds)

    def summary(self) -> list[dict]:
        return window_summary([np.array(lat) for lat in self._lat], self.window_s)

    def drift(self) -> Optional[float]:
        return drift(self.summary())

    def total(self) -> int:
        return sum(map(len, self._lat))


def window_summary(latencies: list[np.ndarray], window_s: float) -> list[dict]:
    """p50 / p99 (ms) of each window's latencies (seconds; NaNs are skipped)."""
    out = []
    for i, lat in enumerate(latencies):
        a = lat[np.isfinite(lat)] * 1e3
        out.append({"window": i, "start_s": i * window_s, "requests": int(len(a)),
                    "p50_ms": float(np.percentile(a, 50)) if len(a) else None,
                    "p99_ms": float(np.percentile(a, 99)) if len(a) else None})
    return out


def drift(summary: list[dict]) -> Optional[float]:
    """The last window's p99 over the first's."""
    first, last = summary[0]["p99_ms"], summary[-1]["p99_ms"]
    return last / first if first and last else None


def per_window(sampler: Sampler, windows: Windows) -> list[dict]:
    """Per window: mean RSS, the process's CPU ms per request (steady when a latency drift comes
    from other tenants rather than from the server) and the mean load average."""
    out = []
    for i, summary in enumerate(windows.summary()):
        lo, hi = i * windows.window_s, (i + 1) * windows.window_s
        xs = [x for x in sampler.samples if lo <= x.t < hi]
        cpu = xs[-1].cpu_s - xs[0].cpu_s if len(xs) > 1 else None
        n = summary["requests"] * (xs[-1].t - xs[0].t) / windows.window_s if len(xs) > 1 else 0
        out.append({"rss_mean_mb": float(np.mean([x.rss_mb for x in xs])) if xs else None,
                    "cpu_ms_per_request": 1e3 * cpu / n if cpu is not None and n else None,
                    "load1_mean": float(np.mean([x.load1 for x in xs])) if xs else None})
    return out


# ---- a served model in a subprocess -------------------------------------------------------------

class ServedModel:
    """``python -m mstar_rt.serve.cli serve CONFIG --port 0`` with one torch thread; ``port`` is
    read from its "serving ... on" line. Use as a context manager (SIGTERM, then kill)."""

    def __init__(self, config: Path) -> None:
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=child_pythonpath())
        self.config = config
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mstar_rt.serve.cli", "serve", str(config), "--port", "0"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
        self.stderr_tail: list[str] = []
        found: list[int] = []

        def read_out() -> None:
            for line in self.proc.stdout:  # type: ignore[union-attr]
                m = re.search(r"serving.* on http://[^:\s]+:(\d+)", line)
                if m and not found:
                    found.append(int(m.group(1)))

        def read_err() -> None:  # kept: a traceback in the server is evidence of an error
            for line in self.proc.stderr:  # type: ignore[union-attr]
                self.stderr_tail = (self.stderr_tail + [line.rstrip()])[-200:]

        threading.Thread(target=read_out, daemon=True).start()
        threading.Thread(target=read_err, daemon=True).start()
        end = time.monotonic() + START_TIMEOUT_S
        while not found:
            if self.proc.poll() is not None or time.monotonic() > end:
                self.close()
                raise RuntimeError(f"mstar-rt serve {config.name} did not start (exit "
                                   f"{self.proc.poll()}): {' | '.join(self.stderr_tail[-5:])}")
            time.sleep(0.05)
        self.port = found[0]
        self.pid = self.proc.pid
        self.url = f"http://127.0.0.1:{self.port}"

    def metrics(self) -> dict[str, float]:
        """/metrics as ``{"name{labels}": value}``."""
        import httpx

        text = httpx.get(self.url + "/metrics", timeout=10).text
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                key, _, value = line.rpartition(" ")
                out[key] = float(value)
        return out

    def idle(self) -> bool:
        """Whether the server holds no request and admits none (a scrape that fails: not yet)."""
        try:
            m = self.metrics()
        except Exception:  # noqa: BLE001  (a scrape that times out under load)
            return False
        return m.get("mstar_live_requests", 1) == 0 and m.get("mstar_admitted_requests", 1) == 0

    def tracebacks(self) -> int:
        return sum(line.startswith("Traceback") for line in self.stderr_tail)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> "ServedModel":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def server_outcomes(metrics: dict[str, float], endpoint: str) -> dict[str, int]:
    """mstar_requests_total by status for one endpoint."""
    out: dict[str, int] = {}
    for key, value in metrics.items():
        m = re.fullmatch(r'mstar_requests_total\{endpoint="([^"]*)",status="([^"]*)"\}', key)
        if m and m.group(1) == endpoint:
            out[m.group(2)] = int(value)
    return out


def wait_until(cond: Callable[[], bool], timeout: float) -> bool:
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            return False
        time.sleep(0.05)
    return True

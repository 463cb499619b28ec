"""Server metrics in the Prometheus text exposition format (version 0.0.4), without a client
library: counters and histograms by label, and gauges read when scraped."""

from __future__ import annotations

import math
import threading
from typing import Any, Callable, Iterable, Optional

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
RTF_BUCKETS = (0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 4.0)


def _labels(names: tuple[str, ...], values: tuple[str, ...]) -> str:
    if not names:
        return ""
    body = ",".join(f'{n}="{_escape(v)}"' for n, v in zip(names, values))
    return "{" + body + "}"


def _escape(v: str) -> str:
    return str(v).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _num(x: float) -> str:
    if math.isinf(x):
        return "+Inf" if x > 0 else "-Inf"
    return repr(float(x)) if not float(x).is_integer() else str(int(x))


class Counter:
    def __init__(self, name: str, help: str, labels: tuple[str, ...] = ()) -> None:
        self.name, self.help, self.labels = name, help, labels
        self._values: dict[tuple[str, ...], float] = {}
        self._lock = threading.Lock()

    def inc(self, *label_values: str, by: float = 1.0) -> None:
        with self._lock:
            self._values[label_values] = self._values.get(label_values, 0.0) + by

    def value(self, *label_values: str) -> float:
        return self._values.get(label_values, 0.0)

    def render(self) -> list[str]:
        out = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} counter"]
        with self._lock:
            for lv, v in sorted(self._values.items()):
                out.append(f"{self.name}{_labels(self.labels, lv)} {_num(v)}")
        return out


class Histogram:
    def __init__(self, name: str, help: str, labels: tuple[str, ...] = (),
                 buckets: tuple[float, ...] = LATENCY_BUCKETS) -> None:
        self.name, self.help, self.labels = name, help, labels
        self.buckets = tuple(sorted(buckets)) + (math.inf,)
        self._series: dict[tuple[str, ...], list] = {}  # counts per bucket, sum, count
        self._lock = threading.Lock()

    def observe(self, value: float, *label_values: str) -> None:
        with self._lock:
            s = self._series.setdefault(label_values, [[0] * len(self.buckets), 0.0, 0])
            for i, b in enumerate(self.buckets):
                if value <= b:
                    s[0][i] += 1
                    break
            s[1] += value
            s[2] += 1

    def count(self, *label_values: str) -> int:
        s = self._series.get(label_values)
        return 0 if s is None else s[2]

    def render(self) -> list[str]:
        out = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        with self._lock:
            for lv, (counts, total, n) in sorted(self._series.items()):
                cum = 0
                for b, c in zip(self.buckets, counts):
                    cum += c
                    lab = _labels(self.labels + ("le",), lv + (_num(b),))
                    out.append(f"{self.name}_bucket{lab} {cum}")
                lab = _labels(self.labels, lv)
                out.append(f"{self.name}_sum{lab} {_num(total)}")
                out.append(f"{self.name}_count{lab} {n}")
        return out


class Gauge:
    """A value read from ``fn`` at scrape time: a number, or ``{label_values: number}``."""

    def __init__(self, name: str, help: str, fn: Callable[[], Any],
                 labels: tuple[str, ...] = ()) -> None:
        self.name, self.help, self.fn, self.labels = name, help, fn, labels

    def render(self) -> list[str]:
        out = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} gauge"]
        value = self.fn()
        items: Iterable = value.items() if isinstance(value, dict) else [((), value)]
        for lv, v in items:
            out.append(f"{self.name}{_labels(self.labels, tuple(lv))} {_num(v)}")
        return out


class ServerMetrics:
    """What the server records; ``render()`` is the /metrics body."""

    def __init__(self, runtime: Any, admitted: Callable[[], int]) -> None:
        self.requests = Counter("mstar_requests_total", "Requests by endpoint and outcome "
                                "(ok, bad_request, unauthorized, rejected, failed, cancelled, "
                                "timeout).", ("endpoint", "status"))
        self.latency = Histogram("mstar_request_duration_seconds", "Wall time from request to "
                                 "its last output.", ("endpoint",))
        self.first_output = Histogram("mstar_time_to_first_output_seconds", "Wall time to the "
                                      "first streamed output.", ("endpoint",))
        self.ttfa = Histogram("mstar_time_to_first_audio_seconds", "Speech: time from request "
                              "to its first audio bytes.")
        self.rtf = Histogram("mstar_speech_real_time_factor", "Speech: synthesis wall time / "
                             "audio duration (below 1 = faster than real time).",
                             buckets=RTF_BUCKETS)
        self.gauges = [
            Gauge("mstar_live_requests", "Requests held by the runtime.",
                  lambda: _live(runtime).get("requests", 0)),
            Gauge("mstar_admitted_requests", "Requests admitted by the server (bounded by "
                  "max_concurrent_requests).", admitted),
            Gauge("mstar_kv_pages_in_use", "KV-cache pages in use, per KV engine.",
                  lambda: {(n,): used for n, (used, _) in kv_pages(runtime).items()},
                  ("engine",)),
            Gauge("mstar_kv_pages_total", "KV-cache pages, per KV engine.",
                  lambda: {(n,): total for n, (_, total) in kv_pages(runtime).items()},
                  ("engine",)),
        ]

    def render(self) -> str:
        lines: list[str] = []
        for m in (self.requests, self.latency, self.first_output, self.ttfa, self.rtf,
                  *self.gauges):
            lines += m.render()
        return "\n".join(lines) + "\n"


def _live(runtime: Any) -> dict:
    live = runtime.live
    return live() if callable(live) else live


def kv_pages(runtime: Any) -> dict[str, tuple[int, int]]:
    """engine name -> (pages in use, pages) for the runtime's engines that have a paged cache."""
    out = {}
    for name, engine in (getattr(runtime, "engines", None) or {}).items():
        cache: Optional[Any] = getattr(engine, "cache", None)
        if cache is not None and hasattr(cache, "free_pages"):
            out[name] = (cache.num_pages - cache.free_pages, cache.num_pages)
    return out

"""Server metrics on ``prometheus_client``: counters and histograms by label, and gauges read
from the runtime when scraped. Each server owns its registry, so several apps in one process
(the tests, a multi-model host) keep separate counts."""

from __future__ import annotations

from typing import Any, Callable, Iterator, Optional

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
RTF_BUCKETS = (0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 4.0)


class LabelledCounter:
    """A counter called the way the routes record: ``inc(endpoint, status)``."""

    def __init__(self, registry: CollectorRegistry, name: str, help: str,
                 labels: tuple[str, ...]) -> None:
        self._counter = Counter(name, help, labels, registry=registry)
        self._registry, self._name, self._labels = registry, name, labels

    def inc(self, *label_values: str, by: float = 1.0) -> None:
        self._counter.labels(*label_values).inc(by)

    def value(self, *label_values: str) -> float:
        labels = dict(zip(self._labels, label_values))
        return self._registry.get_sample_value(self._name, labels) or 0.0


class LabelledHistogram:
    """A histogram called as ``observe(seconds, *label_values)``."""

    def __init__(self, registry: CollectorRegistry, name: str, help: str,
                 labels: tuple[str, ...] = (),
                 buckets: tuple[float, ...] = LATENCY_BUCKETS) -> None:
        self._histogram = Histogram(name, help, labels, registry=registry, buckets=buckets)
        self._registry, self._name, self._labels = registry, name, labels

    def observe(self, value: float, *label_values: str) -> None:
        series = self._histogram.labels(*label_values) if label_values else self._histogram
        series.observe(value)

    def count(self, *label_values: str) -> int:
        labels = dict(zip(self._labels, label_values))
        return int(self._registry.get_sample_value(self._name + "_count", labels) or 0)


class _RuntimeGauges(Collector):
    """Read at scrape time rather than kept up to date: the runtime already knows these."""

    def __init__(self, runtime: Any, admitted: Callable[[], int]) -> None:
        self.runtime, self.admitted = runtime, admitted

    def collect(self) -> Iterator[GaugeMetricFamily]:
        yield GaugeMetricFamily("mstar_live_requests", "Requests held by the runtime.",
                                value=_live(self.runtime).get("requests", 0))
        yield GaugeMetricFamily("mstar_admitted_requests", "Requests admitted by the server "
                                "(bounded by max_concurrent_requests).", value=self.admitted())
        pages = kv_pages(self.runtime)
        in_use = GaugeMetricFamily("mstar_kv_pages_in_use", "KV-cache pages in use, per KV "
                                   "engine.", labels=["engine"])
        total = GaugeMetricFamily("mstar_kv_pages_total", "KV-cache pages, per KV engine.",
                                  labels=["engine"])
        for name, (used, count) in pages.items():
            in_use.add_metric([name], used)
            total.add_metric([name], count)
        yield in_use
        yield total


class ServerMetrics:
    """What the server records; ``render()`` is the /metrics body."""

    def __init__(self, runtime: Any, admitted: Callable[[], int]) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = LabelledCounter(r, "mstar_requests_total", "Requests by endpoint and "
                                        "outcome (ok, bad_request, unauthorized, rejected, "
                                        "deadline, failed, cancelled, timeout).", ("endpoint", "status"))
        self.latency = LabelledHistogram(r, "mstar_request_duration_seconds", "Wall time from "
                                         "request to its last output.", ("endpoint",))
        self.first_output = LabelledHistogram(r, "mstar_time_to_first_output_seconds", "Wall "
                                              "time to the first streamed output.", ("endpoint",))
        self.ttfa = LabelledHistogram(r, "mstar_time_to_first_audio_seconds", "Speech: time "
                                      "from request to its first audio bytes.")
        self.rtf = LabelledHistogram(r, "mstar_speech_real_time_factor", "Speech: synthesis "
                                     "wall time / audio duration (below 1 = faster than real "
                                     "time).", buckets=RTF_BUCKETS)
        r.register(_RuntimeGauges(runtime, admitted))

    def render(self) -> str:
        return generate_latest(self.registry).decode()


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

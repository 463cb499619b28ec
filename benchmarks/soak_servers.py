"""The two served soak sections: the openpi policy websocket under 16 clients and the OpenAI
speech endpoint under 4, each a `mstar-rt serve` subprocess watched through /proc and /metrics.

Each section warms the server up with its clients, lets it settle with no client connected and
takes the baseline (RSS, fds, threads); then the clients run for the soak time while a sampler
records the server's RSS every period; then the clients leave, the server must drop every
request, and the end is taken the same way. Latencies are bucketed by the window their request
started in."""

from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from bench_common import ROOT
from soak_proc import (Sampler, ServedModel, Windows, per_window, server_outcomes, snapshot,
                       wait_until)

POLICY_CONFIG = ROOT / "examples" / "serve" / "vision_policy.yaml"
SPEECH_CONFIG = ROOT / "examples" / "serve" / "speech_orpheus_tiny.yaml"
SETTLE_S = 30.0
POLICY_RECONNECT_EVERY = 100  # requests per connection: connection churn is part of a soak
SPEECH_ABANDON = 0.125  # of speech requests, the client leaves after the first audio
SPEECH_TEXTS = ["Hello there. How can I help you today?",
                "The robot picked up the red cube.",
                "Please wait while I check the schedule.",
                "It is sunny outside. The wind is calm."]
BAD_STATUSES = ("failed", "timeout", "rejected", "bad_request", "unauthorized")


@dataclass
class SoakTimes:
    seconds: float  # the soak itself
    window_s: float
    warmup_s: float
    sample_s: float  # RSS sampling period

    @property
    def windows(self) -> int:
        return max(1, int(round(self.seconds / self.window_s)))


def _run_clients(n: int, body: Callable[[int, Callable[[], bool], list], None],
                 seconds: float) -> list[BaseException]:
    """Runs ``body(k, running, errors)`` on ``n`` threads for ``seconds``; returns the errors."""
    stop_at = time.perf_counter() + seconds
    errors: list[BaseException] = []
    threads = [threading.Thread(target=body, args=(k, lambda: time.perf_counter() < stop_at,
                                                   errors), name=f"soak-client-{k}")
               for k in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return errors


def _watch(server: ServedModel, label: str, seconds: float, period: float,
           stop: threading.Event, peaks: dict) -> None:
    """Scrapes /metrics every ``period`` for the peaks (KV pages in use, live requests), with a
    progress bar when tqdm is installed."""
    try:
        from tqdm import tqdm
        tqdm.monitor_interval = 0  # no monitor thread
        bar = tqdm(total=int(seconds), desc=label, unit="s", leave=False)
    except ImportError:
        bar = None
    t0 = time.perf_counter()
    while not stop.wait(period):
        try:
            m = server.metrics()
        except Exception:  # noqa: BLE001  (a scrape that times out under load is no result)
            continue
        pages = sum(v for k, v in m.items() if k.startswith("mstar_kv_pages_in_use"))
        peaks["kv_pages_peak"] = max(peaks.get("kv_pages_peak", 0), int(pages))
        peaks["live_requests_peak"] = max(peaks.get("live_requests_peak", 0),
                                          int(m.get("mstar_live_requests", 0)))
        if bar is not None:
            bar.n = min(int(time.perf_counter() - t0), int(seconds))
            bar.refresh()
    if bar is not None:
        bar.close()


def _soak(server: ServedModel, label: str, clients: int, times: SoakTimes,
          body: Callable[[int, Callable[[], bool], list, Windows, float], None],
          endpoint: str) -> dict:
    """Warm-up, baseline, soak, settle, end; returns the section's record."""
    scratch = Windows(times.warmup_s or 1.0, 1)
    warm_errors = _run_clients(clients, lambda k, running, errs: body(k, running, errs, scratch,
                                                                       time.perf_counter()),
                               times.warmup_s)
    idle = server.idle
    wait_until(idle, SETTLE_S)
    time.sleep(0.5)  # closed connections' last frames
    start = snapshot(server.pid)
    before = server_outcomes(server.metrics(), endpoint)
    windows = Windows(times.window_s, times.windows)
    t0 = time.perf_counter()
    stop = threading.Event()
    peaks: dict = {}
    watch = threading.Thread(target=_watch, args=(server, label, times.seconds, times.sample_s,
                                                  stop, peaks), daemon=True)
    watch.start()
    with Sampler(server.pid, times.sample_s, t0) as sampler:
        errors = _run_clients(clients, lambda k, running, errs: body(k, running, errs, windows,
                                                                      t0), times.seconds)
        settled = wait_until(idle, SETTLE_S)
    stop.set()
    watch.join()
    time.sleep(0.5)
    end = snapshot(server.pid)
    metrics = server.metrics()
    after = server_outcomes(metrics, endpoint)
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in set(after) | set(before)}
    pages_in_use = sum(v for k, v in metrics.items() if k.startswith("mstar_kv_pages_in_use"))
    pages_total = sum(v for k, v in metrics.items() if k.startswith("mstar_kv_pages_total"))
    server_errors = sum(delta.get(s, 0) for s in BAD_STATUSES) + server.tracebacks()
    return {
        "clients": clients, "soak_s": times.seconds, "window_s": times.window_s,
        "requests": windows.total(), "windows": windows.summary(),
        "per_window": per_window(sampler, windows),
        "rss_series": sampler.series(),
        "start": start, "end": end, "settled": settled,
        "server_outcomes": delta,
        "client_errors": [repr(e) for e in (warm_errors + errors)[:5]],
        "figures": {
            # Steady state: after the first window (16 connections opening, first-touched
            # pages), up to the clients leaving.
            "rss_growth_mb_per_min": sampler.rss_growth_mb_per_min(times.window_s,
                                                                   times.seconds),
            "rss_growth_mb_per_min_whole_soak": sampler.rss_growth_mb_per_min(),
            "rss_start_mb": start["rss_mb"], "rss_end_mb": end["rss_mb"],
            "fds_start": start["fds"], "fds_end": end["fds"],
            "leaked_fds": end["fds"] - start["fds"],
            "threads_start": start["threads"], "threads_end": end["threads"],
            "leaked_threads": end["threads"] - start["threads"],
            "threads_max": max(x.threads for x in sampler.samples),
            "threads_last_change_s": sampler.threads_last_change_s(),
            "live_requests_at_end": int(metrics.get("mstar_live_requests", -1)),
            "kv_pages_in_use_at_end": int(pages_in_use), "kv_pages_total": int(pages_total),
            "kv_pages_peak": peaks.get("kv_pages_peak", 0),
            "live_requests_peak": peaks.get("live_requests_peak", 0),
            "requests": windows.total(),
            "requests_per_s": windows.total() / times.seconds,
            "p99_drift_ratio": windows.drift(),
            "p50_ms_first_window": windows.summary()[0]["p50_ms"],
            "p99_ms_first_window": windows.summary()[0]["p99_ms"],
            "p50_ms_last_window": windows.summary()[-1]["p50_ms"],
            "p99_ms_last_window": windows.summary()[-1]["p99_ms"],
            "errors": len(warm_errors) + len(errors) + server_errors + (0 if settled else 1),
        },
    }


# ---- the policy websocket -----------------------------------------------------------------------

def _observation(i: int) -> dict:
    g = np.random.default_rng(i)
    return {"observation/image": g.integers(0, 256, (64, 64, 3), dtype=np.uint8),
            "observation/state": g.standard_normal(8).astype(np.float32),
            "prompt": "pick up the cube"}


def _policy_client(port: int) -> Callable[..., None]:
    from openpi_client.websocket_client_policy import WebsocketClientPolicy

    def body(k: int, running: Callable[[], bool], errors: list, windows: Windows,
             t0: float) -> None:
        obs = [_observation(16 * i + k) for i in range(4)]
        policy = None
        sent = 0
        try:
            while running():
                if policy is None or sent % POLICY_RECONNECT_EVERY == 0:
                    if policy is not None:
                        policy._ws.close()
                    policy = WebsocketClientPolicy("127.0.0.1", port)
                t = time.perf_counter()
                reply = policy.infer(obs[sent % len(obs)])
                windows.add(t - t0, time.perf_counter() - t)
                sent += 1
                if reply["actions"].shape != (16, 7) or not np.isfinite(reply["actions"]).all():
                    raise RuntimeError(f"bad actions: shape {reply['actions'].shape}")
        except BaseException as e:  # counted, reported after the join
            errors.append(e)
        finally:
            if policy is not None:
                policy._ws.close()

    return body


def run_policy(quick: bool, times: SoakTimes, clients: int = 16) -> dict:
    """The openpi policy websocket (examples/serve/vision_policy.yaml) under ``clients``
    openpi_client connections, each reconnecting every POLICY_RECONNECT_EVERY requests."""
    with ServedModel(POLICY_CONFIG) as server:
        record = _soak(server, "policy", clients, times, _policy_client(server.port), "policy")
    record["model"] = "examples/serve/vision_policy.yaml"
    return record


# ---- the speech endpoint ------------------------------------------------------------------------

def _speech_client(url: str) -> Callable[..., None]:
    from mstar_rt.serve.client import MstarClient

    def body(k: int, running: Callable[[], bool], errors: list, windows: Windows,
             t0: float) -> None:
        rng = random.Random(k)
        try:
            with MstarClient(url, timeout=120) as client:
                i = 0
                while running():
                    text = SPEECH_TEXTS[(k + i) % len(SPEECH_TEXTS)]
                    i += 1
                    leave = rng.random() < SPEECH_ABANDON
                    t = time.perf_counter()
                    got = 0
                    stream: Any = client.speech(text, response_format="pcm")
                    for chunk in stream:
                        got += len(chunk)
                        if leave and got:
                            break
                    stream.close()  # leaving mid-stream closes the connection: a cancel
                    if leave:
                        continue
                    windows.add(t - t0, time.perf_counter() - t)
                    if got < 2 * 2400:  # under 0.1 s of audio at 24 kHz: something broke
                        raise RuntimeError(f"speech stream of {got} bytes for {text!r}")
        except BaseException as e:
            errors.append(e)

    return body


def run_speech(quick: bool, times: SoakTimes, clients: int = 4) -> dict:
    """/v1/audio/speech of the Orpheus-style TTS (tiny random weights, paged KV cache,
    examples/serve/speech_orpheus_tiny.yaml) under ``clients`` streaming HTTP clients; one
    request in 8 is abandoned after its first audio (the server must cancel it and free its
    KV pages)."""
    with ServedModel(SPEECH_CONFIG) as server:
        record = _soak(server, "speech", clients, times, _speech_client(server.url),
                       "/v1/audio/speech")
    record["model"] = "examples/serve/speech_orpheus_tiny.yaml"
    record["figures"]["abandoned_requests"] = record["server_outcomes"].get("cancelled", 0)
    return record

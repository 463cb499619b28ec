#!/usr/bin/env python3
"""Ray Serve replicas benchmark: requests/s on the openpi policy websocket with 2 replicas against
1, in the same run, with the machine's CPU utilisation during each cell.

    python benchmarks/serve_replicas.py [--quick] [--clients 8] [--ray-address ADDR]
                                        [--out benchmarks/results/serve_replicas.json]

The policy is examples/serve/vision_policy.yaml (a conv encoder over a 64x64 RGB image plus the
state, then 10 Euler steps of a flow-matching MLP action expert; random seeded weights), served
by `mstar_rt.serve.ray_serve` exactly as `mstar-rt serve --replicas N` serves it: a local Ray
cluster started here (or the one at --ray-address), Ray Serve's proxy on 127.0.0.1, each replica its own process with its own
model and runtime (num_cpus 1, so Ray gives it one torch thread). The same app is redeployed
with 1 and 2 replicas in the order 1, 2, 2, 1 (--quick: 1, 2). Each cell opens `--clients` real
openpi_client WebsocketClientPolicy connections (Ray routes each connection to a replica; the
split is recorded), runs them closed-loop on threads of this process for a fixed time after a
warm-up, and reads /proc/stat around it: `cpu_busy_pct` is the share of all cores busy, so on a
2-core machine a ratio near 1 with ~100 % busy means the CPU, not the replica count, bounds it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_common import machine  # noqa: E402

DEFAULT_OUT = ROOT / "benchmarks" / "results" / "serve_replicas.json"
CONFIG = ROOT / "examples" / "serve" / "vision_policy.yaml"
FULL = dict(seconds=8.0, warmup=3, order=(1, 2, 2, 1))
QUICK = dict(seconds=2.0, warmup=1, order=(1, 2))
APP = "mstar-bench"


def cpu_times() -> tuple[int, int]:
    """(busy, total) jiffies over all cores, from /proc/stat."""
    fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return sum(fields) - idle, sum(fields)


def observation(i: int) -> dict:
    g = np.random.default_rng(i)
    return {"observation/image": g.integers(0, 256, (64, 64, 3), dtype=np.uint8),
            "observation/state": g.standard_normal(8).astype(np.float32)}


def run_cell(port: int, clients: int, seconds: float, warmup: int) -> dict[str, Any]:
    """``clients`` closed-loop websocket clients for ``seconds``; rps, latency, CPU, the split."""
    from openpi_client.websocket_client_policy import WebsocketClientPolicy

    policies = [WebsocketClientPolicy("127.0.0.1", port) for _ in range(clients)]
    split = Counter(p._ws.response.headers.get("x-mstar-replica", "?") for p in policies)
    obs = [observation(k) for k in range(clients)]
    for k, p in enumerate(policies):
        for _ in range(warmup):
            p.infer(obs[k])
    latencies: list[list[float]] = [[] for _ in range(clients)]
    start, stop = threading.Barrier(clients + 1), threading.Event()

    def client(k: int) -> None:
        start.wait()
        while not stop.is_set():
            t0 = time.perf_counter()
            policies[k].infer(obs[k])
            latencies[k].append(time.perf_counter() - t0)

    threads = [threading.Thread(target=client, args=(k,), daemon=True) for k in range(clients)]
    for t in threads:
        t.start()
    busy0, total0 = cpu_times()
    start.wait()
    t0 = time.perf_counter()
    time.sleep(seconds)
    stop.set()
    for t in threads:
        t.join(30)
    elapsed = time.perf_counter() - t0
    busy1, total1 = cpu_times()
    for p in policies:
        p._ws.close()
    done = sorted(x for lat in latencies for x in lat)
    return {"rps": len(done) / elapsed, "p50_ms": 1e3 * done[len(done) // 2],
            "p99_ms": 1e3 * done[min(len(done) - 1, int(0.99 * len(done)))],
            "cpu_busy_pct": 100.0 * (busy1 - busy0) / max(1, total1 - total0),
            "split": sorted(split.values(), reverse=True)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="one 2 s cell per replica count")
    ap.add_argument("--clients", type=int, default=8, help="concurrent websocket clients")
    ap.add_argument("--port", type=int, default=18790, help="Ray Serve's HTTP port")
    ap.add_argument("--ray-address", help="an existing Ray cluster (default: a local one, "
                    "started and stopped here)")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = ap.parse_args()
    cfg = QUICK if args.quick else FULL

    from ray import serve

    from mstar_rt.serve import ray_serve
    from mstar_rt.serve.config import RaySpec, load_config

    config = load_config(CONFIG).with_server(port=args.port)
    spec = RaySpec(replicas=1, num_cpus=1, app_name=APP)
    print(f"starting on {args.ray_address or 'a local Ray cluster'}; {args.clients} clients, "
          f"cells {cfg['order']} replicas", flush=True)
    t_start = time.monotonic()
    serving = ray_serve.start(config, spec, address=args.ray_address)
    runs: dict[int, list[dict]] = {1: [], 2: []}
    current = 1
    try:
        for n in cfg["order"]:
            if n != current:
                t0 = time.monotonic()
                serve.run(ray_serve.application(config, spec.with_replicas(n)), name=APP,
                          route_prefix="/")
                current = n
                print(f"  now {n} replica(s) ({time.monotonic() - t0:.1f} s to redeploy)",
                      flush=True)
            cell = run_cell(args.port, args.clients, cfg["seconds"], cfg["warmup"])
            runs[n].append(cell)
            print(f"  {n} replica(s): {cell['rps']:.1f} rps, p50 {cell['p50_ms']:.1f} ms, "
                  f"CPU {cell['cpu_busy_pct']:.0f} %, connections per replica {cell['split']}",
                  flush=True)
    finally:
        serving.stop()

    cells = {n: {k: statistics.mean(r[k] for r in per) for k in ("rps", "p50_ms", "p99_ms",
                                                                  "cpu_busy_pct")}
             for n, per in runs.items()}
    ratio = cells[2]["rps"] / cells[1]["rps"]
    print(f"\npolicy websocket through Ray Serve, {args.clients} clients, mean of "
          f"{len(runs[1])} x {cfg['seconds']:.0f} s per replica count (nproc={os.cpu_count()}, "
          f"load average {os.getloadavg()[0]:.1f})")
    print(f"{'replicas':>8} | {'rps':>7} {'p50 ms':>8} {'p99 ms':>8} | {'CPU busy %':>10} | "
          f"connections per replica")
    for n in (1, 2):
        c = cells[n]
        print(f"{n:>8} | {c['rps']:>7.1f} {c['p50_ms']:>8.1f} {c['p99_ms']:>8.1f} | "
              f"{c['cpu_busy_pct']:>10.0f} | {runs[n][-1]['split']}")
    figures: dict[str, float] = {}
    for n in (1, 2):
        for k in ("rps", "p50_ms", "p99_ms", "cpu_busy_pct"):
            figures[f"{k}_{n}_replica{'s' if n > 1 else ''}"] = cells[n][k]
    figures["clients"] = args.clients
    figures["nproc"] = os.cpu_count() or 0
    figures["loadavg_1min"] = os.getloadavg()[0]
    figures["total_s"] = time.monotonic() - t_start
    result = {"name": "serve_replicas", "quick": args.quick, "machine": machine(),
              "figures": figures, "ratios": {"rps_2_replicas_vs_1": ratio}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"\nrps_2_replicas_vs_1 = {ratio:.2f} (CPU busy {cells[1]['cpu_busy_pct']:.0f} % with "
          f"1 replica, {cells[2]['cpu_busy_pct']:.0f} % with 2; wrote {args.out})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

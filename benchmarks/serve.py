#!/usr/bin/env python3
"""Serving benchmark: requests/s and p50/p99 latency of the openpi policy websocket at 1, 4 and
16 concurrent clients, `mstar-rt serve` against a minimal reference server in the same run.

    python benchmarks/serve.py [--quick] [--out benchmarks/results/serve.json]

The policy is examples/serve/vision_policy.py as examples/serve/vision_policy.yaml configures it
(random seeded weights): a conv encoder over a 64x64 RGB image plus the state, then 4 Euler steps
of a flow-matching MLP action expert (3 layers of 1536, ~7 M parameters, weight-read bound at
batch 1 as a real action expert is on a GPU), actions [16, 7]. Its per-call cost at batch 1 and
16 is measured first and recorded (policy_*_ms).
  * ours      `python -m mstar_rt.serve.cli serve vision_policy.yaml` (the mstar-rt CLI): every
              connection submits to the shared Runtime off the event loop, so the observations of
              concurrent clients are batched into one forward per node.
  * blocking  the openpi server pattern: a `websockets` asyncio server whose handler runs the
              same policy (VisionFlowNet.act, the same modules and weights, built from the same
              YAML) for each message, blocking the loop: one forward per message, no batching.
Both servers run as subprocesses with one torch thread each (2-core machine; clients in this
process). Each client is a real openpi_client WebsocketClientPolicy on its own thread sending
uint8 image arrays; a cell runs for a fixed time after a warm-up; the servers alternate cell by
cell over 3 repetitions (medians reported); both servers' actions for the same observation are
compared first. Default run ~1.5 min, --quick ~20 s.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_common import child_pythonpath, machine  # noqa: E402

DEFAULT_OUT = ROOT / "benchmarks" / "results" / "serve.json"
CONFIG = ROOT / "examples" / "serve" / "vision_policy.yaml"
CLIENTS = (1, 4, 16)
FULL = dict(seconds=4.0, warmup=3, reps=3)
QUICK = dict(seconds=1.0, warmup=1, reps=1)
START_TIMEOUT_S = 60.0

try:
    from tqdm import tqdm
except ImportError:
    tqdm = None


# ---- the reference server (run as: serve.py --reference-server) ----------------------------------

def reference_server(host: str, port: int) -> None:
    """openpi's WebsocketPolicyServer pattern, without its code: metadata on connect, then for
    each message unpack, run the policy, pack the actions — all on the event loop."""
    import websockets.asyncio.server
    from openpi_client import msgpack_numpy

    from mstar_rt.serve.config import build_model, load_config

    net = build_model(load_config(CONFIG)).net
    packer = msgpack_numpy.Packer()

    async def handler(ws: Any) -> None:
        await ws.send(packer.pack({"server": "blocking-reference"}))
        async for message in ws:
            t0 = time.monotonic()
            obs = msgpack_numpy.unpackb(message)
            actions = net.act(obs["observation/image"], obs["observation/state"])
            await ws.send(packer.pack({"actions": actions, "server_timing": {
                "infer_ms": (time.monotonic() - t0) * 1e3}}))

    async def main() -> None:
        async with websockets.asyncio.server.serve(handler, host, port, compression=None,
                                                   max_size=None) as server:
            bound = next(iter(server.sockets)).getsockname()[1]
            print(f"reference: serving on http://{host}:{bound}", flush=True)
            await server.serve_forever()

    asyncio.run(main())


# ---- running the servers -------------------------------------------------------------------------

def start(cmd: list[str]) -> tuple[subprocess.Popen, int]:
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=child_pythonpath())
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            env=env, cwd=ROOT)
    found: list[int] = []

    def read() -> None:
        for line in proc.stdout:  # type: ignore[union-attr]
            m = re.search(r"serving.* on http://[^:\s]+:(\d+)", line)
            if m and not found:
                found.append(int(m.group(1)))

    threading.Thread(target=read, daemon=True).start()
    end = time.monotonic() + START_TIMEOUT_S
    while not found:
        if proc.poll() is not None or time.monotonic() > end:
            proc.kill()
            raise RuntimeError(f"{' '.join(cmd)} did not start (exit {proc.poll()})")
        time.sleep(0.05)
    return proc, found[0]


def observation(i: int) -> dict:
    g = np.random.default_rng(i)
    return {"observation/image": g.integers(0, 256, (64, 64, 3), dtype=np.uint8),
            "observation/state": g.standard_normal(8).astype(np.float32),
            "prompt": "pick up the cube"}


def run_cell(port: int, clients: int, seconds: float, warmup: int) -> dict:
    """``clients`` openpi clients on threads, each sending its next observation as soon as the
    last answer came; returns requests/s and latency percentiles."""
    from openpi_client.websocket_client_policy import WebsocketClientPolicy

    policies = [WebsocketClientPolicy("127.0.0.1", port) for _ in range(clients)]
    latencies: list[list[float]] = [[] for _ in range(clients)]
    errors: list[BaseException] = []
    stop_at = [0.0]
    # The action runs before any waiter is released: every client sees the same end time.
    start_line = threading.Barrier(clients + 1, action=lambda: stop_at.__setitem__(
        0, time.perf_counter() + seconds))

    def client(k: int) -> None:
        obs = observation(k)
        try:
            for _ in range(warmup):
                policies[k].infer(obs)
            start_line.wait()
            while time.perf_counter() < stop_at[0]:
                t0 = time.perf_counter()
                reply = policies[k].infer(obs)
                latencies[k].append(time.perf_counter() - t0)
                if reply["actions"].shape != (16, 7):
                    raise RuntimeError(f"actions of shape {reply['actions'].shape}")
        except BaseException as e:  # reported after the join
            errors.append(e)
            start_line.abort()

    threads = [threading.Thread(target=client, args=(k,)) for k in range(clients)]
    for t in threads:
        t.start()
    try:
        start_line.wait()
    except threading.BrokenBarrierError:
        pass
    t0 = stop_at[0] - seconds
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - t0
    for p in policies:
        p._ws.close()
    if errors:
        raise RuntimeError(f"a client failed: {errors[0]!r}")
    lat = sorted(x for per in latencies for x in per)
    return dict(rps=len(lat) / elapsed, p50_ms=1e3 * lat[len(lat) // 2],
                p99_ms=1e3 * lat[min(len(lat) - 1, int(0.99 * len(lat)))], requests=len(lat))


def policy_cost() -> dict:
    """The policy's own per-call cost (one torch thread, no server): batch 1 and batch 16."""
    import torch

    from mstar_rt.serve.config import build_model, load_config

    torch.set_num_threads(1)
    net = build_model(load_config(CONFIG)).net
    obs = [observation(i) for i in range(16)]
    out = {}
    with torch.inference_mode():
        for b in (1, 16):
            images = torch.from_numpy(np.stack([o["observation/image"] for o in obs[:b]]))
            states = torch.from_numpy(np.stack([o["observation/state"] for o in obs[:b]]))

            def call() -> None:
                cond = net.encode(images, states)
                x = torch.zeros(b, net.horizon * net.action_dim)
                for i in range(net.steps):
                    x = net.denoise(x, cond, torch.full((b,), i / net.steps))

            call()
            times = []
            for _ in range(5):
                t0 = time.perf_counter()
                call()
                times.append(time.perf_counter() - t0)
            out[f"policy_batch{b}_ms"] = 1e3 * statistics.median(times)
    return out


def same_actions(ours: int, ref: int) -> float:
    from openpi_client.websocket_client_policy import WebsocketClientPolicy

    a = WebsocketClientPolicy("127.0.0.1", ours)
    b = WebsocketClientPolicy("127.0.0.1", ref)
    try:
        return float(np.abs(a.infer(observation(7))["actions"]
                            - b.infer(observation(7))["actions"]).max())
    finally:
        a._ws.close()
        b._ws.close()


# ---- report --------------------------------------------------------------------------------------

def plot(cells: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for side, style, color in (("ours", "o-", "tab:blue"), ("blocking", "s--", "tab:orange")):
        xs = list(CLIENTS)
        ax1.plot(xs, [cells[side][c]["rps"] for c in xs], style, color=color, label=side)
        ax2.plot(xs, [cells[side][c]["p50_ms"] for c in xs], style, color=color,
                 label=f"{side} p50")
        ax2.plot(xs, [cells[side][c]["p99_ms"] for c in xs], style, color=color, alpha=0.4,
                 label=f"{side} p99")
    ax1.set(xscale="log", xticks=list(CLIENTS), xticklabels=list(map(str, CLIENTS)),
            xlabel="concurrent openpi clients", ylabel="requests / s",
            title="policy websocket throughput")
    ax2.set(xscale="log", yscale="log", xticks=list(CLIENTS),
            xticklabels=list(map(str, CLIENTS)), xlabel="concurrent openpi clients",
            ylabel="latency (ms)", title="latency per observation")
    ax2.yaxis.set_major_locator(matplotlib.ticker.LogLocator(subs=(1.0, 2.0, 5.0)))
    ax2.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
    ax2.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax1.legend()
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="1 s per cell: a smoke test")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--reference-server", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.reference_server:
        reference_server("127.0.0.1", args.port)
        return 0
    cfg = QUICK if args.quick else FULL
    cost = policy_cost()
    servers = {"ours": [sys.executable, "-m", "mstar_rt.serve.cli", "serve", str(CONFIG),
                        "--port", "0"],
               "blocking": [sys.executable, str(Path(__file__).resolve()), "--reference-server"]}
    procs: dict[str, subprocess.Popen] = {}
    ports: dict[str, int] = {}
    try:
        for side, cmd in servers.items():
            procs[side], ports[side] = start(cmd)
        diff = same_actions(ports["ours"], ports["blocking"])
        if diff > 1e-4:
            raise RuntimeError(f"the two servers' actions differ by {diff}")
        runs: dict[str, dict[int, list]] = {"ours": {}, "blocking": {}}
        # The sides alternate cell by cell and swap who goes first each repetition, so load
        # from neighbours on a shared machine falls on both.
        todo = [(c, side) for r in range(cfg["reps"]) for c in CLIENTS
                for side in (("ours", "blocking") if (c + r) % 2 else ("blocking", "ours"))]
        bar = tqdm(todo, desc="cells", unit="cell") if tqdm else todo
        for c, side in bar:
            runs[side].setdefault(c, []).append(
                run_cell(ports[side], c, cfg["seconds"], cfg["warmup"]))
        cells = {side: {c: {k: statistics.median(run[k] for run in per[c])
                            for k in ("rps", "p50_ms", "p99_ms")} for c in CLIENTS}
                 for side, per in runs.items()}
    finally:
        for p in procs.values():
            p.terminate()
        for p in procs.values():
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()

    print(f"\npolicy websocket, medians of {cfg['reps']} x {cfg['seconds']:.0f} s per cell "
          f"(load average {os.getloadavg()[0]:.1f}); policy per call: "
          f"{cost['policy_batch1_ms']:.1f} ms at batch 1, {cost['policy_batch16_ms']:.1f} ms "
          f"at batch 16; actions agree to {diff:.1e}")
    print(f"{'clients':>7} | {'ours rps':>9} {'p50 ms':>8} {'p99 ms':>8} | "
          f"{'blocking rps':>12} {'p50 ms':>8} {'p99 ms':>8} | {'rps ratio':>9}")
    figures: dict[str, float] = dict(cost)
    ratios: dict[str, float] = {}
    for c in CLIENTS:
        o, b = cells["ours"][c], cells["blocking"][c]
        ratio = o["rps"] / b["rps"]
        print(f"{c:>7} | {o['rps']:>9.1f} {o['p50_ms']:>8.1f} {o['p99_ms']:>8.1f} | "
              f"{b['rps']:>12.1f} {b['p50_ms']:>8.1f} {b['p99_ms']:>8.1f} | {ratio:>9.2f}")
        for side, cell in (("ours", o), ("blocking", b)):
            figures[f"{side}_rps_{c}clients"] = cell["rps"]
            figures[f"{side}_p50_ms_{c}clients"] = cell["p50_ms"]
            figures[f"{side}_p99_ms_{c}clients"] = cell["p99_ms"]
        ratios[f"rps_{c}clients_vs_blocking"] = ratio
    ratios["p99_16clients_blocking_vs_ours"] = (cells["blocking"][16]["p99_ms"]
                                                / cells["ours"][16]["p99_ms"])
    figures["actions_max_abs_diff"] = diff
    figures["loadavg_1min"] = os.getloadavg()[0]
    result = {"name": "serve", "quick": args.quick, "machine": machine(),
              "figures": figures, "ratios": ratios}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    plot(cells, args.out.with_suffix(".png"))
    print(f"\nrps_16clients_vs_blocking = {ratios['rps_16clients_vs_blocking']:.2f}  "
          f"(wrote {args.out} and {args.out.with_suffix('.png').name})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

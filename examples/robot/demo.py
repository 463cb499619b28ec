"""Closed-loop reaching with asynchronous chunked inference: a 2-link MuJoCo arm driven at a fixed
rate by a mstar_rt ControlLoop, fed by a learned chunk policy served by the mstar_rt Runtime --
by default the miniature pi0-style VLA (clients.py, pi0_policy.py), or the small MLP (--policy).

Two threads per episode:
  control loop  ControlLoop on the system clock (absolute deadlines), Python tick callback: pops
                one action per tick from an ActionChunkBuffer, sets the servo set-points, steps
                the physics one control period, and leaves an observation stamped with the next
                tick for the inference thread.
  inference     whenever fewer than H/2 planned actions remain: takes the latest observation
                (stamped t0) with the plan the loop still holds from t0 on, asks the policy's
                walk graph through the Runtime for a chunk -- passing d, the LatencyTracker's
                delay in ticks, and the plan's first d actions as run-time inputs (real-time
                chunking: those actions execute before the chunk lands, so the chunk starts with
                them) -- waits until the loop has reached tick t0 + delay (the injected inference
                delay) and publishes the chunk stamped t0; the buffer drops the stale first
                actions and merges the rest (rtc by default). The tracker records each chunk's
                latency from tick t0's deadline to its publication, so d follows the measured
                latency (injected delay included): nothing is told the injected number.

For delay in 0, 2, 5 ticks it runs N episodes (seeds 0 .. N-1), prints a summary table, writes a
PNG (wake-up lateness histogram, one end-effector trajectory per delay, distance to target over
time) and exits non-zero if any delay's success rate is below 80%.

    python examples/robot/demo.py [--episodes 20] [--rate-hz 50] [--mode rtc] [--policy pi0]
                                  [--delays 0,2,5] [--no-rtc-inputs] [--out build/robot_demo.png]

--policy pi0,mlp adds the MLP's rows for comparison; --no-rtc-inputs (an ablation) sends d = 0.
"""

from __future__ import annotations

import argparse
import math
import os
import pathlib
import sys
import threading
import time

import numpy as np

# One OpenMP thread, set before torch loads: the policy runs on the Runtime's worker thread, and
# there torch.set_num_threads() (which sets the caller's OpenMP team only) does not reach; an
# OpenMP team spinning on a small machine turned a 0.1 ms forward into 10-30 ms.
os.environ["OMP_NUM_THREADS"] = "1"
import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

import mstar_rt  # noqa: E402

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from arm_env import ACTION_DIM, ArmEnv  # noqa: E402
from clients import CLIENTS, PolicyClient, make_client  # noqa: E402
from expert import substeps  # noqa: E402

DELAYS = (0, 2, 5)
MIN_SUCCESS = 0.8
TIMEOUT_S = 3.0
LATENCY_WINDOW = 32  # chunks: d is the max over about the last six episodes' latencies


class Episode:
    """State shared by the loop thread (writes obs/tick/left) and the inference thread. Every
    field is one Python object replaced whole, so a reader never sees half an update."""

    def __init__(self, env: ArmEnv, buffer: mstar_rt.ActionChunkBuffer, n_sub: int,
                 period_ns: int, max_delay: int) -> None:
        self.env, self.buffer, self.n_sub = env, buffer, n_sub
        self.period_ns = period_ns
        self.max_delay = max_delay  # the largest d sent to the policy (0: never send one)
        self.horizon = buffer.horizon
        self.cond = threading.Condition()  # notified once per tick: the inference thread waits on it
        self.tick = 0  # the next tick the loop will pop for
        self.obs = (env.observe(), 0, None)  # (observation, its tick, the plan from that tick)
        self.deadline_ns = 0  # of the tick self.tick (the loop's clock: CLOCK_MONOTONIC)
        self.left = 0  # planned actions left from self.tick on (computed on the loop thread)
        self.done = False
        self.success_tick = -1
        self.given = False  # has any action been applied yet?
        self.applied = 0  # chunks the buffer has merged so far
        self.delays: list[int] = []  # d (ticks) of every chunk from the inference thread
        self.given_d: list[int] = []  # d passed to the policy with every request
        self.infer_ms: list[float] = []  # submit -> result of every request (the Runtime's work)
        self.jumps: list[float] = []  # max |delta a| at each switch to a chunk from the thread
        self.plan = np.zeros((0, ACTION_DIM), np.float32)  # the loop's plan from the next tick
        self.path = [env.end_effector()]
        self.distance = [env.distance()]
        self.error: BaseException | None = None
        self.loop: mstar_rt.ControlLoop | None = None  # set by run_episode, cleared after the run

    def on_tick(self, info: mstar_rt.TickInfo) -> None:
        t = info.tick
        action, fresh = self.buffer.pop(t)
        stats = self.buffer.stats
        if stats["applied"] > self.applied:  # a chunk was merged at this tick: note its delay d
            if self.applied > 0:  # (the first chunk is the one primed before the clock started)
                self.delays.append(stats["last_delay_ticks"])
                # and its jump: the new plan's action against the old plan's for this tick
                old = self.plan[0] if len(self.plan) else action
                self.jumps.append(float(np.abs(action - old).max()))
            self.applied = stats["applied"]
        if fresh or self.given:  # before the first chunk, pop gives zeros: keep holding the pose
            self.env.apply(action)
            self.given = True
        # Missed deadlines are skipped ticks; the real arm kept moving on the held set-point for
        # them, so the physics advances by every period since the last tick that ran.
        self.env.step_physics(self.n_sub * (1 + t - self.tick))
        self.path.append(self.env.end_effector())
        self.distance.append(self.env.distance())
        # remaining() is meant for the loop thread (it reads the plan pop() just left), so the
        # plan is taken here and handed over, not read by the inference thread.
        plan = self.plan = self.buffer.remaining(t + 1)
        self.left = len(plan)
        # the state the action for tick t + 1 will meet, and what the loop executes from then on
        obs = self.env.observe()
        with self.cond:
            self.obs = (obs, t + 1, plan)
            self.tick = t + 1
            self.deadline_ns = info.deadline_ns + self.period_ns
            self.cond.notify_all()
        if self.env.success():
            self.success_tick = t + 1
            self.loop.stop()  # ends run() before the next tick

    def infer(self, runtime: mstar_rt.Runtime, client: PolicyClient, delay: int,
              latency: mstar_rt.LatencyTracker, seed: int) -> None:
        try:
            published_at = -1
            count = 0
            while True:
                # Wait for a tick that leaves the plan short and has merged our last chunk.
                with self.cond:
                    self.cond.wait_for(lambda: self.done or (self.tick > published_at
                                                             and self.left < self.horizon // 2))
                    if self.done:
                        return
                    obs, t0, plan = self.obs
                    t0_deadline_ns = self.deadline_ns
                # d from measured latency, capped at what the policy was trained for (a later
                # chunk only loses its stale head, which the buffer drops anyway)
                d = min(latency.delay_ticks, self.max_delay)
                count += 1
                # (--no-rtc-inputs: no d and no plan, so guided RTC has nothing to pull towards)
                request = client.request(obs, d, plan if self.max_delay else None,
                                         seed=seed * 1000 + count)
                start = time.perf_counter()
                out = runtime.submit(request).result(timeout=5.0)
                self.infer_ms.append((time.perf_counter() - start) * 1e3)
                chunk = client.decode(out, obs)
                with self.cond:  # the injected delay: publish no earlier than tick t0 + delay
                    self.cond.wait_for(lambda: self.done or self.tick >= t0 + delay)
                    if self.done:
                        return
                    self.buffer.publish(chunk, t0)
                    latency.record((time.monotonic_ns() - t0_deadline_ns) * 1e-9)
                    if client.uses_delay:  # the mlp takes no d: its d_given is "-"
                        self.given_d.append(d)
                    published_at = self.tick
        except BaseException as e:  # surfaced by the main thread after the episode
            self.error = e

    def stop(self) -> None:
        with self.cond:
            self.done = True
            self.cond.notify_all()


def run_episode(runtime, client, env, seed, delay, args, latency):
    buffer = mstar_rt.ActionChunkBuffer(horizon=client.horizon, action_dim=ACTION_DIM,
                                        mode=args.mode)
    env.reset(seed)
    send_d = client.uses_delay and not args.no_rtc_inputs
    ep = Episode(env, buffer, substeps(args.rate_hz), int(round(1e9 / args.rate_hz)),
                 client.horizon // 2 if send_d else 0)
    # The robot waits for its first plan before the clock starts (as a real one would at rest):
    # the first chunk is observed at tick 0 and arrives in time (d = 0); every later one comes
    # from the inference thread with the injected delay.
    obs = ep.obs[0]
    first = client.decode(runtime.submit(client.request(obs, 0, None, seed * 1000)).result(
        timeout=5.0), obs)
    buffer.publish(first, 0)
    ep.left = len(first)  # the thread must not ask again before the plan runs low
    loop = ep.loop = mstar_rt.ControlLoop(args.rate_hz, ep.on_tick, realtime=args.realtime)
    worker = threading.Thread(target=ep.infer, args=(runtime, client, delay, latency, seed),
                              daemon=True)
    worker.start()
    try:
        loop.run(int(round(TIMEOUT_S * args.rate_hz)))
    finally:
        ep.stop()
        worker.join()
        ep.loop = None  # loop -> callback -> ep -> loop: a cycle the garbage collector cannot see
    if ep.error is not None:
        raise ep.error
    bins, width = loop.lateness_bins_ms
    return dict(success=ep.success_tick >= 0, ticks=ep.success_tick, stats=loop.stats,
                buffer=buffer.stats, lateness_bins=np.asarray(bins), bin_ms=width,
                delays=ep.delays, given_d=ep.given_d, infer_ms=np.asarray(ep.infer_ms),
                jumps=ep.jumps,
                path=np.asarray(ep.path),
                distance=np.asarray(ep.distance),
                target=env.target.copy())


def percentile_from_bins(bins: np.ndarray, width: float, max_ms: float, p: float) -> float:
    """Nearest-rank percentile over pooled per-episode histograms, computed as the loop's own
    stats do: the bin's upper edge capped at the max seen; a rank in the overflow bin (the last)
    gives the max, the only exact value there."""
    total = int(bins.sum())
    if total == 0:
        return 0.0
    rank = max(1, int(np.ceil(p * total / 100 - 1e-9)))
    i = int(np.searchsorted(np.cumsum(bins[:-1]), rank))
    return min((i + 1) * width, max_ms) if i < len(bins) - 1 else max_ms


def summarise(policy, delay, mode, episodes, latency, rate_hz):
    ok = [e for e in episodes if e["success"]]
    bins = sum(e["lateness_bins"] for e in episodes)
    width = episodes[0]["bin_ms"]
    max_ms = max(e["stats"]["lateness_max_ms"] for e in episodes)
    return dict(
        policy=policy, delay=delay, mode=mode, success=len(ok) / len(episodes),
        time_s=float(np.mean([e["ticks"] for e in ok])) / rate_hz if ok else float("nan"),
        starved=sum(e["buffer"]["starved_ticks"] for e in episodes),
        jump=max(e["buffer"]["max_switch_jump"] for e in episodes),
        jump_p50=float(np.median([j for e in episodes for j in e["jumps"]] or [np.nan])),
        # d as the buffer measured it on the chunks it merged: the injected delay plus whatever
        # real inference added (a chunk late by a further tick shows as delay + 1)
        d_seen=sorted({d for e in episodes for d in e["delays"]}),
        d_given=sorted({d for e in episodes for d in e["given_d"]}),
        p50=percentile_from_bins(bins, width, max_ms, 50),
        p99=percentile_from_bins(bins, width, max_ms, 99),
        missed=sum(e["stats"]["missed_deadlines"] for e in episodes),
        # no chunk in time (a very low --rate-hz runs out of ticks first): NaN, not a crash
        infer_p95=float(np.percentile(infer, 95)) if len(
            infer := np.concatenate([e["infer_ms"] for e in episodes])) else float("nan"),
        latency_max=latency.max_s * 1e3,
        sched=episodes[0]["stats"]["mode"], bins=bins, width=width)


def _span(values: list[int]) -> str:
    if not values:
        return "-"
    return str(values[0]) if values[0] == values[-1] else f"{values[0]}-{values[-1]}"


def print_table(rows, episodes):
    w = max(6, *(len(r["policy"]) for r in rows))
    head = (f"{'policy':>{w}} {'delay':>5} {'mode':>5} {'success':>9} {'t_success':>9} "
            f"{'starved':>7} {'jump_p50':>8} {'max_jump':>8} {'d_given':>7} {'d_seen':>6} "
            f"{'late_p50':>8} "
            f"{'late_p99':>8} {'missed':>6} {'infer_p95':>9}  sched")
    print(head)
    print("-" * len(head))
    for r in rows:
        n_ok = round(r["success"] * episodes)
        print(f"{r['policy']:>{w}} {r['delay']:>5} {r['mode']:>5} {n_ok:>3}/{episodes:<2} "
              f"{r['success']:>3.0%} {r['time_s']:>8.2f}s {r['starved']:>7} "
              f"{r['jump_p50']:>8.4f} {r['jump']:>8.3f} "
              f"{_span(r['d_given']):>7} {_span(r['d_seen']):>6} "
              f"{r['p50']:>6.3f}ms {r['p99']:>6.3f}ms {r['missed']:>6} {r['infer_p95']:>7.2f}ms  "
              f"{r['sched']}")
    print("delay: injected (ticks); t_success: mean control time to within 2 cm; starved: ticks"
          " with no planned action\njump_p50 / max_jump: median / largest set-point jump (rad) at"
          " the switches to the inference thread's chunks\nd_given: d (ticks) the LatencyTracker"
          " gave the policy with its requests (pi0 freezes that many leading actions;"
          " pi0-real-arch\nguides them towards the plan; mlp takes no d)\nd_seen: d the buffer"
          " measured on merged chunks; late_p50/p99: tick wake-up lateness over all ticks;"
          " missed: skipped deadlines\ninfer_p95: real Runtime latency (submit to result)")


def plot(rows, examples, rate_hz, out: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only; no display needed
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    ax = axes[0]
    for r in rows:
        bins = r["bins"][:-1]  # the overflow bin has no width to draw
        last = int(np.nonzero(bins)[0].max()) + 1 if bins.any() else 1
        group = max(1, last // 80)  # ~80 bars over the range seen, from the loop's 10 us bins
        bins = np.add.reduceat(bins[:last], np.arange(0, last, group))
        edges = np.arange(len(bins) + 1) * r["width"] * group
        ax.stairs(bins, edges, label=f"{r['policy']} delay {r['delay']}  p99 {r['p99']:.3f} ms")
    ax.set_yscale("log")
    ax.set_xlabel("tick wake-up lateness (ms)")
    ax.set_ylabel("ticks")
    ax.set_title(f"ControlLoop lateness at {rate_hz:g} Hz")
    ax.legend(fontsize=8)

    ax = axes[1]
    for (label, ep), color in zip(examples.items(), [f"C{i}" for i in range(10)]):
        p = ep["path"]
        ax.plot(p[:, 0], p[:, 1], color=color, label=label)
        ax.plot(*p[0], "o", color=color)
    target = next(iter(examples.values()))["target"]
    ax.add_patch(plt.Circle(tuple(target), 0.02, fill=False, color="red", label="target (2 cm)"))
    ax.plot([0], [0], "ks", label="shoulder")
    ax.set_aspect("equal")
    ax.set_title("end-effector path, episode 0 (o = start)")
    ax.legend(fontsize=8)

    ax = axes[2]
    for label, ep in examples.items():
        t = np.arange(len(ep["distance"])) / rate_hz
        ax.plot(t, ep["distance"] * 100, label=label)
    ax.axhline(2.0, color="red", ls="--", lw=1, label="success radius")
    ax.set_xlabel("control time (s)")
    ax.set_ylabel("distance to target (cm)")
    ax.set_title("episode 0: distance to target")
    ax.legend(fontsize=8)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=20)
    parser.add_argument("--rate-hz", type=float, default=50.0,
                        help="control rate; the policy plans for 50 Hz ticks, so other rates replay "
                             "its plan faster or slower (it still converges, with larger switch jumps)")
    parser.add_argument("--mode", choices=["rtc", "weighted", "latest"], default="rtc")
    parser.add_argument("--policy", default="pi0",
                        help=f"comma-separated policies to run, each at every delay: "
                             f"{', '.join(sorted(CLIENTS))} (e.g. pi0,mlp to compare)")
    parser.add_argument("--delays", default=",".join(map(str, DELAYS)),
                        help="comma-separated injected inference delays (ticks)")
    parser.add_argument("--no-rtc-inputs", action="store_true",
                        help="ablation: send d = 0 (no frozen actions) to the policy; the buffer "
                             "still merges in --mode")
    parser.add_argument("--realtime", action="store_true", help="ask for SCHED_FIFO (needs privileges)")
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("build/robot_demo.png"))
    args = parser.parse_args()

    try:
        clients = [make_client(name) for name in args.policy.split(",")]
        delays = [int(d) for d in args.delays.split(",")]
    except (ValueError, FileNotFoundError) as e:
        parser.error(str(e))
    if any(d < 0 for d in delays):
        parser.error(f"--delays must be ticks >= 0; got {args.delays}")
    if args.episodes < 1:
        parser.error(f"--episodes must be 1 or more; got {args.episodes}")
    if not (math.isfinite(args.rate_hz) and 1.0 <= args.rate_hz <= 10_000):
        parser.error(f"--rate-hz must be 1 to 10000 ticks per second; got {args.rate_hz:g}")
    torch.set_num_threads(1)  # tiny models: intra-op threads would only compete with the loop
    start = time.perf_counter()
    env = ArmEnv()
    rows, examples = [], {}
    for client in clients:
        with mstar_rt.Runtime(client.model()) as runtime:
            for i in range(5):  # warm-up: torch's first calls are slow, and that is not the policy
                obs = env.reset(0)
                runtime.submit(client.request(obs, 0, None, i)).result(timeout=30.0)
            for delay in delays:
                latency = mstar_rt.LatencyTracker(window=LATENCY_WINDOW,
                                                  control_period_s=1.0 / args.rate_hz)
                episodes = [run_episode(runtime, client, env, seed, delay, args, latency)
                            for seed in tqdm(range(args.episodes), leave=False,
                                             desc=f"{client.name} delay {delay}")]
                if client is clients[0]:
                    examples[f"{client.name} delay {delay}"] = episodes[0]
                label = client.name + ("/d0" if client.uses_delay and args.no_rtc_inputs else "")
                rows.append(summarise(label, delay, args.mode, episodes, latency, args.rate_hz))
    horizons = ", ".join(f"{c.name} {c.horizon}" for c in clients)
    print(f"\nreaching with learned chunk policies: {args.episodes} episodes per delay, "
          f"{args.rate_hz:g} Hz, horizon {horizons}, timeout {TIMEOUT_S:g} s")
    print_table(rows, args.episodes)
    plot(rows, examples, args.rate_hz, args.out)
    print(f"\nplot: {args.out}")
    print(f"wall time {time.perf_counter() - start:.1f} s")
    failing = [f"{r['policy']} {r['delay']}" for r in rows if r["success"] < MIN_SUCCESS]
    if failing:
        print(f"FAIL: success below {MIN_SUCCESS:.0%} at delay(s) {failing}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

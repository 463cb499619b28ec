"""Closed-loop reaching with asynchronous chunked inference: a 2-link MuJoCo arm driven at a fixed
rate by a mstar_rt ControlLoop, fed by a learned chunk policy served by the mstar_rt Runtime.

Two threads per episode:
  control loop  ControlLoop on the system clock (absolute deadlines), Python tick callback: pops
                one action per tick from an ActionChunkBuffer, sets the servo set-points, steps
                the physics one control period, and leaves an observation stamped with the next
                tick for the inference thread.
  inference     whenever fewer than H/2 planned actions remain: takes the latest observation
                (stamped t0), runs the policy's walk graph through the Runtime, waits until the
                loop has reached tick t0 + delay (the injected inference delay) and publishes the
                chunk stamped t0; the buffer drops the stale first actions and merges the rest
                (rtc by default). A LatencyTracker records the real inference latency.

For delay in 0, 2, 5 ticks it runs N episodes (seeds 0 .. N-1), prints a summary table, writes a
PNG (wake-up lateness histogram, one end-effector trajectory per delay, distance to target over
time) and exits non-zero if any delay's success rate is below 80%.

    python examples/robot/demo.py [--episodes 20] [--rate-hz 50] [--mode rtc] [--out build/robot_demo.png]
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import threading
import time

import numpy as np

# One OpenMP thread, set before torch loads: the MLP runs on the Runtime's worker thread, and
# there torch.set_num_threads() (which sets the caller's OpenMP team only) does not reach; an
# OpenMP team spinning on a small machine turned a 0.1 ms forward into 10-30 ms.
os.environ["OMP_NUM_THREADS"] = "1"
import torch  # noqa: E402

import mstar_rt  # noqa: E402

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from arm_env import ACTION_DIM, ArmEnv  # noqa: E402
from expert import actions_left, substeps  # noqa: E402
from policy import ChunkMLP, ChunkPolicyModel  # noqa: E402

DELAYS = (0, 2, 5)
MIN_SUCCESS = 0.8
TIMEOUT_S = 3.0


class Episode:
    """State shared by the loop thread (writes obs/tick/left) and the inference thread. Every
    field is one Python object replaced whole, so a reader never sees half an update."""

    def __init__(self, env: ArmEnv, buffer: mstar_rt.ActionChunkBuffer, n_sub: int) -> None:
        self.env, self.buffer, self.n_sub = env, buffer, n_sub
        self.horizon = buffer.horizon
        self.cond = threading.Condition()  # notified once per tick: the inference thread waits on it
        self.tick = 0  # the next tick the loop will pop for
        self.obs = (env.observe(), 0)  # (observation, the tick it was taken for)
        self.left = 0  # planned actions left from self.tick on (computed on the loop thread)
        self.done = False
        self.success_tick = -1
        self.given = False  # has any action been applied yet?
        self.applied = 0  # chunks the buffer has merged so far
        self.delays: list[int] = []  # d (ticks) of every chunk from the inference thread
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
        # count is taken here and handed over, not read by the inference thread.
        self.left = actions_left(self.buffer, t + 1)
        self.obs = (self.env.observe(), t + 1)  # the state the action for tick t + 1 will meet
        with self.cond:
            self.tick = t + 1
            self.cond.notify_all()
        if self.env.success():
            self.success_tick = t + 1
            self.loop.stop()  # ends run() before the next tick

    def infer(self, runtime: mstar_rt.Runtime, delay: int, latency: mstar_rt.LatencyTracker) -> None:
        try:
            published_at = -1
            while True:
                # Wait for a tick that leaves the plan short and has merged our last chunk.
                with self.cond:
                    self.cond.wait_for(lambda: self.done or (self.tick > published_at
                                                             and self.left < self.horizon // 2))
                    if self.done:
                        return
                obs, t0 = self.obs
                start = time.perf_counter()
                chunk = runtime.submit({"obs": obs}).result(timeout=2.0)["actions"][0]
                latency.record(time.perf_counter() - start)
                with self.cond:  # the injected delay: publish no earlier than tick t0 + delay
                    self.cond.wait_for(lambda: self.done or self.tick >= t0 + delay)
                    if self.done:
                        return
                    self.buffer.publish(chunk, t0)
                    published_at = self.tick
        except BaseException as e:  # surfaced by the main thread after the episode
            self.error = e

    def stop(self) -> None:
        with self.cond:
            self.done = True
            self.cond.notify_all()


def run_episode(runtime, env, seed, delay, args, latency):
    buffer = mstar_rt.ActionChunkBuffer(horizon=runtime.model.net.horizon, action_dim=ACTION_DIM,
                                        mode=args.mode)
    env.reset(seed)
    ep = Episode(env, buffer, substeps(args.rate_hz))
    # The robot waits for its first plan before the clock starts (as a real one would at rest):
    # the first chunk is observed at tick 0 and arrives in time; every later one comes from the
    # inference thread with the injected delay.
    first = runtime.submit({"obs": ep.obs[0]}).result(timeout=2.0)["actions"][0]
    buffer.publish(first, 0)
    ep.left = len(first)  # the thread must not ask again before the plan runs low
    loop = ep.loop = mstar_rt.ControlLoop(args.rate_hz, ep.on_tick, realtime=args.realtime)
    worker = threading.Thread(target=ep.infer, args=(runtime, delay, latency), daemon=True)
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
                delays=ep.delays, path=np.asarray(ep.path), distance=np.asarray(ep.distance),
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


def summarise(delay, mode, episodes, latency, rate_hz):
    ok = [e for e in episodes if e["success"]]
    bins = sum(e["lateness_bins"] for e in episodes)
    width = episodes[0]["bin_ms"]
    max_ms = max(e["stats"]["lateness_max_ms"] for e in episodes)
    return dict(
        delay=delay, mode=mode, success=len(ok) / len(episodes),
        time_s=float(np.mean([e["ticks"] for e in ok])) / rate_hz if ok else float("nan"),
        starved=sum(e["buffer"]["starved_ticks"] for e in episodes),
        jump=max(e["buffer"]["max_switch_jump"] for e in episodes),
        # d as the buffer measured it on the chunks it merged: the injected delay plus whatever
        # real inference added (a chunk late by a further tick shows as delay + 1)
        d_seen=sorted({d for e in episodes for d in e["delays"]}),
        p50=percentile_from_bins(bins, width, max_ms, 50),
        p99=percentile_from_bins(bins, width, max_ms, 99),
        missed=sum(e["stats"]["missed_deadlines"] for e in episodes),
        infer_p95=latency.p95_s * 1e3, infer_max=latency.max_s * 1e3,
        sched=episodes[0]["stats"]["mode"], bins=bins, width=width)


def _span(values: list[int]) -> str:
    if not values:
        return "-"
    return str(values[0]) if values[0] == values[-1] else f"{values[0]}-{values[-1]}"


def print_table(rows, episodes):
    head = (f"{'delay':>5} {'mode':>8} {'success':>9} {'t_success':>9} {'starved':>7} "
            f"{'max_jump':>8} {'d_seen':>6} {'late_p50':>8} {'late_p99':>8} {'missed':>6} "
            f"{'infer_p95':>9}  sched")
    print(head)
    print("-" * len(head))
    for r in rows:
        n_ok = round(r["success"] * episodes)
        print(f"{r['delay']:>5} {r['mode']:>8} {n_ok:>3}/{episodes:<2} {r['success']:>3.0%} "
              f"{r['time_s']:>8.2f}s {r['starved']:>7} {r['jump']:>8.3f} {_span(r['d_seen']):>6} "
              f"{r['p50']:>6.3f}ms {r['p99']:>6.3f}ms {r['missed']:>6} {r['infer_p95']:>7.2f}ms  "
              f"{r['sched']}")
    print("delay: injected (ticks); t_success: mean control time to within 2 cm; starved: ticks with"
          " no planned action\nmax_jump: largest set-point jump at a chunk switch (rad); d_seen:"
          " delays (ticks) the buffer measured on merged chunks\nlate_p50/p99: tick wake-up lateness"
          " over all ticks; missed: skipped deadlines; infer_p95: real Runtime latency")


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
        ax.stairs(bins, edges, label=f"delay {r['delay']}  p99 {r['p99']:.3f} ms")
    ax.set_yscale("log")
    ax.set_xlabel("tick wake-up lateness (ms)")
    ax.set_ylabel("ticks")
    ax.set_title(f"ControlLoop lateness at {rate_hz:g} Hz")
    ax.legend()

    ax = axes[1]
    for (delay, ep), color in zip(examples.items(), ("C0", "C1", "C2")):
        p = ep["path"]
        ax.plot(p[:, 0], p[:, 1], color=color, label=f"delay {delay}")
        ax.plot(*p[0], "o", color=color)
    target = next(iter(examples.values()))["target"]
    ax.add_patch(plt.Circle(tuple(target), 0.02, fill=False, color="red", label="target (2 cm)"))
    ax.plot([0], [0], "ks", label="shoulder")
    ax.set_aspect("equal")
    ax.set_title("end-effector path, episode 0 (o = start)")
    ax.legend(fontsize=8)

    ax = axes[2]
    for delay, ep in examples.items():
        t = np.arange(len(ep["distance"])) / rate_hz
        ax.plot(t, ep["distance"] * 100, label=f"delay {delay}")
    ax.axhline(2.0, color="red", ls="--", lw=1, label="success radius")
    ax.set_xlabel("control time (s)")
    ax.set_ylabel("distance to target (cm)")
    ax.set_title("episode 0: distance to target")
    ax.legend()
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
    parser.add_argument("--realtime", action="store_true", help="ask for SCHED_FIFO (needs privileges)")
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("build/robot_demo.png"))
    args = parser.parse_args()

    torch.set_num_threads(1)  # a tiny MLP: intra-op threads would only compete with the loop
    start = time.perf_counter()
    env = ArmEnv()
    rows, examples = [], {}
    with mstar_rt.Runtime(ChunkPolicyModel(ChunkMLP.load())) as runtime:
        for _ in range(5):  # warm-up: torch's first calls are slow, and that is not the policy
            runtime.submit({"obs": env.reset(0)}).result(timeout=10.0)
        for delay in DELAYS:
            latency = mstar_rt.LatencyTracker(window=256, control_period_s=1.0 / args.rate_hz)
            episodes = [run_episode(runtime, env, seed, delay, args, latency)
                        for seed in range(args.episodes)]
            examples[delay] = episodes[0]
            rows.append(summarise(delay, args.mode, episodes, latency, args.rate_hz))
    print(f"\nreaching with a learned chunk policy: {args.episodes} episodes per delay, "
          f"{args.rate_hz:g} Hz, horizon {runtime.model.net.horizon}, timeout {TIMEOUT_S:g} s")
    print_table(rows, args.episodes)
    plot(rows, examples, args.rate_hz, args.out)
    print(f"\nplot: {args.out}")
    print(f"wall time {time.perf_counter() - start:.1f} s")
    failing = [r["delay"] for r in rows if r["success"] < MIN_SUCCESS]
    if failing:
        print(f"FAIL: success below {MIN_SUCCESS:.0%} at delay(s) {failing}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

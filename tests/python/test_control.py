"""Control loop and action-chunk buffer from Python: merges, starvation, determinism, errors,
Ctrl-C and interpreter exit."""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import mstar_rt

PYTHONPATH = os.pathsep.join([str(Path(mstar_rt.__file__).parents[1]),
                              os.environ.get("PYTHONPATH", "")])


def _chunk(values, dim=1):
    return np.asarray(values, dtype=np.float32).reshape(-1, dim)


def test_latest_mode_plays_a_chunk_from_its_observation_tick():
    buf = mstar_rt.ActionChunkBuffer(horizon=4, action_dim=1)
    assert buf.publish(_chunk([10, 11, 12, 13]), obs_tick=0)
    got = [float(buf.pop(t)[0][0]) for t in range(4)]
    assert got == [10, 11, 12, 13]
    assert buf.stats["starved_ticks"] == 0


def test_a_late_chunk_skips_the_actions_its_delay_made_stale():
    buf = mstar_rt.ActionChunkBuffer(horizon=6, action_dim=1)
    buf.publish(_chunk([0, 1, 2, 3, 4, 5]), obs_tick=0)
    assert [float(buf.pop(t)[0][0]) for t in range(3)] == [0, 1, 2]
    buf.publish(_chunk([100, 101, 102, 103, 104, 105]), obs_tick=1)  # arrives at tick 3: d = 2
    assert float(buf.pop(3)[0][0]) == 102
    assert buf.stats["last_delay_ticks"] == 2


def test_starvation_holds_the_last_action_and_is_counted():
    buf = mstar_rt.ActionChunkBuffer(horizon=2, action_dim=2)
    action, fresh = buf.pop(0)
    assert not fresh and action.tolist() == [0, 0]
    buf.publish(_chunk([[1, 2], [3, 4]], dim=2), obs_tick=1)
    assert buf.pop(1)[0].tolist() == [1, 2]
    assert buf.pop(2)[0].tolist() == [3, 4]
    action, fresh = buf.pop(3)
    assert not fresh and action.tolist() == [3, 4]
    assert buf.stats["starved_ticks"] == 2


def test_rtc_merge_jumps_less_than_latest_at_a_switch():
    jumps = {}
    for mode in ("latest", "rtc"):
        buf = mstar_rt.ActionChunkBuffer(horizon=8, action_dim=1, mode=mode, schedule="linear")
        buf.publish(_chunk(np.zeros(8)), obs_tick=0)
        for t in range(3):
            buf.pop(t)
        buf.publish(_chunk(np.full(8, 10.0)), obs_tick=1)  # d = 2 when applied at tick 3
        buf.pop(3)
        jumps[mode] = buf.stats["max_switch_jump"]
    assert jumps["latest"] == pytest.approx(10.0)
    assert jumps["rtc"] < jumps["latest"]


def test_rtc_weights_follow_the_schedule():
    buf = mstar_rt.ActionChunkBuffer(horizon=6, action_dim=1, mode="rtc", schedule="linear",
                                     execution_horizon=1)
    # c(k) = (H - s - k) / (H - s - d + 1) with H=6, s=1, d=2: k=2 -> 3/4, k=4 -> 1/4, k>=5 -> 0
    assert buf.rtc_weight(1, 2) == pytest.approx(1.0)
    assert buf.rtc_weight(2, 2) == pytest.approx(0.75)
    assert buf.rtc_weight(4, 2) == pytest.approx(0.25)
    assert buf.rtc_weight(5, 2) == pytest.approx(0.0)


def test_bad_chunks_and_options_get_clear_errors():
    buf = mstar_rt.ActionChunkBuffer(horizon=4, action_dim=3)
    with pytest.raises(ValueError, match=r"shape \(n, 3\), got \(2, 2\)"):
        buf.publish(np.zeros((2, 2), np.float32), 0)
    with pytest.raises(ValueError, match=r"got \(3,\)"):
        buf.publish(np.zeros(3, np.float32), 0)
    with pytest.raises(ValueError, match="1..4 actions"):
        buf.publish(np.zeros((5, 3), np.float32), 0)
    with pytest.raises(ValueError, match="mode must be"):
        mstar_rt.ActionChunkBuffer(horizon=4, action_dim=3, mode="blend")
    with pytest.raises(ValueError):
        mstar_rt.ActionChunkBuffer(horizon=0, action_dim=3)


def test_nan_or_infinite_actions_never_reach_the_robot():
    buf = mstar_rt.ActionChunkBuffer(horizon=4, action_dim=2, mode="weighted")
    assert buf.publish(np.ones((4, 2), np.float32), 0)
    bad = np.ones((4, 2), np.float32)
    bad[3, 1] = np.nan
    assert not buf.publish(bad, 1)
    bad[3, 1] = -np.inf
    assert not buf.publish(bad, 1)
    for tick in range(4):  # the plan in hand keeps running
        action, fresh = buf.pop(tick)
        assert fresh and action.tolist() == [1.0, 1.0]
    stats = buf.stats
    assert (stats["rejected"], stats["nonfinite"], stats["published"]) == (2, 2, 1)


def test_latency_tracker_turns_latencies_into_a_delay_in_ticks():
    tracker = mstar_rt.LatencyTracker(window=3, control_period_s=0.01)
    for latency in (0.005, 0.012, 0.025):
        tracker.record(latency)
    assert tracker.delay_ticks == 3
    for latency in (0.004, 0.004, 0.004):  # the 25 ms sample leaves the window
        tracker.record(latency)
    assert tracker.delay_ticks == 1


def _closed_loop(seed: int, delay: int, mode: str) -> list[float]:
    """A first-order plant (x' = a) driven to a target by a chunking policy, on simulated time."""
    rng = np.random.default_rng(seed)
    clock = mstar_rt.SimulatedClock()
    buf = mstar_rt.ActionChunkBuffer(horizon=10, action_dim=1, mode=mode, schedule="exp")
    state = {"x": 0.0}
    target = 1.0
    trajectory: list[float] = []
    pending: list[tuple[int, np.ndarray, int]] = []

    def on_tick(info):
        t = info.tick
        if t % 5 == 0:  # observe now; the chunk is ready `delay` ticks later
            x = state["x"]
            plan = [(target - x) * 3.0 * 0.9 ** k + rng.normal(0, 0.01) for k in range(10)]
            pending.append((t + delay, np.asarray(plan, np.float32).reshape(-1, 1), t))
        while pending and pending[0][0] <= t:
            _, chunk, obs = pending.pop(0)
            buf.publish(chunk, obs)
        action, _ = buf.pop(t)
        state["x"] += 0.01 * float(action[0])
        trajectory.append(state["x"])

    loop = mstar_rt.ControlLoop(100.0, on_tick, clock=clock)
    loop.run(400)
    assert loop.stats["ticks"] == 400
    assert clock.now_ns == 399 * 10_000_000
    return trajectory


@pytest.mark.parametrize("mode", ["latest", "weighted", "rtc"])
def test_simulated_closed_loop_is_deterministic_and_reaches_the_target(mode):
    a = _closed_loop(seed=3, delay=2, mode=mode)
    b = _closed_loop(seed=3, delay=2, mode=mode)
    assert a == b
    assert abs(a[-1] - 1.0) < 0.05


def test_cpp_tick_pops_actions_without_python():
    clock = mstar_rt.SimulatedClock()
    buf = mstar_rt.ActionChunkBuffer(horizon=50, action_dim=2)
    buf.publish(np.tile(np.arange(50, dtype=np.float32)[:, None], (1, 2)), obs_tick=0)
    loop = mstar_rt.ControlLoop(500.0, action_buffer=buf, clock=clock)
    loop.run(60)
    assert loop.last_action.tolist() == [49.0, 49.0]
    assert loop.starved_ticks == 10


def test_system_clock_loop_reports_lateness_and_mode():
    ticks = []
    loop = mstar_rt.ControlLoop(200.0, lambda info: ticks.append(info.tick))
    loop.run(40)
    assert ticks == list(range(40)) or loop.stats["missed_deadlines"] > 0
    stats = loop.stats
    assert stats["ticks"] >= 30 and stats["lateness_max_ms"] >= stats["lateness_p50_ms"] >= 0
    assert "SCHED_OTHER" in loop.mode


def test_a_callback_error_stops_the_loop_and_propagates():
    def on_tick(info):
        if info.tick == 3:
            raise KeyError("boom")

    loop = mstar_rt.ControlLoop(1000.0, on_tick, clock=mstar_rt.SimulatedClock())
    with pytest.raises(KeyError, match="boom"):
        loop.run(10)


def test_a_loop_needs_something_to_run():
    with pytest.raises(ValueError, match="callback"):
        mstar_rt.ControlLoop(100.0)


def test_remaining_returns_the_plans_future_actions():
    buf = mstar_rt.ActionChunkBuffer(horizon=4, action_dim=2)
    buf.publish(np.arange(8, dtype=np.float32).reshape(4, 2), obs_tick=0)
    buf.pop(0)
    left = buf.remaining(1)
    assert left.shape == (3, 2)
    assert left[:, 0].tolist() == [2.0, 4.0, 6.0]


def test_pop_into_writes_in_place_or_refuses_what_it_cannot_write():
    buf = mstar_rt.ActionChunkBuffer(horizon=4, action_dim=2)
    buf.publish(np.arange(8, dtype=np.float32).reshape(4, 2), obs_tick=0)
    out = np.zeros(2, np.float32)
    assert buf.pop_into(0, out) and out.tolist() == [0.0, 1.0]
    # each would have been copied, the action written into the copy, and True returned
    for bad, words in ((np.zeros(4, np.float32)[::2], "not contiguous"),
                       (np.zeros(2, np.float64), "got float64"),
                       (np.zeros(3, np.float32), r"shape \(3,\)")):
        with pytest.raises(ValueError, match=f"C-contiguous float32 array of 2 values.*{words}"):
            buf.pop_into(1, bad)
    frozen = np.zeros(2, np.float32)
    frozen.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        buf.pop_into(1, frozen)


@pytest.mark.parametrize("call, words", [
    (lambda: mstar_rt.ActionChunkBuffer(4, 2, mode="rtc", execution_horizon=-1),
     "execution_horizon must be >= 0, got -1"),
    (lambda: mstar_rt.ActionChunkBuffer(-1, 2), "horizon must be >= 0"),
    (lambda: mstar_rt.ActionChunkBuffer(4, 2).pop(-1), "pop: tick must be >= 0"),
    (lambda: mstar_rt.ActionChunkBuffer(4, 2).publish(np.zeros((1, 2), np.float32), -3),
     "obs_tick must be >= 0, got -3"),
    (lambda: mstar_rt.ActionChunkBuffer(4, 2).rtc_weight(0, -1), "rtc_weight: d must be >= 0"),
    (lambda: mstar_rt.LatencyTracker(-1, 0.01), "window must be >= 0"),
    (lambda: mstar_rt.ControlLoop(10.0, lambda t: None).run(-2), "run: ticks must be >= 0"),
])
def test_negative_counts_and_ticks_are_refused_by_name(call, words):
    # pybind printed every overload's signature for them
    with pytest.raises(ValueError, match=words):
        call()


SCRIPT_PREAMBLE = """
import os, signal, sys, threading, time
import mstar_rt
"""


def _script(body: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", SCRIPT_PREAMBLE + body], capture_output=True,
                          text=True, timeout=60, env={**os.environ, "PYTHONPATH": PYTHONPATH})


@pytest.mark.parametrize("ending, rc", [("raise RuntimeError('robot script bug')", 1),
                                        ("pass", 0)])
def test_a_started_loop_left_running_ends_with_the_interpreter(ending, rc):
    """A Python tick wanting the GIL while the interpreter finalized ended its thread from
    under the loop: glibc aborted the process (exit 134, 'FATAL: exception not rethrown')."""
    done = _script(f"""
loop = mstar_rt.ControlLoop(500.0, lambda t: None)
loop.start()
time.sleep(0.1)
{ending}
""")
    assert done.returncode == rc, done.stderr
    assert "FATAL" not in done.stderr and "Aborted" not in done.stderr


def test_ctrl_c_stops_run_of_the_cpp_tick():
    done = _script("""
signal.signal(signal.SIGINT, signal.default_int_handler)  # as an interactive shell gives it
threading.Timer(0.3, lambda: os.kill(os.getpid(), signal.SIGINT)).start()
loop = mstar_rt.ControlLoop(100.0, action_buffer=mstar_rt.ActionChunkBuffer(50, 7))
t0 = time.monotonic()
try:
    loop.run()
except KeyboardInterrupt:
    print(f"interrupted {time.monotonic() - t0:.2f} {loop.running}")
""")
    assert done.returncode == 0, done.stderr
    word, after, running = done.stdout.split()
    assert word == "interrupted" and float(after) < 2.0 and running == "False"

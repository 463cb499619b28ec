"""Hangs, not only deaths (issue 16, item 5): a worker that stops answering -- stopped with
SIGSTOP, or stuck in an endless loop in a node -- is detected by its heartbeat within the
configured time; its requests fail with an error naming the rank and the node, and
restart="auto" replaces it."""

from __future__ import annotations

import os
import signal
import time

import pytest

from mstar_rt import RequestFailed
from mstar_rt.placement import NodeGroup, PlacedRuntime

from walk_models import wait_until

T = 30.0
GROUPS = [NodeGroup(["work"], rank=1)]


def failure(handle) -> tuple[str, float]:
    t0 = time.monotonic()
    with pytest.raises(RequestFailed) as e:
        handle.result(timeout=T)
    return str(e.value), time.monotonic() - t0


def served_again(rt) -> bool:
    return wait_until(lambda: rt.workers[1]["state"] == "up", timeout=T) and \
        rt.submit({"mode": "ok", "seconds": 1.5}).result(timeout=T)["y"] == [3.0]


def test_a_stopped_worker_is_detected_by_its_heartbeat_and_replaced():
    with PlacedRuntime("hang_models:hang_model", GROUPS, restart="auto", progress=False,
                       heartbeat_timeout_s=1.0) as rt:
        assert rt.submit({"mode": "ok", "seconds": 1.0}).result(timeout=T)["y"] == [2.0]
        pid = rt.workers[1]["pid"]
        running = rt.submit({"mode": "sleep", "seconds": 0.5})
        time.sleep(0.1)  # in the node now
        os.kill(pid, signal.SIGSTOP)
        t0 = time.monotonic()
        message, _ = failure(running)
        detected = time.monotonic() - t0
        assert "rank 1" in message and "node 'work'" in message, message
        assert "stopped answering" in message and "heartbeat" in message, message
        assert detected < 1.0 + 1.5, f"detected after {detected:.2f} s (timeout 1 s)"
        assert served_again(rt)
        assert rt.workers[1]["pid"] != pid and rt.workers[1]["restarts"] == 1


def test_a_node_stuck_in_an_endless_loop_is_detected_and_its_worker_replaced(capfd):
    with PlacedRuntime("hang_models:hang_model", GROUPS, restart="auto", progress=False,
                       heartbeat_timeout_s=2.0, node_timeout_s=1.0) as rt:
        stuck = rt.submit({"mode": "spin"})
        message, waited = failure(stuck)
        assert "rank 1" in message and "hung in node 'work'" in message, message
        assert "node_timeout_s=1" in message, message
        assert waited < 1.0 + 1.5, f"detected after {waited:.2f} s (node_timeout_s 1 s)"
        # before the kill the worker printed its threads' stacks: the hang can be read later
        err = capfd.readouterr().err
        assert "its thread stacks follow" in err and "hang_models.py" in err, err[-2000:]
        assert served_again(rt)


def test_a_slow_node_within_its_limits_is_left_alone():
    with PlacedRuntime("hang_models:hang_model", GROUPS, progress=False,
                       heartbeat_timeout_s=0.5, node_timeout_s=3.0) as rt:
        # Longer than the heartbeat timeout: heartbeats go on while the node works.
        assert rt.submit({"mode": "sleep", "seconds": 1.5}).result(timeout=T)["y"] == [3.0]
        assert rt.workers[1]["restarts"] == 0 and rt.workers[1]["state"] == "up"


def test_timeouts_are_checked():
    with pytest.raises(ValueError, match="heartbeat_timeout_s"):
        PlacedRuntime("hang_models:hang_model", GROUPS, progress=False, heartbeat_timeout_s=0)


def test_worker_stats_right_after_start_is_answered():
    # A stats request posted while the parent's socket still connects used to be dropped.
    for _ in range(3):
        with PlacedRuntime("hang_models:hang_model", GROUPS, progress=False) as rt:
            stats = rt.worker_stats(1, timeout=10.0)
            assert stats["rank"] == 1 and stats["live_requests"] == 0

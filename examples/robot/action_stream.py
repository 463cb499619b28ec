"""Action chunks through a ring: a slow policy feeds a fast control loop.

A stand-in policy (30 ms per inference) produces a chunk of 50 actions (7-DoF) whenever fewer than
half a chunk is queued, as LeRobot's async client does; a 100 Hz control loop paced on absolute
deadlines pops one action per tick from a lock-free Ring and reports how late its ticks were and
whether it ever ran dry. (The C++ ControlLoop with real-time chunking replaces this
Python loop in a later release; the ring underneath is the same.)
"""

from __future__ import annotations

import argparse
import threading
import time

import numpy as np

import mstar_rt

DOF = 7
HORIZON = 50


def policy(actions: mstar_rt.Ring, seconds: float, inference_s: float) -> int:
    chunks = 0
    step = 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if len(actions) >= HORIZON // 2:
            time.sleep(0.002)
            continue
        time.sleep(inference_s)  # the model thinks
        chunk = np.zeros((HORIZON, DOF), np.float32)
        chunk[:, 0] = np.arange(step, step + HORIZON)
        step += actions.push(chunk, timeout=1.0)
        chunks += 1
    actions.close()
    return chunks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--hz", type=float, default=100.0)
    args = parser.parse_args()

    actions = mstar_rt.Ring(np.float32, 256, item_shape=(DOF,))
    producer = threading.Thread(target=policy, args=(actions, args.seconds, 0.03))
    producer.start()
    period = 1.0 / args.hz
    lateness, starved, executed = [], 0, []
    deadline = time.monotonic() + 0.2  # let the first chunk arrive
    while True:
        time.sleep(max(0.0, deadline - time.monotonic()))
        lateness.append(time.monotonic() - deadline)
        try:
            action = actions.pop(1, timeout=0)
        except TimeoutError:
            starved += 1
            action = np.empty((0, DOF))
        if action is None:
            break
        if len(action):
            executed.append(int(action[0, 0]))
        deadline += period
    producer.join()
    late_ms = np.array(lateness) * 1000
    print(f"ticks {len(lateness)}  actions {len(executed)}  starved ticks {starved}")
    print(f"lateness p50 {np.percentile(late_ms, 50):.3f} ms  p99 {np.percentile(late_ms, 99):.3f} ms")
    if executed != list(range(len(executed))):
        raise SystemExit("actions arrived out of order")


if __name__ == "__main__":
    main()

"""A program that leaves a Runtime open exits cleanly: the runtimes still open are closed at
exit (mstar_rt/lifetime.py). Before, an engine thread still in the Conductor when the
interpreter finalized was torn down inside C++ and the process aborted ("terminate called
without an active exception", SIGABRT) -- after a forgotten close(), or an exception."""

from __future__ import annotations

import glob
import os
import subprocess
import sys
import textwrap
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))

OPEN_AT_EXIT = textwrap.dedent("""
    import sys, torch
    import placement_segment_models as sm
    from mstar_rt import Runtime
    rt = Runtime(sm.fed())
    slow = rt.submit(dict(x=torch.tensor(0.3), n=40, m=60, pause=0.01))  # still running at exit
    print(rt.submit(dict(x=torch.tensor(0.1))).result(30)["tok"][0].numel(), flush=True)
    if sys.argv[1] == "raise":
        raise RuntimeError("the caller's own error")
""")

PLACED_AT_EXIT = textwrap.dedent("""
    import os, torch
    from mstar_rt.placement import NodeGroup, PlacedRuntime
    rt = PlacedRuntime("placement_segment_models:fed", [NodeGroup(["talk", "voice"], rank=2)],
                       progress=False)
    print(rt.workers[2]["pid"], os.getpid(), flush=True)
    rt.submit(dict(x=torch.tensor(0.3), n=40, m=60, pause=0.01))  # still running at exit
""")


def run(script: str, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([HERE] + env.get("PYTHONPATH", "").split(os.pathsep))
    return subprocess.run([sys.executable, "-c", script, *args], env=env, capture_output=True,
                          text=True, timeout=120)


@pytest.mark.parametrize("how", ["return", "raise"])
def test_a_runtime_left_open_is_closed_at_exit(how):
    p = run(OPEN_AT_EXIT, how)
    assert "terminate called" not in p.stderr, p.stderr[-2000:]
    assert p.returncode == (0 if how == "return" else 1), (p.returncode, p.stderr[-2000:])
    assert p.stdout.strip() == "1"
    if how == "raise":
        assert "the caller's own error" in p.stderr


def test_a_placed_runtime_left_open_leaves_no_worker_or_shared_memory():
    p = run(PLACED_AT_EXIT)
    assert p.returncode == 0 and "terminate called" not in p.stderr, p.stderr[-2000:]
    worker, parent = (int(v) for v in p.stdout.split())
    deadline = time.monotonic() + 10
    while os.path.exists(f"/proc/{worker}") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not os.path.exists(f"/proc/{worker}")
    assert glob.glob(f"/dev/shm/mstar_{parent}_*") == []

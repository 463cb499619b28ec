"""A /dev/shm too small for what placement sends (a container's default is 64 MiB) fails the
request whose tensor does not fit, naming the fix, and the runtime serves on; before, the first
write into a page tmpfs had no room for killed the writing process with SIGBUS -- the parent
application itself when the tensor was a request's input. Each case runs in a child process
with its own small tmpfs on /dev/shm (``unshare --mount``; skipped where mounting is not
allowed)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

from mstar_rt import EMIT, GraphEdge, GraphNode, Model, NodeSubmodule, Sequential


class Grow(NodeSubmodule):
    """``y`` = ``n`` float32 zeros (a node whose output size the request picks)."""

    def forward(self, batch: list[dict]) -> list[dict]:
        return [{"y": torch.zeros(int(b["n"]))} for b in batch]


class Count(NodeSubmodule):
    """``n`` = ``x[0]``: the request says how large ``grow``'s output is."""

    def forward(self, batch: list[dict]) -> list[dict]:
        return [{"n": int(b["x"][0].item())} for b in batch]


class Shm(Model):
    inputs = ("x",)

    def __init__(self) -> None:
        self.nodes = [GraphNode("count", ["x"], ["n"], submodule=Count()),
                      GraphNode("grow", ["n"], [GraphEdge(EMIT, "y")], submodule=Grow())]
        self.walks = {"main": Sequential("count", "grow")}


def shm() -> Shm:
    return Shm()


SCRIPT = textwrap.dedent("""
    import sys, torch
    from mstar_rt.placement import NodeGroup, PlacedRuntime
    from mstar_rt.runtime import RequestFailed
    try:
        rt = PlacedRuntime("test_placement_shm_full:shm", [NodeGroup(["count", "grow"], rank=1)],
                           progress=False, shm_bytes=16 << 20)
    except Exception as e:
        print("START FAILED:", e, flush=True)
        sys.exit(0)
    def ask(x):
        try:
            return rt.submit({"x": x}).result(60)["y"][0].numel()
        except RequestFailed as e:
            return "failed: " + str(e)
    try:
        print("small:", ask(torch.tensor([4.0])), flush=True)
        print("big input:", ask(torch.ones(3 << 20)), flush=True)  # 12 MiB to the worker
        print("small:", ask(torch.tensor([8.0])), flush=True)
        print("big output:", ask(torch.tensor([3.0 * 2**20])), flush=True)  # 12 MiB back
        print("small:", ask(torch.tensor([16.0])), flush=True)
    finally:
        rt.close()
    print("closed", flush=True)
""")


def run_in_small_shm(size_mb: int) -> str:
    if shutil.which("unshare") is None or sys.platform != "linux":
        pytest.skip("needs unshare(1) to give the child its own /dev/shm")
    cmd = (f"mount -t tmpfs -o size={size_mb}m tmpfs /dev/shm || exit 77; "
           f"exec {sys.executable} -c \"$SCRIPT\"")
    env = dict(os.environ, SCRIPT=SCRIPT)
    here = os.path.dirname(os.path.abspath(__file__))
    env["PYTHONPATH"] = os.pathsep.join([here] + env.get("PYTHONPATH", "").split(os.pathsep))
    for prefix in ([], ["--user", "--map-root-user"]):  # as root, or in a user namespace
        p = subprocess.run(["unshare", *prefix, "--mount", "sh", "-c", cmd], env=env,
                           capture_output=True, text=True, timeout=240)
        cannot = p.returncode == 77 or (p.returncode == 1 and "unshare:" in p.stderr)
        if not cannot:
            break
    if cannot:
        pytest.skip(f"cannot mount a tmpfs here: {p.stderr.strip()[-200:]}")
    assert p.returncode == 0, f"the child died ({p.returncode}): {p.stdout}\n{p.stderr[-3000:]}"
    return p.stdout


def test_a_tensor_larger_than_what_is_left_of_dev_shm_fails_only_its_request():
    out = run_in_small_shm(24)  # 16 MiB of mailboxes; 8 MiB left for the arenas
    lines = dict(line.split(": ", 1) for line in out.splitlines() if ": " in line)
    assert out.count("small: ") == 3 and all(v in out for v in ("small: 4", "small: 8",
                                                                "small: 16")), out
    for case in ("big input", "big output"):
        assert lines[case].startswith("failed: "), out
        assert "shared memory is full" in lines[case] and "--shm-size" in lines[case], out
    assert "cannot send its inputs to worker process rank 1" in lines["big input"]
    assert "its outputs cannot go back to the parent" in lines["big output"]
    assert out.rstrip().endswith("closed")


def test_a_dev_shm_too_small_for_a_worker_refuses_to_start_naming_the_fix():
    out = run_in_small_shm(8)
    assert "START FAILED: " in out and "shared memory is full" in out and "--shm-size" in out

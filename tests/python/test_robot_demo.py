"""The robot reaching demo: env + expert, the shipped MLP policy weights and walk graph, and the
demo end to end (real-time ControlLoop, asynchronous inference of the mini-pi0 through the
Runtime with d and the frozen actions as request inputs, injected delays). The mini-pi0 itself:
test_robot_pi0.py."""

import pathlib
import subprocess
import sys

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
ROBOT = ROOT / "examples" / "robot"
sys.path.insert(0, str(ROBOT))

torch = pytest.importorskip("torch")
pytest.importorskip("mujoco")
pytest.importorskip("safetensors")

import mstar_rt  # noqa: E402
from arm_env import OBS_DIM, ArmEnv, forward_kinematics, inverse_kinematics  # noqa: E402
from expert import HORIZON, expert_chunk, rollout  # noqa: E402
from policy import WEIGHTS, ChunkMLP, ChunkPolicyModel  # noqa: E402


def test_env_is_seeded_and_inverse_kinematics_hits_the_target():
    env = ArmEnv()
    a, b = env.reset(7), env.reset(7)
    assert a.shape == (OBS_DIM,) and a.dtype == np.float32
    np.testing.assert_array_equal(a, b)  # same seed, same episode
    assert not np.array_equal(a, env.reset(8))
    np.testing.assert_allclose(forward_kinematics(inverse_kinematics(env.target)), env.target, atol=1e-9)
    assert not env.success()  # episodes never start at the target


@pytest.mark.parametrize("delay", [0, 5])
def test_expert_reaches_the_target_under_chunked_delayed_execution(delay):
    env = ArmEnv()
    results = [rollout(env, expert_chunk, seed, delay=delay, max_ticks=150) for seed in range(20)]
    assert sum(ok for ok, _ in results) >= 19


def test_shipped_weights_load_and_give_finite_chunks():
    assert WEIGHTS.exists() and WEIGHTS.stat().st_size < 300 * 1024
    net = ChunkMLP.load()
    obs = ArmEnv().reset(3)
    chunk = net.act(obs)
    assert chunk.shape == (HORIZON, 2) and chunk.dtype == np.float32
    assert np.isfinite(chunk).all()
    # It imitates the expert: the chunk's end (the set-point it settles on) is close to the IK goal.
    assert np.abs(chunk[-1] - expert_chunk(obs)[-1]).max() < 0.1


def test_policy_served_as_a_walk_graph_matches_the_network_and_batches():
    net = ChunkMLP.load()
    env = ArmEnv()
    observations = [env.reset(seed) for seed in range(6)]
    with mstar_rt.Runtime(ChunkPolicyModel(net)) as runtime:
        handles = [runtime.submit({"obs": obs}) for obs in observations]
        results = [h.result(timeout=30)["actions"] for h in handles]
        nodes = [rec["node"] for rec in handles[0].stats()]
    assert nodes == ["normalize", "mlp", "denormalize"]
    for obs, out in zip(observations, results):
        assert len(out) == 1
        np.testing.assert_allclose(out[0], net.act(obs), atol=1e-5)


def test_policy_settles_on_the_target_in_closed_loop():
    net = ChunkMLP.load()
    env = ArmEnv()
    final = []
    for seed in range(10):
        rollout(env, net.act, seed, delay=5, max_ticks=100, stop_on_success=False)
        final.append(env.distance())
    assert np.mean(np.array(final) < 0.02) >= 0.9  # still within 2 cm after 2 s, not just passing by


def test_demo_runs_and_reports(tmp_path):
    out = tmp_path / "x.png"
    command = [sys.executable, str(ROBOT / "demo.py"), "--episodes", "3", "--out", str(out)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    header = next(i for i, line in enumerate(lines)
                  if line.split()[:4] == ["policy", "delay", "mode", "success"])
    rows = [lines[header + 2 + i].split() for i in range(3)]
    assert [r[:3] for r in rows] == [["pi0", d, "rtc"] for d in ("0", "2", "5")]
    # d passed to the policy (d_given) follows the injected delay: the tracker measured it, and
    # at delay 5 the chunks after the first one it timed carry d >= 5
    column = lines[header].split().index("d_given") + 1  # "success" spans two row fields
    assert int(rows[2][column].split("-")[-1]) >= 5, rows[2]
    assert out.exists() and out.stat().st_size > 10_000


@pytest.mark.parametrize("args, words", [(["--rate-hz", "0"], "--rate-hz must be 1 to 10000"),
                                         (["--episodes", "0"], "--episodes must be 1 or more")])
def test_demo_refuses_settings_it_cannot_run(tmp_path, args, words):
    # they ended in a ZeroDivisionError / IndexError traceback
    command = [sys.executable, str(ROBOT / "demo.py"), *args, "--out", str(tmp_path / "x.png")]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert result.returncode == 2 and words in result.stderr, result.stderr
    assert "Traceback" not in result.stderr

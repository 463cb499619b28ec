"""The V-JEPA-2-AC-style world model: the KV-cached ``rollout`` walk equals the upstream loop
that recomputes the whole context every step, for requests of different context lengths and
horizons batched together; bad inputs are refused at submit with errors naming the input;
cancels and ends give every KV page back; checkpoints round-trip; the benchmark runs."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
from child_env import child_env
import torch

from mstar_rt import RequestCancelled, RequestFailed
from mstar_rt.engines import KVCacheEngine
from mstar_rt.models.world_model import WorldModel, rollout_recompute
from mstar_rt.models.world_model_layers import (WorldModelConfig, load_world_model,
                                                random_world_model, save_world_model)

from walk_models import ZERO_LIVE, settled, wait_until

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT = 60.0
pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conftest.py


@pytest.fixture(scope="module")
def predictor():
    return random_world_model(WorldModelConfig(), seed=0)


def rollout_inputs(c: WorldModelConfig, context: int, horizon: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return dict(frames=torch.randn(context, c.num_patches, c.embed_dim, generator=g),
                states=torch.randn(context, c.state_dim, generator=g),
                actions=torch.randn(context - 1 + horizon, c.action_dim, generator=g),
                horizon=horizon)


def pages_back(engine: KVCacheEngine) -> bool:
    cache = engine.cache
    return wait_until(lambda: cache.free_pages == cache.num_pages and cache.live_sequences == 0)


def test_rollouts_of_different_horizons_batched_together_equal_full_recompute(serve, predictor):
    c = predictor.config
    engine = KVCacheEngine(page_size=c.block_tokens, num_pages=128)
    model = WorldModel(predictor, max_horizon=30, engine=engine)
    rt = serve(model)
    cases = [(1, 3), (2, 5), (3, 1), (1, 8), (2, 30)]  # (observed frames, horizon)
    requests = [rollout_inputs(c, ctx, h, seed) for seed, (ctx, h) in enumerate(cases)]
    requests[1]["horizon"] = np.int64(5)  # as openpi_client sends an integer
    handles = [rt.submit(r) for r in requests]
    for r, h in zip(requests, handles):
        out = h.result(timeout=TIMEOUT)
        want_states, want_frames = rollout_recompute(predictor, r["frames"], r["states"],
                                                     r["actions"], r["horizon"])
        assert len(out["state"]) == len(out["frame"]) == r["horizon"]
        torch.testing.assert_close(torch.stack(out["state"]), want_states, atol=1e-4, rtol=0)
        torch.testing.assert_close(torch.stack(out["frame"]), want_frames, atol=1e-4, rtol=0)
        steps = [s for s in h.stats() if s["node"] == "predictor"]
        assert [s["iteration"] for s in steps] == list(range(r["horizon"]))
    sizes = [s["batch_size"] for h in handles for s in h.stats()]
    assert max(sizes) >= 3, f"the requests never shared an engine step: {sizes}"
    assert settled(rt) == ZERO_LIVE
    assert pages_back(engine)


def test_each_step_writes_one_block_and_the_cache_holds_the_whole_context(serve, predictor):
    c = predictor.config
    engine = KVCacheEngine(page_size=c.block_tokens, num_pages=64)
    model = WorldModel(predictor, max_horizon=8, engine=engine)
    lengths: list[tuple[int, int]] = []
    real = model.node.forward_kv

    def spy(works, step):
        out = real(works, step)
        lengths.extend((w.payload[3], w.num_tokens) for w in works)
        return out

    model.node.forward_kv = spy
    rt = serve(model)
    rt.submit(rollout_inputs(c, 3, 4, seed=5)).result(timeout=TIMEOUT)
    f = c.block_tokens
    assert lengths == [(0, 3 * f), (1, f), (2, f), (3, f)]
    assert pages_back(engine)


def test_a_different_action_changes_only_later_predictions(predictor):
    c = predictor.config
    r = rollout_inputs(c, 1, 4, seed=2)
    base, _ = rollout_recompute(predictor, r["frames"], r["states"], r["actions"], 4)
    actions = r["actions"].clone()
    actions[2] += 1.0
    moved, _ = rollout_recompute(predictor, r["frames"], r["states"], actions, 4)
    assert torch.equal(base[:2], moved[:2])          # block-causal: the past does not see it
    assert not torch.allclose(base[2:], moved[2:])   # and the action matters


@pytest.mark.parametrize("change, words", [
    (dict(frames=torch.zeros(1, 5, 32)), ["'frames'", "[C, 16, 32]"]),
    (dict(states=torch.zeros(2, 7)), ["'states'", "[1, 7]"]),
    (dict(actions=torch.zeros(3, 6)), ["'actions'", "[T, 7]"]),
    (dict(horizon=9), ["horizon 9", "need 9"]),
    (dict(horizon=0), ["'horizon'", ">= 1"]),
    (dict(horizon=True), ["'horizon'", "integer"]),
    (dict(actions=None), ["'actions'", "missing"]),
    (dict(states=torch.full((1, 7), float("nan"))), ["'states'", "NaN"]),
    # a complex tensor lost its imaginary part in the cast; text was a bare torch TypeError
    (dict(frames=torch.zeros(1, 16, 32, dtype=torch.complex64)), ["'frames'", "real numbers"]),
    (dict(frames="abc"), ["'frames'", "array or tensor of numbers, not str"]),
    (dict(actions=torch.zeros(4, 7, dtype=torch.bool)), ["'actions'", "real numbers, got bool"]),
])
def test_bad_inputs_are_refused_at_submit_naming_the_input(serve, predictor, change, words):
    c = predictor.config
    engine = KVCacheEngine(page_size=c.block_tokens, num_pages=64)
    rt = serve(WorldModel(predictor, max_horizon=8, engine=engine))
    good = rollout_inputs(c, 1, 4, seed=1)
    h = rt.submit(good)
    with pytest.raises(ValueError) as e:
        rt.submit({**good, **change})
    for w in words:
        assert w in str(e.value), (w, str(e.value))
    assert len(h.result(timeout=TIMEOUT)["state"]) == 4  # the others are served as usual
    assert settled(rt) == ZERO_LIVE and pages_back(engine)


def test_a_rollout_failing_mid_way_fails_alone_and_frees_its_pages(serve, predictor):
    c = predictor.config
    engine = KVCacheEngine(page_size=c.block_tokens, num_pages=128)
    model = WorldModel(predictor, max_horizon=8, engine=engine)
    real = model.node.forward_kv

    def flaky(works, step):  # the horizon-7 request breaks at its third step
        if any(w.payload[4]["horizon"] == 7 and w.payload[3] == 2 for w in works):
            raise RuntimeError("boom: predictor fault")
        return real(works, step)

    model.node.forward_kv = flaky
    rt = serve(model)
    requests = [rollout_inputs(c, 2, h, seed=10 + h) for h in (5, 7, 6)]
    handles = [rt.submit(r) for r in requests]
    with pytest.raises(RequestFailed, match="boom"):
        handles[1].result(timeout=TIMEOUT)
    for i in (0, 2):
        r = requests[i]
        out = handles[i].result(timeout=TIMEOUT)
        want, _ = rollout_recompute(predictor, r["frames"], r["states"], r["actions"],
                                    r["horizon"])
        torch.testing.assert_close(torch.stack(out["state"]), want, atol=1e-4, rtol=0)
    assert settled(rt) == ZERO_LIVE and pages_back(engine)


def test_horizon_beyond_max_horizon_is_refused(serve, predictor):
    c = predictor.config
    rt = serve(WorldModel(predictor, max_horizon=4))
    with pytest.raises(ValueError, match="max_horizon 4"):
        rt.submit(rollout_inputs(c, 1, 6, seed=0))


def test_cancel_mid_rollout_gives_every_page_back(serve, predictor):
    c = predictor.config
    engine = KVCacheEngine(page_size=c.block_tokens, num_pages=64)
    model = WorldModel(predictor, max_horizon=30, engine=engine)
    real = model.node.forward_kv
    entered, release = threading.Event(), threading.Event()

    def held(works, step):  # hold the fourth step until the test has cancelled
        if any(w.payload[3] == 3 for w in works):
            entered.set()
            release.wait(10)
        return real(works, step)

    model.node.forward_kv = held
    rt = serve(model)
    h = rt.submit(rollout_inputs(c, 2, 30, seed=3))
    assert entered.wait(TIMEOUT)
    assert engine.cache.free_pages < engine.cache.num_pages  # the rollout holds pages
    h.cancel()
    release.set()
    with pytest.raises(RequestCancelled):
        h.result(timeout=TIMEOUT)
    assert settled(rt) == ZERO_LIVE
    assert pages_back(engine)
    out = rt.submit(rollout_inputs(c, 1, 2, seed=4)).result(timeout=TIMEOUT)
    assert len(out["state"]) == 2


def test_checkpoint_directory_round_trips_and_a_mismatch_is_an_error(tmp_path, predictor):
    save_world_model(predictor, tmp_path / "wm")
    loaded = load_world_model(tmp_path / "wm", progress=False)
    r = rollout_inputs(predictor.config, 2, 3, seed=6)
    a, _ = rollout_recompute(predictor, r["frames"], r["states"], r["actions"], 3)
    b, _ = rollout_recompute(loaded, r["frames"], r["states"], r["actions"], 3)
    assert torch.equal(a, b)
    served = WorldModel.from_pretrained(tmp_path / "wm", progress=False)
    assert served.predictor.config == predictor.config
    config = json.loads((tmp_path / "wm" / "config.json").read_text())
    config["hidden_size"] = 32
    (tmp_path / "wm" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="does not match"):
        load_world_model(tmp_path / "wm", progress=False)


def test_world_model_benchmark_quick_tiny_writes_its_result(tmp_path):
    out = tmp_path / "world_model.json"
    env = child_env(ROOT / "benchmarks")
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "world_model.py"), "--quick",
                           "--tiny", "--out", str(out)], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["name"] == "world_model" and result["quick"] is True
    assert set(result["ratios"]) == {"speedup_h4", "speedup_h15", "speedup_h30"}
    assert all(v > 0 for v in result["ratios"].values())
    assert result["figures"]["kv_pages_leaked"] == 0
    assert result["figures"]["max_rel_diff_states"] < 1e-4
    assert out.with_suffix(".png").exists()
    assert "speedup_h30" in proc.stdout or "speedup" in proc.stdout

"""The pi0-style VLA: the SigLIP tower equals transformers' SiglipVisionModel with the same
weights; OpenCV preprocessing keeps the aspect ratio; the served action chunk (prefix once,
flow steps reading it) equals the plain forward that recomputes the prefix at every flow step,
for requests batched together, in both real-time-chunking forms; flow steps never write the
cached prefix; trained RTC freezes the leading actions, guided RTC pulls them; bad inputs are refused at submit; cancels free every page;
checkpoints round-trip; the benchmark runs."""

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

from mstar_rt import RequestCancelled
from mstar_rt.engines import KVCacheEngine
from mstar_rt.models.pi0 import Pi0Policy, sample_actions_recompute
from mstar_rt.models.pi0_layers import Pi0Config, load_pi0, random_pi0, save_pi0
from mstar_rt.models.siglip import SiglipConfig, SiglipVisionTower, preprocess_image

from walk_models import ZERO_LIVE, settled, wait_until

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT = 60.0
pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conftest.py


@pytest.fixture(scope="module")
def module():
    return random_pi0(Pi0Config(), seed=0)


def request(c: Pi0Config, seed: int, cameras: int = 1, prompt_len: int = 6, delay: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    g = torch.Generator().manual_seed(seed)
    return dict(images=[rng.integers(0, 256, (24 + 8 * i, 40, 3), dtype=np.uint8)
                        for i in range(cameras)],
                prompt=rng.integers(0, c.vocab_size, prompt_len).tolist(),
                state=torch.randn(c.state_dim, generator=g),
                noise=torch.randn(c.action_horizon, c.action_dim, generator=g),
                delay=delay, prev_actions=torch.randn(c.action_horizon, c.action_dim, generator=g))


def pages_back(engine: KVCacheEngine) -> bool:
    cache = engine.cache
    return wait_until(lambda: cache.free_pages == cache.num_pages and cache.live_sequences == 0)


def test_siglip_tower_equals_transformers_siglip_vision_model():
    from transformers import SiglipVisionConfig, SiglipVisionModel

    hf_config = SiglipVisionConfig(hidden_size=48, intermediate_size=96, num_hidden_layers=3,
                                   num_attention_heads=4, image_size=32, patch_size=8,
                                   vision_use_head=False)
    torch.manual_seed(3)
    hf = SiglipVisionModel(hf_config).eval()
    ours = SiglipVisionTower(SiglipConfig.from_hf(hf_config)).eval()
    ours.load_hf_state_dict(hf.state_dict())
    pixels = torch.randn(3, 3, 32, 32)
    with torch.no_grad():
        want = hf(pixel_values=pixels).last_hidden_state
        got = ours(pixels)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_preprocessing_keeps_the_aspect_ratio_with_black_bars_and_scales_to_unit_range():
    image = np.full((20, 40, 3), (255, 0, 128), dtype=np.uint8)
    x = preprocess_image(image, 32)
    assert x.shape == (3, 32, 32) and x.dtype == torch.float32
    assert torch.all(x[:, :8] == -1) and torch.all(x[:, 24:] == -1)   # bars above and below
    torch.testing.assert_close(x[:, 8:24], torch.tensor([1.0, -1.0, 128 / 127.5 - 1])
                               [:, None, None].expand(3, 16, 32))
    with pytest.raises(ValueError, match=r"uint8 array \[H, W, 3\]"):
        preprocess_image(image.astype(np.float32), 32)


@pytest.mark.parametrize("rtc", ["trained", "guided"])
def test_action_chunks_equal_the_recompute_reference_for_batched_requests(serve, module, rtc):
    c = module.config
    engine = KVCacheEngine(page_size=16, num_pages=128)
    rt = serve(Pi0Policy(module, engine=engine, rtc=rtc))
    cases = [request(c, 0), request(c, 1, cameras=2, prompt_len=3, delay=2),
             request(c, 2, cameras=3, prompt_len=11, delay=5),
             {**request(c, 3, prompt_len=0), "prev_actions": None},
             {k: v for k, v in request(c, 4, delay=1).items() if k != "images"}]  # state only
    handles = [rt.submit(r) for r in cases]
    for r, h in zip(cases, handles):
        out = h.result(timeout=TIMEOUT)
        assert len(out["actions"]) == 1
        chunk = out["actions"][0]
        assert chunk.shape == (c.action_horizon, c.action_dim)
        torch.testing.assert_close(chunk, sample_actions_recompute(module, r, rtc=rtc),
                                   atol=1e-4, rtol=0)
        steps = [s for s in h.stats() if s["node"] == "denoise"]
        assert [s["iteration"] for s in steps] == list(range(c.num_steps))
    sizes = [s["batch_size"] for h in handles for s in h.stats() if s["node"] == "denoise"]
    assert max(sizes) >= 2, f"flow steps of different requests never shared a step: {sizes}"
    assert settled(rt) == ZERO_LIVE and pages_back(engine)


@pytest.mark.parametrize("rtc", ["trained", "guided"])
def test_flow_steps_read_the_prefix_without_writing_it(serve, module, rtc):
    c = module.config
    engine = KVCacheEngine(page_size=16, num_pages=64)
    policy = Pi0Policy(module, engine=engine, rtc=rtc)
    node = policy.submodules["denoise"]
    real = node.forward_kv
    seen: list = []

    def spy(works, step):
        cache = engine.cache
        rid = next(iter(r for (r, _l) in cache._seqs))
        seq = cache.sequence(rid, "main")
        before = ([t[seq.pages].clone() for t in cache.k + cache.v], seq.length, list(seq.pages))
        out = real(works, step)
        after = [t[seq.pages] for t in cache.k + cache.v]
        seen.append((all(w.persist is False for w in works), before[1] == seq.length,
                     before[2] == seq.pages,
                     all(torch.equal(a, b) for a, b in zip(before[0], after))))
        return out

    node.forward_kv = spy
    rt = serve(policy)
    r = request(c, 7, cameras=2, delay=2)
    rt.submit(r).result(timeout=TIMEOUT)
    assert len(seen) == c.num_steps
    assert all(all(s) for s in seen), seen
    assert pages_back(engine)


def test_real_time_chunking_freezes_the_leading_actions_and_conditions_the_rest(serve, module):
    c = module.config
    rt = serve(Pi0Policy(module))
    r = request(c, 5, delay=3)
    chunk = rt.submit(r).result(timeout=TIMEOUT)["actions"][0]
    assert torch.equal(chunk[:3], r["prev_actions"][:3])
    free = rt.submit({**r, "delay": 0}).result(timeout=TIMEOUT)["actions"][0]
    assert not torch.allclose(free[:3], chunk[:3])
    other = {**r, "prev_actions": r["prev_actions"] + 1.0}
    moved = rt.submit(other).result(timeout=TIMEOUT)["actions"][0]
    assert not torch.allclose(moved[3:], chunk[3:], atol=1e-4)  # the free actions see the frozen


def test_guided_real_time_chunking_pulls_the_overlap_towards_the_previous_chunk(serve, module):
    c = module.config
    rt = serve(Pi0Policy(module, rtc="guided"))
    r = request(c, 5, delay=3)
    prev = r["prev_actions"]
    guided = rt.submit(r).result(timeout=TIMEOUT)["actions"][0]
    free = rt.submit({**r, "delay": 0, "prev_actions": None}).result(timeout=TIMEOUT)["actions"][0]
    err = lambda x: float((x[:3] - prev[:3]).abs().mean())  # noqa: E731
    assert err(guided) < 0.2 * err(free), (err(guided), err(free))
    # Soft guidance: close, not frozen (the trained form freezes them exactly).
    assert not torch.equal(guided[:3], prev[:3])


def test_an_unknown_rtc_form_is_refused(module):
    with pytest.raises(ValueError, match="trained"):
        Pi0Policy(module, rtc="inpaint")


def test_seed_draws_the_noise_when_none_is_given(serve, module):
    c = module.config
    rt = serve(Pi0Policy(module))
    r = {k: v for k, v in request(c, 6).items() if k != "noise"}
    a = rt.submit({**r, "seed": 1}).result(timeout=TIMEOUT)["actions"][0]
    b = rt.submit({**r, "seed": 1}).result(timeout=TIMEOUT)["actions"][0]
    d = rt.submit({**r, "seed": 2}).result(timeout=TIMEOUT)["actions"][0]
    assert torch.equal(a, b) and not torch.allclose(a, d)


@pytest.mark.parametrize("change, words", [
    (dict(state=None), ["'state'", "missing"]),
    (dict(state=torch.zeros(3)), ["'state'", "[8]"]),
    (dict(noise=torch.zeros(4, 7)), ["'noise'", "[8, 7]"]),
    (dict(delay=8), ["'delay' 8", "below the action horizon"]),
    (dict(delay=2, prev_actions=None), ["'prev_actions'", "delay"]),
    (dict(delay=4, prev_actions=torch.zeros(2, 7)), ["'prev_actions'", "[>= 4, 7]"]),
    (dict(prev_actions=torch.zeros(3, 5)), ["'prev_actions'", "[>= 1, 7]"]),
    (dict(images=[np.zeros((8, 8, 3), dtype=np.float32)]), ["'images'[0]", "uint8"]),
    (dict(images=[np.zeros((8, 8, 3), dtype=np.uint8)] * 4), ["'images'", "0 to 3"]),
    (dict(prompt=[1, 2, 99]), ["'prompt'", "[0, 64)"]),
    (dict(noise=torch.full((8, 7), float("inf"))), ["'noise'", "infinite"]),
])
def test_bad_inputs_are_refused_at_submit_naming_the_input(serve, module, change, words):
    c = module.config
    engine = KVCacheEngine(page_size=16, num_pages=64)
    rt = serve(Pi0Policy(module, engine=engine))
    good = request(c, 9)
    h = rt.submit(good)
    with pytest.raises(ValueError) as e:
        rt.submit({**good, **change})
    for w in words:
        assert w in str(e.value), (w, str(e.value))
    assert h.result(timeout=TIMEOUT)["actions"][0].shape == (c.action_horizon, c.action_dim)
    assert settled(rt) == ZERO_LIVE and pages_back(engine)


def test_cancel_during_action_generation_frees_the_prefix_pages(serve, module):
    c = module.config
    engine = KVCacheEngine(page_size=16, num_pages=64)
    policy = Pi0Policy(module, engine=engine)
    node = policy.submodules["denoise"]
    real = node.forward_kv
    entered, release = threading.Event(), threading.Event()

    def slow(works, step):
        entered.set()
        release.wait(10)
        return real(works, step)

    node.forward_kv = slow
    rt = serve(policy)
    h = rt.submit(request(c, 4))
    assert entered.wait(TIMEOUT)
    assert engine.cache.free_pages < engine.cache.num_pages  # the prefix holds pages
    h.cancel()
    release.set()
    with pytest.raises(RequestCancelled):
        h.result(timeout=TIMEOUT)
    assert settled(rt) == ZERO_LIVE and pages_back(engine)


def test_checkpoint_directory_round_trips(tmp_path, module):
    save_pi0(module, tmp_path / "pi0")
    loaded = load_pi0(tmp_path / "pi0", progress=False)
    r = request(module.config, 2, cameras=2)
    assert torch.equal(sample_actions_recompute(module, r), sample_actions_recompute(loaded, r))
    assert Pi0Policy.from_pretrained(tmp_path / "pi0", progress=False).module.config == \
        module.config


def test_vla_benchmark_quick_tiny_writes_its_result(tmp_path):
    out = tmp_path / "vla.json"
    env = child_env(ROOT / "benchmarks")
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "vla.py"), "--quick",
                           "--tiny", "--out", str(out)], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["name"] == "vla" and result["quick"] is True
    assert result["ratios"]["prefix_reuse_speedup"] > 0
    assert result["figures"]["max_abs_diff_actions"] < 1e-4
    assert result["figures"]["kv_pages_leaked"] == 0
    assert out.with_suffix(".png").exists()

"""V-JEPA 2-AC served: the KV-cached ``rollout`` walk over the real predictor equals upstream's
loop (``VisionTransformerPredictorAC`` over every frame so far at each step, the newest
prediction layer-normed, poses by upstream's planner update) for requests of different context
lengths and horizons batched together; fed by the encoder node, camera images give what
transformers' encoder and the upstream predictor give; bad requests and mismatched parts are
refused naming what to fix; every KV page comes back."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mstar_rt.engines import KVCacheEngine
from mstar_rt.models.vjepa2_predictor import VJEPA2ACPredictor
from mstar_rt.models.vjepa2_world_model import VJEPA2WorldModel, upstream_rollout
from mstar_rt.models.world_model import rollout_recompute

from test_vjepa2_predictor import CONFIGS, tiny_config, upstream_predictor
from walk_models import ZERO_LIVE, settled, wait_until

TIMEOUT = 60.0
pytestmark = [pytest.mark.usefixtures("one_torch_thread"),
              pytest.mark.filterwarnings("ignore:.*sdp_kernel:FutureWarning")]


@pytest.fixture(scope="module")
def pair():
    return upstream_predictor(tiny_config(**{**CONFIGS["grid3x3"], "num_frames": 64}), seed=7)


def request(config, context: int, horizon: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    frames = torch.randn(context, config.num_patches, config.embed_dim, generator=g)
    return dict(frames=F.layer_norm(frames, (config.embed_dim,)),
                states=torch.rand(context, 7, generator=g),
                actions=0.3 * torch.randn(context - 1 + horizon, 7, generator=g),
                horizon=horizon)


def pages_back(engine: KVCacheEngine) -> bool:
    cache = engine.cache
    return wait_until(lambda: cache.free_pages == cache.num_pages and cache.live_sequences == 0)


def test_batched_rollouts_of_different_horizons_equal_upstreams_loop(serve, pair):
    up, ours = pair
    c = ours.config
    engine = KVCacheEngine(page_size=c.block_tokens, num_pages=256)
    rt = serve(VJEPA2WorldModel(ours, max_horizon=24, engine=engine))
    cases = [(1, 1), (1, 4), (2, 7), (3, 2), (1, 15), (2, 24)]  # (observed frames, horizon)
    requests = [request(c, ctx, h, seed) for seed, (ctx, h) in enumerate(cases)]
    handles = [rt.submit(r) for r in requests]
    worst = 0.0
    for r, h in zip(requests, handles):
        out = h.result(timeout=TIMEOUT)
        want_states, want_frames = upstream_rollout(up, r["frames"], r["states"], r["actions"],
                                                    r["horizon"], c.num_patches)
        assert len(out["frame"]) == len(out["state"]) == r["horizon"]
        got = torch.stack(out["frame"])
        torch.testing.assert_close(got, want_frames, atol=1e-4, rtol=0)
        torch.testing.assert_close(torch.stack(out["state"]), want_states, atol=1e-6, rtol=0)
        worst = max(worst, float((got - want_frames).abs().max()))
        steps = [s for s in h.stats() if s["node"] == "predictor"]
        assert [s["iteration"] for s in steps] == list(range(r["horizon"]))
    print(f"max |walk - upstream| over predicted frames: {worst:.2e}")
    sizes = [s["batch_size"] for h in handles for s in h.stats()]
    assert max(sizes) >= 3, f"the requests never shared an engine step: {sizes}"
    assert settled(rt) == ZERO_LIVE and pages_back(engine)


def test_each_step_runs_only_the_newest_block(serve, pair):
    _, ours = pair
    c = ours.config
    engine = KVCacheEngine(page_size=c.block_tokens, num_pages=64)
    model = VJEPA2WorldModel(ours, max_horizon=8, engine=engine)
    lengths: list[tuple[int, int]] = []
    real = model.node.forward_kv

    def spy(works, step):
        lengths.extend((w.payload[3], w.num_tokens) for w in works)
        return real(works, step)

    model.node.forward_kv = spy
    rt = serve(model)
    rt.submit(request(c, 3, 4, seed=5)).result(timeout=TIMEOUT)
    f = c.block_tokens
    assert lengths == [(0, 3 * f), (1, f), (2, f), (3, f)]
    assert pages_back(engine)


def test_recompute_reference_over_our_predictor_equals_upstreams(pair):
    up, ours = pair
    r = request(ours.config, 2, 5, seed=3)
    a = rollout_recompute(ours, r["frames"], r["states"], r["actions"], 5)
    b = upstream_rollout(up, r["frames"], r["states"], r["actions"], 5, ours.config.num_patches)
    torch.testing.assert_close(a[1], b[1], atol=1e-4, rtol=0)
    torch.testing.assert_close(a[0], b[0], atol=1e-6, rtol=0)


@pytest.fixture(scope="module")
def encoder_pair(tmp_path_factory):
    """transformers' VJEPA2Model (random, sized to the predictor: 48 px, width 40) and our
    frame encoder loaded from its Hugging Face directory."""
    pytest.importorskip("transformers")
    from test_vjepa2_encoder import hf_model, tiny_encoder_config

    from mstar_rt.models.vjepa2_encoder import load_vjepa2_encoder

    model = hf_model(tiny_encoder_config(hidden=40, crop=48), seed=2)
    path = tmp_path_factory.mktemp("vjepa2-hf")
    model.save_pretrained(path)
    return model, load_vjepa2_encoder(path, progress=False)


def test_images_through_the_encoder_node_equal_transformers_then_upstream(serve, pair,
                                                                         encoder_pair):
    up, ours = pair
    hf, encoder = encoder_pair
    c = ours.config
    engine = KVCacheEngine(page_size=c.block_tokens, num_pages=128)
    rt = serve(VJEPA2WorldModel(ours, encoder, max_horizon=8, engine=engine))
    g = torch.Generator().manual_seed(11)
    rgb = torch.randint(0, 256, (2, 48, 48, 3), dtype=torch.uint8, generator=g)
    pixels = torch.randn(1, 3, 48, 48, generator=g).clamp(-2.1, 2.6)  # normalized pixels
    cases = [dict(images=rgb, states=torch.rand(2, 7, generator=g),
                  actions=0.3 * torch.randn(4, 7, generator=g), horizon=3),
             dict(images=pixels, states=torch.rand(1, 7, generator=g),
                  actions=0.3 * torch.randn(5, 7, generator=g), horizon=5)]
    handles = [rt.submit(r) for r in cases]
    mean = torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1)
    std = torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1)
    for r, h in zip(cases, handles):
        x = r["images"]
        if x.dtype == torch.uint8:
            x = (x.permute(0, 3, 1, 2).float() / 255 - mean) / std
        with torch.no_grad():  # upstream's encode(): a still clip per image, layer-normed
            feats = F.layer_norm(hf.get_vision_features(x[:, None].repeat(1, 2, 1, 1, 1)),
                                 (c.embed_dim,))
        want_states, want_frames = upstream_rollout(up, feats, r["states"], r["actions"],
                                                    r["horizon"], c.num_patches)
        out = h.result(timeout=TIMEOUT)
        torch.testing.assert_close(torch.stack(out["frame"]), want_frames, atol=1e-4, rtol=0)
        torch.testing.assert_close(torch.stack(out["state"]), want_states, atol=1e-6, rtol=0)
    assert [s["node"] for s in handles[0].stats()][0] == "encoder"
    assert settled(rt) == ZERO_LIVE and pages_back(engine)


@pytest.mark.parametrize("change, words", [
    (dict(images=torch.zeros(2, 3, 32, 32)), ["'images'", "[C, 3, 48, 48]"]),
    (dict(states=torch.zeros(3, 7)), ["'states'", "[2, 7]"]),
    (dict(actions=torch.zeros(2, 7)), ["'actions'", "need 3"]),
    (dict(horizon=9, actions=torch.zeros(10, 7)), ["max_horizon 8"]),
    (dict(images=None), ["'images'", "missing"]),
])
def test_bad_image_requests_are_refused_at_submit(serve, pair, encoder_pair, change, words):
    _, ours = pair
    rt = serve(VJEPA2WorldModel(ours, encoder_pair[1], max_horizon=8))
    good = dict(images=torch.zeros(2, 3, 48, 48), states=torch.zeros(2, 7),
                actions=torch.zeros(3, 7), horizon=2)
    with pytest.raises(ValueError) as e:
        rt.submit({**good, **change})
    for w in words:
        assert w in str(e.value), (w, str(e.value))
    assert len(rt.submit(good).result(timeout=TIMEOUT)["frame"]) == 2
    assert settled(rt) == ZERO_LIVE


def test_parts_that_do_not_fit_are_refused_when_built(pair, encoder_pair):
    _, ours = pair
    narrow = VJEPA2ACPredictor(tiny_config(**CONFIGS["grid2x2"]))
    with pytest.raises(ValueError, match="width 40 per image, but the predictor reads 4 of "
                                         "width 32"):
        VJEPA2WorldModel(narrow, encoder_pair[1])
    extrinsics = VJEPA2ACPredictor(tiny_config(**CONFIGS["grid4x3_extrinsics_odd_head"]))
    with pytest.raises(ValueError, match="without extrinsics"):
        VJEPA2WorldModel(extrinsics)
    c = ours.config
    with pytest.raises(ValueError, match="max_frames=32"):
        VJEPA2WorldModel(ours, max_horizon=40).validate_inputs(request(c, 1, 33, seed=0))

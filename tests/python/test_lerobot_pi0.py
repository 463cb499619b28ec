"""pi0 and pi0.5 as LeRobot 0.6.1 defines them, loaded from its checkpoint directories
(tests/reference/fixtures/{pi0,pi05}: a tiny random policy saved by LeRobot, its raw inputs,
fixed noise, intermediates and outputs). The plain reference computation equals every recorded
intermediate and the final chunk; the walks (prefix once on the KV engine, a Loop of flow steps
reading it) give the same chunk, also for concurrent requests batched together, and leave
LeRobot's prefix keys and values in the pages without ever writing them during the flow steps;
guided real-time chunking follows LeRobot's rules; bad inputs are refused at submit."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from mstar_rt.engines import KVCacheEngine
from mstar_rt.models.lerobot_pi0 import LeRobotPi0Policy
from mstar_rt.models.lerobot_pi0_config import RtcSettings
from mstar_rt.models.lerobot_pi0_load import load_lerobot_pi0
from mstar_rt.models.lerobot_pi0_reference import reference_actions
from mstar_rt.models.lerobot_pi0_request import prefix_weights

from walk_models import ZERO_LIVE, settled, wait_until

FIXTURES = Path(__file__).resolve().parents[1] / "reference" / "fixtures"
FAMILIES = ("pi0", "pi05")
TOL = 1e-4  # float32, absolute (the fixtures' tolerance)
TIMEOUT = 60.0
pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conftest.py


class Fixture:
    """One family's LeRobot fixture: the loaded policy, io tensors and metadata."""

    def __init__(self, family: str) -> None:
        d = FIXTURES / family
        self.family = family
        self.io = load_file(str(d / "io.safetensors"))
        self.meta = json.loads((d / "io.json").read_text())
        tiny = json.loads((d / "tiny_sizes.json").read_text())
        heads = tiny["paligemma_hf_config"]["vision_config"]["num_attention_heads"]
        self.policy = load_lerobot_pi0(d / "checkpoint", tokenizer=d / "tokenizer",
                                       sizes={"vision_heads": heads}, verbose=False)

    def observation(self, **changes) -> dict:
        io = self.io
        obs = {"images": {k: io[f"input.{k}"] for k in self.meta["cameras_in_order"]},
               "state": io["input.observation.state"], "task": self.meta["prompt"],
               "noise": io["input.noise"]}
        obs.update(changes)
        return obs

    @property
    def chunk(self) -> torch.Tensor:
        return self.io["output.action_chunk"][0]


@pytest.fixture(scope="module", params=FAMILIES)
def fx(request) -> Fixture:
    return Fixture(request.param)


def close(got: torch.Tensor, want: torch.Tensor, what: str) -> float:
    diff = (got.float() - want.float()).abs().max().item()
    assert diff <= TOL, f"{what}: max |diff| {diff:.3g} > {TOL}"
    return diff


def pages_back(engine: KVCacheEngine) -> bool:
    cache = engine.cache
    return wait_until(lambda: cache.free_pages == cache.num_pages and cache.live_sequences == 0)


def test_the_reference_equals_every_lerobot_intermediate_and_the_chunk(fx):
    io = fx.io
    out = reference_actions(fx.policy, fx.observation())
    for i in range(2):
        close(out["images"][i][None], io[f"model.images.{i}"], f"images.{i}")
        close(out["image_embs"][i][None], io[f"model.image_embs.{i}"], f"image_embs.{i}")
    assert torch.equal(out["tokens"], io["batch.observation.language.tokens"][0])
    assert torch.equal(out["attention_mask"], io["batch.observation.language.attention_mask"][0])
    assert torch.equal(out["prefix_pad_masks"], io["model.prefix_pad_masks"][0])
    close(out["prefix_embs"][None], io["model.prefix_embs"], "prefix_embs")
    close(out["prefix_out"][None], io["model.prefix_out"], "prefix_out")
    for layer, (k, v) in out["prefix_kv"].items():
        close(k.transpose(0, 1)[None], io[f"model.prefix_kv.{layer}.keys"], f"keys {layer}")
        close(v.transpose(0, 1)[None], io[f"model.prefix_kv.{layer}.values"], f"values {layer}")
    if fx.family == "pi0":
        close(out["state_padded"][None], io["model.state_padded"], "state_padded")
    else:
        close(out["adarms_cond"], io["model.adarms_cond.step0"], "adarms_cond")
    close(out["suffix_embs"][None], io["model.suffix_embs.step0"], "suffix_embs")
    close(out["suffix_out"][None], io["model.suffix_out.step0"], "suffix_out")
    close(out["t"], io["model.t"], "t")
    close(out["x_t"][:, None], io["model.x_t"], "x_t")
    close(out["v_t"][:, None], io["model.v_t"], "v_t")
    close(out["v_t"][0][None], io["model.v_t0_nocache"], "v_t at t=1 (cache-free)")
    close(out["actions_padded"][None], io["model.actions_padded"], "actions_padded")
    close(out["action_chunk_normalized"][None], io["output.action_chunk_normalized"],
          "chunk (normalised)")
    close(out["action_chunk"], fx.chunk, "chunk")


def test_the_prompt_is_what_lerobots_preprocessor_fed_the_tokenizer(fx):
    proc = fx.policy.processor
    state = proc.state_vector(fx.io["input.observation.state"])
    assert [proc.prompt(fx.meta["prompt"], state)] == fx.meta["prompt_after_preprocessor"]


def test_the_walks_give_lerobots_chunk_and_cache_its_prefix_read_only(serve, fx):
    engine = KVCacheEngine(page_size=16, num_pages=64)
    policy = LeRobotPi0Policy(fx.policy, engine=engine)
    node = policy.submodules["denoise"]
    real, seen = node.forward_kv, []

    def spy(works, step):
        cache = engine.cache
        rid = next(iter(r for (r, _l) in cache._seqs))
        seq = cache.sequence(rid, "main")
        slots = [p * cache.page_size + i for p in seq.pages for i in range(cache.page_size)]
        before = [t.view(-1, *t.shape[2:])[slots[:seq.length]].clone()
                  for t in cache.k + cache.v]
        out = real(works, step)
        after = [t.view(-1, *t.shape[2:])[slots[:seq.length]] for t in cache.k + cache.v]
        seen.append((before, all(torch.equal(a, b) for a, b in zip(before, after))))
        return out

    node.forward_kv = spy
    rt = serve(policy)
    out = rt.submit(fx.observation()).result(timeout=TIMEOUT)
    close(out["actions"][0], fx.chunk, "served chunk")
    c = fx.policy.config
    assert len(seen) == c.num_steps and all(unchanged for _b, unchanged in seen)
    # the pages hold LeRobot's prefix K/V at its valid (unpadded) positions, in order
    valid = fx.io["model.prefix_pad_masks"][0]
    n = int(valid.sum())
    layers = c.backbone.depth
    for layer in range(layers):
        for j, kind in ((layer, "keys"), (layers + layer, "values")):
            want = fx.io[f"model.prefix_kv.{layer}.{kind}"][0].transpose(0, 1)[valid]
            close(seen[0][0][j][:n], want, f"cached {kind} of layer {layer}")
    assert seen[0][0][0].shape[0] == n + (fx.family == "pi0")  # pi0: the state token follows
    assert pages_back(engine)


def test_concurrent_requests_batch_and_each_equals_the_reference(serve, fx):
    io, c = fx.io, fx.policy.config
    cams = fx.meta["cameras_in_order"]
    as_uint8 = {k: io[f"input.{k}.uint8"].permute(1, 2, 0).numpy() for k in cams}  # [H, W, 3]
    cases = [
        fx.observation(),
        fx.observation(images=as_uint8, noise=None, seed=5),
        fx.observation(images={cams[1]: io[f"input.{cams[1]}"]}, task="open the drawer",
                       noise=torch.randn(c.chunk_size, c.max_action_dim,
                                         generator=torch.Generator().manual_seed(2))),
        fx.observation(images=[io[f"input.{cams[0]}"]],
                       state=io["input.observation.state"] * 0.5 + 0.1),
    ]
    engine = KVCacheEngine(page_size=16, num_pages=128)
    rt = serve(LeRobotPi0Policy(fx.policy, engine=engine))
    handles = [rt.submit(o) for o in cases]
    results = [h.result(timeout=TIMEOUT)["actions"] for h in handles]
    for i, (o, got) in enumerate(zip(cases, results)):
        assert len(got) == 1 and got[0].shape == (c.chunk_size, c.action_dim)
        close(got[0], reference_actions(fx.policy, o)["action_chunk"], f"request {i}")
    close(results[0][0], fx.chunk, "request 0 against LeRobot")
    chunks = [r[0] for r in results]
    assert all((a - b).abs().max() > 1e-3 for a, b in zip(chunks, chunks[1:]))  # all differ
    sizes = [s["batch_size"] for h in handles for s in h.stats() if s["node"] == "denoise"]
    assert max(sizes) >= 2, f"flow steps of different requests never shared a step: {sizes}"
    assert settled(rt) == ZERO_LIVE and pages_back(engine)


def test_prefix_weights_follow_lerobots_schedules():
    w = prefix_weights("LINEAR", 2, 6, 8)
    torch.testing.assert_close(w, torch.tensor([1, 1, 4 / 5, 3 / 5, 2 / 5, 1 / 5, 0, 0]))
    ramp = torch.tensor([4 / 5, 3 / 5, 2 / 5, 1 / 5])
    torch.testing.assert_close(prefix_weights("EXP", 2, 6, 8)[2:6],
                               ramp * torch.expm1(ramp) / (np.e - 1))
    assert prefix_weights("ZEROS", 2, 6, 8).tolist() == [1, 1, 0, 0, 0, 0, 0, 0]
    assert prefix_weights("ONES", 2, 6, 8).tolist() == [1, 1, 1, 1, 1, 1, 0, 0]
    assert prefix_weights("LINEAR", 9, 6, 8).tolist() == [1] * 6 + [0, 0]  # delay past horizon


def test_guided_real_time_chunking_is_served_as_the_reference_computes_it(serve, fx):
    rtc = RtcSettings("LINEAR", max_guidance_weight=10.0, execution_horizon=8)
    c = fx.policy.config
    prev = fx.chunk[3:] + 0.5  # what the previous chunk still has to execute
    guided = fx.observation(delay=3, prev_actions=prev)
    rt = serve(LeRobotPi0Policy(fx.policy, rtc=rtc))
    handles = [rt.submit(guided), rt.submit(fx.observation())]  # guided beside unguided
    got, plain = (h.result(timeout=TIMEOUT)["actions"][0] for h in handles)
    close(got, reference_actions(fx.policy, guided, rtc)["action_chunk"], "guided chunk")
    close(plain, fx.chunk, "unguided chunk in the same batch")
    # guidance pulls the frozen actions towards what will execute
    d = 3
    assert (got[:d] - prev[:d]).abs().mean() < (plain[:d] - prev[:d]).abs().mean()
    assert got.shape == (c.chunk_size, c.action_dim)


@pytest.mark.parametrize("change, words", [
    (dict(task=None), "'task' is missing"),
    (dict(task=3), "'task' must be a string"),
    (dict(state=[0.0, 1.0]), r"'state' must be \[6\]"),
    (dict(state=[float("nan")] * 6), "NaN"),
    (dict(images={"observation.images.top": np.zeros((8, 8, 3), np.uint8)}), "cameras"),
    (dict(images={}), "at least one camera"),
    (dict(images=[np.zeros((8, 8), np.uint8)]), r"\[3, H, W\] or \[H, W, 3\]"),
    (dict(images=[np.zeros((0, 0, 3), np.uint8)]), r"H, W >= 1; got \[0, 0, 3\]"),
    # 0-255 in a float image passed as an all-white one
    (dict(images=[np.full((8, 8, 3), 200.0, np.float32)]), r"values in \[200, 200\].*\[0, 1\]"),
    (dict(noise=torch.zeros(3, 32)), r"'noise' must be \[10, 32\]"),
    (dict(delay=2), "needs 'prev_actions'"),
    (dict(delay=10, prev_actions=torch.zeros(10, 6)), "below the chunk size"),
    (dict(prev_actions=torch.zeros(4, 5)), r"'prev_actions' must be finite floats \[N >= 1, 6\]"),
])
def test_bad_inputs_are_refused_at_submit_naming_the_input(serve, fx, change, words):
    rt = serve(LeRobotPi0Policy(fx.policy))
    with pytest.raises(ValueError, match=words):
        rt.submit(fx.observation(**change))
    assert settled(rt) == ZERO_LIVE


def test_prev_actions_are_refused_when_guidance_is_disabled(serve, fx):
    rt = serve(LeRobotPi0Policy(fx.policy, rtc=RtcSettings(enabled=False)))
    with pytest.raises(ValueError, match="real-time chunking"):
        rt.submit(fx.observation(prev_actions=torch.zeros(4, 6)))


def test_flow_steps_through_the_engines_attention_give_the_same_chunk(serve, fx, monkeypatch):
    """Where the cache cannot hand a prefix out (a tensor-parallel share), the flow steps attend
    through the engine's paged attention every step instead of a snapshot taken once: same
    chunk."""
    import mstar_rt.models.lerobot_pi0 as served

    monkeypatch.setattr(served, "prefix_snapshot", lambda step, request_id: None)
    engine = KVCacheEngine(page_size=16, num_pages=64)
    rt = serve(LeRobotPi0Policy(fx.policy, engine=engine))
    close(rt.submit(fx.observation()).result(timeout=TIMEOUT)["actions"][0], fx.chunk,
          "chunk through the engine's attention")
    assert pages_back(engine)

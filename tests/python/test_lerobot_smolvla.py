"""SmolVLA exactly as LeRobot 0.6.1 defines it (tests/reference/fixtures/smolvla): the loader
reads LeRobot's checkpoint directory (policy config, LeRobot's state-dict keys, normalizer
statistics, the SmolVLM folder and its tokenizer); the reference forward reproduces every
intermediate LeRobot recorded and the final chunk within 1e-4; the walk-served chunk (prefix
once on the KV engine, flow steps reading it) equals the fixture, also for concurrent requests
that batch; damaged checkpoints fail naming the key; the full-size structure has smolvla_base's
keys, shapes and parameter count."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from mstar_rt.engines import KVCacheEngine
from mstar_rt.models.checkpoint import meta_module
from mstar_rt.models.smolvla import SmolVLAPolicy
from mstar_rt.models.smolvla_checkpoint import load_lerobot_smolvla, memory_estimate
from mstar_rt.models.smolvla_config import smolvla_base_config
from mstar_rt.models.smolvla_layers import SmolVLAModule, parameter_count
from mstar_rt.models.smolvla_reference import sample_actions_reference

from walk_models import ZERO_LIVE, settled, wait_until

FIXTURE = Path(__file__).resolve().parents[1] / "reference" / "fixtures" / "smolvla"
CHECKPOINT, VLM = FIXTURE / "checkpoint", FIXTURE / "smolvlm_tiny"
CAMERAS = ("observation.images.camera1", "observation.images.camera2")
TIMEOUT = 60.0
TOL = 1e-4
pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conftest.py


@pytest.fixture(scope="module")
def io() -> dict:
    return load_file(str(FIXTURE / "io.safetensors"))


@pytest.fixture(scope="module")
def policy():
    return load_lerobot_smolvla(CHECKPOINT, progress=False)


def fixture_inputs(io: dict, uint8: bool = False) -> dict:
    meta = json.loads((FIXTURE / "io.json").read_text())
    suffix = ".uint8" if uint8 else ""
    return {"images": {k: io[f"input.{k}{suffix}"] for k in CAMERAS},
            "state": io["input.observation.state"], "task": meta["prompt"],
            "noise": io["input.noise"]}


def max_diff(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float().reshape(want.shape) - want.float()).abs().max())


def pages_back(engine: KVCacheEngine) -> bool:
    cache = engine.cache
    return wait_until(lambda: cache.free_pages == cache.num_pages and cache.live_sequences == 0)


# ---- the loader ----------------------------------------------------------------------------------

def test_loader_reads_sizes_tokenizer_and_statistics_as_lerobot(policy, io, capsys):
    c = policy.config
    assert c.cameras == CAMERAS and (c.state_dim, c.action_dim) == (6, 6)
    assert (c.num_layers, c.expert_width, c.expert_mlp_width) == (4, 48, 256)
    assert [i for i in range(c.num_layers) if c.is_cross(i)] == [1, 3]
    assert c.tokens_per_image == 4 and c.chunk_size == 10
    meta = json.loads((FIXTURE / "io.json").read_text())
    ids = policy.tokenize(meta["prompt"])
    assert ids == io["batch.observation.language.tokens"][0].tolist()
    state = policy.normalize_state(io["input.observation.state"])
    assert max_diff(state, io["model.state_padded"]) == 0.0
    load_lerobot_smolvla(CHECKPOINT)
    printed = capsys.readouterr().out
    assert "124 tensors" in printed and "float32" in printed and "bfloat16" in printed


def test_the_unused_lm_head_is_checked_but_not_loaded(policy):
    keys = set(policy.module.state_dict())
    assert not any("lm_head" in k for k in keys) and len(keys) == 123


# ---- parity with LeRobot -------------------------------------------------------------------------

def test_every_intermediate_and_the_chunk_equal_lerobot(policy, io):
    rec: dict = {}
    chunk = sample_actions_reference(policy, fixture_inputs(io), rec)
    names = [f"images.{i}" for i in range(2)] + [f"image_embs.{i}" for i in range(2)] + [
        "state_padded", "prefix_embs", "prefix_out", "suffix_embs.step0", "suffix_out.step0",
        "x_t", "t", "v_t", "actions_padded"] + [
        f"prefix_kv.{layer}.{kv}" for layer in range(4) for kv in ("keys", "values")]
    diffs = {n: max_diff(rec[n], io[f"model.{n}"]) for n in names}
    diffs["action_chunk_normalized"] = max_diff(rec["action_chunk_normalized"],
                                                io["output.action_chunk_normalized"])
    diffs["action_chunk"] = max_diff(chunk, io["output.action_chunk"])
    assert all(d <= TOL for d in diffs.values()), diffs
    assert chunk.shape == (10, 6)


def test_uint8_cameras_in_either_layout_give_the_same_chunk(policy, io):
    want = io["output.action_chunk"]
    chw = fixture_inputs(io, uint8=True)
    hwc = {**chw, "images": [im.permute(1, 2, 0).numpy() for im in chw["images"].values()]}
    for inputs in (chw, hwc):
        assert max_diff(sample_actions_reference(policy, inputs), want) <= TOL


# ---- served as walks -----------------------------------------------------------------------------

def test_the_served_chunk_equals_lerobot(serve, policy, io):
    engine = KVCacheEngine(page_size=16, num_pages=16)
    rt = serve(SmolVLAPolicy(policy, engine=engine))
    h = rt.submit(fixture_inputs(io))
    out = h.result(timeout=TIMEOUT)
    assert len(out["actions"]) == 1
    assert max_diff(out["actions"][0], io["output.action_chunk"]) <= TOL
    steps = [s for s in h.stats() if s["node"] == "denoise"]
    assert [s["iteration"] for s in steps] == list(range(10))
    assert [s["node"] for s in h.stats()][:2] == ["vision", "prefix"]
    assert settled(rt) == ZERO_LIVE and pages_back(engine)


def other_requests(io: dict) -> list[dict]:
    """The fixture's request and variations: one camera, the cameras as a list, other tasks,
    states and noise (different prefix lengths batched together)."""
    base = fixture_inputs(io)
    g = torch.Generator().manual_seed(1)
    cam1, cam2 = (base["images"][k] for k in CAMERAS)
    return [base,
            {**base, "images": {CAMERAS[1]: cam2}, "task": "stack the cubes",
             "noise": torch.randn(10, 32, generator=g)},
            {**base, "images": [cam2, cam1], "task": "open the drawer slowly, then stop",
             "state": base["state"] + 0.5, "noise": torch.randn(10, 32, generator=g)},
            {**base, "task": "wave", "noise": None, "seed": 3}]


def test_concurrent_requests_batch_and_each_equals_its_reference(serve, policy, io):
    engine = KVCacheEngine(page_size=16, num_pages=32)
    rt = serve(SmolVLAPolicy(policy, engine=engine))
    cases = other_requests(io)
    handles = [rt.submit(r) for r in cases]
    for r, h in zip(cases, handles):
        chunk = h.result(timeout=TIMEOUT)["actions"][0]
        assert max_diff(chunk, sample_actions_reference(policy, r)) <= TOL
    assert max_diff(handles[0].result()["actions"][0], io["output.action_chunk"]) <= TOL
    sizes = [s["batch_size"] for h in handles for s in h.stats() if s["node"] == "denoise"]
    assert max(sizes) >= 2, f"flow steps of different requests never shared a step: {sizes}"
    assert settled(rt) == ZERO_LIVE and pages_back(engine)


def test_flow_steps_read_the_prefix_pages_without_writing_them(serve, policy, io):
    engine = KVCacheEngine(page_size=16, num_pages=16)
    model = SmolVLAPolicy(policy, engine=engine)
    node = model.submodules["denoise"]
    real, seen = node.forward_kv, []

    def spy(works, step):
        cache = engine.cache
        seq = cache.sequence(next(iter(r for (r, _l) in cache._seqs)), "main")
        before = [t[seq.pages].clone() for t in cache.k + cache.v], seq.length
        out = real(works, step)
        seen.append(all(w.persist is False for w in works) and before[1] == seq.length and all(
            torch.equal(a, t[seq.pages]) for a, t in zip(before[0], cache.k + cache.v)))
        return out

    node.forward_kv = spy
    serve(model).submit(fixture_inputs(io)).result(timeout=TIMEOUT)
    assert seen == [True] * 10


@pytest.mark.parametrize("change, words", [
    (dict(task=None), ["'task'", "missing"]),
    (dict(state=torch.zeros(3)), ["'state'", "[6]"]),
    (dict(state=torch.zeros(3, 2)), ["'state'", "[6]", "[3, 2]"]),  # it was flattened
    (dict(noise=torch.zeros(10, 6)), ["'noise'", "[10, 32]"]),
    (dict(images={"observation.images.wrist": torch.zeros(3, 8, 8)}), ["unknown cameras",
                                                                       "wrist"]),
    (dict(images={}), ["'images'", "no camera"]),
    (dict(images=[torch.full((3, 8, 8), 2.0)]), ["image 'observation.images.camera1'",
                                                 "[0, 1]"]),
    (dict(images=[np.zeros((0, 0, 3), np.uint8)]), ["H, W >= 1", "[0, 0, 3]"]),
    (dict(task=list(range(49))), ["'task'", "at most 48"]),
    (dict(state=torch.full((6,), float("nan"))), ["'state'", "NaN"]),
])
def test_bad_inputs_are_refused_at_submit_naming_the_input(serve, policy, io, change, words):
    rt = serve(SmolVLAPolicy(policy, engine=KVCacheEngine(page_size=16, num_pages=16)))
    with pytest.raises(ValueError) as e:
        rt.submit({**fixture_inputs(io), **change})
    for w in words:
        assert w in str(e.value), (w, str(e.value))


# ---- damaged checkpoints -------------------------------------------------------------------------

def damaged(tmp_path: Path, edit) -> Path:
    out = tmp_path / "checkpoint"
    shutil.copytree(CHECKPOINT, out)
    state = load_file(str(out / "model.safetensors"))
    edit(state)
    save_file(state, str(out / "model.safetensors"))
    return out


EXPERT_Q = "model.vlm_with_expert.lm_expert.layers.1.self_attn.q_proj.weight"


@pytest.mark.parametrize("edit, words", [
    (lambda s: s.pop(EXPERT_Q), ["missing", EXPERT_Q]),
    (lambda s: s.update({"model.extra_head.weight": torch.zeros(2, 2)}),
     ["unknown checkpoint keys", "model.extra_head.weight"]),
    (lambda s: s.update({EXPERT_Q: torch.zeros(64, 40)}), [EXPERT_Q, "(64, 40)", "(64, 48)"]),
    (lambda s: s.update({"model.vlm_with_expert.vlm.lm_head.weight": torch.zeros(3, 64)}),
     ["lm_head", "(3, 64)"]),
])
def test_a_damaged_checkpoint_fails_naming_the_key(tmp_path, edit, words):
    path = damaged(tmp_path, edit)
    with pytest.raises(ValueError) as e:
        load_lerobot_smolvla(path, vlm_dir=str(VLM), progress=False)
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def test_missing_statistics_and_backbone_folder_are_named(tmp_path):
    path = tmp_path / "checkpoint"
    shutil.copytree(CHECKPOINT, path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "vlm_model_name": "no/such_vlm"}))
    with pytest.raises(FileNotFoundError, match="no/such_vlm.*vlm_dir"):
        load_lerobot_smolvla(path, progress=False)
    stats = path / "policy_preprocessor_step_5_normalizer_processor.safetensors"
    kept = load_file(str(stats))
    save_file({k: v for k, v in kept.items() if k != "observation.state.std"}, str(stats))
    with pytest.raises(ValueError, match=r"lacks 'observation.state.std'"):
        load_lerobot_smolvla(path, vlm_dir=str(VLM), progress=False)
    save_file(kept, str(stats))
    (path / "policy_postprocessor.json").unlink()
    with pytest.raises(FileNotFoundError, match="policy_postprocessor.json"):
        load_lerobot_smolvla(path, vlm_dir=str(VLM), progress=False)


@pytest.mark.parametrize("step, words", [
    ({"registry_name": "my_crop_processor"}, "processor step 'my_crop_processor' is not one"),
    ({"registry_name": "rename_observations_processor",
      "config": {"rename_map": {"cam": "observation.images.camera1"}}}, "rename map"),
    ({"registry_name": "relative_actions_processor", "config": {"enabled": True}},
     "relative_actions_processor is enabled"),
    # newer LeRobot saves it in every SmolVLA pipeline, disabled: that one loads
    ({"registry_name": "relative_actions_processor", "config": {"enabled": False}}, None),
])
def test_a_processor_step_not_reproduced_here_is_refused(tmp_path, step, words):
    path = tmp_path / "checkpoint"
    shutil.copytree(CHECKPOINT, path)
    pre = json.loads((path / "policy_preprocessor.json").read_text())
    pre["steps"].insert(0, step)
    (path / "policy_preprocessor.json").write_text(json.dumps(pre))
    if words is None:
        load_lerobot_smolvla(path, vlm_dir=str(VLM), progress=False)
        return
    with pytest.raises(ValueError, match=words):
        load_lerobot_smolvla(path, vlm_dir=str(VLM), progress=False)


def test_a_missing_tokenizer_is_named_when_a_task_comes_as_text(tmp_path, capsys):
    vlm = tmp_path / "vlm"
    shutil.copytree(VLM, vlm)
    (vlm / "tokenizer.json").unlink()
    policy = load_lerobot_smolvla(CHECKPOINT, vlm_dir=str(vlm))
    assert f"no {vlm / 'tokenizer.json'}" in capsys.readouterr().out
    with pytest.raises(ValueError, match=f"{vlm / 'tokenizer.json'} is missing"):
        policy.tokenize("pick up the cube")
    # served, its task comes as token ids: the websocket does not ask for text then
    assert "task" not in SmolVLAPolicy(policy).openpi_defaults()["dtypes"]
    with_text = load_lerobot_smolvla(CHECKPOINT, vlm_dir=str(VLM), progress=False)
    assert SmolVLAPolicy(with_text).openpi_defaults()["dtypes"]["task"] == "str"


def test_a_config_that_does_not_match_the_weights_is_refused(tmp_path):
    path = tmp_path / "checkpoint"
    shutil.copytree(CHECKPOINT, path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "num_vlm_layers": 3}))
    with pytest.raises(ValueError, match="unknown checkpoint keys.*layers.3"):
        load_lerobot_smolvla(path, vlm_dir=str(VLM), progress=False)
    (path / "config.json").write_text(json.dumps({**config, "adapt_to_pi_aloha": True}))
    with pytest.raises(ValueError, match="adapt_to_pi_aloha"):
        load_lerobot_smolvla(path, vlm_dir=str(VLM), progress=False)


# ---- full size -----------------------------------------------------------------------------------

def test_full_size_smolvla_base_has_lerobots_keys_shapes_and_parameter_count():
    want = json.loads((FIXTURE / "full_size_keys.json").read_text())
    module = meta_module(lambda: SmolVLAModule(smolvla_base_config()), "smolvla_base")
    got = {k: list(v.shape) for k, v in module.state_dict().items()}
    assert got == want["keys"]
    assert list(got) == list(want["keys"])  # LeRobot's order too
    assert parameter_count(module) == (500, 450_046_176) == (want["num_tensors"],
                                                             want["num_params"])
    sizes = memory_estimate(smolvla_base_config())  # what the loader prints
    assert sizes["parameters"] + sizes["lm_head"] == 450_046_176
    assert sizes["weights.bfloat16"] == 2 * sizes["parameters"]


def test_flow_steps_through_the_engines_attention_give_the_same_chunks(serve, policy, io,
                                                                        monkeypatch):
    """Where the cache cannot hand a prefix out (a tensor-parallel share), the flow steps attend
    through the engine's paged attention every step instead of a copy taken once: the same
    chunks, batched requests of different prefix lengths included."""
    import mstar_rt.models.smolvla as served

    monkeypatch.setattr(served, "prefix_snapshot", lambda step, request_id: None)
    engine = KVCacheEngine(page_size=16, num_pages=32)
    rt = serve(SmolVLAPolicy(policy, engine=engine))
    cases = other_requests(io)
    handles = [rt.submit(r) for r in cases]
    for r, h in zip(cases, handles):
        assert max_diff(h.result(timeout=TIMEOUT)["actions"][0],
                        sample_actions_reference(policy, r)) <= TOL
    assert settled(rt) == ZERO_LIVE and pages_back(engine)

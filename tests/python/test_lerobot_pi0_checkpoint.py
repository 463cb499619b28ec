"""Loading LeRobot pi0 / pi0.5 checkpoint directories: the full-size configurations have LeRobot's
exact keys, shapes and parameter counts (built on the meta device); a damaged checkpoint (a
missing key, an unexpected one, a wrong shape, integer weights, a corrupt file, a wrong type, a
missing tokenizer) is an error naming what is wrong; openpi's converted key layout loads the same
weights; the load prints a memory estimate; bfloat16 loads and stays near the float32 chunk."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from mstar_rt.models.lerobot_pi0_config import LM_HEADS, checkpoint_layout, full_size
from mstar_rt.models.lerobot_pi0_layers import parameter_count
from mstar_rt.models.lerobot_pi0_load import load_lerobot_pi0
from mstar_rt.models.lerobot_pi0_reference import reference_actions

FIXTURES = Path(__file__).resolve().parents[1] / "reference" / "fixtures"
SIZES = {"vision_heads": 2}  # the tiny tower's (tiny_sizes.json); shapes cannot tell it
pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conftest.py


def load(family: str, path=None, **kw):
    d = FIXTURES / family
    kw.setdefault("tokenizer", d / "tokenizer")
    kw.setdefault("sizes", SIZES)
    kw.setdefault("verbose", False)
    return load_lerobot_pi0(path or d / "checkpoint", **kw)


def copy_with(tmp_path: Path, family: str, change) -> Path:
    """The fixture checkpoint copied to ``tmp_path`` with ``change(state_dict)`` applied."""
    dst = tmp_path / family
    shutil.copytree(FIXTURES / family / "checkpoint", dst)
    state = load_file(str(dst / "model.safetensors"))
    change(state)
    save_file(state, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize("family, tensors, params", [("pi0", 778, 4_028_019_472),
                                                     ("pi05", 813, 4_143_404_816)])
def test_full_size_structure_has_lerobots_keys_shapes_and_parameter_count(family, tensors,
                                                                          params):
    want = json.loads((FIXTURES / family / "full_size_keys.json").read_text())
    assert (want["num_tensors"], want["num_params"]) == (tensors, params)
    config = full_size(family)
    assert parameter_count(config) == (tensors, params)
    layout = checkpoint_layout(config)
    assert set(layout) == set(want["keys"])
    wrong = {k: (layout[k], tuple(s)) for k, s in want["keys"].items() if layout[k] != tuple(s)}
    assert not wrong
    kept_tensors, kept = parameter_count(config, with_lm_heads=False)
    assert kept_tensors == tensors - 2 and params - kept == 257152 * (2048 + 1024)


def test_loading_prints_the_memory_per_dtype(capsys):
    policy = load("pi0", verbose=True)
    line = capsys.readouterr().out
    kept = sum(p.numel() for p in policy.module.state_dict().values())
    assert f"pi0: {kept:,} parameters" in line and "49,152 more in the lm_heads" in line
    for words in ("in float32", "in bfloat16", "in float16", "KV cache"):
        assert words in line
    # the bfloat16 figure is what a bfloat16 load holds (its tower, norms and heads stay
    # float32): it counted 2 bytes for every parameter, 380.69 KiB for 469.4 KiB
    half = load("pi0", dtype=torch.bfloat16, verbose=True)
    line = capsys.readouterr().out
    held = sum(p.numel() * p.element_size() for p in half.module.parameters())
    printed = re.search(r"([\d.]+) (KiB|MiB) in bfloat16", line)
    assert printed, line
    value = float(printed[1]) * (1024 if printed[2] == "KiB" else 1024 ** 2)
    assert abs(value - held) / held < 0.02, (value, held)


@pytest.mark.parametrize("change, words", [
    (lambda s: s.pop("model.action_out_proj.bias"), "missing key 'model.action_out_proj.bias'"),
    (lambda s: s.update({"model.extra.weight": torch.zeros(2)}),
     "unexpected key 'model.extra.weight'"),
    (lambda s: s.update({"model.action_out_proj.bias": torch.zeros(31)}),
     r"key 'model.action_out_proj.bias' has shape \(31,\) but the configuration expects \(32,\)"),
    (lambda s: s.update({"model.state_proj.bias": torch.zeros(32, dtype=torch.int64)}),
     "'model.state_proj.bias' holds I64"),
    (lambda s: s.pop("model.paligemma_with_expert.gemma_expert.model.layers.0.self_attn."
                     "q_proj.weight"), "missing key 'model.paligemma_with_expert.gemma_expert"),
    (lambda s: s.update({"model.paligemma_with_expert.paligemma.model.language_model.layers.0."
                         "mlp.up_proj.weight": torch.zeros(100, 64)}),
     r"language_model.layers.0.mlp.up_proj.weight' has shape \(100, 64\)"),
])
def test_a_damaged_checkpoint_is_refused_naming_the_key(tmp_path, change, words):
    with pytest.raises(ValueError, match=words):
        load("pi0", copy_with(tmp_path, "pi0", change))


def test_a_checkpoint_of_another_family_or_type_is_refused(tmp_path):
    dst = copy_with(tmp_path, "pi0", lambda s: None)
    config = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**config, "type": "pi05"}))
    with pytest.raises(ValueError, match="unexpected key 'model.action_time_mlp_in.bias'"):
        load("pi0", dst)
    (dst / "config.json").write_text(json.dumps({**config, "type": "smolvla"}))
    with pytest.raises(ValueError, match="type 'smolvla' is not a pi0 or pi0.5 policy"):
        load("pi0", dst)


def test_a_corrupt_or_incomplete_directory_is_refused(tmp_path):
    dst = copy_with(tmp_path, "pi05", lambda s: None)
    (dst / "model.safetensors").write_bytes((dst / "model.safetensors").read_bytes()[:5000])
    with pytest.raises(ValueError, match="not a readable safetensors file"):
        load("pi05", dst)
    with pytest.raises(FileNotFoundError, match="pass tokenizer=<its folder>"):
        load("pi05", tokenizer=None)
    with pytest.raises(ValueError, match=r"give sizes=\{'vision_heads': N\}"):
        load("pi05", sizes={})
    dst = copy_with(tmp_path / "b", "pi05", lambda s: None)
    next(dst.glob("policy_postprocessor_step_*.safetensors")).unlink()
    with pytest.raises(ValueError, match="not a readable normalizer state file"):
        load("pi05", dst)


def _edit_stats(dst: Path, change) -> None:
    """``change(stats)`` applied to the checkpoint's state statistics file."""
    file = next(dst.glob("policy_preprocessor_step_*normalizer_processor.safetensors"))
    stats = load_file(str(file))
    change(stats)
    save_file(stats, str(file))


def _edit_config(dst: Path, change) -> None:
    config = json.loads((dst / "config.json").read_text())
    change(config)
    (dst / "config.json").write_text(json.dumps(config))


def _edit_normalizer(dst: Path, **changes) -> None:
    file = dst / "policy_preprocessor.json"
    pipeline = json.loads(file.read_text())
    for step in pipeline["steps"]:
        if step["registry_name"] == "normalizer_processor":
            step.setdefault("config", {}).update(changes)
    file.write_text(json.dumps(pipeline))


def _tokenizer_copy(dst, settings=None, extra_tokens=0):
    """The fixture's tokenizer in ``dst/tokenizer``, its settings file replaced, or grown."""
    from tokenizers import Tokenizer

    shutil.copytree(FIXTURES / "pi0" / "tokenizer", dst / "tokenizer")
    if settings is not None:
        (dst / "tokenizer" / "tokenizer_config.json").write_text(settings)
    if extra_tokens:
        tk = Tokenizer.from_file(str(dst / "tokenizer" / "tokenizer.json"))
        tk.add_tokens([f"<extra{i}>" for i in range(extra_tokens)])
        tk.save(str(dst / "tokenizer" / "tokenizer.json"))


@pytest.mark.parametrize("edit, words", [
    # the statistics and config.json disagree: refused at load, not in every request
    (lambda d: _edit_stats(d, lambda s: s.update({k: v[:5] for k, v in s.items()
                                                  if k.startswith("observation.state.")})),
     r"'observation.state' statistic '\w+' has shape \[5\], but config.json gives "
     r"'observation.state' 6 values"),
    (lambda d: _edit_config(d, lambda c: c["input_features"]["observation.state"].update(
        shape=[7])), "config.json gives 'observation.state' 7 values"),
    (lambda d: _edit_config(d, lambda c: c.pop("output_features")),  # LeRobot: max_action_dim
     "config.json gives 'action' 32 values"),
    (lambda d: _edit_stats(d, lambda s: s.update({k: torch.full_like(v, float("inf"))
                                                  for k, v in s.items()})),
     "NaN or infinite values .* save the policy with its dataset's statistics"),
    (lambda d: (d / "model.safetensors").unlink(),  # the processor files are no weights
     "holds no .safetensors weights"),
    (lambda d: (d / "tokenizer").mkdir() or (d / "tokenizer" / "tokenizer.json").write_text(
        "{\"model\": 1}"), "tokenizer.json is not a readable tokenizer"),
    # a bare JSONDecodeError / AttributeError before
    (lambda d: _tokenizer_copy(d, settings="{bad"), "tokenizer_config.json is not valid JSON"),
    (lambda d: _tokenizer_copy(d, settings="[1]"),
     "tokenizer_config.json holds a list, not the tokenizer's settings"),
    # its ids past the text embedding failed every request with an IndexError
    (lambda d: _tokenizer_copy(d, extra_tokens=4000), r"has \d+ tokens, more than the "
                                                      r"checkpoint's \d+-row text embedding"),
    # loaded float32 without a word / an IndexError / truncated to 6 / accepted
    (lambda d: _edit_config(d, lambda c: c.update(dtype="bf16")), "dtype 'bf16' is not one of"),
    (lambda d: _edit_config(d, lambda c: c["input_features"]["observation.state"].update(
        shape=[])), r"observation.state.shape \[\] must be \[n\]"),
    (lambda d: _edit_config(d, lambda c: c["input_features"]["observation.state"].update(
        shape=[6.7])), r"observation.state.shape \[6.7\] must be \[n\]"),
    (lambda d: _edit_config(d, lambda c: c.update(n_action_steps=c["chunk_size"] + 1)),
     "n_action_steps .* is more than chunk_size"),
    (lambda d: _edit_normalizer(d, eps="x"), r"normalizer_processor step\): eps 'x' must be"),
])
def test_statistics_config_weights_or_tokenizer_that_do_not_fit_are_refused(tmp_path, edit,
                                                                            words):
    dst = copy_with(tmp_path, "pi0", lambda s: None)
    edit(dst)
    tokenizer = dst / "tokenizer"
    tokenizer = tokenizer if tokenizer.exists() else FIXTURES / "pi0" / "tokenizer"
    with pytest.raises((ValueError, FileNotFoundError), match=words):
        load("pi0", dst, tokenizer=tokenizer)


def test_the_preprocessors_tokenizer_is_found_in_the_hugging_face_cache(tmp_path, monkeypatch):
    """No tokenizer= and none beside the weights: the one LeRobot's preprocessor names
    (google/paligemma-3b-pt-224) is read from the Hugging Face cache, never downloaded."""
    import huggingface_hub.constants

    revision = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--google--paligemma-3b-pt-224"
    shutil.copytree(FIXTURES / "pi0" / "tokenizer", repo / "snapshots" / revision)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    policy = load("pi0", tokenizer=None)
    want = load("pi0")
    assert policy.processor.tokens("pick up the cube\n").tolist() == \
        want.processor.tokens("pick up the cube\n").tolist()
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "empty"))
    with pytest.raises(FileNotFoundError, match="Hugging Face cache of "
                                                "'google/paligemma-3b-pt-224'"):
        load("pi0", tokenizer=None)


@pytest.mark.parametrize("family", ["pi0", "pi05"])
def test_openpis_converted_layout_loads_the_same_weights(tmp_path, family):
    """No ``model.`` prefix, openpi's head names, no text embedding (its lm_head stands in);
    pi0.5 files may still hold a state_proj and plain expert norms, which LeRobot drops."""
    def to_openpi(state):
        embed = state.pop("model.paligemma_with_expert.paligemma.model.language_model."
                          "embed_tokens.weight")
        state[LM_HEADS[0]] = embed.clone()
        for key in list(state):
            new = key.removeprefix("model.")
            if family == "pi0":
                new = new.replace("action_time_mlp_", "time_mlp_")
            state[new] = state.pop(key)
        if family == "pi05":
            state["state_proj.weight"] = torch.zeros(32, 32)
            state["paligemma_with_expert.gemma_expert.model.norm.weight"] = torch.zeros(32)

    want = load(family).module.state_dict()
    got = load(family, copy_with(tmp_path, family, to_openpi)).module.state_dict()
    assert list(got) == list(want)
    assert all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.parametrize("family", ["pi0", "pi05"])
def test_bfloat16_is_lerobots_mixed_precision_and_gives_its_bfloat16_chunk(family):
    """LeRobot's bfloat16 keeps the vision tower, projector, norms and heads in float32 (its
    flow state and velocities too): the same dtype for every parameter here, and the chunk --
    served and from the reference -- near LeRobot's own bfloat16 chunk
    (fixtures/<family>/bf16, made by make_pi0_bf16_fixtures.py), as near as that is to the
    float32 one. An all-bfloat16 module was 2-9 times farther (0.018 / 0.060)."""
    from mstar_rt import Runtime
    from mstar_rt.models.lerobot_pi0 import LeRobotPi0Policy
    from mstar_rt.models.lerobot_pi0_layers import lerobot_key

    d = FIXTURES / family
    io = load_file(str(d / "io.safetensors"))
    meta = json.loads((d / "io.json").read_text())
    theirs = json.loads((d / "bf16" / "io.json").read_text())
    lerobot_bf16 = load_file(str(d / "bf16" / "io.safetensors"))["output.action_chunk"][0]
    policy = load(family, dtype=torch.bfloat16)
    m = policy.module
    assert (m.dtype, m.head_dtype) == (torch.bfloat16, torch.float32)
    dtypes = {lerobot_key(n): str(p.dtype).removeprefix("torch.") for n, p in
              m.named_parameters()}
    assert dtypes == {k: v for k, v in theirs["parameter_dtypes"].items() if k not in LM_HEADS}
    obs = {"images": {k: io[f"input.{k}"] for k in meta["cameras_in_order"]},
           "state": io["input.observation.state"], "task": meta["prompt"],
           "noise": io["input.noise"]}
    reference = reference_actions(policy, obs)["action_chunk"]
    chunks = {"reference": reference}
    for graphs in (False, True):  # the static flow buckets too (eagerly, on this CPU)
        with Runtime(LeRobotPi0Policy(policy, max_batch=2, cuda_graphs=graphs)) as rt:
            chunks[f"served, cuda_graphs={graphs}"] = rt.submit(obs).result(
                timeout=60)["actions"][0]
    gap = theirs["max_abs_minus_float32_chunk"]  # LeRobot's own bfloat16 against its float32
    for name, chunk in chunks.items():
        assert chunk.dtype == torch.float32
        # as far from float32 as LeRobot's bfloat16 is; from LeRobot's bfloat16 chunk, up to
        # both gaps (bfloat16 GEMMs round differently per CPU: AMX, AVX512-BF16 or neither)
        assert (chunk - io["output.action_chunk"][0]).abs().max() < 1.5 * gap, name
        assert (chunk - lerobot_bf16).abs().max() < 2.5 * gap, name


def test_a_prompt_is_tokenized_once_for_its_check_and_its_prefix():
    """submit's check and the prefix node both need the prompt's ids: the tokenizer runs once
    per distinct prompt, and the ids stay equal to a fresh tokenizer's."""
    proc = load("pi0").processor
    calls = []
    encode = proc.tokenizer.encode
    proc.tokenizer.encode = lambda text: (calls.append(text), encode(text))[1]
    first = proc.tokens("pick up the cube\n")
    first.add_(1)  # a caller's own tensor: changing it changes no later answer
    again = proc.tokens("pick up the cube\n")
    assert calls == ["pick up the cube\n"]
    assert again.tolist() == encode("pick up the cube\n").ids[: proc.max_length]
    proc.tokens("stack the blocks\n")
    assert calls == ["pick up the cube\n", "stack the blocks\n"]


@pytest.mark.parametrize("sizes", [{**SIZES, "vision_heads": 0}, {**SIZES, "vision_heads": "2"}])
def test_head_counts_that_no_layer_can_take_are_refused(sizes):
    # a ZeroDivisionError / TypeError inside a layer before
    with pytest.raises(ValueError, match="head counts are integers >= 1"):
        load("pi0", sizes=sizes)

"""load_qwen3_omni on the tiny Qwen3-Omni saved by transformers (hub layout: one tensor per
expert): every checkpoint tensor lands where it belongs (the experts fused), the loaded thinker
and talker compute transformers' outputs, sharded and fused-expert checkpoints load, vision keys
and components this build lacks are skipped, and a missing, unknown or mis-shaped key is an
error naming it."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from safetensors.torch import load_file, save_file  # noqa: E402

from mstar_rt.engines.attention_base import SeqStep  # noqa: E402
from mstar_rt.engines.kv_engine import KVStep  # noqa: E402
from mstar_rt.engines.paged_kv import PagedKVCache  # noqa: E402
from mstar_rt.engines.torch_backend import TorchAttention  # noqa: E402
from mstar_rt.models.qwen3_omni import checkpoint as omni_checkpoint  # noqa: E402
from mstar_rt.models.qwen3_omni.checkpoint import (  # noqa: E402
    PREFIXES, Qwen3OmniConfig, load_qwen3_omni)

import omni_tiny  # noqa: E402

EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(hf model, checkpoint dir, its tensors)."""
    hf = omni_tiny.model()
    path = tmp_path_factory.mktemp("omni")
    omni_tiny.save(hf, str(path))
    return hf, path, load_file(path / "model.safetensors")


def variant(saved, tmp_path, name: str, tensors=None, config=None):
    """A copy of the saved checkpoint with other tensors and/or another config.json."""
    _hf, path, _t = saved
    d = tmp_path / name
    shutil.copytree(path, d)
    if tensors is not None:
        save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
    if config is not None:
        (d / "config.json").write_text(json.dumps(config))
    return d


def read_config(saved) -> dict:
    return json.loads((saved[1] / "config.json").read_text())


def ours_for(weights, key: str) -> torch.Tensor:
    """The loaded tensor a checkpoint key was copied into (a slice for one expert's)."""
    prefix, component = next((p, c) for p, c in PREFIXES if key.startswith(p))
    module = getattr(weights, component)
    state = module.state_dict()
    local = key[len(prefix):]
    m = EXPERT.match(local)
    if m is None:
        return state[local]
    if m[3] == "down":
        return state[f"{m[1]}.down_proj"][int(m[2])]
    fused = state[f"{m[1]}.gate_up_proj"][int(m[2])]
    half = fused.shape[0] // 2
    return fused[:half] if m[3] == "gate" else fused[half:]


# ---- loading -------------------------------------------------------------------------------------

def test_every_checkpoint_tensor_is_loaded_where_it_belongs(saved):
    hf, path, tensors = saved
    w = load_qwen3_omni(path, progress=False)
    assert w.skipped == ("thinker.visual.",)
    checked = 0
    for key, tensor in tensors.items():
        if key.startswith("thinker.visual."):
            continue
        assert torch.equal(ours_for(w, key), tensor), key
        checked += 1
    assert checked == len(tensors) - sum(k.startswith("thinker.visual.") for k in tensors)
    # and the fused experts are transformers' own in-memory tensors
    hf_thinker = hf.thinker.model.language_model.state_dict()
    for name, p in w.thinker.state_dict().items():
        assert torch.equal(p, hf_thinker[name.removeprefix("model.")] if name.startswith(
            "model.") else hf.thinker.state_dict()[name]), name
    hf_talker = hf.talker.state_dict()
    for name, p in w.talker.state_dict().items():
        assert torch.equal(p, hf_talker[name]), name
    c = w.config
    assert (c.im_start, c.im_end, c.tts_pad, c.tts_bos, c.tts_eos) == (
        omni_tiny.IM_START, omni_tiny.IM_END, omni_tiny.TTS_PAD, omni_tiny.TTS_BOS,
        omni_tiny.TTS_EOS)
    assert (c.system, c.user, c.assistant, c.audio) == (
        omni_tiny.SYSTEM, omni_tiny.USER, omni_tiny.ASSISTANT, omni_tiny.AUDIO)
    assert dict(c.speaker_id) == omni_tiny.SPEAKERS and c.num_code_groups == omni_tiny.GROUPS
    assert c.accept_hidden_layer == 2 and c.codec["codec_eos_token_id"] == omni_tiny.CODEC[
        "codec_eos_token_id"]


def test_loaded_lms_compute_transformers_outputs(saved):
    """Rotary tables are rebuilt after the meta-device build (not left as garbage)."""
    hf, path, _t = saved
    w = load_qwen3_omni(path, progress=False)
    ids = torch.tensor(omni_tiny.chat_prompt([72, 105, 33]))
    x = torch.randn(11, w.talker.config.hidden_size, generator=torch.Generator().manual_seed(1))
    for module, run, ref in (
            (w.thinker, lambda s: w.thinker.logits(w.thinker(ids, s)[0]),
             lambda: hf.thinker(input_ids=ids[None]).logits[0]),
            (w.talker, lambda s: w.talker.logits(w.talker(x, s)),
             lambda: hf.talker.codec_head(hf.talker.model(inputs_embeds=x[None])[0][0]))):
        cache = PagedKVCache(module.kv_layout(), 4, 16)
        n = ref().shape[0]
        seq = cache.admit(0, "main", n)
        with torch.no_grad():
            got = run(KVStep(TorchAttention(cache), [SeqStep(0, n, list(seq.pages))]))
            assert (got - ref()).abs().max() < 1e-4


def test_dtype_casts_weights_but_keeps_rotary_in_float32(saved):
    _hf, path, _t = saved
    w = load_qwen3_omni(path, dtype=torch.bfloat16, progress=False)
    assert w.thinker.kv_layout().dtype == torch.bfloat16
    assert w.talker.model.layers[0].mlp.experts.gate_up_proj.dtype == torch.bfloat16
    assert w.thinker.model.rotary.inv_freq.dtype == torch.float32


def test_sharded_and_fused_expert_checkpoints_load(saved, tmp_path):
    hf, path, tensors = saved
    sharded = tmp_path / "sharded"
    hf.save_pretrained(sharded, max_shard_size="100KB")
    assert len(list(sharded.glob("*.safetensors"))) >= 3
    w = load_qwen3_omni(sharded, progress=False)
    assert all(torch.equal(ours_for(w, k), t) for k, t in tensors.items()
               if not k.startswith("thinker.visual."))
    # Fused experts (the names our modules and transformers use in memory) load too.
    fused = {k: v for k, v in tensors.items() if not EXPERT.match(k)}
    for name, p in w.thinker.state_dict().items():
        if ".experts." in name:
            fused[f"thinker.{name}"] = p
    for name, p in w.talker.state_dict().items():
        if ".experts." in name:
            fused[f"talker.{name}"] = p
    again = load_qwen3_omni(variant(saved, tmp_path, "fused", fused), progress=False)
    for a, b in ((w.thinker, again.thinker), (w.talker, again.talker)):
        assert all(torch.equal(p, b.state_dict()[n]) for n, p in a.state_dict().items())


def test_components_missing_from_the_build_are_skipped(saved, monkeypatch):
    _hf, path, _t = saved
    real = omni_checkpoint.importlib.import_module

    def without_code2wav(name: str, *a):
        if name.endswith(".code2wav"):
            raise ImportError(name)
        return real(name, *a)

    monkeypatch.setattr(omni_checkpoint.importlib, "import_module", without_code2wav)
    w = load_qwen3_omni(path, progress=False)
    assert w.code2wav is None and w.skipped == ("thinker.visual.", "code2wav.")
    assert w.talker is not None


def test_disabled_audio_output_loads_the_thinker_alone(saved, tmp_path):
    config = read_config(saved)
    config["enable_audio_output"] = False
    w = load_qwen3_omni(variant(saved, tmp_path, "no_audio", config=config), progress=False)
    assert w.talker is None and w.code_predictor is None and w.code2wav is None
    assert w.audio_encoder is not None and w.config.talker is None
    assert w.skipped == ("thinker.visual.", "talker.code_predictor.", "talker.", "code2wav.")


# ---- errors --------------------------------------------------------------------------------------

@pytest.mark.parametrize("key", ["thinker.model.layers.1.mlp.experts.3.up_proj.weight",
                                 "talker.model.layers.0.mlp.experts.0.down_proj.weight",
                                 "talker.codec_head.weight", "thinker.model.norm.weight",
                                 "talker.text_projection.linear_fc1.bias"])
def test_missing_key_is_named(saved, tmp_path, key):
    tensors = {k: v for k, v in saved[2].items() if k != key}
    with pytest.raises(ValueError, match=r"missing from the checkpoint: .*" + re.escape(key)):
        load_qwen3_omni(variant(saved, tmp_path, "missing", tensors), progress=False)


@pytest.mark.parametrize("key, why", [
    ("thinker.model.layers.0.mlp.experts.4.gate_proj.weight", "past the config's num_experts"),
    ("talker.model.layers.0.mlp.router.weight", ""),
    ("vocoder.weight", "no component has the prefix"),
])
def test_unknown_key_is_named(saved, tmp_path, key, why):
    tensors = {**saved[2], key: torch.zeros(16, 32)}
    with pytest.raises(ValueError, match=re.escape(f"'{key}'") + ".*" + re.escape(why)):
        load_qwen3_omni(variant(saved, tmp_path, "unknown", tensors), progress=False)


def test_config_that_does_not_match_the_weights(saved, tmp_path):
    config = read_config(saved)
    config["talker_config"]["text_config"]["moe_intermediate_size"] = 8
    with pytest.raises(ValueError, match=r"talker\.model\.layers\.0\.mlp\.experts\.0\..*shape"):
        load_qwen3_omni(variant(saved, tmp_path, "shape", config=config), progress=False)
    config = read_config(saved)
    config["talker_config"]["accept_hidden_layer"] = 9
    with pytest.raises(ValueError, match="'accept_hidden_layer'"):
        load_qwen3_omni(variant(saved, tmp_path, "layer", config=config), progress=False)
    config = read_config(saved)
    config["tts_bos_token_id"] = "<tts_bos>"
    with pytest.raises(ValueError, match="'tts_bos_token_id'"):
        load_qwen3_omni(variant(saved, tmp_path, "token", config=config), progress=False)
    del config["tts_bos_token_id"]  # left out: transformers' default, as transformers reads it
    assert Qwen3OmniConfig.from_hf(config).tts_bos == 151672
    tensors = {**saved[2], "thinker.model.norm.weight": torch.ones(32, dtype=torch.int32)}
    with pytest.raises(ValueError, match="thinker.model.norm.weight.*floating-point"):
        load_qwen3_omni(variant(saved, tmp_path, "int", tensors), progress=False)

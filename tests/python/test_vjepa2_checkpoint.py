"""Loading the V-JEPA 2-AC predictor from the layouts upstream and users have: upstream's
training checkpoint (``{"encoder", "predictor", ...}``, DDP's ``module.`` prefix), a bare state
dict, a safetensors file (bare or ``predictor.``-prefixed keys, next to ``encoder.`` ones), a
saved directory; each loads to the reference's numbers. A damaged checkpoint -- a missing key,
an unexpected key, a wrong shape, integers for weights -- is a ValueError naming the key, raised
before any weight is allocated; the loader prints its memory per dtype."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

import mstar_rt.models.vjepa2_checkpoint as ckpt
from mstar_rt.models.vjepa2_checkpoint import (load_vjepa2_predictor, memory_estimate,
                                               meta_predictor, save_upstream_layout,
                                               save_vjepa2_predictor)
from mstar_rt.models.vjepa2_predictor import VJEPA2ACConfig

from test_vjepa2_predictor import CONFIGS, tiny_config, upstream_predictor

pytestmark = [pytest.mark.usefixtures("one_torch_thread"),
              pytest.mark.filterwarnings("ignore:.*sdp_kernel:FutureWarning")]


@pytest.fixture(scope="module")
def pair():
    return upstream_predictor(tiny_config(**CONFIGS["grid2x2"]), seed=4)


def same_outputs(up, loaded) -> None:
    c = loaded.config
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 2 * c.num_patches, c.embed_dim, generator=g)
    a, s = torch.randn(1, 2, 7, generator=g), torch.randn(1, 2, 7, generator=g)
    with torch.no_grad():
        torch.testing.assert_close(loaded.forward_frames(x, a, s), up(x, a, s), atol=1e-4, rtol=0)


def test_upstream_training_checkpoint_with_ddp_prefix_loads(tmp_path, pair, capsys):
    up, ours = pair
    file = tmp_path / "vjepa2-ac.pt"
    torch.save({"encoder": {"module.blocks.0.norm1.weight": torch.ones(3)},
                "predictor": {"module." + k: v for k, v in up.state_dict().items()},
                "opt": {"lr": 1e-4}, "epoch": 315}, file)
    loaded = load_vjepa2_predictor(file, ours.config)
    same_outputs(up, loaded)
    printed = capsys.readouterr().err
    count = sum(p.numel() for p in ours.parameters())
    assert f"{count:,} parameters" in printed
    for dtype in ("float32", "bfloat16", "float16"):
        assert f" in {dtype}" in printed, printed
    assert "KV cache" in printed


def test_bare_state_dict_and_prefixed_safetensors_load(tmp_path, pair):
    up, ours = pair
    torch.save(up.state_dict(), tmp_path / "bare.pt")
    same_outputs(up, load_vjepa2_predictor(tmp_path / "bare.pt", ours.config, progress=False))
    combined = {"predictor." + k: v.contiguous() for k, v in up.state_dict().items()}
    combined["encoder.norm.weight"] = torch.ones(4)
    save_file(combined, str(tmp_path / "both.safetensors"))
    same_outputs(up, load_vjepa2_predictor(tmp_path / "both.safetensors", ours.config,
                                           progress=False))


def test_saved_directory_round_trips_with_its_config(tmp_path, pair):
    up, ours = pair
    save_vjepa2_predictor(ours, tmp_path / "ac")
    loaded = load_vjepa2_predictor(tmp_path / "ac", progress=False)  # config.json gives sizes
    assert loaded.config == ours.config
    same_outputs(up, loaded)
    half = load_vjepa2_predictor(tmp_path / "ac", dtype=torch.bfloat16, progress=False)
    assert half.dtype == torch.bfloat16
    # a config.json that lost a field: the shape error names the field left to the default
    config = json.loads((tmp_path / "ac" / "config.json").read_text())
    del config["embed_dim"]
    (tmp_path / "ac" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"config.json gives no \['embed_dim'\]: the published "
                                         "values were taken"):
        load_vjepa2_predictor(tmp_path / "ac", progress=False)
    # depth counts layers: 5000 built for seconds on the meta device (2^31 was allowed)
    (tmp_path / "ac" / "config.json").write_text(json.dumps({**config, "embed_dim": 32,
                                                             "depth": 5000}))
    with pytest.raises(ValueError, match=r"'depth'.*\[1, 1024\]"):
        load_vjepa2_predictor(tmp_path / "ac", progress=False)


def _damage(state: dict, how: str) -> tuple[dict, str]:
    state = {"module." + k: v for k, v in state.items()}
    if how == "missing":
        del state["module.predictor_blocks.1.mlp.fc2.bias"]
        return state, "missing key 'predictor_blocks.1.mlp.fc2.bias'"
    if how == "unexpected":
        state["module.predictor_blocks.0.attn.q_norm.weight"] = torch.ones(24)
        return state, "unexpected key 'predictor_blocks.0.attn.q_norm.weight'"
    if how == "shape":
        state["module.state_encoder.weight"] = torch.zeros(48, 6)
        return state, "key 'state_encoder.weight' has shape (48, 6) but this V-JEPA 2-AC " \
                      "predictor config expects (48, 7)"
    state["module.predictor_norm.weight"] = torch.ones(48, dtype=torch.int64)
    return state, "key 'predictor_norm.weight' holds torch.int64"


@pytest.mark.parametrize("how", ["missing", "unexpected", "shape", "integers"])
@pytest.mark.parametrize("form", ["pt", "safetensors"])
def test_a_damaged_checkpoint_is_an_error_naming_the_key(tmp_path, pair, how, form, capsys,
                                                         monkeypatch):
    up, ours = pair
    state, words = _damage(up.state_dict(), how)
    file = tmp_path / f"damaged.{form}"
    if form == "pt":
        torch.save({"predictor": state}, file)
    else:
        save_file({k: v.contiguous() for k, v in state.items()}, str(file))
    built = []  # the device each predictor the loader makes is built on
    real = ckpt.VJEPA2ACPredictor
    monkeypatch.setattr(ckpt, "VJEPA2ACPredictor",
                        lambda config: (built.append(torch.empty(0).device.type), real(config))[1])
    with pytest.raises(ValueError) as e:
        load_vjepa2_predictor(file, ours.config)
    assert words in str(e.value), str(e.value)
    assert str(file) in str(e.value)
    assert built == ["meta"]                             # nothing real was allocated
    assert capsys.readouterr().err == ""                 # no estimate for a refused file


def test_wrong_config_and_unreadable_files_are_errors(tmp_path, pair):
    up, ours = pair
    save_upstream_layout(tmp_path / "ac.pt", up)
    with pytest.raises(ValueError, match="missing key 'predictor_blocks.2.*VJEPA2ACConfig"):
        load_vjepa2_predictor(tmp_path / "ac.pt", progress=False)  # the full-size default
    wide = tiny_config(**{**CONFIGS["grid2x2"], "embed_dim": 64})
    with pytest.raises(ValueError, match=r"'predictor_embed.weight' has shape \(48, 32\)"):
        load_vjepa2_predictor(tmp_path / "ac.pt", wide, progress=False)
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match="not a readable torch checkpoint"):
        load_vjepa2_predictor(tmp_path / "junk.pt", ours.config, progress=False)
    (tmp_path / "junk.safetensors").write_bytes(b"\x00" * 16)
    with pytest.raises(ValueError, match="not a readable safetensors file"):
        load_vjepa2_predictor(tmp_path / "junk.safetensors", ours.config, progress=False)
    torch.save({"encoder": {"w": torch.ones(1)}, "epoch": 1}, tmp_path / "enc.pt")
    with pytest.raises(ValueError, match="no 'predictor' state dict"):
        load_vjepa2_predictor(tmp_path / "enc.pt", ours.config, progress=False)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_vjepa2_predictor(tmp_path / "nowhere.pt", ours.config, progress=False)


def test_full_size_memory_estimate_per_dtype():
    sizes = memory_estimate(meta_predictor(VJEPA2ACConfig()))
    assert sizes == {"float32": 4 * 305_220_992, "bfloat16": 2 * 305_220_992,
                     "float16": 2 * 305_220_992}

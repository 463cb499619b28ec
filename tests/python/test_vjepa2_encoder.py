"""The V-JEPA 2 frame encoder: from a Hugging Face directory its features equal transformers'
``VJEPA2Model``; from upstream's ``.pt`` layout (one ``qkv`` per block, ``module.`` prefix)
they equal upstream's ``VisionTransformer`` (cc-vjepa2); a still image is encoded as upstream's
planner does (a clip of identical frames, layer-normed); the full-size ViT-g encoder the AC
predictor reads maps upstream's keys one to one onto transformers' on the meta device; damaged
checkpoints and bad images are errors naming the key or the input."""

from __future__ import annotations

import json

import functools

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

from mstar_rt.models.vjepa2_checkpoint import TensorSource, save_upstream_layout  # noqa: E402
from mstar_rt.models.vjepa2_encoder import (VJEPA2FrameEncoder, check_images,  # noqa: E402
                                            from_upstream_keys, load_vjepa2_encoder,
                                            vitg_encoder_config)

from test_vjepa2_predictor import reference, upstream_on_meta  # noqa: E402

pytestmark = [pytest.mark.usefixtures("one_torch_thread"),
              pytest.mark.filterwarnings("ignore:.*sdp_kernel:FutureWarning")]


def tiny_encoder_config(hidden: int = 32, crop: int = 32, **fields):
    return transformers.VJEPA2Config(
        hidden_size=hidden, num_hidden_layers=2, num_attention_heads=2, crop_size=crop,
        patch_size=16, frames_per_clip=4, tubelet_size=2, mlp_ratio=4.0, pred_hidden_size=24,
        pred_num_hidden_layers=1, pred_num_attention_heads=2, pred_num_mask_tokens=2, **fields)


def hf_model(config, seed: int = 0, std: float = 0.1):
    torch.manual_seed(seed)
    model = transformers.VJEPA2Model(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, std)
    return model


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    model = hf_model(tiny_encoder_config(hidden=48, crop=48))
    path = tmp_path_factory.mktemp("hf") / "vjepa2-tiny"
    model.save_pretrained(path)
    return model, path


def test_hugging_face_checkpoint_gives_vjepa2model_features(hf_dir, capsys):
    model, path = hf_dir
    encoder = load_vjepa2_encoder(path)  # config.json gives the sizes
    assert "parameters" in capsys.readouterr().err
    video = torch.randn(2, 4, 3, 48, 48, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model.get_vision_features(video)
        got = encoder.encode_video(video)
    assert got.shape == (2, 2 * 9, 48)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    images = video[:, 0]  # the planner's use: each image a still clip, layer-normed
    with torch.no_grad():
        want = F.layer_norm(model.get_vision_features(images[:, None].repeat(1, 2, 1, 1, 1)),
                            (48,))
        torch.testing.assert_close(encoder(images), want, atol=1e-4, rtol=0)


def test_a_sharded_hugging_face_directory_loads_and_a_float8_tensor_is_named(tmp_path, hf_dir):
    from safetensors.torch import load_file, save_file

    model, _ = hf_dir
    model.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")  # refused before
    assert len(list((tmp_path / "sharded").glob("*.safetensors"))) > 2
    encoder = load_vjepa2_encoder(tmp_path / "sharded", progress=False)
    video = torch.randn(1, 4, 3, 48, 48, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(encoder.encode_video(video), model.get_vision_features(video),
                                   atol=1e-4, rtol=0)
    model.save_pretrained(tmp_path / "f8")
    file = tmp_path / "f8" / "model.safetensors"
    tensors = load_file(file)
    key = next(k for k in tensors if k.endswith("fc1.weight"))
    tensors[key] = tensors[key].to(torch.float8_e4m3fn)  # it read as torch.uint8
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=f"key '{key}' holds F8_E4M3, which this loader does "
                                         "not read"):
        load_vjepa2_encoder(tmp_path / "f8", progress=False)


def test_upstream_pt_layout_gives_upstream_vision_transformer_features(tmp_path):
    ref = reference()
    config = tiny_encoder_config(hidden=48)
    up = ref.vit.VisionTransformer(
        img_size=(32, 32), patch_size=16, num_frames=4, tubelet_size=2, embed_dim=48, depth=2,
        num_heads=2, mlp_ratio=4.0, qkv_bias=True, use_rope=True, use_sdpa=True,
        norm_layer=functools.partial(torch.nn.LayerNorm, eps=1e-6)).eval()
    with torch.no_grad():
        for p in up.parameters():
            p.normal_(0, 0.1)
    save_upstream_layout(tmp_path / "ac.pt", encoder=up.state_dict())
    encoder = load_vjepa2_encoder(tmp_path / "ac.pt", config, progress=False)
    video = torch.randn(3, 4, 3, 32, 32, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = up(video.permute(0, 2, 1, 3, 4))
        got = encoder.encode_video(video)
    assert want.abs().max() > 0.5
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


def test_full_size_vitg_maps_upstream_keys_onto_transformers_on_meta(monkeypatch):
    ref = reference()
    with upstream_on_meta(monkeypatch):  # upstream's hub: the encoder of vjepa2_ac_vit_giant
        up = ref.vit.vit_giant_xformers(img_size=(256, 256), num_frames=64, tubelet_size=2,
                                        use_sdpa=True, use_silu=False, wide_silu=True,
                                        uniform_power=False, use_rope=True)
    with torch.device("meta"):
        ours = VJEPA2FrameEncoder(vitg_encoder_config())
    source = TensorSource("upstream", {k: (tuple(v.shape), v.dtype)
                                       for k, v in up.state_dict().items()}, lambda k: None)
    mapped = {k: s for k, (s, _) in from_upstream_keys(source).shapes.items()}
    want = {k: tuple(v.shape) for k, v in ours.state_dict().items()}
    assert mapped == want
    count = sum(p.numel() for p in ours.parameters())
    assert count == sum(p.numel() for p in up.parameters()) == 1_012_173_952
    assert (ours.embed_dim, ours.num_patches) == (1408, 256)  # what the AC predictor reads


def test_damaged_encoder_checkpoints_name_the_key(tmp_path, hf_dir):
    config = hf_dir[0].config
    ref = reference()
    up = ref.vit.VisionTransformer(img_size=(48, 48), patch_size=16, num_frames=4,
                                   embed_dim=48, depth=2, num_heads=2, use_rope=True)
    damaged = dict(up.state_dict())
    del damaged["blocks.1.mlp.fc1.bias"]
    save_upstream_layout(tmp_path / "missing.pt", encoder=damaged)
    with pytest.raises(ValueError, match="missing key 'encoder.layer.1.mlp.fc1.bias'"):
        load_vjepa2_encoder(tmp_path / "missing.pt", config, progress=False)
    damaged = {**up.state_dict(), "blocks.0.attn.q_norm.weight": torch.ones(24)}
    save_upstream_layout(tmp_path / "unexpected.pt", encoder=damaged)
    with pytest.raises(ValueError, match="unexpected key 'blocks.0.attn.q_norm.weight'"):
        load_vjepa2_encoder(tmp_path / "unexpected.pt", config, progress=False)
    wide = tiny_encoder_config(hidden=64, crop=48)
    save_upstream_layout(tmp_path / "ok.pt", encoder=up.state_dict())
    with pytest.raises(ValueError, match="'encoder.embeddings.patch_embeddings.proj.weight' "
                                         r"has shape \(48, 3, 2, 16, 16\)"):
        load_vjepa2_encoder(tmp_path / "ok.pt", wide, progress=False)


@pytest.mark.parametrize("change, words", [
    # transformers' StrictDataclassFieldValidationError, a ZeroDivisionError, a KeyError deep in
    # the model's build, or minutes of building 100000 layers on the meta device
    ({"hidden_size": "32"}, "'hidden_size'"),
    ({"mlp_ratio": "x"}, "'mlp_ratio'"),
    ({"num_attention_heads": 0}, "'num_attention_heads'"),
    ({"patch_size": 0}, "'patch_size'"),
    ({"hidden_act": "nonsense"}, "hidden_act 'nonsense'"),
    ({"hidden_size": 33}, "hidden_size 33 .* not a multiple"),
    ({"num_hidden_layers": 100000}, r"'num_hidden_layers'.*\[1, 1024\]"),
])
def test_a_config_json_the_encoder_cannot_take_is_named(tmp_path, hf_dir, change, words):
    import shutil

    d = tmp_path / "damaged"
    shutil.copytree(hf_dir[1], d)
    config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(ValueError, match=words) as e:
        load_vjepa2_encoder(d, progress=False)
    assert "config.json" in str(e.value)


@pytest.mark.parametrize("images, words", [
    (torch.zeros(2, 3, 16, 16), ["'images'", "[C, 3, 32, 32]"]),
    (torch.zeros(2, 30, 32, 3, dtype=torch.uint8), ["'images'", "[C, 32, 32, 3]", "resize"]),
    (torch.zeros(2, 3, 32, 32, dtype=torch.int32), ["'images'", "float"]),
    (torch.full((1, 3, 32, 32), float("nan")), ["'images'", "NaN"]),
    (None, ["'images'", "missing"]),
])
def test_bad_images_are_refused_naming_the_input(images, words):
    with pytest.raises(ValueError) as e:
        check_images(images, 32)
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def test_uint8_images_are_normalized_with_the_imagenet_statistics():
    rgb = torch.randint(0, 256, (2, 32, 32, 3), dtype=torch.uint8)
    x = check_images(rgb, 32)
    assert x.shape == (2, 3, 32, 32) and x.dtype == torch.float32
    want = (rgb[1, 5, 7, 2].float() / 255 - 0.406) / 0.225
    torch.testing.assert_close(x[1, 2, 5, 7], want)
    assert check_images(rgb[0], 32).shape == (1, 3, 32, 32)

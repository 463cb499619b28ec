"""SnacDecoder against the public `snac` package (a test dependency only): same audio from the
same weights and codes, the checkpoint formats SNAC ships, noise control, and the receptive
field that streaming decodes rely on."""

import json
import re
import math
import time

import pytest
import torch

snac = pytest.importorskip("snac")
pytest.importorskip("einops")

from mstar_rt.models.snac import (PositionalNoise, SnacConfig, SnacDecoder,  # noqa: E402
                                  load_snac)

TOL = 1e-5


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conftest.py

# Small architectures covering every branch: depthwise or not, noise or not, odd and even
# rates, window attention.
SMALL = {
    "depthwise": dict(encoder_dim=8, encoder_rates=[2, 4], decoder_dim=64,
                      decoder_rates=[4, 2], attn_window_size=None, codebook_size=64,
                      codebook_dim=4, vq_strides=[4, 2, 1], noise=True, depthwise=True),
    "plain_odd_rates": dict(encoder_dim=8, encoder_rates=[3, 2], latent_dim=24,
                            decoder_dim=96, decoder_rates=[3, 2, 2], attn_window_size=None,
                            codebook_size=64, codebook_dim=8, vq_strides=[2, 1], noise=False,
                            depthwise=False),
    "attention": dict(encoder_dim=16, encoder_rates=[2, 2], decoder_dim=128,
                      decoder_rates=[2, 2], attn_window_size=4, codebook_size=64,
                      codebook_dim=8, vq_strides=[2, 1], noise=True, depthwise=True),
}


def reference(config: dict, seed: int = 0):
    torch.manual_seed(seed)
    model = snac.SNAC(**config).eval()
    with torch.no_grad():  # trained Snake alphas are not all 1: make them matter
        for name, p in model.named_parameters():
            if name.endswith("alpha"):
                p.uniform_(0.5, 2.0)
    return model


def random_codes(config: SnacConfig, coarse_frames: int, batch: int = 2, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    s = config.latent_frames_per_coarse_frame
    return [torch.randint(0, config.codebook_size, (batch, coarse_frames * s // stride),
                          generator=g) for stride in config.vq_strides]


def snac_decode(model, codes, seed=None):
    if seed is not None:
        torch.manual_seed(seed)
    with torch.no_grad():
        return model.decode(codes)


def save_checkpoint(path, config: dict, state: dict, fmt: str = "bin"):
    path.mkdir(exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    if fmt == "bin":
        torch.save(state, path / "pytorch_model.bin")
    else:
        from safetensors.torch import save_file
        save_file({k: v.contiguous() for k, v in state.items()}, path / "model.safetensors")
    return path


def lengths_for(cfg: SnacConfig):
    return (cfg.window_alignment, 3 * cfg.window_alignment, 8 * cfg.window_alignment)


@pytest.mark.parametrize("name", sorted(SMALL))
@pytest.mark.parametrize("fmt", ["bin", "safetensors"])
def test_decode_matches_snac_with_same_seed(tmp_path, name, fmt):
    raw = SMALL[name]
    ref = reference(raw)
    ours = load_snac(save_checkpoint(tmp_path / "ckpt", raw, ref.state_dict(), fmt),
                     progress=False)
    cfg = ours.config
    for i, frames in enumerate(lengths_for(cfg)):
        codes = random_codes(cfg, frames, seed=i)
        want = snac_decode(ref, codes, seed=100 + i)
        torch.manual_seed(100 + i)
        got = ours.decode(codes)
        assert got.shape == want.shape == (2, 1, frames * cfg.samples_per_coarse_frame)
        assert torch.allclose(got, want, atol=TOL, rtol=0), (got - want).abs().max()
        latent = ref.quantizer.from_codes(codes)
        assert torch.allclose(ours.codes_to_latent(codes), latent, atol=TOL, rtol=0)


def test_unfolded_weight_norm_and_old_weight_g_v_keys_match_snac():
    raw = SMALL["depthwise"]
    ref = reference(raw)
    state = ref.state_dict()
    old = {k.replace(".parametrizations.weight.original0", ".weight_g")
           .replace(".parametrizations.weight.original1", ".weight_v"): v
           for k, v in state.items()}
    assert any(k.endswith(".weight_g") for k in old)
    again = snac.SNAC(**raw).eval()
    again.load_state_dict(old)  # torch maps the old names too: a real checkpoint format
    codes = random_codes(SnacConfig.from_dict(raw), 3)
    want = snac_decode(ref, codes, seed=5)
    for source, fold in ((state, False), (old, False), (old, True)):
        ours = SnacDecoder.from_snac_state_dict(source, SnacConfig.from_dict(raw), fold=fold)
        torch.manual_seed(5)
        assert torch.allclose(ours.decode(codes), want, atol=TOL, rtol=0)
    unfolded = SnacDecoder.from_snac_state_dict(state, SnacConfig.from_dict(raw), fold=False)
    assert set(unfolded.state_dict()) == {k for k in state if not k.startswith("encoder.")
                                          and ".in_proj." not in k}


def test_noise_off_equals_snac_with_silent_noise_blocks():
    raw = SMALL["depthwise"]
    ref = reference(raw)
    ours = SnacDecoder.from_snac_state_dict(ref.state_dict(), SnacConfig.from_dict(raw))
    codes = random_codes(ours.config, 4)
    noisy = [snac_decode(ref, codes, seed=s) for s in (1, 2)]
    assert (noisy[0] - noisy[1]).abs().max() > 1e-3  # the noise is not negligible here
    with torch.no_grad():
        for m in ref.modules():
            if type(m).__name__ == "NoiseBlock":
                m.linear.parametrizations.weight.original0.zero_()
    silent = snac_decode(ref, codes, seed=3)
    assert torch.allclose(ours.decode(codes, noise=False), silent, atol=TOL, rtol=0)
    assert torch.equal(ours.decode(codes, noise=False), ours.decode(codes, noise=False))


def test_generator_noise_equals_seeded_default_generator():
    raw = SMALL["attention"]
    ref = reference(raw)
    ours = SnacDecoder.from_snac_state_dict(ref.state_dict(), SnacConfig.from_dict(raw))
    codes = random_codes(ours.config, 4)
    want = snac_decode(ref, codes, seed=7)
    got = ours.decode(codes, noise=torch.Generator().manual_seed(7))
    assert torch.allclose(got, want, atol=TOL, rtol=0)
    other = ours.decode(codes, noise=torch.Generator().manual_seed(8))
    assert (other - want).abs().max() > 1e-3


def test_full_24khz_architecture_matches_snac():
    start = time.perf_counter()
    cfg = SnacConfig()
    ref = reference(cfg.to_dict())
    ours = SnacDecoder.from_snac_state_dict(ref.state_dict(), cfg)
    codes = random_codes(cfg, 2, batch=1)
    want = snac_decode(ref, codes, seed=11)
    torch.manual_seed(11)
    got = ours.decode(codes)
    assert got.shape == (1, 1, 2 * 2048)
    assert torch.allclose(got, want, atol=TOL, rtol=0), (got - want).abs().max()
    assert time.perf_counter() - start < 10


def test_24khz_units():
    cfg = SnacConfig()
    assert cfg.latent_dim == 768 and cfg.hop_length == 512
    assert cfg.hop_length == snac.SNAC(**cfg.to_dict()).hop_length
    assert cfg.latent_frames_per_coarse_frame == 4
    assert cfg.codes_per_coarse_frame == 7  # one Orpheus token group
    assert cfg.samples_per_coarse_frame == 2048
    assert cfg.latent_receptive_field() == (10, 10)
    assert cfg.receptive_field_frames() == (3, 3)


@pytest.mark.parametrize("name", ["depthwise", "plain_odd_rates"])
def test_latent_receptive_field_is_exact(name):
    """Changing the finest code of latent frame j changes the samples of frame f exactly when
    j is within the receptive field of f."""
    cfg = SnacConfig.from_dict(SMALL[name])
    ours = SnacDecoder.from_snac_state_dict(reference(SMALL[name]).state_dict(), cfg)
    left, right = cfg.latent_receptive_field()
    hop, frames, f = cfg.hop_length, 2 * (left + right) + 8, left + right + 4
    codes = random_codes(cfg, frames // cfg.latent_frames_per_coarse_frame + 1, batch=1)
    base = ours.decode(codes, noise=False)[0, 0, f * hop:(f + 1) * hop]
    changed = []
    for j in range(codes[-1].shape[1]):
        moved = [c.clone() for c in codes]
        moved[-1][0, j] = (moved[-1][0, j] + 1) % cfg.codebook_size
        audio = ours.decode(moved, noise=False)[0, 0, f * hop:(f + 1) * hop]
        if not torch.equal(audio, base):
            changed.append(j)
    assert changed == list(range(f - left, f + right + 1))


@pytest.mark.parametrize("name", sorted(SMALL))
def test_windowed_decode_with_receptive_field_equals_one_shot(name):
    cfg = SnacConfig.from_dict(SMALL[name])
    ours = SnacDecoder.from_snac_state_dict(reference(SMALL[name]).state_dict(), cfg)
    left, right = cfg.receptive_field_frames()
    align, spc = cfg.window_alignment, cfg.samples_per_coarse_frame
    n = left + right + 4 * align  # some windows have full context on both sides
    codes = random_codes(cfg, n, batch=1)
    s = cfg.latent_frames_per_coarse_frame

    def window(c, a, b):  # the codes of coarse frames [a, b)
        return [x[:, a * s // st: b * s // st] for x, st in zip(c, cfg.vq_strides)]

    for noise in (False, PositionalNoise(seed=3)):
        whole = ours.decode(codes, noise=noise)
        pieces = []
        for a in range(0, n, align):
            lo, hi = max(0, a - left), min(n, a + align + right)
            if isinstance(noise, PositionalNoise):
                noise = PositionalNoise(seed=3, frame_offset=lo * s)
            audio = ours.decode(window(codes, lo, hi), noise=noise)
            pieces.append(audio[..., (a - lo) * spc:(a - lo + align) * spc])
        assert torch.allclose(torch.cat(pieces, dim=-1), whole, atol=TOL, rtol=0)


def test_full_24khz_windowed_decode_with_3_coarse_frames_of_context_is_exact():
    cfg = SnacConfig()
    ours = SnacDecoder.from_snac_state_dict(reference(cfg.to_dict()).state_dict(), cfg)
    n, spc, s = 8, cfg.samples_per_coarse_frame, cfg.latent_frames_per_coarse_frame
    codes = random_codes(cfg, n, batch=1)
    whole = ours.decode(codes, noise=PositionalNoise(seed=5))
    for a in range(n):
        lo, hi = max(0, a - 3), min(n, a + 4)
        piece = ours.decode([c[:, lo * s // st: hi * s // st]
                             for c, st in zip(codes, cfg.vq_strides)],
                            noise=PositionalNoise(seed=5, frame_offset=lo * s))
        got = piece[..., (a - lo) * spc:(a - lo + 1) * spc]
        assert torch.allclose(got, whole[..., a * spc:(a + 1) * spc], atol=TOL, rtol=0)


def test_positional_noise_is_reproducible_and_per_row():
    raw = SMALL["depthwise"]
    ours = SnacDecoder.from_snac_state_dict(reference(raw).state_dict(),
                                            SnacConfig.from_dict(raw))
    codes = random_codes(ours.config, 3)
    a = ours.decode(codes, noise=PositionalNoise(seed=(1, 2)))
    assert torch.equal(a, ours.decode(codes, noise=PositionalNoise(seed=(1, 2))))
    b = ours.decode(codes, noise=PositionalNoise(seed=(1, 9)))
    assert torch.equal(a[0], b[0]) and not torch.equal(a[1], b[1])
    with pytest.raises(ValueError, match="3 values for 2 rows"):
        ours.decode(codes, noise=PositionalNoise(seed=(1, 2, 3)))


def test_checkpoint_errors(tmp_path):
    raw = SMALL["depthwise"]
    state = reference(raw).state_dict()
    extra = dict(state, **{"decoder.model.9.bogus": torch.zeros(1)})
    with pytest.raises(ValueError, match="1 unknown keys: decoder.model.9.bogus"):
        load_snac(save_checkpoint(tmp_path / "extra", raw, extra), progress=False)
    missing = {k: v for k, v in state.items() if k != "decoder.model.2.block.0.alpha"}
    with pytest.raises(ValueError, match="1 missing parameters: decoder.model.2.block.0.alpha"):
        SnacDecoder.from_snac_state_dict(missing, SnacConfig.from_dict(raw))
    wrong = dict(raw, codebook_size=32)
    with pytest.raises(ValueError, match=r"shape mismatches: .*codebook.weight \(64, 4\) "
                                         r"\(expected \(32, 4\)\)"):
        load_snac(save_checkpoint(tmp_path / "wrong", wrong, state), progress=False)
    with pytest.raises(ValueError, match="unknown SNAC config fields \\['hop'\\]"):
        SnacConfig.from_dict(dict(raw, hop=512))
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.json").write_text(json.dumps(raw))
    with pytest.raises(FileNotFoundError, match="no SNAC weights"):
        load_snac(tmp_path / "empty", progress=False)
    folded = SnacDecoder.from_snac_state_dict(state, SnacConfig.from_dict(raw))
    with pytest.raises(ValueError, match="before fold_weight_norm"):
        folded.load_snac_state_dict(state)
    # cast without a word before: a bool codebook became all zeros
    codebook = "quantizer.quantizers.0.codebook.weight"
    for dtype in (torch.bool, torch.int8):
        damaged = dict(state, **{codebook: state[codebook].to(dtype)})
        with pytest.raises(ValueError, match=rf"not floating point: {re.escape(codebook)} "
                                             rf"\({dtype}\)"):
            load_snac(save_checkpoint(tmp_path / str(dtype), raw, damaged), progress=False)
    bad = save_checkpoint(tmp_path / "bad", raw, state)
    for content, words in ((b"not a zip", "not a readable PyTorch state dict"),
                           (None, "holds a list, not a state dict")):
        if content is None:
            torch.save([1, 2], bad / "pytorch_model.bin")
        else:
            (bad / "pytorch_model.bin").write_bytes(content)
        with pytest.raises(ValueError, match=words):
            load_snac(bad, progress=False)


def test_code_errors():
    raw = SMALL["attention"]
    ours = SnacDecoder.from_snac_state_dict(reference(raw).state_dict(),
                                            SnacConfig.from_dict(raw))
    good = random_codes(ours.config, 2)
    with pytest.raises(ValueError, match="needs 2 code tensors"):
        ours.decode(good[:1])
    with pytest.raises(ValueError, match="disagree on batch or length"):
        ours.decode([good[0], good[1][:, :-2]])
    with pytest.raises(ValueError, match="must be an integer tensor"):
        ours.decode([good[0].float(), good[1]])
    with pytest.raises(ValueError, match=r"must lie in \[0, 64\)"):
        ours.decode([good[0], good[1] + 64])
    with pytest.raises(ValueError, match="multiple of 4 latent frames"):
        ours.decode([good[0][:, :1], good[1][:, :2]])  # 2 latent frames
    with pytest.raises(TypeError, match="noise must be"):
        ours.decode(good, noise="random")
    assert math.prod(ours.config.decoder_rates) == ours.hop_length

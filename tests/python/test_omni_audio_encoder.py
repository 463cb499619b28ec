"""Qwen3-Omni's audio encoder against transformers' ``audio_tower``: audios shorter than a
chunk, exactly one chunk, several chunks with a tail, longer than one attention window, several
in one call; the output-length rule; batch independence (where transformers' padding is not);
parameter names as the checkpoint writes them; config errors that name the field."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from mstar_rt.models.qwen3_omni.audio_encoder import (AudioEncoder,  # noqa: E402
                                                      feature_output_length)

import omni_tiny  # noqa: E402

TOL = 1e-4  # float32 against transformers
PREFIX = "thinker.audio_tower."
# under a chunk, one frame, exactly one chunk, chunks + tail, > n_window_infer (800): 2 windows
FRAMES = [37, 1, 100, 230, 1234]

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conftest.py


@pytest.fixture(scope="module")
def hf():
    """The tiny model's audio tower with its matrices scaled up (so attention is sharp and a
    slip shows far beyond TOL) and non-zero biases (random init zeroes them; a conv bias is
    what makes padding frames leak into the last valid ones)."""
    m = omni_tiny.model()
    tower = m.thinker.model.audio_tower
    with torch.no_grad():
        for name, p in tower.named_parameters():
            if p.dim() >= 2:
                p.mul_(4.0)
            elif name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.3)
    return m


@pytest.fixture(scope="module")
def encoder(hf) -> AudioEncoder:
    ours = AudioEncoder.from_hf(hf.config.thinker_config.audio_config.to_dict())
    ours.load_state_dict(hf.thinker.model.audio_tower.state_dict(), strict=True)
    return ours.eval()


def reference(hf, mels: list[torch.Tensor]) -> torch.Tensor:
    """transformers' encoder on ``mels`` in one call (all embeddings concatenated)."""
    with torch.no_grad():
        return hf.thinker.model.audio_tower(
            input_features=torch.cat(mels, dim=1),
            feature_lens=torch.tensor([m.shape[1] for m in mels])).last_hidden_state


@pytest.mark.parametrize("frames", FRAMES)
def test_one_audio_matches_transformers(hf, encoder, frames):
    mel = omni_tiny.mel(frames)
    with torch.no_grad():
        (ours,) = encoder([mel])
    theirs = reference(hf, [mel])
    assert ours.shape == theirs.shape == (omni_tiny.audio_tokens(frames), 32)
    assert theirs.abs().max() > 0.1  # not a degenerate instance
    torch.testing.assert_close(ours, theirs, atol=TOL, rtol=0)


def test_several_audios_in_one_call_match_each_alone(hf, encoder):
    mels = [omni_tiny.mel(1234, seed=1), omni_tiny.mel(37, seed=2), omni_tiny.mel(230, seed=3),
            omni_tiny.mel(100, seed=4)]
    with torch.no_grad():
        ours = encoder(mels)
    for mel, out in zip(mels, ours):
        torch.testing.assert_close(out, reference(hf, [mel]), atol=TOL, rtol=0)
    # Audios of at least one chunk: also what transformers gives for them batched together.
    long = [mels[0], mels[2], mels[3]]
    torch.testing.assert_close(torch.cat([ours[0], ours[2], ours[3]]), reference(hf, long),
                               atol=TOL, rtol=0)


def test_a_short_audio_does_not_depend_on_its_batch_mates(hf, encoder):
    """transformers pads every chunk of a call to the longest, and the padding leaks into the
    last frames through the conv biases; we pad each audio as if alone."""
    short, long = omni_tiny.mel(37, seed=2), omni_tiny.mel(230, seed=3)
    with torch.no_grad():
        alone = encoder([short])[0]
        mixed = encoder([long, short])[1]
    torch.testing.assert_close(mixed, alone, atol=1e-6, rtol=0)
    theirs_mixed = reference(hf, [long, short])[-alone.shape[0]:]
    assert (theirs_mixed - reference(hf, [short])).abs().max() > 1e-6


def test_output_length_matches_transformers(encoder):
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
        _get_feat_extract_output_lengths)

    frames = torch.arange(1, 2500)
    theirs = _get_feat_extract_output_lengths(frames).tolist()
    assert [encoder.output_length(int(n)) for n in frames] == theirs
    assert feature_output_length(200, n_window=100) == 25  # one chunk of 200 frames


def test_empty_call_and_bad_features(encoder):
    assert encoder([]) == []
    with pytest.raises(ValueError, match=r"audio 1 .*\[128, frames\]"):
        encoder([omni_tiny.mel(10), torch.zeros(80, 10)])
    with pytest.raises(ValueError, match="audio 0"):
        encoder([torch.zeros(128, 0)])


def test_parameter_names_are_the_checkpoints(hf, encoder, tmp_path):
    from safetensors import safe_open

    omni_tiny.save(hf, str(tmp_path))
    keys = set()
    for f in tmp_path.glob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            keys |= {k[len(PREFIX):] for k in st.keys() if k.startswith(PREFIX)}
    assert keys == set(encoder.state_dict())


def test_built_on_meta_then_loaded_matches(hf, encoder):
    """The loader's path: build on meta, ``to_empty``, load, ``init_buffers``."""
    with torch.device("meta"):
        ours = AudioEncoder.from_hf(hf.config.thinker_config.audio_config.to_dict())
    ours = ours.to_empty(device="cpu")
    ours.load_state_dict(encoder.state_dict(), strict=True)
    ours.init_buffers()
    mel = omni_tiny.mel(230)
    with torch.no_grad():
        torch.testing.assert_close(ours.eval()([mel])[0], encoder([mel])[0], atol=0, rtol=0)


@pytest.mark.parametrize("change, field", [
    (dict(encoder_attention_heads=3), "d_model"),
    (dict(n_window_infer=60), "n_window_infer"),
    (dict(activation_function="swish"), "activation_function"),
    (dict(encoder_layers="2"), "encoder_layers"),
    (dict(d_model=0), "d_model"),
    (dict(max_source_positions=5), "max_source_positions"),
])
def test_config_errors_name_the_field(hf, change, field):
    config = {**hf.config.thinker_config.audio_config.to_dict(), **change}
    with pytest.raises(ValueError, match=f"'{field}'"):
        AudioEncoder.from_hf(config)

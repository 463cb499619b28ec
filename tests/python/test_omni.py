"""Qwen3-Omni on the runtime equals transformers' ``generate`` (tiny random model, greedy, loaded
from a ``save_pretrained`` directory in the hub layout): thinker tokens identical, codec frames
identical, waveform within 1e-4 -- for text in, audio in, and requests of different lengths run
concurrently (batched by the engines); the streamed waveform equals one-shot decoding."""

from __future__ import annotations

import numpy as np
import pytest

import mstar_rt
from mstar_rt.models.qwen3_omni.checkpoint import load_qwen3_omni
from mstar_rt.models.qwen3_omni.code2wav_stream import decode_one_shot
from mstar_rt.models.qwen3_omni.omni import Qwen3Omni

import omni_tiny as ot

GREEDY_TALKER = {"temperature": 0.0, "max_tokens": 40}


@pytest.fixture(scope="module")
def hf():
    return ot.model()


@pytest.fixture(scope="module")
def omni(hf, tmp_path_factory):
    path = ot.save(hf, str(tmp_path_factory.mktemp("omni")))
    return Qwen3Omni(load_qwen3_omni(path, progress=False))


def _reference(hf, prompt, features=None, speaker="ethan"):
    """transformers' generate: (thinker tokens, codec frames [T, G], waveform)."""
    captured = {}
    decode = hf.code2wav.chunked_decode

    def capture(codes, **kw):
        captured["codes"] = codes.clone()
        return decode(codes, **kw)

    hf.code2wav.chunked_decode = capture
    try:
        seq, wav = ot.generate(hf, prompt, features, speaker=speaker)
    finally:
        del hf.code2wav.chunked_decode
    return (seq[0, len(prompt):].tolist(), captured["codes"][0].T.numpy(),
            wav.reshape(-1).numpy())


def _inputs(prompt, features=None, speaker="ethan"):
    return {"prompt": prompt, "speaker": speaker,
            "audio_features": [] if features is None else [features.numpy()],
            "thinker_sampling": {"max_tokens": 12}, "talker_sampling": GREEDY_TALKER}


def _collect(handle):
    out = list(handle)
    audio = [v for k, v in out if k == "audio"]
    return [v for k, v in out if k == "token"], (np.concatenate(audio) if audio else
                                                 np.zeros(0, np.float32))


def _frames(omni, monkeypatch):
    """Records the frames the code predictor finishes, per request."""
    from mstar_rt.models.qwen3_omni import talker_node

    frames: dict = {}
    forward = talker_node.PredictorNode.forward

    def spy(self, batch):
        out = forward(self, batch)
        for (state, _, _), o in zip(batch, out):
            if "frame" in o:
                frames.setdefault(id(state), []).append(o["frame"][0])
        return out

    monkeypatch.setattr(talker_node.PredictorNode, "forward", spy)
    return frames


def _check(omni, got, ref, frames=None):
    tokens, audio = got
    ref_tokens, ref_codes, ref_wav = ref
    assert tokens == ref_tokens
    if frames is not None:
        assert np.array_equal(np.stack(frames), ref_codes)
    assert audio.shape == ref_wav.shape
    assert np.abs(audio - ref_wav).max() < 1e-4
    assert np.abs(ref_wav).max() > 0.05  # loud enough for the tolerance to mean something
    # streamed == one-shot decoding of the same frames
    one = decode_one_shot(omni.weights.code2wav, ref_codes)
    assert np.abs(audio - one).max() < 1e-5


def test_text_in_text_and_audio_out_equal_transformers(hf, omni, monkeypatch):
    frames = _frames(omni, monkeypatch)
    prompt = ot.chat_prompt([72, 105, 33])
    with mstar_rt.Runtime(omni) as rt:
        got = _collect(rt.submit(_inputs(prompt)))
    _check(omni, got, _reference(hf, prompt), next(iter(frames.values())))


def test_audio_in_text_and_audio_out_equal_transformers(hf, omni):
    features = ot.mel(230)
    prompt = ot.chat_prompt([72], audio_frames=230)
    with mstar_rt.Runtime(omni) as rt:
        got = _collect(rt.submit(_inputs(prompt, features)))
    _check(omni, got, _reference(hf, prompt, features))


def test_requests_of_different_lengths_batched_equal_each_alone(hf, omni):
    cases = [(ot.chat_prompt([72, 105, 33, 44, 50, 61]), None, "ethan"),
             (ot.chat_prompt([9]), None, "chelsie"),
             (ot.chat_prompt([72, 7], audio_frames=130), ot.mel(130, seed=3), "ethan")]
    with mstar_rt.Runtime(omni) as rt:
        handles = [rt.submit(_inputs(p, f, s)) for p, f, s in cases]
        got = [_collect(h) for h in handles]
        steps = list(rt.engines["talker"].step_sizes)
    for (p, f, s), g in zip(cases, got):
        _check(omni, g, _reference(hf, p, f, s))
    assert max(steps) > 1, "the talker never batched two requests"


def test_text_only_walk_equals_the_thinker(hf, omni):
    prompt = ot.chat_prompt([72, 105, 33])
    with mstar_rt.Runtime(omni) as rt:
        out = list(rt.submit({**_inputs(prompt), "return_audio": False}))
    assert [k for k, _ in out] == ["token"] * len(out)
    assert [v for _, v in out] == _reference(hf, prompt)[0]


def test_cancel_frees_both_kv_caches(omni):
    prompt = ot.chat_prompt([72, 105, 33])
    with mstar_rt.Runtime(omni) as rt:
        h = rt.submit({**_inputs(prompt), "thinker_sampling": {"max_tokens": 200},
                       "talker_sampling": {"temperature": 0.0, "max_tokens": 400}})
        for name, _ in h:
            if name == "audio":
                break
        h.cancel()
        thinker, talker = rt.engines["thinker"].cache, rt.engines["talker"].cache
        ot_wait = __import__("walk_models").wait_until
        assert ot_wait(lambda: not thinker.holders() and not talker.holders(), 10)


def test_bad_input_names_what_to_fix(omni):
    with mstar_rt.Runtime(omni) as rt:
        with pytest.raises(ValueError, match="speaker"):
            rt.submit({**_inputs(ot.chat_prompt([1])), "speaker": "nobody"})
        with pytest.raises(ValueError, match="talker_sampling"):
            rt.submit({**_inputs(ot.chat_prompt([1])), "talker_sampling": {"top_p": 3}})
        h = rt.submit({**_inputs(ot.chat_prompt([1], audio_frames=100))})  # no audio given
        with pytest.raises(RuntimeError, match="audio placeholders"):
            list(h)
        # the runtime still serves
        assert _collect(rt.submit(_inputs(ot.chat_prompt([72]))))[0]


def test_a_reply_ended_by_its_first_token_skips_the_decode_walk_and_says_nothing(omni):
    """The thinker Part's state machine: after prefill, decode only if the reply goes on; the
    talker then hears the thinker's streams end and speaks nothing."""
    prompt = ot.chat_prompt([72, 105, 33])
    chosen = []
    choose = Qwen3Omni.next_part_walk

    def spy(self, request, part, finished):
        walk = choose(self, request, part, finished)
        chosen.append((part, finished, walk))
        return walk

    with mstar_rt.Runtime(omni) as rt:
        Qwen3Omni.next_part_walk = spy
        try:
            out = list(rt.submit({**_inputs(prompt), "max_tokens": 1}))
        finally:
            Qwen3Omni.next_part_walk = choose
        assert not rt.engines["thinker"].cache.holders()
        assert not rt.engines["talker"].cache.holders()
    assert [k for k, _ in out] == ["token"]  # no frame, so no audio (not an empty chunk)
    assert ("thinker", "prefill", None) in chosen and ("thinker", None, "prefill") in chosen
    assert not any(w == "decode" for _, _, w in chosen)

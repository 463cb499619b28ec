"""WhisperASR on a tiny random Whisper checkpoint saved here (with a byte-level BPE tokenizer
that has Whisper's special tokens): recognize() gives exactly what feature extraction +
generate + decode give, with and without a forced language; bad audio (stereo, integer PCM,
empty, too long, NaN) and incomplete checkpoints fail with errors saying what to do; as the
agent's ASR, a bad utterance fails only its own reply request."""

from __future__ import annotations

import numpy as np
import pytest
from virtual_audio import require_tool

pytest.importorskip("transformers")

import mstar_rt  # noqa: E402
from mstar_rt.audio.whisper import WhisperASR  # noqa: E402
from tiny_checkpoints import whisper_dir  # noqa: E402

NEW = 12


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conftest.py


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("whisper")
    model, tokenizer = whisper_dir(path)
    return path, model, tokenizer


def _speechlike(seconds: float, seed: int = 0) -> np.ndarray:
    """A voiced-sounding test signal: harmonics of a gliding pitch under a syllable envelope."""
    t = np.arange(int(16000 * seconds)) / 16000
    f0 = 120 + 40 * np.sin(2 * np.pi * 0.7 * t)
    phase = 2 * np.pi * np.cumsum(f0) / 16000
    x = sum(np.sin(k * phase) / k for k in range(1, 8)) * (0.5 + 0.5 * np.sin(2 * np.pi * 3 * t))
    x += 0.01 * np.random.default_rng(seed).standard_normal(len(t))
    return (0.2 * x).astype(np.float32)


def _reference(path, model, tokenizer, x: np.ndarray, **kw) -> str:
    from transformers import WhisperFeatureExtractor

    feats = WhisperFeatureExtractor.from_pretrained(path)(x, sampling_rate=16000,
                                                          return_tensors="pt")
    ids = model.generate(feats.input_features, max_new_tokens=NEW, do_sample=False, **kw)
    return tokenizer.decode(ids[0], skip_special_tokens=True).strip()


def test_recognize_is_features_generate_decode(checkpoint):
    path, model, tokenizer = checkpoint
    asr = WhisperASR(path, max_new_tokens=NEW)
    assert asr.sample_rate == 16000
    for seconds, seed in ((1.5, 0), (3.0, 1)):
        x = _speechlike(seconds, seed)
        got = asr.recognize(x)
        assert got.text == _reference(path, model, tokenizer, x) and got.text
        assert 0.0 < got.confidence <= 1.0 and got.seconds > 0
        assert asr.recognize(x.astype(np.float64)).text == got.text  # any float dtype
        assert asr.recognize(x[:, None]).text == got.text  # one channel, as a column
    forced = WhisperASR(path, language="en", max_new_tokens=NEW)
    x = _speechlike(2.0, 2)
    assert forced.recognize(x).text == _reference(path, model, tokenizer, x, language="en",
                                                  task="transcribe")


def test_bad_audio_and_checkpoints_say_what_to_fix(checkpoint, tmp_path):
    path, _, _ = checkpoint
    asr = WhisperASR(path, max_new_tokens=NEW)
    x = _speechlike(1.0)
    with pytest.raises(ValueError, match="mono.*mix"):
        asr.recognize(np.stack([x, x], axis=1))
    with pytest.raises(TypeError, match="divide int16 PCM by 32768"):
        asr.recognize((x * 32767).astype(np.int16))
    with pytest.raises(ValueError, match="empty audio"):
        asr.recognize(np.zeros(0, np.float32))
    with pytest.raises(ValueError, match="at most 30 s"):
        asr.recognize(np.zeros(16000 * 31, np.float32))
    with pytest.raises(ValueError, match="NaN"):
        asr.recognize(np.full(1600, np.nan, np.float32))
    with pytest.raises(FileNotFoundError, match="config.json or tokenizer.json"):
        WhisperASR(tmp_path)


def test_whisper_as_the_agents_asr_fails_only_the_bad_request(checkpoint):
    from mstar_rt.audio.agent import CommandResponder, ReplyModel
    from mstar_rt.audio.tts import EspeakTTS

    path, model, tokenizer = checkpoint
    require_tool("espeak-ng")
    tts = EspeakTTS()
    asr = WhisperASR(path, max_new_tokens=NEW)
    x = _speechlike(1.5)
    with mstar_rt.Runtime(ReplyModel(asr, CommandResponder(), tts), poll_s=0.01) as rt:
        with pytest.raises(mstar_rt.runtime.RequestFailed, match="empty audio"):
            rt.submit({"audio": np.zeros(0, np.float32)}).result(timeout=60)
        got = rt.submit({"audio": x}).result(timeout=60)
        assert got["text"] == [_reference(path, model, tokenizer, x)]
        assert got["reply"] and got["audio_out"]

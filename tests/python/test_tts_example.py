"""examples/voice/tts.py runs end to end with the tiny random model and writes the streamed
audio as a WAV file: 24 kHz, mono, 16-bit, one 2048-sample frame per 7 tokens, not silent."""

import pathlib
import re
import subprocess
import sys
import wave

import numpy as np
import pytest

pytest.importorskip("torch")

ROOT = pathlib.Path(__file__).resolve().parents[2]


def run_example(tmp_path: pathlib.Path, *args: str) -> str:
    result = subprocess.run([sys.executable, str(ROOT / "examples/voice/tts.py"), *args],
                            capture_output=True, cwd=tmp_path, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def read_wav(path: pathlib.Path) -> tuple[wave._wave_params, np.ndarray]:
    with wave.open(str(path)) as w:
        return w.getparams(), np.frombuffer(w.readframes(w.getnframes()), "<i2")


def test_tts_example_writes_the_streamed_audio_to_a_wav(tmp_path):
    fixed = tmp_path / "fixed.wav"
    out = run_example(tmp_path, "--token-ids", "72,105", "--max-tokens", "70", "--ignore-eos",
                      "--out", str(fixed))
    params, pcm = read_wav(fixed)
    assert (params.framerate, params.nchannels, params.sampwidth) == (24000, 1, 2)
    assert params.nframes == 10 * 2048  # 70 tokens = 10 frames
    assert np.abs(pcm).max() > 0
    for key in ("time to first audio", "real-time factor", "audio chunks", "streaming viable"):
        assert key in out, out
    assert "(10 frames)" in out and "tokens generated     70" in out

    spoken = tmp_path / "text.wav"
    out = run_example(tmp_path, "Hello there", "--out", str(spoken), "--seed", "3")
    frames = int(re.search(r"\((\d+) frames\)", out).group(1))
    params, pcm = read_wav(spoken)
    assert frames > 0 and params.nframes == frames * 2048

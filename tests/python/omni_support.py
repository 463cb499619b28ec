"""Helpers for the omni chat tests: the tiny character-level tokenizer of the tiny Qwen3-Omni
(ids as in omni_tiny: characters below 200, the chat specials from 200), and FakeOmni, a model
that follows the Qwen3-Omni request contract with a trivial walk, for the serving tests.

FakeOmni's answer is the last user message's text, preceded by ``[F]`` for each of that
message's audios (F its mel frames); it EMITs one ``token`` per character, then ``<|im_end|>``
(unless ``max_tokens`` cuts it short), and with ``return_audio`` one ``audio`` chunk of
:data:`SAMPLES_PER_TOKEN` samples per text token (a sine whose amplitude tells the speaker)."""

from __future__ import annotations

import threading
import time
from typing import Any, Mapping, Optional

import numpy as np

from mstar_rt import EMIT, DynamicLoop, GraphEdge, GraphNode, Model, NodeSubmodule
from mstar_rt.models.qwen3_omni.chat import ChatTokens, audio_output_length

# The ids of omni_tiny (which imports torch; these are plain numbers).
IM_START, IM_END, AUDIO, AUDIO_START, AUDIO_END = 200, 201, 202, 203, 204
IMAGE, VIDEO, VISION_START = 205, 206, 207
TTS_PAD, TTS_BOS, TTS_EOS = 208, 209, 210
SYSTEM, USER, ASSISTANT, NEWLINE = 211, 212, 213, 10
SPECIALS = {"<|im_start|>": IM_START, "<|im_end|>": IM_END, "<|audio_pad|>": AUDIO,
            "<|audio_start|>": AUDIO_START, "<|audio_end|>": AUDIO_END,
            "<|image_pad|>": IMAGE, "<|video_pad|>": VIDEO, "<|vision_start|>": VISION_START,
            "<|tts_pad|>": TTS_PAD, "<|tts_bos|>": TTS_BOS, "<|tts_eos|>": TTS_EOS}
ROLE_WORDS = {"system": SYSTEM, "user": USER, "assistant": ASSISTANT}
TOKENS = ChatTokens(im_start=IM_START, im_end=IM_END, system=SYSTEM, user=USER,
                    assistant=ASSISTANT, audio=AUDIO, audio_start=AUDIO_START,
                    audio_end=AUDIO_END, newline_ids=(NEWLINE,))
SPEAKERS = ("ethan", "chelsie")
SAMPLE_RATE = 24000
SAMPLES_PER_TOKEN = 480  # 20 ms of audio per text token


def tiny_tokenizer() -> Any:
    """A ``tokenizers.Tokenizer``: one id per character (its code point, 1..199; anything else
    is ``<unk>`` = 0), Qwen's special tokens at omni_tiny's ids, and the role words as single
    vocabulary entries (never produced from text, found by ``token_to_id``). Save it with
    ``.save(dir + "/tokenizer.json")``."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    vocab = {chr(i): i for i in range(1, 200)}
    vocab["<unk>"] = 0
    vocab.update(SPECIALS)
    vocab.update(ROLE_WORDS)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    return tok


class _Talk(NodeSubmodule):
    """Iteration i EMITs the answer's i-th token (and its audio chunk); stops after the last."""

    max_batch = 8

    def __init__(self, model: "FakeOmni") -> None:
        self.model = model

    def prepare_inputs(self, ctx: Any, inputs: dict) -> Any:
        state = ctx.request.state
        if "answer" not in state:
            state["answer"] = self.model.answer(inputs)
            self.model.seen.append(dict(inputs))
        return state["answer"], ctx.iteration, inputs

    def forward(self, batch: list) -> list:
        m = self.model
        if m.hold:
            m.holding += 1
            m.release.wait(20)
        if m.step_s:
            time.sleep(m.step_s)
        out = []
        for answer, i, x in batch:
            if m.fail_at is not None and i == m.fail_at:
                raise RuntimeError(f"step {i} failed on purpose")
            token = answer[i]
            item: dict[str, Any] = {"token": token}
            if x["return_audio"] and token != IM_END:
                amp = 0.1 * (1 + SPEAKERS.index(x["speaker"] or SPEAKERS[0]))
                t = np.arange(SAMPLES_PER_TOKEN) / SAMPLE_RATE
                item["audio"] = (amp * np.sin(2 * np.pi * 440 * t)).astype(np.float32)
            out.append(item)
        return out

    def check_stop(self, batch: list, outputs: list) -> list:
        return [("talk",) if i + 1 >= len(answer) else () for answer, i, _ in batch]


class FakeOmni(Model):
    """A stand-in for ``mstar_rt.models.qwen3_omni.omni.Qwen3Omni`` with its request inputs,
    EMITs and attributes. ``step_s`` slows each step; ``hold`` makes steps wait for
    :attr:`release`; ``fail_at`` fails that step; :attr:`seen` records every request's
    inputs."""

    inputs = ("prompt", "audio_features", "speaker", "return_audio", "max_tokens",
              "max_audio_frames", "thinker_sampling", "talker_sampling",
              "code_predictor_sampling")
    input_defaults = {"audio_features": [], "speaker": None, "return_audio": True,
                      "max_tokens": 64, "max_audio_frames": 1024, "thinker_sampling": None,
                      "talker_sampling": None, "code_predictor_sampling": None}
    speakers = SPEAKERS
    sample_rate = SAMPLE_RATE
    tokens = TOKENS

    def __init__(self, step_s: float = 0.0, fail_at: Optional[int] = None) -> None:
        self.tokenizer = tiny_tokenizer()
        self.step_s, self.fail_at = step_s, fail_at
        self.hold = False
        self.holding = 0
        self.release = threading.Event()
        self.seen: list[dict] = []
        self.nodes = [GraphNode("talk", list(self.inputs),
                                [GraphEdge(EMIT, "token"), GraphEdge(EMIT, "audio")],
                                submodule=_Talk(self))]
        self.walks = {"talk": DynamicLoop("talk", 4096, "talk")}

    def audio_output_length(self, frames: int) -> int:
        return audio_output_length(frames)

    def answer(self, inputs: Mapping[str, Any]) -> list[int]:
        prompt = list(inputs["prompt"])
        starts = [i for i in range(len(prompt) - 1)
                  if prompt[i] == IM_START and prompt[i + 1] == USER]
        if not starts:  # no user turn: nothing to answer
            return [IM_END]
        start = starts[-1]
        end = prompt.index(IM_END, start)
        turn = prompt[start + 3:end]
        text = [t for t in turn if t not in (AUDIO, AUDIO_START, AUDIO_END)]
        runs = turn.count(AUDIO_START)
        before = len([1 for i in range(start) if prompt[i] == AUDIO_START])
        frames = [f.shape[1] for f in inputs["audio_features"][before:before + runs]]
        ids = [int(i) for f in frames for i in self.tokenizer.encode(f"[{f}]").ids] + text
        return (ids + [IM_END])[:inputs["max_tokens"]]

    def validate_inputs(self, inputs: Mapping[str, Any]) -> None:
        prompt = inputs["prompt"]
        if (not isinstance(prompt, list) or not prompt
                or not all(isinstance(t, int) and 0 <= t < 256 for t in prompt)):
            raise ValueError("'prompt' must be a non-empty list of token ids below 256")
        if prompt[-3:] != [IM_START, ASSISTANT, NEWLINE]:
            raise ValueError("'prompt' must end with the assistant header")
        feats = inputs["audio_features"]
        runs = _audio_runs(prompt)
        if len(runs) != len(feats):
            raise ValueError(f"the prompt has {len(runs)} audio slots but {len(feats)} "
                             "audio_features")
        for n, f in zip(runs, feats):
            if (not isinstance(f, np.ndarray) or f.dtype != np.float32 or f.ndim != 2
                    or f.shape[0] != 128):
                raise ValueError("each audio_features entry must be float32 [128, frames]")
            if n != self.audio_output_length(f.shape[1]):
                raise ValueError(f"an audio slot has {n} placeholders, but {f.shape[1]} frames "
                                 f"need {self.audio_output_length(f.shape[1])}")
        speaker = inputs["speaker"]
        if speaker is not None and speaker not in SPEAKERS:
            raise ValueError(f"unknown speaker {speaker!r}")
        if not isinstance(inputs["max_tokens"], int) or inputs["max_tokens"] < 1:
            raise ValueError("'max_tokens' must be a positive integer")
        for k in ("thinker_sampling", "talker_sampling", "code_predictor_sampling"):
            if inputs[k] is not None and not isinstance(inputs[k], dict):
                raise ValueError(f"'{k}' must be None or a dict")


def _audio_runs(prompt: list[int]) -> list[int]:
    """The placeholder count of each ``<|audio_start|> ... <|audio_end|>`` run, in order."""
    runs, n = [], None
    for t in prompt:
        if t == AUDIO_START:
            n = 0
        elif t == AUDIO and n is not None:
            n += 1
        elif t == AUDIO_END and n is not None:
            runs.append(n)
            n = None
    return runs


def tiny_qwen3_omni(directory: str, seed: int = 0, hf: Any = None) -> Any:
    """The real model on the tiny random checkpoint: omni_tiny's weights (or ``hf``'s) and
    :func:`tiny_tokenizer` saved in ``directory`` and loaded as a checkpoint is."""
    import omni_tiny
    from mstar_rt.models.qwen3_omni.omni import Qwen3Omni

    omni_tiny.save(hf if hf is not None else omni_tiny.model(seed), directory)
    tiny_tokenizer().save(f"{directory}/tokenizer.json")
    return Qwen3Omni.from_pretrained(directory, progress=False)

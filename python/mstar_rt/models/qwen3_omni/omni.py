"""Qwen3-Omni as walk graphs: hears text and audio, answers in text and speech.

Walk ``speak`` (``return_audio``, the default) runs the thinker and the talker side by side,
each an independent loop with its own stop, joined by streams::

    Parallel(
      Part("thinker", {"prefill": Sequential("audio_encoder", "thinker_prefill"),
                       "decode": DynamicLoop("thinker_decode", "think")}),
      Part("talker", {"speak": DynamicLoop(Sequential("talker",
                                                      Loop("code_predictor", G - 1)), "talk")}),
      "code2wav")

The thinker and talker are :class:`~mstar_rt.graph.Part` s: each advances on its own, and the
model's state machine picks each part's walks (:meth:`Qwen3Omni.next_part_walk`: the thinker
decodes only if its first token did not already end the reply).

* ``thinker_prefill`` --prompt_states--> ``talker`` and ``thinker_decode`` --reply--> ``talker``:
  ``Fixed(1)`` streams read one window per talker iteration, ``continue_after_done`` (the
  talker goes on speaking after the thinker is done);
* ``talker`` --frame_codes--> ``code2wav``: a stream of ``G``-code frames under a ``Ramp``
  policy (small first windows: the first audio comes after 2 frames), decoded sample-exact.

Walk ``text`` (``return_audio=False``) runs the thinker's Part alone. Every thinker token is EMITted as
``token`` while it is made, and ``audio`` (float32, 24 kHz) as code2wav decodes it.

Sampling is per part: ``thinker_sampling``, ``talker_sampling`` (default: transformers'
temperature 0.9, top-k 50, repetition penalty 1.05) and ``code_predictor_sampling`` (default:
greedy when the talker is, else top-k 50 / top-p 0.8), each a SamplingParams or a dict.
"""

from __future__ import annotations

import os
from typing import Any, Mapping, Optional, Union

import torch

from mstar_rt.engines.kv_engine import KVCacheEngine
from mstar_rt.graph import (EMIT, DynamicLoop, GraphEdge, GraphNode, Loop, Parallel, Part,
                            Sequential, StreamingGraphEdge)
from mstar_rt.model import Model, RequestContext
from mstar_rt.models.causal_lm import as_params
from mstar_rt.models.qwen3_omni.checkpoint import Qwen3OmniWeights, load_qwen3_omni
from mstar_rt.models.qwen3_omni.code2wav_stream import Code2WavStreamNode
from mstar_rt.models.qwen3_omni.talker_node import TALK, PredictorNode, TalkerNode
from mstar_rt.models.qwen3_omni.thinker_node import THINK, AudioEncoderNode, ThinkerNode
from mstar_rt.streaming import Fixed

SAMPLE_RATE = 24000


class Qwen3Omni(Model):
    """Serves loaded Qwen3-Omni modules (:func:`load_qwen3_omni` or :meth:`from_pretrained`).

    Inputs: ``prompt`` (chat-formatted token ids ending with the assistant header;
    :func:`~mstar_rt.models.qwen3_omni.chat.format_chat` makes them), ``audio_features`` (one
    ``[128, frames]`` log-mel array per audio placeholder run), ``speaker``, ``return_audio``,
    ``max_tokens``, ``max_audio_frames`` and the three sampling settings.
    ``audio_policy``: how code2wav cuts the frame stream (default
    ``Code2WavStreamNode.first_audio_policy()``: ``Ramp([2, 4, 8], 12)``)."""

    inputs = ("prompt", "audio_features", "speaker", "return_audio", "max_tokens",
              "max_audio_frames", "thinker_sampling", "talker_sampling",
              "code_predictor_sampling", "frame")
    input_defaults = {"audio_features": (), "speaker": None, "return_audio": True,
                      "max_tokens": None, "max_audio_frames": None, "thinker_sampling": None,
                      "talker_sampling": None, "code_predictor_sampling": None, "frame": None}
    sample_rate = SAMPLE_RATE

    def __init__(self, weights: Qwen3OmniWeights, max_seq_len: int = 4096, max_batch: int = 32,
                 audio_policy: Any = None, page_size: int = 16, num_pages: int = 2048,
                 tokenizer: Any = None) -> None:
        w, c = weights, weights.config
        self.weights, self.config, self.tokenizer = w, c, tokenizer
        self.thinker = ThinkerNode(w.thinker, c.audio, [c.im_end], c.accept_hidden_layer,
                                   max_seq_len, max_batch)
        text = ThinkerNode(w.thinker, c.audio, [c.im_end], c.accept_hidden_layer, max_seq_len,
                           max_batch, for_talker=False)
        audio = AudioEncoderNode(w.audio_encoder)
        self.nodes: list[GraphNode] = [
            GraphNode("text_audio_encoder", ["audio_features"], ["audio_embeds"],
                      submodule=audio, engine="audio"),
            GraphNode("text_prefill", ["prompt", "audio_embeds", "thinker_sampling",
                                       "max_tokens"],
                      [GraphEdge(EMIT, "token"), "token"], submodule=text, engine="thinker"),
            GraphNode("text_decode", ["token"], [GraphEdge(EMIT, "token"), "token"],
                      submodule=text, engine="thinker")]
        self.walks: dict[str, Any] = {"text": Part("thinker", {
            "prefill": Sequential("text_audio_encoder", "text_prefill"),
            "decode": DynamicLoop("text_decode", max_seq_len, THINK)})}
        self.engine_specs = {"thinker": KVCacheEngine(page_size, num_pages, max_batch)}
        self.speakers: list[str] = list(c.speaker_id)
        if w.talker is not None and w.code_predictor is not None and w.code2wav is not None:
            self._add_speech(w, max_seq_len, max_batch, audio, page_size, num_pages,
                             audio_policy or Code2WavStreamNode.first_audio_policy())

    def _add_speech(self, w: Qwen3OmniWeights, max_seq_len: int, max_batch: int,
                    audio: AudioEncoderNode, page_size: int, num_pages: int,
                    audio_policy: Any) -> None:
        c = self.config
        self.talker = TalkerNode(w.talker, w.thinker.model.embed_tokens, c, max_seq_len,
                                 max_batch)
        self.code2wav = Code2WavStreamNode(w.code2wav, max_batch=8, input_name="frame_codes")
        to_talker = [StreamingGraphEdge("talker", "prompt_states", Fixed(1),
                                        continue_after_done=True)]
        self.nodes += [
            GraphNode("audio_encoder", ["audio_features"], ["audio_embeds"], submodule=audio,
                      engine="audio"),
            GraphNode("thinker_prefill", ["prompt", "audio_embeds", "thinker_sampling",
                                          "max_tokens"],
                      [GraphEdge(EMIT, "token"), "token"] + to_talker,
                      submodule=self.thinker, engine="thinker"),
            GraphNode("thinker_decode", ["token"],
                      [GraphEdge(EMIT, "token"), "token",
                       StreamingGraphEdge("talker", "reply", Fixed(1), continue_after_done=True)],
                      submodule=self.thinker, engine="thinker"),
            GraphNode("talker", ["prompt_states", "reply", "frame", "speaker", "talker_sampling",
                                 "code_predictor_sampling", "max_audio_frames"],
                      ["talk_out", StreamingGraphEdge("code2wav", "frame_codes", audio_policy)],
                      submodule=self.talker, engine="talker"),
            GraphNode("code_predictor", ["talk_out"], ["frame"],
                      submodule=PredictorNode(w.code_predictor), engine="predictor"),
            GraphNode("code2wav", ["frame_codes"], [GraphEdge(EMIT, "audio")],
                      submodule=self.code2wav, engine="code2wav")]
        groups = c.num_code_groups
        self.walks["speak"] = Parallel(
            Part("thinker", {"prefill": Sequential("audio_encoder", "thinker_prefill"),
                             "decode": DynamicLoop("thinker_decode", max_seq_len, THINK)}),
            Part("talker", {"speak": DynamicLoop(
                Sequential("talker", Loop("code_predictor", groups - 1, outputs=("frame",))),
                max_seq_len, TALK)}),
            "code2wav")
        self.engine_specs["talker"] = KVCacheEngine(page_size, num_pages, max_batch)

    # ---- the request ----------------------------------------------------------------------------

    @property
    def speaks(self) -> bool:
        return "speak" in self.walks

    def validate_inputs(self, inputs: Mapping[str, Any]) -> None:
        if inputs.get("prompt") is None:
            raise ValueError("give 'prompt': chat-formatted token ids (see format_chat)")
        self.thinker.prompt_ids(inputs["prompt"])
        for name in ("thinker_sampling", "talker_sampling", "code_predictor_sampling"):
            try:
                as_params(inputs.get(name))
            except (TypeError, ValueError) as e:
                raise ValueError(f"'{name}': {e}") from e
        if inputs.get("return_audio", True) and self.speaks:
            self.talker.speaker_id(inputs.get("speaker"))
        for name in ("max_tokens", "max_audio_frames"):
            v = inputs.get(name)
            if v is not None and (type(v) is not int or v < 1):
                raise ValueError(f"'{name}' must be a positive integer, not {v!r}")

    def next_part_walk(self, request: RequestContext, part: str,
                       finished: Optional[str]) -> Optional[str]:
        """The thinker decodes only if its prefill's token did not end the reply; the talker
        speaks once. (A thinker that never decodes ends its streams: the talker then says
        nothing, or goes on with empty windows.)"""
        if part == "thinker" and finished == "prefill":
            return None if request.state.get("thinker_done") else "decode"
        return super().next_part_walk(request, part, finished)

    def initial_walk(self, request: RequestContext) -> str:
        if request.inputs.get("return_audio", True) and self.speaks:
            return "speak"
        return "text"

    # ---- helpers for callers -------------------------------------------------------------------

    def audio_output_length(self, frames: int) -> int:
        """How many audio placeholders ``frames`` mel frames take in the prompt."""
        enc = self.weights.audio_encoder
        if enc is None:
            raise ValueError("this Qwen3-Omni has no audio encoder")
        return int(enc.output_length(frames))

    def tokens_read_by(self, samples: int) -> int:
        """How many of a reply's thinker tokens the talker had read when it made the reply's
        first ``samples`` audio samples (24 kHz), to whole frames (one counts once half of it
        is out; cap it by the tokens made). The talker reads one token per codec frame (frame
        ``i`` after tokens 0 .. i, as transformers' ``trailing_text_hidden``) and is causal,
        so those samples can hold no later text; it reads ahead of its speech, so this bounds
        what they say rather than measuring it."""
        if not self.speaks:
            raise ValueError("this Qwen3-Omni has no talker: it makes no audio")
        per_frame = self.code2wav.decoder.samples_per_frame
        return (max(int(samples), 0) + per_frame // 2) // per_frame

    def health(self) -> Optional[str]:
        """A tensor-parallel thinker's health (None otherwise: nothing else can be lost)."""
        health = getattr(self.weights.thinker, "health", None)
        return health() if health is not None else None

    def close(self) -> None:
        """Stops a tensor-parallel thinker's follower processes (nothing otherwise)."""
        close = getattr(self.weights.thinker, "close", None)
        if close is not None:
            close()

    @staticmethod
    def from_pretrained(path: Union[str, os.PathLike], dtype: Optional[torch.dtype] = None,
                        device: str = "cpu", progress: bool = True, tp_size: int = 1,
                        tp_restart: str = "auto", expert_parallel: bool = False,
                        **kwargs: Any) -> "Qwen3Omni":
        """Loads a Qwen3-Omni checkpoint directory (``config.json``, safetensors in the hub
        layout, and ``tokenizer.json`` when present). ``tp_size`` > 1 splits the thinker over
        that many processes (:func:`~mstar_rt.models.qwen3_omni.thinker_tp.load_thinker_tp`,
        ``tp_restart`` its ``restart``, ``expert_parallel`` whole experts per rank;
        docs/tensor_parallel.md); :meth:`close` stops them."""
        thinker = None
        if tp_size != 1:
            from mstar_rt.models.qwen3_omni.thinker_tp import load_thinker_tp

            thinker = load_thinker_tp(path, tp_size, dtype=dtype, device=device,
                                      restart=tp_restart, expert_parallel=expert_parallel)
        elif expert_parallel:
            raise ValueError("expert_parallel=True splits the thinker's experts over tp_size "
                             "processes; give tp_size > 1 as well")
        try:
            weights = load_qwen3_omni(path, dtype=dtype, device=device, progress=progress,
                                      thinker=thinker)
            tok = os.path.join(os.fspath(path), "tokenizer.json")
            tokenizer = None
            if os.path.exists(tok):
                from mstar_rt.models.checkpoint import read_tokenizer

                tokenizer = read_tokenizer(tok)
            return Qwen3Omni(weights, tokenizer=tokenizer, **kwargs)
        except BaseException:
            if thinker is not None:  # do not leave followers behind a refused model
                thinker.close()
            raise

"""Shared by the tests of Qwen3-Omni's split thinker (tensor and expert parallel): its steps
run by hand, and requests through the runtime."""

from __future__ import annotations

import numpy as np
import torch

import mstar_rt

import omni_tiny as ot
from tp_support import run_steps

GREEDY = {"temperature": 0.0, "max_tokens": 40}
TOL = 1e-4


def with_dense_layer_and_biases(seed: int):
    """A tiny HF Qwen3-Omni whose thinker has a dense MLP layer (1) among the MoE ones and
    biases on q/k/v/o, drawn at random (transformers starts them at zero)."""
    hf = ot.model(seed=seed, thinker_text={"mlp_only_layers": [1], "attention_bias": True})
    with torch.no_grad():
        for name, p in hf.thinker.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)
    return hf


def assert_same_steps(one, split, script, hidden_layer) -> None:
    """The split thinker's final hidden states, layer ``hidden_layer`` (what the talker reads)
    and logits, step by step, within TOL of the whole one's."""
    for (f1, a1, l1), (f2, a2, l2) in zip(thinker_steps(one, script, hidden_layer),
                                          thinker_steps(split, script, hidden_layer)):
        assert (f1 - f2).abs().max() < TOL
        assert (a1 - a2).abs().max() < TOL
        assert (l1 - l2).abs().max() < TOL


def thinker_steps(module, script, hidden_layer):
    """tp_support.run_steps, each step's (final hidden, hidden at ``hidden_layer``, logits of
    its last tokens)."""
    def call(ids, kv, step):
        final, at = module(ids, kv, hidden_layer=hidden_layer)
        return final, at, module.logits(final[step.last_token])

    return run_steps(module, script, call)


def omni_requests() -> list[dict]:
    """Text in and speech out, audio and text in, text only: three requests of different
    lengths, submitted at once so the engines batch them."""
    features = torch.as_tensor(ot.mel(230))
    return [{"prompt": ot.chat_prompt([72, 105, 33]), "speaker": "ethan",
             "thinker_sampling": {"max_tokens": 10}, "talker_sampling": GREEDY},
            {"prompt": ot.chat_prompt([1, 2, 3, 4, 5, 6], audio_frames=230), "speaker": "chelsie",
             "audio_features": [features.numpy()], "thinker_sampling": {"max_tokens": 12},
             "talker_sampling": GREEDY},
            {"prompt": ot.chat_prompt([9, 8]), "return_audio": False,
             "thinker_sampling": {"max_tokens": 6}}]


def omni_answers(model, inputs):
    """Each request's (thinker tokens, audio samples) through a Runtime of ``model``; every
    thinker page is back at the end."""
    with mstar_rt.Runtime(model) as rt:
        handles = [rt.submit(i) for i in inputs]  # at once: the engines batch them
        out = []
        for h in handles:
            items = list(h)
            audio = [v for k, v in items if k == "audio"]
            out.append(([v for k, v in items if k == "token"],
                        np.concatenate(audio) if audio else np.zeros(0, np.float32)))
        assert rt.engines["thinker"].cache.free_pages == rt.engines["thinker"].cache.num_pages
    return out

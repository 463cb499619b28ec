"""Tiny random Llama checkpoints and their transformers reference, for test_llama.py.

Weights use a large init (0.2) so attention is sharp and logits spread widely: a wrong rope
scaling, a lost bias or a mis-read page then moves logits far beyond the 1e-4 tolerance, and
greedy choices are never near-ties.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
import transformers

from mstar_rt import Runtime
from mstar_rt.engines import KVCacheEngine, SamplingParams
from mstar_rt.models.causal_lm import CausalLM

T = 60.0  # seconds: the longest any single wait in test_llama.py may take

BASE: dict[str, Any] = dict(
    vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
    initializer_range=0.2, rope_theta=10000.0, tie_word_embeddings=False,
    eos_token_id=None, bos_token_id=None, pad_token_id=None)

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 32}

# rope_theta + rope_scaling are accepted by transformers 4.x and 5.x alike.
VARIANTS: dict[str, dict[str, Any]] = {
    "mha": dict(hidden_size=32, num_key_value_heads=4),
    "gqa": dict(),
    "llama3": dict(rope_theta=2000.0, rope_scaling=LLAMA3),
    "tied": dict(tie_word_embeddings=True, num_key_value_heads=1, vocab_size=200),
    # head_dim given apart from hidden/heads, biases everywhere, another eps
    "linear_bias": dict(hidden_size=48, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                        rope_theta=500.0, rope_scaling={"rope_type": "linear", "factor": 2.0},
                        attention_bias=True, mlp_bias=True, rms_norm_eps=1e-5),
}


def make_hf(variant: str, seed: int = 0) -> transformers.LlamaForCausalLM:
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(**{**BASE, **VARIANTS[variant]})
    return transformers.LlamaForCausalLM(config).eval()


def make_prompts(vocab: int, lengths: tuple[int, ...], seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def read_config(path: str) -> dict:
    with open(os.path.join(path, "config.json")) as f:
        return json.load(f)


def write_config(path: str, config: dict) -> None:
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2)


def rope_params(config: dict) -> dict:
    """The rope settings of a config.json in either dialect, as one 5.x-style dict."""
    if "rope_parameters" in config:
        return dict(config["rope_parameters"])
    params = dict(config.get("rope_scaling") or {"rope_type": "default"})
    params["rope_theta"] = config["rope_theta"]
    return params


def as_4x(config: dict, type_key: str = "rope_type") -> dict:
    """``config`` rewritten in the transformers 4.x dialect: top-level ``rope_theta``, scaling in
    ``rope_scaling`` under ``type_key`` (4.x accepted both "rope_type" and the older "type")."""
    params = rope_params(config)
    out = {k: v for k, v in config.items() if k not in ("rope_parameters", "rope_scaling")}
    out["rope_theta"] = params.pop("rope_theta")
    kind = params.pop("rope_type", params.pop("type", "default"))
    out["rope_scaling"] = None if kind == "default" else {type_key: kind, **params}
    if "dtype" in out:  # 4.x named it torch_dtype
        out["torch_dtype"] = out.pop("dtype")
    return out


def as_5x(config: dict) -> dict:
    params = rope_params(config)
    out = {k: v for k, v in config.items() if k not in ("rope_theta", "rope_scaling")}
    params.setdefault("rope_type", params.pop("type", "default"))
    out["rope_parameters"] = params
    return out


@torch.no_grad()
def teacher_forced(hf: transformers.PreTrainedModel, prompt: list[int],
                   tokens: list[int]) -> torch.Tensor:
    """HF logits ``[len(tokens), V]`` for each generated position, given prompt + ``tokens`` in
    one full (cache-free) forward: row i is what HF predicts after prompt + tokens[:i]."""
    ids = torch.tensor([prompt + tokens[:-1]])
    return hf(ids).logits[0, len(prompt) - 1:].float()


@torch.no_grad()
def hf_generate(hf: transformers.PreTrainedModel, prompt: list[int],
                n: int) -> tuple[list[int], torch.Tensor]:
    """HF greedy decoding with its KV cache: (tokens, per-step logits ``[n, V]``)."""
    ids = torch.tensor([prompt])
    # the mask given: without it transformers masks every pad id (0) in the prompt as padding
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                      min_new_tokens=n, do_sample=False, output_logits=True,
                      return_dict_in_generate=True, pad_token_id=0)
    return out.sequences[0, len(prompt):].tolist(), torch.cat(out.logits).float()


def run_all(rt: Runtime, requests: list[dict]) -> list[dict]:
    """Submits every request before waiting on any (so they batch); returns their results."""
    handles = [rt.submit(r) for r in requests]
    return [h.result(timeout=T) for h in handles]


def greedy(prompt: list[int], n: int, **kw: Any) -> dict:
    return {"prompt": prompt, "params": SamplingParams(max_tokens=n, **kw)}


def make_lm(module: torch.nn.Module, page_size: int = 4, num_pages: int = 256,
            emit_logits: bool = True, **kw: Any) -> CausalLM:
    return CausalLM(module, engine=KVCacheEngine(page_size=page_size, num_pages=num_pages),
                    emit_logits=emit_logits, **kw)


def max_diff(ours: list[torch.Tensor], ref: torch.Tensor) -> float:
    assert len(ours) == ref.shape[0], (len(ours), tuple(ref.shape))
    return (torch.stack(ours) - ref).abs().max().item()


def top2_gap(logits: torch.Tensor) -> torch.Tensor:
    """Per row, how far the best logit lies above the second best."""
    top = logits.topk(2, dim=-1).values
    return top[..., 0] - top[..., 1]

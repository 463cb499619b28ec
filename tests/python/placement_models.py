"""Models for test_placement.py, built by import path in the parent and in every worker.

``pipeline`` is a plain multi-node walk (encoder -> DynamicLoop backbone with a streamed token
-> head) whose values exercise every kind the codec carries; ``tiny_llama`` is a small random
Llama served by CausalLM on a paged KV cache (greedy decoding, logits EMITted); ``text_llama``
puts a tokenizer node of its own in front of it; ``lerobot_policy`` and ``smolvla_policy`` are
LeRobot's tiny pi0 and SmolVLA fixtures; ``tiny_tts`` a tiny random Orpheus (an LM streaming codes
to SNAC).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any, Mapping, Optional

import numpy as np
import torch

from mstar_rt import (EMIT, DynamicLoop, Fixed, GraphEdge, GraphNode, Model, NodeSubmodule,
                      Parallel, Sequential, StreamingGraphEdge)
from mstar_rt.engines import KVCacheEngine
from mstar_rt.models.causal_lm import CausalLM
from mstar_rt.models.llama import LlamaConfig, LlamaForCausalLM
from mstar_rt.placement import register_type

DIM_IN, DIM = 8, 16


@register_type
@dataclass(frozen=True)
class Tag:
    name: str
    value: float


class Encoder(NodeSubmodule):
    max_batch = 4

    def __init__(self, g: torch.Generator) -> None:
        self.w = torch.randn(DIM_IN, DIM, generator=g) * 0.5
        self.b = torch.randn(DIM, generator=g) * 0.1

    def forward(self, batch: list[dict]) -> list[Mapping[str, Any]]:
        out = []
        for item in batch:
            x, delay = item["x"], item["delay"]
            if not (isinstance(x, torch.Tensor) and x.dim() == 2 and x.shape[1] == DIM_IN):
                raise ValueError(f"encoder: x must be a [n, {DIM_IN}] tensor, got "
                                 f"{getattr(x, 'shape', type(x).__name__)}")
            if delay:
                time.sleep(delay)
            feat = torch.tanh(x @ self.w + self.b)
            meta = {"shape": tuple(x.shape), "sum": x.double().sum(0).numpy(),
                    "mean": np.float32(x.mean().item()), "raw": b"\x00\x01mstar",
                    "nested": [1, (2.5, "s"), None, True, {"k": [np.int64(3)]}],
                    "tag": Tag("enc", float(x[0, 0])), "empty": torch.zeros(0, 3),
                    "half": x.to(torch.bfloat16)}
            out.append({"feat": feat, "h": feat.clone(), "meta": meta})
        return out


class Embed(NodeSubmodule):
    def forward(self, batch: list[dict]) -> list[Mapping[str, Any]]:
        return [{"feat": item["x"] @ torch.ones(DIM_IN, DIM) * 0.1,
                 "h": item["x"] @ torch.ones(DIM_IN, DIM) * 0.05} for item in batch]


class Backbone(NodeSubmodule):
    """One refinement step per loop iteration; stops after ``steps`` iterations."""

    max_batch = 4

    def __init__(self, g: torch.Generator) -> None:
        self.w = torch.randn(DIM, DIM, generator=g) * 0.4

    def prepare_inputs(self, ctx: Any, inputs: dict) -> dict:
        ctx.request.state["refines"] = ctx.iteration + 1
        return {**inputs, "iteration": ctx.iteration}

    def forward(self, batch: list[dict]) -> list[Mapping[str, Any]]:
        out = []
        for item in batch:
            if item["pause"]:
                time.sleep(item["pause"])
            h = torch.tanh(item["h"] @ self.w + item["feat"])
            out.append({"h": h, "tok": int(h[0].argmax())})
        return out

    def check_stop(self, batch: list[dict], outputs: list) -> list:
        return [("refine",) if b["iteration"] + 1 >= b["steps"] else () for b in batch]


class Collect(NodeSubmodule):
    def forward(self, batch: list[dict]) -> list[Mapping[str, Any]]:
        return [{"window": (w.begin, w.new_begin, w.end, w.last, list(w.items))}
                for w in (item["tok"] for item in batch)]


class Head(NodeSubmodule):
    def forward(self, batch: list[dict]) -> list[Mapping[str, Any]]:
        return [{"y": item["h"].sum(-1)} for item in batch]


class Pipeline(Model):
    """``full``: encoder -> (backbone loop || collect) -> head; ``direct`` swaps the encoder for
    a cheap embed, so it never touches the encoder's rank."""

    inputs = ("x", "steps", "delay", "pause", "mode")
    input_defaults = {"steps": 3, "delay": 0.0, "pause": 0.0, "mode": "full"}

    def __init__(self, seed: int = 0, sick_file: Optional[str] = None) -> None:
        self.sick_file = sick_file
        g = torch.Generator().manual_seed(seed)
        loop_out = ["h", GraphEdge(EMIT, "h"), StreamingGraphEdge("collect", "tok", Fixed(2))]
        self.nodes = [
            GraphNode("encoder", ["x", "delay"], ["feat", "h", GraphEdge(EMIT, "meta")]),
            GraphNode("embed", ["x"], ["feat", "h"]),
            GraphNode("backbone", ["feat", "h", "steps", "pause"], loop_out),
            GraphNode("collect", ["tok"], [GraphEdge(EMIT, "window")]),
            GraphNode("head", ["h"], [GraphEdge(EMIT, "y")]),
        ]

        def body() -> Parallel:  # a fresh section per walk
            return Parallel(DynamicLoop("backbone", 8, "refine", outputs=["h"]), "collect")

        self.walks = {"full": Sequential("encoder", body(), "head"),
                      "direct": Sequential("embed", body(), "head")}
        self.submodules = {"encoder": Encoder(g), "embed": Embed(), "backbone": Backbone(g),
                           "collect": Collect(), "head": Head()}

    def validate_inputs(self, inputs: Mapping[str, Any]) -> None:
        if inputs["mode"] not in self.walks:
            raise ValueError(f"mode must be one of {list(self.walks)}, not {inputs['mode']!r}")

    def initial_walk(self, request: Any) -> str:
        return request.inputs["mode"]

    def health(self) -> Optional[str]:
        """What ``sick_file`` says once a test wrote it (as a lost tensor-parallel rank would)."""
        if self.sick_file and os.path.exists(self.sick_file):
            with open(self.sick_file) as f:
                return f.read()
        return None


def pipeline(seed: int = 0, fail: bool = False, sick_file: Optional[str] = None) -> Pipeline:
    """``fail``: raise as a missing dependency would (given to one worker by the start test);
    ``sick_file``: :meth:`Pipeline.health` says what it holds."""
    if fail:
        raise ImportError("No module named 'missing_dependency' (simulated by the test)")
    return Pipeline(seed, sick_file)


def _random_llama(seed: int) -> LlamaForCausalLM:
    """A 2-layer random Llama (GQA, 128-token vocabulary) with sharp logits, so greedy tokens
    are never near-ties."""
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, max_position_embeddings=128)
    g = torch.Generator().manual_seed(seed)
    with torch.device("meta"):
        module = LlamaForCausalLM(config)
    module = module.to_empty(device="cpu")
    module.rotary.inv_freq = config.rope.inv_freq(config.head_dim)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return module


def tiny_llama(seed: int = 0, page_size: int = 4, num_pages: int = 256, max_batch: int = 8,
               emit_logits: bool = True, max_seq_len: Optional[int] = None) -> CausalLM:
    engine = KVCacheEngine(page_size=page_size, num_pages=num_pages, max_batch=max_batch)
    return CausalLM(_random_llama(seed), (), max_seq_len=max_seq_len, engine=engine,
                    max_batch=max_batch, emit_logits=emit_logits)


class Tokenize(NodeSubmodule):
    """Bytes of the text, folded into the 128-token vocabulary."""

    max_batch = 8

    def forward(self, batch: list[dict]) -> list[Mapping[str, Any]]:
        return [{"prompt": [b % 128 for b in item["text"].encode()]} for item in batch]


class TextLM(CausalLM):
    """The tiny Llama behind a tokenizer node of its own: ``prefill`` is tokenize -> prefill,
    ``decode`` as in CausalLM; so the graph can be split over two workers (tokenizer on one,
    the LM and its KV cache on the other)."""

    inputs = ("text", "params")

    def __init__(self, seed: int = 0) -> None:
        super().__init__(_random_llama(seed), (), engine=KVCacheEngine(page_size=4, num_pages=256,
                                                                     max_batch=8),
                         max_batch=8, emit_logits=True)
        self.nodes = [GraphNode("tokenize", ["text"], [GraphEdge("prefill", "prompt")]),
                      *self.nodes]
        self.walks = {"prefill": Sequential("tokenize", "prefill"),
                      "decode": self.walks["decode"]}
        self.submodules = {**self.submodules, "tokenize": Tokenize()}

    def validate_inputs(self, inputs: Mapping[str, Any]) -> None:
        text = inputs["text"]
        if not isinstance(text, str) or not text:
            raise ValueError("text must be a non-empty string")


def text_llama(seed: int = 0) -> TextLM:
    return TextLM(seed)


def checkpoint_lm(path: str, tp_size: int = 1, tp_restart: str = "auto") -> CausalLM:
    """A Llama checkpoint directory as a CausalLM (``tp_size`` > 1: tensor-parallel, the
    followers started beside the process that builds it)."""
    return CausalLM.from_pretrained(path, tp_size=tp_size, tp_restart=tp_restart,
                                    progress=False, emit_logits=True)


def lerobot_policy(family: str = "pi0"):
    """LeRobot's tiny pi0 / pi0.5 fixture (tests/reference/fixtures) as a walk graph: vision,
    prefix on the KV engine, a Loop of flow steps reading it."""
    import json
    from pathlib import Path

    from mstar_rt.models.lerobot_pi0 import LeRobotPi0Policy
    from mstar_rt.models.lerobot_pi0_load import load_lerobot_pi0

    d = Path(__file__).resolve().parents[1] / "reference" / "fixtures" / family
    tiny = json.loads((d / "tiny_sizes.json").read_text())
    heads = tiny["paligemma_hf_config"]["vision_config"]["num_attention_heads"]
    return LeRobotPi0Policy(load_lerobot_pi0(d / "checkpoint", tokenizer=d / "tokenizer",
                                             sizes={"vision_heads": heads}, verbose=False))


def tiny_tts():
    """A tiny random Orpheus: its speak walk streams the LM's codes to SNAC in the same walk."""
    from mstar_rt.models.orpheus import OrpheusTTS

    return OrpheusTTS.tiny(0, constrain_codes=True)


def smolvla_policy():
    """LeRobot's tiny SmolVLA fixture as a walk graph (prefix on the KV engine, flow steps)."""
    from pathlib import Path

    from mstar_rt.models.smolvla import SmolVLAPolicy
    from mstar_rt.models.smolvla_checkpoint import load_lerobot_smolvla

    d = Path(__file__).resolve().parents[1] / "reference" / "fixtures" / "smolvla"
    return SmolVLAPolicy(load_lerobot_smolvla(d / "checkpoint", progress=False))


def tiny_omni(directory: str, tp_size: int = 1):
    """The tiny random Qwen3-Omni saved in ``directory`` (omni_support.tiny_qwen3_omni);
    ``tp_size``: its thinker split over that many processes."""
    from mstar_rt.models.qwen3_omni.omni import Qwen3Omni

    return Qwen3Omni.from_pretrained(directory, progress=False, tp_size=tp_size)

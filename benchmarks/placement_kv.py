"""The models-on-a-KV-cache sections of benchmarks/placement.py (also importable by its workers:
``placement_kv:kv_lm``): a small random Llama decoding on a worker, in one piece and
disaggregated, and the tiny Qwen3-Omni split over two workers."""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench_common import ROOT, alternate, use_source_tree  # noqa: E402

use_source_tree()
sys.path.insert(0, str(ROOT / "tests" / "python"))  # the tiny Qwen3-Omni (workers inherit it)

import torch  # noqa: E402

from mstar_rt import Runtime  # noqa: E402
from mstar_rt.placement import NodeGroup, PlacedRuntime  # noqa: E402

KV_TOKENS = 64  # tokens per request of the KV-cache LM


def kv_lm() -> Any:
    """A small random Llama on a paged KV cache (``placement_kv:kv_lm``): its decode steps cost
    little, so what placement adds per token shows."""
    from mstar_rt.engines import KVCacheEngine
    from mstar_rt.models.causal_lm import CausalLM
    from mstar_rt.models.llama import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, max_position_embeddings=256)
    with torch.device("meta"):
        module = LlamaForCausalLM(config)
    module = module.to_empty(device="cpu")
    module.rotary.inv_freq = config.rope.inv_freq(config.head_dim)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in module.named_parameters():
            p.copy_(torch.ones(p.shape) if "norm" in name else torch.randn(p.shape, generator=g))
    return CausalLM(module, (), max_seq_len=256, max_batch=16,
                    engine=KVCacheEngine(page_size=16, num_pages=512, max_batch=16))


def kv_decode(reps: int, disagg: bool = False) -> dict[str, float]:
    """µs per generated token of the KV-cache LM: in-process, on a worker with its walks as
    segments (the decode loop inside the worker), and on a worker node by node (a crossing
    per token), for 1 and 8 requests at once. ``disagg``: prefill on worker 1 and decode on
    worker 2 (each request's K/V moving between them), segments against node by node."""
    from mstar_rt.models.causal_lm import SamplingParams

    req = {"prompt": [1, 2, 3, 4], "params": SamplingParams(max_tokens=KV_TOKENS,
                                                            ignore_eos=True)}
    group = [NodeGroup(["prefill", "decode"], rank=1)]
    if disagg:
        group = [NodeGroup(["prefill"], rank=1), NodeGroup(["decode"], rank=2)]
    runtimes = {"segments": PlacedRuntime("placement_kv:kv_lm", group, progress=False),
                "per_node": PlacedRuntime("placement_kv:kv_lm", group, progress=False,
                                          segments=False)}
    if disagg:
        runtimes = {f"disagg_{k}": rt for k, rt in runtimes.items()}
    else:
        runtimes = {"inproc": Runtime(kv_lm()), **runtimes}

    def serve(rt: Any, n: int) -> float:
        t0 = time.perf_counter()
        for h in [rt.submit(req) for _ in range(n)]:
            assert len(h.result(120)["token"]) == KV_TOKENS
        return time.perf_counter() - t0

    figures: dict[str, float] = {}
    try:
        for rt in runtimes.values():
            serve(rt, 2)  # warm-up
        for n in (1, 8):
            t = alternate([(k, lambda rt=rt: serve(rt, n)) for k, rt in runtimes.items()],
                          reps, f"kv {'disaggregated ' if disagg else ''}decode x{n}")
            for k in runtimes:
                figures[f"kv_{k}_us_per_token_{n}req"] = (statistics.median(t[k])
                                                          / (n * KV_TOKENS) * 1e6)
    finally:
        for rt in runtimes.values():
            rt.close()
    return figures


def omni_split(reps: int) -> dict[str, float]:
    """The tiny Qwen3-Omni with its thinker on worker 1 and talker, code predictor and code2wav
    on worker 2: ms per request and to the first audio, with segments (the code predictor's
    inner Loop one run per frame) and node by node, alternating."""
    import numpy as np
    from omni_support import tiny_qwen3_omni

    import omni_tiny as ot

    directory = tempfile.mkdtemp(prefix="mstar-bench-omni-")
    nodes = [n.name for n in tiny_qwen3_omni(directory).nodes]
    thinker = [n for n in nodes if n.startswith(("text_", "thinker_", "audio_encoder"))]
    groups = [NodeGroup(thinker, rank=1),
              NodeGroup([n for n in nodes if n not in thinker], rank=2)]
    req = {"prompt": ot.chat_prompt([5, 9, 13]), "speaker": "ethan", "audio_features": [],
           "thinker_sampling": {"max_tokens": 12},
           "talker_sampling": {"temperature": 0.0, "max_tokens": 40}}
    runtimes = {k: PlacedRuntime("placement_models:tiny_omni", groups, progress=False,
                                 model_kwargs={"directory": directory}, segments=k == "segments")
                for k in ("segments", "per_node")}
    first: dict[str, list[float]] = {k: [] for k in runtimes}

    def one(k: str) -> float:
        t0 = time.perf_counter()
        audio = []
        for name, value in runtimes[k].submit(req):
            if name == "audio":
                if not audio:
                    first[k].append(time.perf_counter() - t0)
                audio.append(value)
        assert np.concatenate(audio).size > 0
        return time.perf_counter() - t0

    try:
        for k in runtimes:
            one(k)  # warm-up
        first = {k: [] for k in runtimes}
        t = alternate([(k, lambda k=k: one(k)) for k in runtimes], reps, "omni split")
    finally:
        for rt in runtimes.values():
            rt.close()
    out = {}
    for k in runtimes:
        out[f"omni_split_{k}_ms_per_request"] = statistics.median(t[k]) * 1e3
        out[f"omni_split_{k}_first_audio_ms"] = statistics.median(first[k]) * 1e3
    return out

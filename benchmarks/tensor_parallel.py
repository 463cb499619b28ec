#!/usr/bin/env python3
"""Tensor parallelism on CPU: is splitting an LM over two processes worth it?

    python benchmarks/tensor_parallel.py [--quick]

Two random checkpoints, float32, each served through the runtime (KV engine, greedy):

* ``llama``: a Llama of 44 M parameters (768 wide, 6 layers, 12 query heads over 4 KV heads,
  MLP 2048) through ``CausalLM``;
* ``omni``: a Qwen3-Omni thinker of 8 MoE layers (512 wide, 8 experts of 512 columns, top 2;
  tests/python/omni_tiny.py with larger thinker sizes) through ``Qwen3Omni``'s text walk.

Three ways, alternating request by request: ``tp_size`` 1 with one torch thread, ``tp_size`` 1
with two (the same two cores, split inside each op: the baseline a CPU user has), and
``tp_size`` 2 with one thread per rank (this process and one follower); for the omni thinker a
fourth, ``ep2``: ``tp_size`` 2 with ``expert_parallel`` (each rank four whole experts instead of
every expert's half). Each times a prefill of PROMPT tokens (one request, ``max_tokens`` 1) and
a decode (BATCH requests of DECODE tokens at once, µs per token). Ratios:
``tp2_over_tp1_{prefill,decode}_speedup_{model}``: the faster tp_size 1 way (one or two
threads) over tp_size 2, above 1 when the split pays on these cores;
``ep2_over_tp2_{prefill,decode}_speedup_omni``: the column split over the expert split.
Outputs of every way are checked equal (tokens) first. ``--models omni`` runs one model.
Writes benchmarks/results/tensor_parallel.json and .png.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch

from bench_common import ROOT, alternate, machine, use_source_tree

use_source_tree()
sys.path.insert(0, str(ROOT / "tests" / "python"))

import mstar_rt  # noqa: E402
from mstar_rt.models.causal_lm import CausalLM, SamplingParams  # noqa: E402
from mstar_rt.models.qwen3_omni.omni import Qwen3Omni  # noqa: E402

PROMPT, BATCH, DECODE = 256, 8, 32
WAYS = ("tp1_1thread", "tp1_2threads", "tp2", "ep2")
MODELS = {"llama": WAYS[:3], "omni": WAYS}
OUT = ROOT / "benchmarks" / "results" / "tensor_parallel.json"


def save_llama(path: str) -> None:
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=4096, hidden_size=768, intermediate_size=2048,
                                      num_hidden_layers=6, num_attention_heads=12,
                                      num_key_value_heads=4, head_dim=64,
                                      max_position_embeddings=1024)
    transformers.LlamaForCausalLM(config).eval().save_pretrained(path)


def save_omni(path: str) -> None:
    import omni_tiny

    omni_tiny.save(omni_tiny.model(thinker_layers=8, thinker_text=dict(
        hidden_size=512, num_attention_heads=8, num_key_value_heads=4, head_dim=64,
        moe_intermediate_size=512, num_experts=8, intermediate_size=1024,
        max_position_embeddings=1024)), path)


def llama_request(prompt: list[int], tokens: int) -> dict:
    return {"prompt": prompt, "params": SamplingParams(max_tokens=tokens, ignore_eos=True)}


def omni_request(prompt: list[int], tokens: int) -> dict:
    return {"prompt": prompt, "return_audio": False,
            "thinker_sampling": {"max_tokens": tokens, "ignore_eos": True}}


def tokens_of(handle: Any) -> list[int]:
    return [v for k, v in handle if k == "token"]


def measure(load: Callable[..., Any], request: Callable[[list[int], int], dict], vocab: int,
            reps: int, ways: tuple[str, ...]) -> dict[str, float]:
    """Seconds per prefill and µs per decoded token, the ways alternating. ``load(way)`` builds
    the model."""
    g = torch.Generator().manual_seed(1)
    long = torch.randint(0, vocab, (PROMPT,), generator=g).tolist()
    short = [torch.randint(0, vocab, (16,), generator=g).tolist() for _ in range(BATCH)]
    threads = {"tp1_1thread": 1, "tp1_2threads": 2, "tp2": 1, "ep2": 1}
    models, runtimes = {}, {}
    for way in ways:
        n = threads[way]
        models[way] = load(way)
        for engine in models[way].engine_specs.values():  # OpenMP's count is per thread
            engine.num_threads, engine.auto_threads = n, False  # (auto: 1 on <= 4 cores)
        runtimes[way] = mstar_rt.Runtime(models[way])
    try:
        want = [tokens_of(runtimes["tp1_1thread"].submit(request(p, 8))) for p in short[:2]]
        for way, rt in runtimes.items():
            got = [tokens_of(rt.submit(request(p, 8))) for p in short[:2]]
            assert got == want, f"{way} answered differently: {got} != {want}"

        def prefill(way: str) -> float:
            torch.set_num_threads(threads[way])  # MKL's count is process-wide: set per turn
            t0 = time.perf_counter()
            tokens_of(runtimes[way].submit(request(long, 1)))
            return time.perf_counter() - t0

        def decode(way: str) -> float:
            torch.set_num_threads(threads[way])
            handles = [runtimes[way].submit(request(p, DECODE)) for p in short]
            first = [next(iter(h)) for h in handles]  # every prefill done: decoding from here
            t0 = time.perf_counter()
            for h in handles:
                tokens_of(h)
            assert len(first) == BATCH
            return (time.perf_counter() - t0) / (BATCH * (DECODE - 1))

        p = alternate([(w, lambda w=w: prefill(w)) for w in ways], reps, "prefill")
        d = alternate([(w, lambda w=w: decode(w)) for w in ways], reps, "decode")
    finally:
        for rt in runtimes.values():
            rt.close()
        for way in ("tp2", "ep2"):
            if way in models:
                models[way].close()
        torch.set_num_threads(1)
    out = {f"{w}_prefill_ms": statistics.median(p[w]) * 1e3 for w in ways}
    out |= {f"{w}_decode_us_per_token": statistics.median(d[w]) * 1e6 for w in ways}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    ap.add_argument("--quick", action="store_true", help="fewer repetitions")
    ap.add_argument("--models", default="llama,omni", help="comma-separated: llama, omni")
    args = ap.parse_args()
    names = [m for m in MODELS if m in args.models.split(",")]
    reps = 4 if args.quick else 12
    figures: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            path = f"{tmp}/{name}"
            if name == "llama":
                save_llama(path)
                got = measure(lambda way: CausalLM.from_pretrained(
                    path, progress=False, max_seq_len=1024, tp_size=2 if way == "tp2" else 1),
                    llama_request, 4096, reps, MODELS[name])
            else:
                save_omni(path)
                got = measure(lambda way: Qwen3Omni.from_pretrained(
                    path, progress=False, tp_size=1 if way.startswith("tp1") else 2,
                    expert_parallel=way == "ep2"), omni_request, 200, reps, MODELS[name])
            figures |= {f"{k}_{name}": v for k, v in got.items()}
    ratios = {}
    for name in names:
        for what, unit in (("prefill", "ms"), ("decode", "us_per_token")):
            key = f"{what}_{unit}_{name}"
            ratios[f"tp2_over_tp1_{what}_speedup_{name}"] = (
                min(figures[f"tp1_1thread_{key}"], figures[f"tp1_2threads_{key}"])
                / figures[f"tp2_{key}"])
            if "ep2" in MODELS[name]:
                ratios[f"ep2_over_tp2_{what}_speedup_{name}"] = (figures[f"tp2_{key}"]
                                                                 / figures[f"ep2_{key}"])
    print(f"{'model':>6} {'':>8} {'tp1, 1 thread':>14} {'tp1, 2 threads':>15} {'tp2':>8} "
          f"{'ep2':>8} {'speedup':>8} {'ep2/tp2':>8}")
    for name in names:
        for what, unit in (("prefill", "ms"), ("decode", "us_per_token")):
            key = f"{what}_{unit}_{name}"
            ep = ratios.get(f"ep2_over_tp2_{what}_speedup_{name}")
            print(f"{name:>6} {what:>8} " + " ".join(
                f"{figures.get(f'{w}_{key}', float('nan')):>{n}.1f}"
                for w, n in zip(WAYS, (14, 15, 8, 8)))
                + f" {ratios[f'tp2_over_tp1_{what}_speedup_{name}']:>8.2f}"
                + (f" {ep:>8.2f}" if ep is not None else f" {'-':>8}"))
    print(f"(prefill: ms for {PROMPT} tokens; decode: µs per token, {BATCH} requests at once; "
          f"speedup: the faster tp1 over tp2; ep2/tp2: tp2 over ep2; {machine()})")
    OUT.parent.mkdir(exist_ok=True)
    OUT.write_text(json.dumps({"name": "tensor_parallel", "quick": args.quick,
                               "machine": machine(), "figures": figures, "ratios": ratios},
                              indent=2))
    plot(figures, OUT.with_suffix(".png"), names)
    print(f"wrote {OUT}")


def plot(figures: dict[str, float], path: Path, names: list[str]) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    fig, axes = plt.subplots(1, 2, figsize=(8, 3.2))
    for ax, (what, unit, label) in zip(axes, (("prefill", "ms", f"prefill of {PROMPT} tokens, ms"),
                                              ("decode", "us_per_token",
                                               f"decode, µs per token ({BATCH} requests)"))):
        for i, w in enumerate(WAYS):
            ax.bar([j + i * 0.2 for j in range(len(names))],
                   [figures.get(f"{w}_{what}_{unit}_{m}", 0.0) for m in names], 0.2, label=w)
        ax.set_xticks([j + 0.3 for j in range(len(names))],
                      [{"llama": "Llama 44M", "omni": "omni thinker"}[m] for m in names])
        ax.set_title(label, fontsize=9)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

"""The two sides of benchmarks/decode.py and one timed run of each: a random-weight Llama built
with transformers and loaded into ours (the same weights), ours served by a fresh Runtime, HF's
``generate`` on a thread of its own, and the CPU time other processes took meanwhile."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
import transformers  # noqa: E402

import mstar_rt  # noqa: E402
from mstar_rt.engines import KVCacheEngine, SamplingParams  # noqa: E402
from mstar_rt.models.causal_lm import CausalLM  # noqa: E402

PROMPT_TOKENS = (16, 32)  # inclusive range of prompt lengths
MODEL = dict(vocab_size=16384, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
             num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1024)
THREADS = torch.get_num_threads()  # torch's default for this machine: both sides get it
TIMEOUT_S = 600.0


# ---- the two models ------------------------------------------------------------------------------

def build_models(path: str) -> tuple[Any, CausalLM, float]:
    """A random-weight HF Llama saved to ``path`` and ours loaded from it (the same weights)."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(**MODEL, tie_word_embeddings=False, eos_token_id=None,
                                   bos_token_id=None, pad_token_id=None, dtype="float32")
    hf = transformers.LlamaForCausalLM(cfg).eval()
    hf.save_pretrained(path)
    ours = make_ours(CausalLM.from_pretrained(path, progress=False).module)
    params_m = sum(p.numel() for p in hf.parameters()) / 1e6
    return hf, ours, params_m


def make_ours(module: torch.nn.Module) -> CausalLM:
    """A fresh CausalLM (and engine) around an already loaded module."""
    # 16 requests x (32 + 64 tokens) need 96 pages of 16; 256 leaves room without a large cache.
    # The engine's worker gets every core (the main thread keeps torch at one thread, so the
    # worker's OpenMP pool is the only one alive while it runs; see main()).
    return CausalLM(module, engine=KVCacheEngine(page_size=16, num_pages=256, max_batch=64,
                                                 num_threads=THREADS))


def make_prompts(count: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1234)
    lo, hi = PROMPT_TOKENS
    lengths = torch.randint(lo, hi + 1, (count,), generator=g).tolist()
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


# ---- one run of each -----------------------------------------------------------------------------

def run_ours(rt: mstar_rt.Runtime, prompts: list, max_tokens: int) -> dict:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    engine = rt.engines["lm"]
    steps0 = engine.steps
    submitted, handles = [], []
    t0 = time.perf_counter()
    for p in prompts:
        submitted.append(time.monotonic())  # the Conductor's timeline uses CLOCK_MONOTONIC too
        handles.append(rt.submit({"prompt": p, "params": params}))
    tokens = [h.result(timeout=TIMEOUT_S)["token"] for h in handles]
    t1 = time.perf_counter()
    ttft = []
    for h, t_sub in zip(handles, submitted):
        prefill = [r for r in h.stats() if r["node"] == "prefill"]
        if len(prefill) != 1:
            raise AssertionError(f"expected one prefill execution, saw {len(prefill)}")
        ttft.append(prefill[0]["finished"] - t_sub)
    check_counts("ours", tokens, max_tokens)
    return {"tokens": tokens, "wall_s": t1 - t0, "ttft_s": ttft, "steps": engine.steps - steps0,
            "t0": t0, "t1": t1}


def serve_once(module: torch.nn.Module, prompts: list, max_tokens: int) -> dict:
    """One timed run in a Runtime of its own, warmed up by a short request first. A Runtime
    left open between runs would keep its worker's OpenMP threads alive, and those slow down
    torch ops on every other thread, HF's included (see op_thread_cost)."""
    with mstar_rt.Runtime(make_ours(module)) as rt:
        run_ours(rt, prompts[:1], 2)
        r = run_ours(rt, prompts, max_tokens)
        # torch threads on the worker, where the engine sets them (None: torch's default)
        r["worker_threads"] = getattr(rt.engines["lm"], "num_threads", None)
        return r


def run_hf(hf: Any, prompts: list, max_tokens: int) -> dict:
    """HF's requests on a fresh thread with every core; its OpenMP pool ends with the thread."""
    result: dict = {}

    def body() -> None:
        torch.set_num_threads(THREADS)
        try:
            result.update(_run_hf(hf, prompts, max_tokens))
        except BaseException as e:  # re-raised on the calling thread
            result["error"] = e

    t = threading.Thread(target=body, name="hf-generate")
    t.start()
    t.join()
    if "error" in result:
        raise result["error"]
    return result


def _run_hf(hf: Any, prompts: list, max_tokens: int) -> dict:
    tokens = []
    t0 = time.perf_counter()
    for p in prompts:
        ids = torch.tensor([p])
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                          min_new_tokens=max_tokens, do_sample=False, pad_token_id=0)
        tokens.append(out[0, len(p):].tolist())
    wall = time.perf_counter() - t0
    check_counts("hf", tokens, max_tokens)
    return {"tokens": tokens, "wall_s": wall}


def cpu_counters() -> tuple[float, float, float, float]:
    """Machine-wide busy and stolen CPU s, this process's CPU s and the wall clock: other
    processes on a shared VM (and other VMs on its host) compete for the same cores."""
    f = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    hz = os.sysconf("SC_CLK_TCK")
    return (f[0] + f[1] + f[2] + f[5] + f[6]) / hz, f[7] / hz, time.process_time(), time.monotonic()


def contention(c0: tuple, c1: tuple) -> tuple[float, float]:
    """(other processes' CPU, hypervisor steal) between two counter readings, % of one CPU."""
    busy, steal, own, wall = (b - a for a, b in zip(c0, c1))
    return max(0.0, 100.0 * (busy - own) / wall), 100.0 * steal / wall


def check_counts(kind: str, tokens: list, max_tokens: int) -> None:
    """A run that produced fewer tokens cannot be allowed to look fast."""
    bad = [len(t) for t in tokens if len(t) != max_tokens]
    if bad:
        raise AssertionError(f"{kind}: requests produced {bad} tokens, expected {max_tokens} each")


def divergence(hf: Any, prompt: list, ref: list, ours: list) -> tuple[int, float]:
    """Index of the first differing token and HF's logit margin there (its pick minus ours)."""
    i = next(k for k, (a, b) in enumerate(zip(ref, ours)) if a != b)
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + ref[:i]])).logits[0, -1]
    return i, float(logits[ref[i]] - logits[ours[i]])

"""What the tensor-parallel tests share: a tiny Llama checkpoint with biases everywhere, process
checks through /proc (the disaggregation tests use them too), and a script of KV steps run
straight on a module."""

from __future__ import annotations

import os

import torch

from mstar_rt.distributed.tp_driver import TensorParallelLM
from mstar_rt.engines.attention_base import SeqStep
from mstar_rt.engines.kv_engine import KVStep
from mstar_rt.engines.paged_kv import PagedKVCache
from mstar_rt.engines.torch_backend import TorchAttention

from llama_ref import BASE

# Biases everywhere: the row-parallel biases must be added once, not once per rank.
TINY = dict(attention_bias=True, mlp_bias=True)


def save_llama(path, seed: int = 0, **overrides) -> None:
    import transformers

    torch.manual_seed(seed)
    config = transformers.LlamaConfig(**{**BASE, **TINY, **overrides})
    transformers.LlamaForCausalLM(config).eval().save_pretrained(path)


def children() -> list[int]:
    """Live processes whose parent is this one."""
    me, out = str(os.getpid()), []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except (FileNotFoundError, ProcessLookupError, IndexError):  # it went meanwhile
                continue
            if fields[1] == me and fields[0] != "Z":
                out.append(int(entry))
    return out


def follower_pids(module: TensorParallelLM) -> list[int]:
    return [f.proc.pid for f in module.followers]


def steps_of(cache: PagedKVCache, entry: list) -> KVStep:
    """One step ``[(label, token ids), ...]`` of request 0 on ``cache`` (every label persists):
    its sequences admitted, the KVStep for them."""
    steps = []
    for label, ids in entry:
        seq = cache.admit(0, label, len(ids))
        steps.append(SeqStep(seq.length, len(ids), list(seq.pages)))
    return KVStep(TorchAttention(cache), steps)


@torch.inference_mode()
def run_steps(module, script: list, call=None) -> list:
    """Runs ``script`` on a fresh cache of ``module``'s layout: each entry is a fork
    ``("fork", src, dst)`` or a step ``[(label, token ids), ...]`` (every label persists);
    returns each step's hidden states (or what ``call(ids, kv_step, step)`` returns)."""
    cache = PagedKVCache(module.kv_layout(), page_size=4, num_pages=32)
    backend, out = TorchAttention(cache), []
    for entry in script:
        if entry[0] == "fork":
            cache.fork(0, entry[1], entry[2])
            continue
        step = steps_of(cache, entry)
        ids = torch.tensor([t for _label, toks in entry for t in toks])
        kv = KVStep(backend, step.steps)
        out.append(module(ids, kv) if call is None else call(ids, kv, step))
        for label, toks in entry:
            cache.commit(0, label, len(toks))
    return out

"""Qwen3-Omni's thinker split over ``tp_size`` processes, as M* runs it: the 30B-A3B thinker is
~60 GB of bf16 weights, more than one 48 GB GPU holds, while the talker and code2wav are small
and stay whole on rank 0 (the driver, :mod:`mstar_rt.distributed.tp_driver`).

Megatron-style, like the Llama split (:mod:`mstar_rt.distributed.llama_shards`): each rank holds
its share of the query and KV heads (q/k/v rows, o_proj columns; the per-head q/k norms whole)
and of every expert's columns (gate and up rows, down columns) or of a dense layer's MLP; the
routers, norms, embeddings and LM head are whole on every rank, so each rank routes every token
to the same experts and the partial sums add up exactly. The hub checkpoint keeps one tensor per
expert; a rank reads only the thinker's tensors and keeps its slice of each.

With ``expert_parallel`` the experts split by whole experts instead: rank r holds the r-th even
block of each MoE layer's experts (all their columns; the others' tensors are not even kept) and
computes only the (token, expert) pairs routed to them; the same all-reduce adds the ranks'
shares. Fewer, larger GEMMs per rank than every expert's column slice (Qwen3-Omni-30B's experts
are 768 wide: 384 columns each at tp_size 2) and the same bytes on the wire; the load per rank
follows the router (a batch's tokens may favour one rank's experts).
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Optional, Union

import torch

from mstar_rt.distributed.split import TensorSplit, check_split
from mstar_rt.distributed.tp_driver import TensorParallelLM, load_tp
from mstar_rt.models.checkpoint import read_config
from mstar_rt.models.qwen3_omni.checkpoint import (Qwen3OmniConfig, checkpoint_dtype,
                                                   load_thinker)
from mstar_rt.models.qwen3_omni.thinker import ThinkerLM

LOADER = "mstar_rt.models.qwen3_omni.thinker_tp:load_thinker_shard"
LOADER_EP = "mstar_rt.models.qwen3_omni.thinker_tp:load_thinker_shard_ep"
#: an expert's tensors (hub: one per expert) and the fused ones ([E, ...]), by expert
_EXPERT = re.compile(r"\.mlp\.experts\.(\d+)\.")
_FUSED = re.compile(r"\.mlp\.experts\.(gate_up_proj|down_proj)$")
#: thinker key (after ``thinker.``) -> how it splits: rows, columns, or the fused experts.
_RULES = (
    (re.compile(r"\.self_attn\.[qkv]_proj\.(weight|bias)$"), "rows"),
    (re.compile(r"\.self_attn\.o_proj\.weight$"), "columns"),
    (re.compile(r"\.self_attn\.o_proj\.bias$"), "rank0"),
    (re.compile(r"\.mlp\.(experts\.\d+\.)?(gate|up)_proj\.weight$"), "rows"),
    (re.compile(r"\.mlp\.(experts\.\d+\.)?down_proj\.weight$"), "columns"),
    (re.compile(r"\.mlp\.experts\.gate_up_proj$"), "gate_up"),
    (re.compile(r"\.mlp\.experts\.down_proj$"), "columns"),
)


def thinker_share(key: str, tensor: torch.Tensor, split: TensorSplit
                  ) -> Optional[torch.Tensor]:
    """Rank ``split.rank``'s slice of thinker tensor ``key`` (whole when it is not split; None
    for an expert another rank holds, with ``split.experts``)."""
    block = split.expert_block()
    if block is not None:
        start, stop = block
        one = _EXPERT.search(key)
        if one is not None:
            return tensor if start <= int(one.group(1)) < stop else None
        if _FUSED.search(key):
            return tensor[start:stop]
    rule = next((r for pattern, r in _RULES if pattern.search(key)), None)
    if rule == "rows":
        a, b = split.part(tensor.shape[0])
        return tensor[a:b]
    if rule == "columns":
        a, b = split.part(tensor.shape[-1])
        return tensor[..., a:b]
    if rule == "gate_up":  # [E, 2I, H], gate rows first: this rank's gate rows and up rows
        gate, up = tensor.chunk(2, dim=1)
        a, b = split.part(gate.shape[1])
        return torch.cat([gate[:, a:b], up[:, a:b]], dim=1)
    if rule == "rank0" and split.rank != 0:
        return torch.zeros_like(tensor)  # the ranks' partial sums add up after the bias
    return tensor


def checked_config(path: Union[str, os.PathLike], tp_size: int,
                   expert_parallel: bool = False) -> Qwen3OmniConfig:
    """The checkpoint's config, refused when ``tp_size`` does not split the thinker evenly."""
    source = os.path.join(os.fspath(path), "config.json")
    config = Qwen3OmniConfig.from_hf(read_config(path), source)
    t = config.thinker
    if expert_parallel and t.num_experts % tp_size:
        raise ValueError(f"tp_size {tp_size} does not divide num_experts {t.num_experts} of the "
                         f"thinker of {source}: with expert_parallel every rank holds an equal "
                         f"block of whole experts; use a tp_size that divides {t.num_experts}, "
                         "or expert_parallel=False")
    widths = [t.moe_intermediate_size] if t.num_experts and not expert_parallel else []
    if t.dense_layers:
        widths.append(t.intermediate_size)
    for width in widths or [t.intermediate_size]:
        check_split(t.num_attention_heads, t.num_key_value_heads, width, tp_size,
                    f"the thinker of {source}")
    return config


def load_thinker_shard(path: str, split: TensorSplit, dtype: torch.dtype,
                       device: str = "cpu") -> ThinkerLM:
    """Rank ``split.rank``'s thinker (the driver's and each follower's loader)."""
    return load_thinker(path, split, dtype, device)


def load_thinker_shard_ep(path: str, split: TensorSplit, dtype: torch.dtype,
                          device: str = "cpu") -> ThinkerLM:
    """Rank ``split.rank``'s thinker with its block of whole experts (expert parallelism)."""
    experts = checked_config(path, split.size, expert_parallel=True).thinker.num_experts
    return load_thinker(path, dataclasses.replace(split, experts=experts), dtype, device)


def load_thinker_tp(path: Union[str, os.PathLike], tp_size: int,
                    dtype: Optional[torch.dtype] = None, device: str = "cpu",
                    timeout_s: float = 60.0, start_timeout_s: float = 300.0,
                    num_threads: Optional[int] = None, restart: str = "auto",
                    max_restarts: int = 3, expert_parallel: bool = False) -> TensorParallelLM:
    """The thinker of the Qwen3-Omni checkpoint at ``path`` split over ``tp_size`` ranks
    (refused before anything starts when ``tp_size`` does not divide its heads, KV heads and
    expert width -- or, with ``expert_parallel``, its number of experts); the other arguments
    are :func:`~mstar_rt.distributed.tp_driver.load_tp`'s. The result has :class:`ThinkerLM`'s
    face: ``Qwen3Omni`` serves it unchanged."""
    path = os.fspath(path)
    checked_config(path, tp_size, expert_parallel)
    return load_tp(path, tp_size, LOADER_EP if expert_parallel else LOADER, "Qwen3-Omni thinker",
                   checkpoint_dtype(path, dtype), device, timeout_s, start_timeout_s,
                   num_threads, restart, max_restarts)


__all__ = ["checked_config", "load_thinker_shard", "load_thinker_shard_ep", "load_thinker_tp",
           "thinker_share"]

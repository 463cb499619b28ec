"""The attention-backend interface of the KV engine, and the choice of backend.

A backend attends over a :class:`~mstar_rt.engines.paged_kv.PagedKVCache`: per step it builds one
plan from the step's :class:`~mstar_rt.engines.attention_base.SeqStep` list (positions, gather
indices, masks), then every layer calls ``attend`` with that plan, which also writes the step's
persisted K/V into the pages. For CUDA-graph decode a backend makes a static-shape twin
(:class:`StaticDecodeAttention`) whose buffers keep their addresses between replays.

Two backends, same inputs and same results (docs/engines.md):

* ``torch`` (:mod:`mstar_rt.engines.torch_backend`): gather + ``scaled_dot_product_attention``;
  CPU and CUDA;
* ``flashinfer`` (:mod:`mstar_rt.engines.flashinfer_backend`): FlashInfer's paged kernels; CUDA,
  fp16/bf16, the optional ``flashinfer`` package, imported only when the backend is built.

:func:`select_backend` picks one by name, or for ``"auto"`` by the cache's device and dtype and
whether FlashInfer is installed.
"""

from __future__ import annotations

from typing import Callable, Optional, Protocol, Sequence as Seq

import torch

from mstar_rt.engines.attention_base import SeqStep, StaticDecodePlan, runs
from mstar_rt.engines.flashinfer_backend import FlashInferAttention, flashinfer_available
from mstar_rt.engines.paged_kv import PagedKVCache
from mstar_rt.engines.torch_backend import TorchAttention


class AttentionPlan(Protocol):
    """What a backend's plan exposes to the model besides what its ``attend`` reads."""

    positions: torch.Tensor   # [T]: positions of the step's new tokens, work after work
    last_token: torch.Tensor  # [B]: index of each work's last new token among the T


class StaticDecodeAttention(Protocol):
    """Decode attention over fixed-address buffers, one plan per batch-size bucket: ``fill``
    writes a step into the plan (outside a CUDA graph), ``prepare`` derives what the layers
    read (inside it), ``attend`` is what the graph captures."""

    max_seq_len: int

    def new_plan(self, size: int) -> StaticDecodePlan: ...

    def fill(self, plan: StaticDecodePlan, steps: Seq[SeqStep]) -> None: ...

    def prepare(self, plan: StaticDecodePlan) -> None: ...

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               plan: StaticDecodePlan, scale: Optional[float] = None) -> torch.Tensor: ...


class AttentionBackend(Protocol):
    """Paged attention for the KV engine. ``plan(steps)`` once per step; ``attend`` per layer
    with q ``[T, Hq, D]`` and k/v ``[T, Hkv, D]`` of the step's new tokens (flat, work after
    work), returning ``[T, Hq, D]`` and writing persisted K/V into ``cache``'s pages;
    ``static_decode`` makes the static-shape decode attention for CUDA-graph buckets (it may
    serve fewer than ``max_seq_len`` positions: its own ``max_seq_len`` says how many)."""

    name: str
    cache: PagedKVCache

    def plan(self, steps: Seq[SeqStep]) -> AttentionPlan: ...

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               plan: AttentionPlan, scale: Optional[float] = None) -> torch.Tensor: ...

    def static_decode(self, num_qo_heads: int, max_seq_len: int) -> StaticDecodeAttention: ...


BACKENDS: dict[str, Callable[[PagedKVCache], AttentionBackend]] = {
    "torch": TorchAttention,
    "flashinfer": FlashInferAttention,
}


def select_backend(name: str, cache: PagedKVCache) -> AttentionBackend:
    """The attention backend ``name`` (``"torch"``, ``"flashinfer"``) for ``cache``; ``"auto"``
    is FlashInfer when it runs the cache's device and dtype (CUDA, fp16/bf16) and is installed,
    else torch. A backend that cannot run the cache raises a ValueError saying what to change."""
    if name == "auto":
        layout = cache.layout
        fits = runs("flashinfer", layout.dtype, layout.device)
        name = "flashinfer" if fits and flashinfer_available() else "torch"
    make = BACKENDS.get(name)
    if make is None:
        raise ValueError(f"unknown attention_backend '{name}'; use 'torch', 'flashinfer' or "
                         "'auto'")
    return make(cache)


__all__ = ["AttentionBackend", "AttentionPlan", "BACKENDS", "StaticDecodeAttention",
           "select_backend"]

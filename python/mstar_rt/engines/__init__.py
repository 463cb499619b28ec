"""Engines run node batches: :class:`StatelessEngine` for independent calls and
:class:`KVCacheEngine` (paged KV cache, continuous batching) for transformer nodes, which attend
through an :class:`~mstar_rt.engines.attention.AttentionBackend` (torch or FlashInfer, chosen by
:func:`~mstar_rt.engines.attention.select_backend`).

The KV parts import torch; they load on first use so ``import mstar_rt`` stays light.
"""

from __future__ import annotations

import importlib
from typing import Any

from mstar_rt.engines.base import Engine, StatelessEngine, stack_pad

_LAZY = {
    "KVCacheEngine": "mstar_rt.engines.kv_engine",
    "KVNodeSubmodule": "mstar_rt.engines.kv_engine",
    "KVWork": "mstar_rt.engines.kv_engine",
    "KVStep": "mstar_rt.engines.kv_engine",
    "KVLayout": "mstar_rt.engines.paged_kv",
    "PagedKVCache": "mstar_rt.engines.paged_kv",
    "OutOfPages": "mstar_rt.engines.paged_kv",
    "SequenceTooLarge": "mstar_rt.engines.paged_kv",
    "Causal": "mstar_rt.engines.masks",
    "PrefixBidirectional": "mstar_rt.engines.masks",
    "BlockCausal": "mstar_rt.engines.masks",
    "AttentionBackend": "mstar_rt.engines.attention",
    "select_backend": "mstar_rt.engines.attention",
    "SamplingParams": "mstar_rt.engines.sampling",
}

__all__ = ["Engine", "StatelessEngine", "stack_pad", *_LAZY]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'mstar_rt.engines' has no attribute '{name}'")
    return getattr(importlib.import_module(module), name)

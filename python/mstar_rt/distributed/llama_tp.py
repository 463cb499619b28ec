"""A Llama split over ``tp_size`` processes (the driver: :mod:`.tp_driver`; a rank's share of
the checkpoint: :mod:`.llama_shards`)."""

from __future__ import annotations

import os
from typing import Optional, Union

import torch

from mstar_rt.distributed.llama_shards import checked_config
from mstar_rt.distributed.tp_driver import TensorParallelLM, load_tp
from mstar_rt.models.llama import checkpoint_dtype

LOADER = "mstar_rt.distributed.llama_shards:load_llama_shard"


def load_llama_tp(path: Union[str, os.PathLike], tp_size: int,
                  dtype: Optional[torch.dtype] = None, device: str = "cpu",
                  timeout_s: float = 60.0, start_timeout_s: float = 300.0,
                  num_threads: Optional[int] = None, restart: str = "auto",
                  max_restarts: int = 3) -> TensorParallelLM:
    """Loads the HF Llama checkpoint at ``path`` split over ``tp_size`` ranks (refused before
    anything starts when ``tp_size`` does not divide its heads and MLP width); the arguments
    are :func:`~mstar_rt.distributed.tp_driver.load_tp`'s."""
    path = os.fspath(path)
    config = checked_config(path, tp_size)
    return load_tp(path, tp_size, LOADER, "Llama", checkpoint_dtype(config, path, dtype),
                   device, timeout_s, start_timeout_s, num_threads, restart, max_restarts)


__all__ = ["load_llama_tp"]

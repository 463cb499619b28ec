"""The arguments of a :class:`~mstar_rt.distributed.disagg.DisaggregatedLM`, checked before its
decode process starts: what that process could not take failed there (a pickling error, or a
torch error about a device) after it had started, or not at all (max_restarts=-1)."""

from __future__ import annotations

import pickle
from typing import Any, Mapping, Sequence


def check_args(kwargs: Mapping[str, Any], devices: Sequence[str], restart: str,
               max_restarts: int, timeouts: Mapping[str, float]) -> None:
    """ValueError / TypeError naming the argument to fix."""
    for name, seconds in timeouts.items():  # 0 failed the start in the gloo rendezvous
        if not (isinstance(seconds, (int, float)) and 0 < seconds < float("inf")):
            raise ValueError(f"{name}={seconds!r}: give seconds > 0")
    if restart not in ("auto", "manual"):
        raise ValueError(f"restart must be 'auto' or 'manual', not {restart!r}")
    if type(max_restarts) is not int or max_restarts < 0:
        raise ValueError(f"max_restarts={max_restarts!r}: give a count >= 0")
    if kwargs.get("tp_size", 1) != 1:
        raise ValueError(f"tp_size={kwargs['tp_size']}: a DisaggregatedLM moves a request's "
                         "K/V pages between two processes, and a tensor-parallel cache is "
                         "split over ranks that cannot export them; give tp_size 1")
    if "engine" in kwargs:
        raise ValueError("engine: each side builds a KVCacheEngine of its own; give their "
                         "settings as prefill_engine= / decode_engine= (mappings of "
                         "KVCacheEngine arguments)")
    for key, value in kwargs.items():  # they are sent to the decode process
        try:
            pickle.dumps(value)
        except Exception as e:
            raise TypeError(f"kwargs['{key}'] ({type(value).__name__}) cannot reach the decode "
                            f"process ({type(e).__name__}: {e}); give plain data, or build it "
                            "inside the factory") from None
    if not (isinstance(devices, (tuple, list)) and len(devices) == 2
            and all(isinstance(d, str) and (d == "cpu" or d.startswith("cuda")) for d in devices)):
        raise ValueError(f"devices={devices!r}: give two of 'cpu' or 'cuda:N' (prefill, decode)")
    if any(d.startswith("cuda") for d in devices):
        import torch

        if not torch.cuda.is_available():
            raise ValueError(f"devices={tuple(devices)!r}: this process sees no CUDA device "
                             "(torch.cuda.is_available() is False); give ('cpu', 'cpu')")

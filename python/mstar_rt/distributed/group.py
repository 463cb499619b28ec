"""The process group of one tensor-parallel model: its rendezvous and its two collectives.

Each model gets a group of its own, built straight from a ``TCPStore`` rather than through
``torch.distributed.init_process_group``: that one is process-global, and a driver process may
serve several models (or already run a default group of its own). The driver's store listens on
a free port that the OS picks (listening on every interface, as torch's store does); followers
connect to it at the driver's address: loopback on one host, the node's address across hosts. Every collective gives up after
``timeout_s`` (a rank that stopped answering), and gloo fails at once when a peer's connection
closes (a rank that died).
"""

from __future__ import annotations

import datetime
from typing import Any

import torch
import torch.distributed as dist


def backend_for(device: str) -> str:
    """``"nccl"`` for a model on CUDA, else ``"gloo"``."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def open_store(world: int, timeout_s: float) -> Any:
    """The driver's rendezvous store, on a free port (``store.port``)."""
    return dist.TCPStore("127.0.0.1", 0, world, True,
                         timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False)


def join_store(port: int, world: int, timeout_s: float, host: str = "127.0.0.1") -> Any:
    """A follower's client of the driver's store at ``host``."""
    return dist.TCPStore(host, port, world, False,
                         timeout=datetime.timedelta(seconds=timeout_s))


class TPGroup:
    """Rank ``rank`` of ``size`` in the group keyed ``key`` on ``store``; the constructor
    returns once every rank has joined (or raises after ``timeout_s``)."""

    def __init__(self, store: Any, key: str, rank: int, size: int, device: str,
                 timeout_s: float) -> None:
        self.rank, self.size, self.device = rank, size, device
        self.store = store  # the driver's store serves the others while they join
        self.backend = backend_for(device)
        prefixed = dist.PrefixStore(f"mstar_tp/{key}/", store)
        timeout = datetime.timedelta(seconds=timeout_s)
        if self.backend == "nccl":  # never run: no GPU machine has been lent to this path yet
            self.pg = dist.ProcessGroupNCCL(prefixed, rank, size)
            self.pg.set_timeout(timeout)
        else:
            self.pg = dist.ProcessGroupGloo(prefixed, rank, size, timeout)

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sums ``t`` over the ranks, in place; returns it."""
        self.pg.allreduce([t]).wait()
        return t

    def broadcast(self, t: torch.Tensor) -> torch.Tensor:
        """Overwrites ``t`` with the driver's (rank 0's) ``t``; returns it."""
        self.pg.broadcast(t, 0).wait()
        return t

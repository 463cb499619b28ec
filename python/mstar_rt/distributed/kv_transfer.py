"""A point-to-point channel for a request's KV between two processes, on ``torch.distributed``.

One message is a *description* (a dict of plain data: the request's decode state, the KV's
layout) and a few tensors (the K/V, one contiguous buffer). On the wire: the description's
length (one int64), the description as JSON bytes, then each tensor's bytes, all by
``send``/``recv`` on a two-rank process group of the channel's own (gloo on CPU; NCCL on CUDA,
which has never run here). Each operation gives up after ``timeout_s``; gloo fails at once when
the peer's connection closes. A channel that failed once is broken for good (a timed-out gloo
pair is closed): every later call raises at once, naming the first failure.
"""

from __future__ import annotations

import base64
import datetime
import json
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

from mstar_rt.distributed.group import backend_for
from mstar_rt.engines.paged_kv import SequenceKV

_TAG = 0


class TransferError(RuntimeError):
    """A KV transfer failed: the peer died, stopped answering, or the channel broke before."""


def _encode(value: Any) -> Any:
    if isinstance(value, (bytes, bytearray)):
        return {"$bytes": base64.b64encode(bytes(value)).decode("ascii")}
    raise TypeError(f"a KV transfer description holds plain data (dict, list, str, int, float, "
                    f"bool, None, bytes), not {type(value).__name__}")


def _decode(obj: dict) -> Any:
    if obj.keys() == {"$bytes"}:
        return base64.b64decode(obj["$bytes"])
    return obj


class KVChannel:
    """Rank ``rank`` (0 or 1) of the channel keyed ``key`` on ``store`` (a ``TCPStore``, see
    :func:`~mstar_rt.distributed.group.open_store`); the constructor returns once both ranks
    joined. ``device``: where the tensors live (``cuda:N`` selects NCCL)."""

    def __init__(self, store: Any, key: str, rank: int, device: str = "cpu",
                 timeout_s: float = 60.0) -> None:
        if rank not in (0, 1):
            raise ValueError(f"a KV channel has ranks 0 and 1, not {rank}")
        self.rank, self.peer, self.device, self.timeout_s = rank, 1 - rank, device, timeout_s
        self.backend = backend_for(device)
        self.broken: Optional[str] = None
        self.sent = self.received = 0  # messages, for stats and tests
        prefixed = dist.PrefixStore(f"mstar_kv/{key}/", store)
        timeout = datetime.timedelta(seconds=timeout_s)
        if self.backend == "nccl":  # never run: no GPU machine has been lent to this path yet
            self.pg = dist.ProcessGroupNCCL(prefixed, rank, 2)
            self.pg.set_timeout(timeout)
            self.wire = device  # NCCL moves device tensors only, the description included
        else:
            self.pg = dist.ProcessGroupGloo(prefixed, rank, 2, timeout)
            self.wire = "cpu"

    # ---- messages ----------------------------------------------------------------------------

    def send(self, description: dict, tensors: Sequence[torch.Tensor] = ()) -> None:
        """Sends one message; returns when the peer has it (or raises TransferError)."""
        specs = [dict(dtype=str(t.dtype).removeprefix("torch."), shape=list(t.shape))
                 for t in tensors]
        text = json.dumps({"d": description, "t": specs}, default=_encode).encode()
        head = torch.tensor([len(text)], dtype=torch.int64, device=self.wire)
        body = torch.frombuffer(bytearray(text), dtype=torch.uint8).to(self.wire)
        self._run("send", [head, body] + [self._bytes(t.to(self.wire)) for t in tensors])
        self.sent += 1

    def recv(self) -> tuple[dict, list[torch.Tensor]]:
        """Waits for the peer's next message: (description, tensors on the wire's device)."""
        head = torch.empty(1, dtype=torch.int64, device=self.wire)
        self._run("recv", [head])
        body = torch.empty(int(head[0]), dtype=torch.uint8, device=self.wire)
        self._run("recv", [body])
        message = json.loads(body.cpu().numpy().tobytes(), object_hook=_decode)
        tensors = [torch.empty(s["shape"], dtype=getattr(torch, s["dtype"]), device=self.wire)
                   for s in message["t"]]
        self._run("recv", [self._bytes(t) for t in tensors])
        self.received += 1
        return message["d"], tensors

    def send_kv(self, description: dict, kv: SequenceKV) -> None:
        """Sends a request's K/V with its description (``kv`` layout under the key ``kv``)."""
        self.send({**description, "kv": kv.describe()}, [kv.data])

    def recv_kv(self, device: Optional[str] = None) -> tuple[dict, SequenceKV]:
        """The peer's next :meth:`send_kv`: (description, K/V on ``device``)."""
        description, tensors = self.recv()
        if len(tensors) != 1 or "kv" not in description:
            raise TransferError(f"the KV channel got a message that is not a KV transfer "
                                f"({len(tensors)} tensors, keys {sorted(description)})")
        data = tensors[0] if device is None else tensors[0].to(device)
        return description, SequenceKV(data, int(description["kv"]["reserve"]))

    # ---- the wire ----------------------------------------------------------------------------

    @staticmethod
    def _bytes(t: torch.Tensor) -> torch.Tensor:
        """``t``'s storage as flat bytes (gloo and NCCL move every dtype alike that way)."""
        return t.contiguous().reshape(-1).view(torch.uint8)

    def _run(self, op: str, tensors: list[torch.Tensor]) -> None:
        if self.broken is not None:
            raise TransferError(self.broken)
        try:
            for t in tensors:
                if t.numel() == 0:
                    continue
                work = (self.pg.send([t], self.peer, _TAG) if op == "send"
                        else self.pg.recv([t], self.peer, _TAG))
                work.wait(datetime.timedelta(seconds=self.timeout_s))
        except Exception as e:
            self.broken = (f"the KV channel (rank {self.rank}, {self.backend}) failed to {op}: "
                           f"{type(e).__name__}: {e}; a broken channel cannot be reused, start "
                           "the two sides again")
            raise TransferError(self.broken) from None

"""The walk boundary of a disaggregated causal LM: the two halves of a :class:`CausalLM`.

* :class:`PrefillSide` serves the ``prefill`` walk only. Where the LM would go on to ``decode``,
  its ``next_walk`` lifts the request's K/V out of the engine (on the engine's thread, before
  the request's end frees the pages) with the decode state, leaves them in
  ``request.state["handoff"]`` as a :class:`Handoff`, and ends the request.
* :class:`DecodeSide` serves the ``decode`` walk for requests that start there: inputs
  ``token`` (the first decode input) and ``handoff`` (a key into :meth:`DecodeSide.expect`'s
  table). Its first step (:meth:`LMNode.resume`) writes the K/V into the engine's own pages
  (``KVWork.kv_import``) and restores the state, so decode runs exactly as in the colocated LM.

Whatever moves the :class:`Handoff` between them (:mod:`~mstar_rt.distributed.kv_transfer`, a
queue in one process) is not their business.
"""

from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass
from typing import Any, Mapping, Optional

from mstar_rt.engines.kv_engine import KVCacheEngine
from mstar_rt.engines.paged_kv import SequenceKV
from mstar_rt.graph import DynamicLoop
from mstar_rt.model import Model, RequestContext
from mstar_rt.models.causal_lm import LOOP, CausalLM


@dataclass
class Handoff:
    """A request between its walks: ``state`` (:meth:`LMNode.handoff_state`'s plain data,
    ``state["token"]`` the first decode input) and its cached K/V."""

    state: dict
    kv: SequenceKV


def lm_engine(lm: CausalLM) -> KVCacheEngine:
    engine = lm.engine_specs["lm"]
    if not isinstance(engine, KVCacheEngine):
        raise TypeError(f"the LM's engine is {type(engine).__name__}, not a KVCacheEngine")
    return engine


class PrefillSide(Model):
    """``lm``'s graph, run up to the end of ``prefill`` (see the module doc). A request that is
    done after prefill (EOS, ``max_tokens`` 1) has no handoff."""

    def __init__(self, lm: CausalLM, export_device: str = "cpu") -> None:
        """``export_device``: where the lifted K/V go (the transfer's device)."""
        self.lm, self.engine, self.export_device = lm, lm_engine(lm), export_device
        self.nodes, self.walks = lm.nodes, lm.walks
        self.inputs, self.input_defaults = lm.inputs, lm.input_defaults
        self.engine_specs = lm.engine_specs

    def validate_inputs(self, inputs: Mapping[str, Any]) -> None:
        self.lm.validate_inputs(inputs)

    def initial_walk(self, request: RequestContext) -> str:
        return "prefill"

    def next_walk(self, request: RequestContext, finished_walk: str,
                  persisted: Mapping[str, Any]) -> Optional[str]:
        if finished_walk == "prefill" and not request.state.get("done", True):
            state = self.lm.lm.handoff_state(request.state)
            kv = self.engine.export_request(request.id, free=True, device=self.export_device)
            request.state["handoff"] = Handoff(state, kv)
        return None


class HandoffTable:
    """Handoffs waiting for their request's first decode step, by key (thread-safe): what
    :attr:`LMNode.handoffs` holds on a decode side."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.items: dict[Any, Handoff] = {}

    def put(self, key: Any, handoff: Handoff) -> None:
        with self.lock:
            if key in self.items:
                raise ValueError(f"handoff {key!r} is expected already")
            self.items[key] = handoff

    def take(self, key: Any) -> Optional[Handoff]:
        with self.lock:
            return self.items.pop(key, None)

    def __len__(self) -> int:
        with self.lock:
            return len(self.items)


class DecodeSide(Model):
    """``lm``'s ``decode`` walk for requests whose prefill ran elsewhere (see the module doc):
    ``expect(key, handoff)`` then ``submit({"token": handoff.state["token"], "handoff": key})``
    (:meth:`request` builds those inputs)."""

    inputs = ("token", "handoff")

    def __init__(self, lm: CausalLM) -> None:
        self.lm, self.engine = lm, lm_engine(lm)
        self.pending = HandoffTable()
        lm.lm.handoffs = self.pending
        decode = next(n for n in lm.nodes if n.name == "decode")
        self.nodes = [dataclasses.replace(decode, inputs=("token", "handoff"))]
        self.walks = {"decode": DynamicLoop("decode", lm.lm.max_seq_len, LOOP)}
        self.engine_specs = lm.engine_specs

    def expect(self, key: Any, handoff: Handoff) -> None:
        self.pending.put(key, handoff)

    def request(self, key: Any, handoff: Handoff) -> dict:
        """Registers ``handoff`` under ``key``; returns the inputs to submit for it."""
        self.expect(key, handoff)
        return {"token": int(handoff.state["token"]), "handoff": key}

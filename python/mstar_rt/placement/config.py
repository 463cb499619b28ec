"""Placement configuration: which nodes run where, and the model every process builds.

A :class:`NodeGroup` puts nodes on a rank. Rank 0 is the parent process (the Conductor and every
node no group names); a group with ``process=True`` runs in a worker process of its own, one per
rank; ``process=False`` keeps its nodes in the parent on an engine thread of their own. Every
process builds the model from a :class:`ModelSpec` -- an import path and JSON-able keyword
arguments -- so no model object ever crosses a process boundary.
"""

from __future__ import annotations

import importlib
import json
import re
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence, Union

from mstar_rt.model import Model

_DEVICE = re.compile(r"^(cpu|cuda(:\d+)?)$")


@dataclass(frozen=True)
class ModelSpec:
    """``factory``: ``"package.module:attr"`` naming a Model class or a function returning a
    Model; ``kwargs`` (JSON data) are passed to it in every process; ``parent_kwargs`` override
    them in the parent, which needs the graph and state machine but not the placed nodes'
    weights (e.g. ``{"device": "meta"}`` for a factory that supports it)."""

    factory: str
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    parent_kwargs: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.factory, str) or not re.match(r"^[\w.]+:[\w.]+$", self.factory):
            raise ValueError(f"ModelSpec factory {self.factory!r} must look like "
                             "'package.module:ClassOrFunction'")
        for what, kw in (("kwargs", self.kwargs), ("parent_kwargs", self.parent_kwargs)):
            try:
                json.dumps(dict(kw), allow_nan=False)
            except (TypeError, ValueError) as e:
                raise ValueError(f"ModelSpec {what} must be JSON data (numbers, strings, lists, "
                                 f"dicts) so every worker can get them: {e}; build other objects "
                                 "inside the factory") from None

    def build(self, overrides: Optional[Mapping[str, Any]] = None) -> Model:
        module_name, _, attr = self.factory.partition(":")
        obj: Any = importlib.import_module(module_name)
        for part in attr.split("."):
            obj = getattr(obj, part)
        model = obj(**{**self.kwargs, **(overrides or {})})
        if not isinstance(model, Model):
            raise TypeError(f"{self.factory} returned {type(model).__name__}, not an "
                            "mstar_rt.Model")
        return model


@dataclass(frozen=True)
class NodeGroup:
    """``nodes`` run on ``rank``. ``process``: in a worker process (else a thread of the parent).
    ``device``: ``cpu``, ``cuda`` or ``cuda:N`` (a worker on ``cuda:N`` sees only that GPU, as
    ``cuda:0``). ``model_kwargs`` override the ModelSpec's kwargs in this worker (e.g. its
    device). ``request_inputs``: send each request's inputs to the worker so ``prepare_inputs``
    can read ``ctx.request.inputs`` (turn off when its nodes read only their own inputs, to spare
    a copy of large ones)."""

    nodes: Sequence[str]
    rank: int
    process: bool = True
    device: str = "cpu"
    model_kwargs: Mapping[str, Any] = field(default_factory=dict)
    request_inputs: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "nodes", tuple(self.nodes))
        if not self.nodes or not all(isinstance(n, str) for n in self.nodes):
            raise ValueError(f"NodeGroup(rank={self.rank}) needs a non-empty list of node names")
        if type(self.rank) is not int or self.rank < 0:
            raise ValueError(f"NodeGroup rank {self.rank!r} must be an integer >= 0")
        if self.process and self.rank == 0:
            raise ValueError(f"NodeGroup {list(self.nodes)}: rank 0 is the parent process; give "
                             "a worker process rank 1 or higher")
        if not _DEVICE.match(self.device):
            raise ValueError(f"NodeGroup rank {self.rank}: device {self.device!r} is not 'cpu', "
                             "'cuda' or 'cuda:N'")
        try:
            json.dumps(dict(self.model_kwargs), allow_nan=False)
        except (TypeError, ValueError) as e:
            raise ValueError(f"NodeGroup rank {self.rank}: model_kwargs must be JSON data: {e}") \
                from None


@dataclass
class RankPlan:
    """What one worker process runs."""

    rank: int
    nodes: list[str]
    device: str
    model_kwargs: dict[str, Any]
    request_inputs: bool


@dataclass
class Plan:
    node_rank: dict[str, int]        # every node -> its rank (0: the parent)
    workers: dict[int, RankPlan]     # process ranks
    parent_engines: dict[str, str]   # node -> engine name in the parent's runtime


def make_plan(model: Model, groups: Sequence[NodeGroup]) -> Plan:
    """Checks ``groups`` against the model and decides each node's rank and parent engine."""
    names = [n.name for n in model.nodes]
    node_rank: dict[str, int] = {n: 0 for n in names}
    rank_process: dict[int, bool] = {}
    workers: dict[int, RankPlan] = {}
    seen: dict[str, int] = {}
    for g in groups:
        if not isinstance(g, NodeGroup):
            raise TypeError(f"node_groups must hold NodeGroup objects, not {type(g).__name__}")
        unknown = [n for n in g.nodes if n not in node_rank]
        if unknown:
            raise ValueError(f"NodeGroup rank {g.rank} names nodes {unknown} that the model "
                             f"does not have; its nodes are {names}")
        for n in g.nodes:
            if n in seen:
                raise ValueError(f"node '{n}' is in two node groups (ranks {seen[n]} and "
                                 f"{g.rank}); put each node in one group")
            seen[n] = g.rank
            node_rank[n] = g.rank
        if rank_process.setdefault(g.rank, g.process) != g.process:
            raise ValueError(f"rank {g.rank} is both a worker process and a parent thread; give "
                             "the groups different ranks")
        if g.process:
            plan = workers.get(g.rank)
            if plan is None:
                workers[g.rank] = RankPlan(g.rank, list(g.nodes), g.device, dict(g.model_kwargs),
                                           g.request_inputs)
            elif (plan.device, plan.model_kwargs) != (g.device, dict(g.model_kwargs)):
                raise ValueError(f"node groups of rank {g.rank} give different devices or "
                                 "model_kwargs; one worker process builds one model")
            else:
                plan.nodes.extend(g.nodes)
                plan.request_inputs |= g.request_inputs
    # An engine object with state (a KV cache) lives in exactly one process.
    engine_ranks: dict[str, set[int]] = {}
    for n in names:
        engine_ranks.setdefault(model.engines.get(n, "default"), set()).add(node_rank[n])
    for engine, ranks in engine_ranks.items():
        if engine in model.engine_specs and len(ranks) > 1:
            members = [n for n in names if model.engines.get(n, "default") == engine]
            raise ValueError(f"nodes {members} share engine '{engine}' (its state, e.g. a KV "
                             f"cache, lives in one process) but are placed on ranks "
                             f"{sorted(ranks)}; put them in one node group")
    parent_engines = {}
    for n in names:
        engine, rank = model.engines.get(n, "default"), node_rank[n]
        remote = rank in workers
        split = rank != 0 and (remote or engine not in model.engine_specs)
        parent_engines[n] = f"{engine}@rank{rank}" if split else engine
    return Plan(node_rank, workers, parent_engines)


_OPTIONS = ("shm_bytes", "ready_timeout_s", "restart", "max_restarts", "progress", "poll_s")


def read_config(source: Union[str, Mapping[str, Any]]) -> dict[str, Any]:
    """PlacedRuntime keyword arguments from a placement config: a YAML file path or its mapping.

    .. code-block:: yaml

        model:
          factory: my_pkg.models:build_policy     # every process builds the model from this
          kwargs: {num_pages: 4096}                # KV-cache sizes etc. are the model's kwargs
          parent_kwargs: {device: meta}            # optional: the parent's copy
        node_groups:
          - {nodes: [vision], rank: 1, device: "cuda:0"}
          - {nodes: [prefill, decode], rank: 2, device: "cuda:1", model_kwargs: {device: cuda}}
        restart: auto                              # shm_bytes, ready_timeout_s, max_restarts,
                                                   # progress, poll_s: as PlacedRuntime's
    """
    if isinstance(source, str):
        import yaml

        with open(source) as f:
            cfg = yaml.safe_load(f)
        where = source
    else:
        cfg, where = source, "the placement config"
    if not isinstance(cfg, Mapping):
        raise ValueError(f"{where} must be a mapping with 'model' and 'node_groups'")
    unknown = set(cfg) - {"model", "node_groups", *_OPTIONS}
    if unknown:
        raise ValueError(f"{where}: unknown keys {sorted(unknown)}; known: model, node_groups, "
                         f"{', '.join(_OPTIONS)}")
    model = cfg.get("model")
    if isinstance(model, str):
        model = {"factory": model}
    if not isinstance(model, Mapping) or "factory" not in model:
        raise ValueError(f"{where}: 'model' needs a 'factory' such as 'package.module:build'")
    extra = set(model) - {"factory", "kwargs", "parent_kwargs"}
    if extra:
        raise ValueError(f"{where}: unknown model keys {sorted(extra)}; use factory, kwargs, "
                         "parent_kwargs")
    groups = cfg.get("node_groups") or []
    if not isinstance(groups, list) or not all(isinstance(g, Mapping) for g in groups):
        raise ValueError(f"{where}: 'node_groups' must be a list of mappings")
    fields = {"nodes", "rank", "process", "device", "model_kwargs", "request_inputs"}
    for g in groups:
        if set(g) - fields:
            raise ValueError(f"{where}: unknown node group keys {sorted(set(g) - fields)}; "
                             f"use {sorted(fields)}")
    out: dict[str, Any] = {k: cfg[k] for k in _OPTIONS if k in cfg}
    out["model"] = ModelSpec(model["factory"], dict(model.get("kwargs") or {}),
                             dict(model.get("parent_kwargs") or {}))
    out["node_groups"] = [NodeGroup(**g) for g in groups]
    return out

"""Placement plans: which rank each node runs on, and what each worker process runs.

The config side -- :class:`ModelSpec` (the model every process builds from an import path and
JSON keyword arguments, so no model object ever crosses a process boundary) and
:class:`NodeGroup` (nodes on a rank; ``process=True``, the default here, a worker process of its
own; ``process=False`` the parent, on an engine thread of its own) -- lives in
:mod:`mstar_rt.config`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence, Union

from mstar_rt.config import ModelSpec, NodeGroup, check_groups, read_placement
from mstar_rt.model import Model, node_engines
from mstar_rt.placement.kv_moves import plan_moves
from mstar_rt.placement.ray_rank import actor_options

__all__ = ["ModelSpec", "NodeGroup", "Plan", "RankPlan", "make_plan", "read_config"]


@dataclass
class RankPlan:
    """What one worker process runs."""

    rank: int
    nodes: list[str]
    device: str
    model_kwargs: dict[str, Any]
    request_inputs: bool
    ray_options: dict[str, Any]  # its Ray actor's resources (launcher="ray")
    follower_options: list[dict[str, Any]] = field(default_factory=list)  # tp_resources


@dataclass
class Plan:
    node_rank: dict[str, int]        # every node -> its rank (0: the parent)
    workers: dict[int, RankPlan]     # process ranks
    parent_engines: dict[str, str]   # node -> engine name in the parent's runtime
    kv_moves: dict[str, dict[str, int]] = field(default_factory=dict)  # engine -> walk -> rank


def make_plan(model: Model, groups: Sequence[NodeGroup]) -> Plan:
    """Checks ``groups`` against the model and decides each node's rank and parent engine."""
    for g in groups:
        if not isinstance(g, NodeGroup):
            raise TypeError(f"node_groups must hold NodeGroup objects, not {type(g).__name__}")
    check_groups(groups)
    names = [n.name for n in model.nodes]
    node_rank: dict[str, int] = {n: 0 for n in names}
    rank_process: dict[int, bool] = {}
    workers: dict[int, RankPlan] = {}
    seen: dict[str, int] = {}
    for g in groups:
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
            ray_options = actor_options(g.num_cpus, g.num_gpus, g.resources, g.device)
            followers = [actor_options(g.num_cpus, g.num_gpus, r, g.device)
                         for r in g.tp_resources or ()]
            if plan is None:
                workers[g.rank] = RankPlan(g.rank, list(g.nodes), g.device, dict(g.model_kwargs),
                                           g.request_inputs, ray_options, followers)
            elif ((plan.device, plan.model_kwargs, plan.ray_options, plan.follower_options)
                  != (g.device, dict(g.model_kwargs), ray_options, followers)):
                what = [name for name, a, b in (
                    ("device", plan.device, g.device),
                    ("model_kwargs (tp_size included)", plan.model_kwargs, dict(g.model_kwargs)),
                    ("resources", (plan.ray_options, plan.follower_options),
                     (ray_options, followers))) if a != b]
                raise ValueError(f"node groups of rank {g.rank} (nodes {plan.nodes} and "
                                 f"{list(g.nodes)}) give different {' and '.join(what)}; one "
                                 "worker process builds one model: make them equal")
            else:
                plan.nodes.extend(g.nodes)
                plan.request_inputs |= g.request_inputs
    # An engine object with state (a KV cache) lives in one process per walk: a KV engine's
    # walks may sit on different workers, its requests' K/V moving between them (kv_moves.py).
    engine_of = node_engines(model)
    moves = plan_moves(model, node_rank, set(workers), groups)
    parent_engines = {}
    for n in names:
        engine, rank = engine_of[n], node_rank[n]
        remote = rank in workers
        split = rank != 0 and (remote or engine not in model.engine_specs)
        parent_engines[n] = f"{engine}@rank{rank}" if split else engine
    return Plan(node_rank, workers, parent_engines, moves)


def read_config(source: Union[str, "os.PathLike[str]", Mapping[str, Any]]) -> dict[str, Any]:
    """PlacedRuntime keyword arguments from a placement config: a YAML file path or its mapping.

    .. code-block:: yaml

        model:
          class: my_pkg.models:build_policy        # every process builds the model from this
          args: {num_pages: 4096}                  # KV-cache sizes etc. are the model's args
          parent_kwargs: {device: meta}            # optional: the parent's copy
        node_groups:
          - {nodes: [vision], rank: 1, device: "cuda:0"}
          - {nodes: [prefill, decode], rank: 2, device: "cuda:1", model_kwargs: {device: cuda}}
        restart: auto                              # shm_bytes, ready_timeout_s, max_restarts,
                                                   # progress, poll_s: as PlacedRuntime's

    ``factory`` and ``kwargs`` are accepted for ``class`` and ``args``. Errors are ConfigError
    (a ValueError) naming the key.
    """
    return read_placement(source)

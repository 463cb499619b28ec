"""A cross-entropy-method planner as a ``plan`` walk, whatever its rules:

    [first ->] cem_context -> Loop(iterations){ cem_sample -> cem_evaluate -> cem_update } -> cem_act

:class:`CEMWalk` builds the nodes and the walk; a planner subclasses it and supplies the rules
(:meth:`~CEMWalk.start`, :meth:`~CEMWalk.sample`, :meth:`~CEMWalk.energies`,
:meth:`~CEMWalk.refit`, :meth:`~CEMWalk.act`) -- the miniature world model's (models/cem.py) and
upstream V-JEPA 2-AC's (models/vjepa2_cem.py) differ in those alone. What stays here is what
every CEM shares: the noise of an iteration from a generator seeded by the request's ``seed`` and
the iteration (a plan with a seed is reproducible; a request without one draws its own, once),
the ``top_k`` lowest energies as the elites, the ``best_energy`` EMITted per iteration, and the
``action`` / ``plan`` / ``energy`` EMITted at the end.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Mapping, Optional, Sequence

import torch

from mstar_rt.graph import EMIT, GraphEdge, GraphNode, Loop, Sequential
from mstar_rt.model import Model, NodeSubmodule, WorkContext
from mstar_rt.models.sampling import request_seed


def plan_seed(ctx: WorkContext, seed: Any) -> int:
    """The seed of a request's candidates: its own, or one drawn at its first iteration and
    kept for the rest (each iteration's draw is then still its own)."""
    if seed is not None:
        return int(seed)
    return ctx.request.state.setdefault("cem_seed", request_seed(None))


def sample_generator(seed: int, iteration: int, device: Any) -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed((int(seed) * 1_000_003 + iteration) % (2 ** 63))
    return g


class CEMWalk(Model, ABC):
    """The ``plan`` walk over the rules a subclass defines. ``config`` needs ``samples``,
    ``top_k`` and ``iterations``; ``context_inputs`` are what :meth:`start` reads (``seed``
    is the walk's own); ``first``: a node run before the context (an encoder), with its
    submodule and engine."""

    def __init__(self, config: Any, context_inputs: Sequence[str],
                 first: Optional[tuple[GraphNode, NodeSubmodule, str]] = None) -> None:
        self.config = config
        self.nodes = [
            GraphNode("cem_context", list(context_inputs), ["context", "mean", "std"]),
            GraphNode("cem_sample", ["mean", "std", "seed"], ["candidates"]),
            GraphNode("cem_evaluate", ["context", "candidates"], ["energies"]),
            GraphNode("cem_update", ["candidates", "energies", "mean", "std"],
                      ["mean", "std", GraphEdge(EMIT, "best_energy")]),
            GraphNode("cem_act", ["context", "mean"],
                      [GraphEdge(EMIT, "action"), GraphEdge(EMIT, "plan"),
                       GraphEdge(EMIT, "energy")]),
        ]
        steps: list[Any] = [
            "cem_context",
            Loop(Sequential("cem_sample", "cem_evaluate", "cem_update"), config.iterations,
                 outputs=["mean", "std"]),
            "cem_act"]
        self.submodules: dict[str, NodeSubmodule] = {
            "cem_context": _Context(self), "cem_sample": _Sample(self),
            "cem_evaluate": _Evaluate(self), "cem_update": _Update(self), "cem_act": _Act(self)}
        self.engines = {n: "planner" for n in self.submodules}
        if first is not None:
            node, submodule, engine = first
            self.nodes.insert(0, node)
            steps.insert(0, node.name)
            self.submodules[node.name] = submodule
            self.engines[node.name] = engine
        self.walks = {"plan": Sequential(*steps)}

    # ---- the rules -----------------------------------------------------------------------------

    @abstractmethod
    def start(self, inputs: Mapping[str, Any]) -> tuple[Any, torch.Tensor, torch.Tensor]:
        """A request's (context, initial mean, initial std) from its ``context_inputs``."""

    @abstractmethod
    def sample(self, mean: torch.Tensor, std: torch.Tensor,
               noise: torch.Tensor) -> torch.Tensor:
        """The candidates ``[S, H, action]`` from the standard normal ``noise [S, *mean]``."""

    @abstractmethod
    def energies(self, context: Any, candidates: torch.Tensor) -> torch.Tensor:
        """Each candidate's energy ``[S]`` (lower is better)."""

    @abstractmethod
    def refit(self, mean: torch.Tensor, std: torch.Tensor,
              elites: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The next (mean, std) from the ``top_k`` best candidates, best first."""

    @abstractmethod
    def act(self, context: Any, mean: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, float]:
        """(action, plan, energy) from the final mean."""


class _Node(NodeSubmodule):
    max_batch = 16

    def __init__(self, planner: CEMWalk) -> None:
        self.planner = planner


class _Context(_Node):
    def forward(self, batch: list[Any]) -> list[Mapping[str, Any]]:
        return [dict(zip(("context", "mean", "std"), self.planner.start(b))) for b in batch]


class _Sample(_Node):
    def prepare_inputs(self, ctx: WorkContext, inputs: dict) -> Any:
        return inputs, ctx.iteration, plan_seed(ctx, inputs["seed"])

    def forward(self, batch: list[Any]) -> list[Mapping[str, Any]]:
        pl, outs = self.planner, []
        for inputs, iteration, seed in batch:
            mean, std = inputs["mean"], inputs["std"]
            g = sample_generator(seed, iteration, mean.device)
            noise = torch.randn((pl.config.samples, *mean.shape), generator=g,
                                device=mean.device, dtype=mean.dtype)
            outs.append({"candidates": pl.sample(mean, std, noise)})
        return outs


class _Evaluate(_Node):
    def forward(self, batch: list[Any]) -> list[Mapping[str, Any]]:
        # one batch of S rollouts per request
        return [{"energies": self.planner.energies(b["context"], b["candidates"])}
                for b in batch]


class _Update(_Node):
    def forward(self, batch: list[Any]) -> list[Mapping[str, Any]]:
        pl, outs = self.planner, []
        for b in batch:
            best = b["energies"].topk(pl.config.top_k, largest=False)
            mean, std = pl.refit(b["mean"], b["std"], b["candidates"][best.indices])
            outs.append({"mean": mean, "std": std, "best_energy": float(best.values[0])})
        return outs


class _Act(_Node):
    def forward(self, batch: list[Any]) -> list[Mapping[str, Any]]:
        outs = []
        for b in batch:
            action, plan, energy = self.planner.act(b["context"], b["mean"])
            outs.append({"action": action, "plan": plan, "energy": energy})
        return outs


__all__ = ["CEMWalk", "plan_seed", "sample_generator"]

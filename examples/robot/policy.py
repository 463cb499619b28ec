"""A small MLP chunk policy (obs -> H joint set-points) and the mstar_rt walk graph serving it.

The network predicts the chunk as a residual over the current joint angles, a_k - q, normalised
by per-output statistics; inputs are standardised. Predicting the residual makes the target
proportional to how far the arm still has to go, so near the goal the network's job (output
~0) is easy and its errors shrink with the distance — what the 2 cm success radius needs.

Served as a model with one walk, "act", of three nodes:

    normalize (obs -> x) -> mlp (x -> y, one torch forward for a whole batch) -> denormalize
    (y, obs -> actions, EMITted)

so a request exercises the Conductor's routing from node to node, and concurrent requests are
batched in the mlp node (max_batch). Weights and statistics live in one safetensors file, the
architecture in its metadata.
"""

from __future__ import annotations

import pathlib
from typing import Optional

import numpy as np
import torch
from safetensors.torch import load_file, save_file

import mstar_rt as m
from mstar_rt import EMIT, GraphEdge, GraphNode, Sequential

WEIGHTS = pathlib.Path(__file__).resolve().parent / "policy.safetensors"


class ChunkMLP(torch.nn.Module):
    """obs (N, obs_dim) -> normalised residual chunk (N, H * A); statistics kept as buffers."""

    def __init__(self, obs_dim: int = 8, horizon: int = 20, action_dim: int = 2, hidden: int = 128,
                 layers: int = 3) -> None:
        super().__init__()
        self.obs_dim, self.horizon, self.action_dim = obs_dim, horizon, action_dim
        self.hidden, self.layers = hidden, layers
        out = horizon * action_dim
        dims = [obs_dim] + [hidden] * layers
        mods: list[torch.nn.Module] = []
        for a, b in zip(dims[:-1], dims[1:]):
            mods += [torch.nn.Linear(a, b), torch.nn.SiLU()]
        mods.append(torch.nn.Linear(dims[-1], out))
        self.net = torch.nn.Sequential(*mods)
        self.register_buffer("obs_mean", torch.zeros(obs_dim))
        self.register_buffer("obs_std", torch.ones(obs_dim))
        self.register_buffer("out_mean", torch.zeros(out))
        self.register_buffer("out_std", torch.ones(out))

    def set_stats(self, obs: np.ndarray, residual: np.ndarray) -> None:
        """Normalisation statistics from training data: obs (N, obs_dim), residual (N, H, A)."""
        r = residual.reshape(len(residual), -1)
        self.obs_mean.copy_(torch.from_numpy(obs.mean(0)))
        self.obs_std.copy_(torch.from_numpy(obs.std(0) + 1e-3))  # +eps: a constant input is fine
        self.out_mean.copy_(torch.from_numpy(r.mean(0)))
        self.out_std.copy_(torch.from_numpy(r.std(0) + 1e-3))

    # The three stages the walk graph runs as separate nodes; act() chains them in one call.
    def normalize(self, obs: torch.Tensor) -> torch.Tensor:
        return (obs - self.obs_mean) / self.obs_std

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def denormalize(self, y: torch.Tensor, obs: torch.Tensor) -> torch.Tensor:
        residual = (y * self.out_std + self.out_mean).view(*y.shape[:-1], self.horizon, self.action_dim)
        return residual + obs[..., None, 0:self.action_dim]  # the residual is over joint angles q

    @torch.inference_mode()
    def act(self, obs: np.ndarray) -> np.ndarray:
        """(obs_dim,) -> (H, A), or (N, obs_dim) -> (N, H, A), float32 — without the runtime."""
        o = torch.as_tensor(np.asarray(obs, np.float32))
        return self.denormalize(self(self.normalize(o)), o).numpy()

    def save(self, path: pathlib.Path | str = WEIGHTS) -> None:
        tensors = {k: v.detach().contiguous() for k, v in self.state_dict().items()}
        meta = dict(obs_dim=self.obs_dim, horizon=self.horizon, action_dim=self.action_dim,
                    hidden=self.hidden, layers=self.layers)
        save_file(tensors, str(path), metadata={k: str(v) for k, v in meta.items()})

    @classmethod
    def load(cls, path: pathlib.Path | str = WEIGHTS) -> "ChunkMLP":
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            meta = {k: int(v) for k, v in f.metadata().items()}
        net = cls(**meta)
        net.load_state_dict(load_file(str(path)))
        return net.eval()


# ---- the walk graph -------------------------------------------------------------------------


class Normalize(m.NodeSubmodule):
    max_batch = 16

    def __init__(self, net: ChunkMLP) -> None:
        self.net = net

    def forward(self, batch):
        with torch.inference_mode():
            return [{"x": self.net.normalize(torch.as_tensor(np.asarray(item["obs"], np.float32)))}
                    for item in batch]


class Mlp(m.NodeSubmodule):
    """The one node worth batching: requests that arrive together share a single forward."""

    max_batch = 16

    def __init__(self, net: ChunkMLP) -> None:
        self.net = net

    def forward(self, batch):
        with torch.inference_mode():
            y = self.net(torch.stack([item["x"] for item in batch]))
        return [{"y": row} for row in y]


class Denormalize(m.NodeSubmodule):
    max_batch = 16

    def __init__(self, net: ChunkMLP) -> None:
        self.net = net

    def forward(self, batch):
        with torch.inference_mode():
            return [{"actions": self.net.denormalize(
                        item["y"], torch.as_tensor(np.asarray(item["obs"], np.float32))).numpy()}
                    for item in batch]


class ChunkPolicyModel(m.Model):
    """Request inputs: {"obs": float32 (obs_dim,)}; EMITs "actions": float32 (H, A)."""

    inputs = ("obs",)
    nodes = [
        GraphNode("normalize", ["obs"], [GraphEdge("mlp", "x")]),
        GraphNode("mlp", ["x"], [GraphEdge("denormalize", "y")]),
        GraphNode("denormalize", ["y", "obs"], [GraphEdge(EMIT, "actions")]),
    ]
    walks = {"act": Sequential("normalize", "mlp", "denormalize")}

    def __init__(self, net: Optional[ChunkMLP] = None) -> None:
        self.net = net if net is not None else ChunkMLP.load()
        self.submodules = {"normalize": Normalize(self.net), "mlp": Mlp(self.net),
                           "denormalize": Denormalize(self.net)}

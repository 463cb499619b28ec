"""The demo's policies behind one client interface: what a request holds and how its EMITted
chunk becomes joint set-points.

    pi0            the miniature pi0-style VLA (pi0_policy.py) served as mstar_rt.models.pi0.
                   Pi0Policy -- prefix walk + action_gen Loop of flow steps -- with trained
                   real-time chunking: each request carries the delay d and the actions the loop
                   still executes (run-time inputs: a new d is a new request, never a new graph).
    pi0-real-arch  a tiny pi0 of LeRobot's own architecture (pi0_real.py), a LeRobot checkpoint
                   directory served as mstar_rt.models.lerobot_pi0.LeRobotPi0Policy, with
                   LeRobot's guided real-time chunking: d and the actions still to execute go in
                   as `delay` and `prev_actions`, and every flow step is pulled towards them.
    mlp            the behaviour-cloned ChunkMLP (policy.py), a 3-node walk; it has no RTC
                   inputs, so d and the plan are not sent (the ActionChunkBuffer's rtc merge
                   still applies).
"""

from __future__ import annotations

import abc

from typing import Any, Optional

import numpy as np

import mstar_rt


class PolicyClient(abc.ABC):
    """A policy behind one request/decode interface (the demo serves either kind)."""

    name = ""
    horizon = 0
    uses_delay = False  # does the request carry d and the frozen actions?

    @abc.abstractmethod
    def model(self) -> mstar_rt.Model:
        """The walk-graph model the Runtime serves."""

    @abc.abstractmethod
    def request(self, obs: np.ndarray, delay: int, plan: Optional[np.ndarray],
                seed: int) -> dict:
        """The request inputs for one observation (with d and the plan if uses_delay; plan None:
        send no real-time-chunking inputs)."""

    @abc.abstractmethod
    def decode(self, out: dict[str, Any], obs: np.ndarray) -> np.ndarray:
        """The action chunk [H, A] in joint space from the request's outputs."""


class Pi0Client(PolicyClient):
    name = "pi0"
    uses_delay = True

    def __init__(self, path: Optional[str] = None) -> None:
        from pi0_policy import WEIGHTS_DIR, MiniPi0

        self.policy = MiniPi0.load(path or WEIGHTS_DIR)
        self.horizon = self.policy.horizon

    def model(self) -> mstar_rt.Model:
        from mstar_rt.models.pi0 import Pi0Policy

        return Pi0Policy(self.policy.module, max_batch=4)

    def request(self, obs, delay, plan, seed):
        return self.policy.request(obs, delay, plan, seed)

    def decode(self, out, obs):
        return self.policy.from_model(out["actions"][0].numpy(), obs)


class Pi0RealClient(PolicyClient):
    name = "pi0-real-arch"
    uses_delay = True

    def __init__(self, path: Optional[str] = None) -> None:
        from pi0_real import WEIGHTS_DIR, RealPi0

        self.policy = RealPi0.load(path or WEIGHTS_DIR)
        self.horizon = self.policy.horizon

    def model(self) -> mstar_rt.Model:
        from mstar_rt.models.lerobot_pi0 import LeRobotPi0Policy

        return LeRobotPi0Policy(self.policy.policy, max_batch=4)

    def request(self, obs, delay, plan, seed):
        return self.policy.request(obs, delay, plan, seed)

    def decode(self, out, obs):
        return self.policy.decode(out["actions"][0], obs)


class MlpClient(PolicyClient):
    name = "mlp"

    def __init__(self, path: Optional[str] = None) -> None:
        from policy import WEIGHTS, ChunkMLP

        self.net = ChunkMLP.load(path or WEIGHTS)
        self.horizon = self.net.horizon

    def model(self) -> mstar_rt.Model:
        from policy import ChunkPolicyModel

        return ChunkPolicyModel(self.net)

    def request(self, obs, delay, plan, seed):
        return {"obs": obs}

    def decode(self, out, obs):
        return np.asarray(out["actions"][0], np.float32)


CLIENTS = {"pi0": Pi0Client, "pi0-real-arch": Pi0RealClient, "mlp": MlpClient}


def make_client(name: str) -> PolicyClient:
    if name not in CLIENTS:
        raise ValueError(f"unknown policy {name!r}; choose one of {sorted(CLIENTS)}")
    return CLIENTS[name]()

"""A camera + state policy in the shape of a flow-matching VLA, for serving demos and the serving
benchmark: random (seeded) weights, real compute.

    encode   uint8 RGB image [S, S, 3] and state [state_dim] -> condition (a 3-layer strided conv
             encoder, mean-pooled, plus a state projection); the action sample x starts at 0
    denoise  one Euler step of a flow-matching action expert (an MLP over x, the condition and
             the flow time), run `steps` times in a Loop, as pi0 runs its action expert
    finish   x -> actions [horizon, action_dim], EMITted

Every node stacks its batch into one torch forward, so requests that arrive together share the
weights' reads — at batch 1 the expert is bound by reading its weights, as a real action
expert is on a GPU. :meth:`VisionFlowPolicy.act` runs the same modules for one observation
without the runtime (what a one-forward-per-message server does).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

import mstar_rt as m
from mstar_rt import EMIT, GraphEdge, GraphNode, Loop, Sequential


class VisionFlowNet(torch.nn.Module):
    def __init__(self, image_size: int = 64, state_dim: int = 8, horizon: int = 16,
                 action_dim: int = 7, width: int = 128, hidden: int = 1536, layers: int = 3,
                 steps: int = 4, seed: int = 0, device: str = "cpu") -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.device = torch.device(device)
        self.image_size, self.state_dim = image_size, state_dim
        self.horizon, self.action_dim, self.steps = horizon, action_dim, steps
        self.encoder = torch.nn.Sequential(
            torch.nn.Conv2d(3, 32, 5, 2, 2), torch.nn.SiLU(),
            torch.nn.Conv2d(32, 64, 3, 2, 1), torch.nn.SiLU(),
            torch.nn.Conv2d(64, width, 3, 2, 1), torch.nn.SiLU())
        self.state_proj = torch.nn.Linear(state_dim, width)
        out = horizon * action_dim
        dims = [out + width + 1] + [hidden] * layers
        mods: list[torch.nn.Module] = []
        for a, b in zip(dims[:-1], dims[1:]):
            mods += [torch.nn.Linear(a, b), torch.nn.SiLU()]
        mods.append(torch.nn.Linear(hidden, out))
        self.expert = torch.nn.Sequential(*mods)
        self.to(self.device).eval()

    def encode(self, images: torch.Tensor, states: torch.Tensor) -> torch.Tensor:
        """uint8 [N, S, S, 3], float [N, state_dim] -> condition [N, width]."""
        x = images.permute(0, 3, 1, 2).float() / 127.5 - 1.0
        return self.encoder(x).mean(dim=(2, 3)) + self.state_proj(states)

    def denoise(self, x: torch.Tensor, cond: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """One Euler step of dx/dt = v(x, cond, t) over dt = 1 / steps."""
        v = self.expert(torch.cat([x, cond, t[:, None]], dim=1))
        return x + v / self.steps

    @torch.inference_mode()
    def act(self, image: np.ndarray, state: np.ndarray) -> np.ndarray:
        """One observation -> actions [horizon, action_dim], float32, without the runtime."""
        dev = self.device
        cond = self.encode(torch.from_numpy(np.ascontiguousarray(image))[None].to(dev),
                           torch.as_tensor(np.asarray(state, np.float32))[None].to(dev))
        x = torch.zeros(1, self.horizon * self.action_dim, device=dev)
        for i in range(self.steps):
            x = self.denoise(x, cond, torch.full((1,), i / self.steps, device=dev))
        return x.view(self.horizon, self.action_dim).cpu().numpy()


class _Encode(m.NodeSubmodule):
    max_batch = 16

    def __init__(self, net: VisionFlowNet) -> None:
        self.net = net

    def forward(self, batch: list[Any]) -> list[dict[str, Any]]:
        with torch.inference_mode():
            dev = self.net.device
            images = torch.from_numpy(np.stack([np.asarray(b["image"], np.uint8)
                                                for b in batch])).to(dev)
            states = torch.from_numpy(np.stack([np.asarray(b["state"], np.float32)
                                                for b in batch])).to(dev)
            cond = self.net.encode(images, states)
            x = torch.zeros(len(batch), self.net.horizon * self.net.action_dim, device=dev)
        return [{"cond": c, "x": xi} for c, xi in zip(cond, x)]


class _Denoise(m.NodeSubmodule):
    max_batch = 16

    def __init__(self, net: VisionFlowNet) -> None:
        self.net = net

    def prepare_inputs(self, ctx: Any, inputs: dict[str, Any]) -> Any:
        return inputs["x"], inputs["cond"], ctx.iteration / self.net.steps

    def forward(self, batch: list[Any]) -> list[dict[str, Any]]:
        with torch.inference_mode():
            x = self.net.denoise(torch.stack([b[0] for b in batch]),
                                 torch.stack([b[1] for b in batch]),
                                 torch.tensor([b[2] for b in batch], dtype=torch.float32,
                                              device=self.net.device))
        return [{"x": row} for row in x]


class _Finish(m.NodeSubmodule):
    max_batch = 16

    def __init__(self, net: VisionFlowNet) -> None:
        self.net = net

    def forward(self, batch: list[Any]) -> list[dict[str, Any]]:
        shape = (self.net.horizon, self.net.action_dim)
        x = torch.stack([b["x"] for b in batch]).view(len(batch), *shape).cpu().numpy()
        return [{"actions": a} for a in x]  # one device-to-host copy per batch


class VisionFlowPolicy(m.Model):
    """Inputs ``image`` (uint8 [S, S, 3]) and ``state`` (float32 [state_dim]); EMITs ``actions``
    (float32 [horizon, action_dim]). Keyword arguments build the :class:`VisionFlowNet`
    (``device="cuda"`` runs it on a GPU)."""

    inputs = ("image", "state")

    def __init__(self, **net_args: Any) -> None:
        self.net = VisionFlowNet(**net_args)
        self.nodes = [GraphNode("encode", ["image", "state"], ["cond", "x"]),
                      GraphNode("denoise", ["cond", "x"], ["x"]),
                      GraphNode("finish", ["x"], [GraphEdge(EMIT, "actions")])]
        self.walks = {"act": Sequential("encode", Loop("denoise", self.net.steps, outputs=["x"]),
                                        "finish")}
        self.submodules = {"encode": _Encode(self.net), "denoise": _Denoise(self.net),
                           "finish": _Finish(self.net)}

    def validate_inputs(self, inputs: Any) -> None:
        s, d = self.net.image_size, self.net.state_dim
        image, state = np.asarray(inputs["image"]), np.asarray(inputs["state"])
        if image.shape != (s, s, 3) or image.dtype != np.uint8:
            raise ValueError(f"'image' must be uint8 [{s}, {s}, 3], got {image.dtype} "
                             f"{list(image.shape)}")
        if state.shape != (d,):
            raise ValueError(f"'state' must be [{d}], got {list(state.shape)}")

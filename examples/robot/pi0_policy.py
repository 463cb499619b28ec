"""A miniature of the pi0-style VLA (mstar_rt.models.pi0) for the reaching task, and the client
side that turns robot data into its requests and its chunks back into joint set-points.

The model is the library's Pi0Policy unchanged -- the walk graph users serve:

    prefix     = vision (tiny SigLIP over a 16 px top-down camera) -> prefix (backbone over the
                 4 image tokens + the state token, written to the request's KV pages)
    action_gen = Loop(denoise, num_steps): the flow-matching action expert over H action tokens,
                 attending to the cached prefix read-only

with trained real-time chunking: each request carries the delay d and the actions the robot
will still execute from its current plan; the first d actions of the new chunk are those.

As openpi wraps its models in input/output transforms, MiniPi0 normalises outside the graph:
the state is standardised, and actions are deltas over the current joint angles (openpi's
DeltaActions) standardised per chunk position. Deltas make the target proportional to the
distance left, so near the goal the expert's job is to output ~0 -- what a 2 cm radius needs.
A checkpoint is a save_pi0 directory (config.json, model.safetensors) plus norm_stats.json.
"""

from __future__ import annotations

import json
import pathlib
from dataclasses import dataclass
from typing import Optional, Union

import numpy as np
import torch
import torch.nn.functional as F

from mstar_rt.models.pi0_layers import Pi0Config, Pi0Module, load_pi0, save_pi0
from mstar_rt.models.siglip import SiglipConfig, preprocess_image
from topdown import SIZE, topdown_image

WEIGHTS_DIR = pathlib.Path(__file__).resolve().parent / "pi0_weights"
HORIZON = 20  # H: 0.4 s at 50 Hz; a chunk is asked for when fewer than H / 2 actions are left
MAX_DELAY = HORIZON // 2  # the largest d trained for (the plan left when asking is below H / 2)


def mini_pi0_config(num_steps: int = 5) -> Pi0Config:
    """pi0's layout at toy size: 1 camera of 16 px in 8 px patches, no prompt, 2 layers, 4 heads
    sharing 1 KV head, an expert as wide as the backbone."""
    vision = SiglipConfig(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2,
                          image_size=SIZE, patch_size=8)
    return Pi0Config(vision=vision, vocab_size=8, width=64, mlp_width=128, num_layers=2,
                     num_heads=4, num_kv_heads=1, head_dim=16, expert_width=64,
                     expert_mlp_width=128, state_dim=8, action_dim=2, action_horizon=HORIZON,
                     num_steps=num_steps, max_images=1, max_prompt_tokens=0)


@dataclass
class NormStats:
    """Standardisation of the state [8] and of the action deltas [H, 2]."""

    state_mean: np.ndarray
    state_std: np.ndarray
    delta_mean: np.ndarray
    delta_std: np.ndarray

    @staticmethod
    def fit(obs: np.ndarray, chunks: np.ndarray) -> "NormStats":
        delta = chunks - obs[:, None, 0:2]
        return NormStats(obs.mean(0), obs.std(0) + 1e-3, delta.mean(0), delta.std(0) + 1e-3)

    def to_json(self) -> dict:
        return {k: np.asarray(v, np.float64).tolist() for k, v in self.__dict__.items()}

    @staticmethod
    def from_json(d: dict) -> "NormStats":
        return NormStats(**{k: np.asarray(v, np.float32) for k, v in d.items()})


class MiniPi0:
    """The module and its normalisation; builds Pi0Policy requests and decodes their chunks."""

    def __init__(self, module: Pi0Module, stats: NormStats) -> None:
        self.module, self.stats = module, stats
        self.horizon = module.config.action_horizon

    @staticmethod
    def load(path: Union[str, pathlib.Path] = WEIGHTS_DIR) -> "MiniPi0":
        path = pathlib.Path(path)
        if not (path / "norm_stats.json").exists():
            raise FileNotFoundError(f"{path} holds no mini-pi0 checkpoint (norm_stats.json); "
                                    "train one with examples/robot/train_pi0.py")
        stats = NormStats.from_json(json.loads((path / "norm_stats.json").read_text()))
        return MiniPi0(load_pi0(path, progress=False), stats)

    def save(self, path: Union[str, pathlib.Path] = WEIGHTS_DIR) -> None:
        save_pi0(self.module, path)
        (pathlib.Path(path) / "norm_stats.json").write_text(json.dumps(self.stats.to_json()))

    # ---- transforms -----------------------------------------------------------------------------

    def state(self, obs: np.ndarray) -> np.ndarray:
        return ((np.asarray(obs, np.float32) - self.stats.state_mean) / self.stats.state_std
                ).astype(np.float32)

    def to_model(self, actions: np.ndarray, obs: np.ndarray) -> np.ndarray:
        """Joint set-points [..., n, 2] (chunk positions 0..n-1) -> the model's action space."""
        n = actions.shape[-2]
        delta = actions - np.asarray(obs)[..., None, 0:2]
        return ((delta - self.stats.delta_mean[:n]) / self.stats.delta_std[:n]).astype(np.float32)

    def from_model(self, y: np.ndarray, obs: np.ndarray) -> np.ndarray:
        """The model's chunk [..., H, 2] -> joint set-points."""
        delta = np.asarray(y) * self.stats.delta_std + self.stats.delta_mean
        return (delta + np.asarray(obs)[..., None, 0:2]).astype(np.float32)

    def request(self, obs: np.ndarray, delay: int = 0, plan: Optional[np.ndarray] = None,
                seed: int = 0) -> dict:
        """Pi0Policy inputs for an observation. `plan`: the actions the robot will still execute
        from the observation's tick on (ActionChunkBuffer.remaining); its first `delay` rows are
        frozen into the new chunk (trained real-time chunking)."""
        if isinstance(delay, bool) or not isinstance(delay, (int, np.integer)) \
                or not 0 <= delay < self.horizon:
            raise ValueError(f"delay must be an integer in [0, {self.horizon}) ticks (the "
                             f"action horizon); got {delay!r}")
        out = {"images": [topdown_image(obs)], "prompt": [], "state": self.state(obs),
               "seed": int(seed), "delay": int(delay)}
        if delay:
            out["prev_actions"] = self.to_model(frozen_rows(plan, int(delay), obs), obs)
        return out

    def act(self, obs: np.ndarray, delay: int = 0, plan: Optional[np.ndarray] = None,
            seed: int = 0) -> np.ndarray:
        """The chunk [H, 2] of joint set-points without the runtime: the same request, the same
        noise (drawn from `seed` as Pi0Policy draws it), the dense batched forward."""
        r = self.request(obs, delay, plan, seed)
        c = self.module.config
        noise = torch.randn(c.action_horizon, c.action_dim,
                            generator=torch.Generator().manual_seed(int(seed)))
        prev = torch.zeros_like(noise)
        if delay:
            prev[:delay] = torch.from_numpy(r["prev_actions"])
        y = sample_chunks(self.module, pixels_for(np.asarray(obs)[None]),
                          torch.from_numpy(r["state"])[None], noise[None],
                          torch.tensor([int(delay)]), prev[None])
        return self.from_model(y[0].numpy(), obs)


def frozen_rows(plan: Optional[np.ndarray], delay: int, obs: np.ndarray) -> np.ndarray:
    """The `delay` actions the loop executes before a new chunk lands: the plan's, and where the
    plan runs out the buffer holds its last action (no plan at all: the arm holds its pose)."""
    rows = np.zeros((0, 2), np.float32) if plan is None else np.asarray(plan, np.float32)
    if len(rows) >= delay:
        return rows[:delay]
    hold = rows[-1] if len(rows) else np.asarray(obs, np.float32)[0:2]
    return np.concatenate([rows, np.repeat(hold[None], delay - len(rows), 0)])


# ---- batched dense forward for training and fast evaluation ----------------------------------
# The module's layers take flat tokens and an attention object; these objects attend within each
# of B equal-length sequences, which is what training and batched rollouts need. The runtime
# serves the same module through the KV engine; the tests hold the two to the same chunk.

class _BatchedPrefix:
    """Bidirectional attention inside each sample's prefix; keeps each layer's K/V."""

    def __init__(self, batch: int) -> None:
        self.batch = batch
        self.k: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.k[layer], self.v[layer] = k, v
        return _sdpa(self.batch, q, k, v)


class _BatchedSuffix:
    """Action tokens attend to their sample's prefix K/V and to each other (pi0's shared
    attention); nothing is kept."""

    def __init__(self, prefix: _BatchedPrefix) -> None:
        self.prefix = prefix

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        b = self.prefix.batch
        pk = self.prefix.k[layer].view(b, -1, *k.shape[1:])
        pv = self.prefix.v[layer].view(b, -1, *v.shape[1:])
        kk = torch.cat([pk, k.view(b, -1, *k.shape[1:])], 1).flatten(0, 1)
        vv = torch.cat([pv, v.view(b, -1, *v.shape[1:])], 1).flatten(0, 1)
        return _sdpa(b, q, kk, vv)


def _sdpa(b: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Flat [b * T, heads, dim] tokens, attention within each of the b sequences."""
    qb, kb, vb = (t.view(b, -1, *t.shape[1:]).transpose(1, 2) for t in (q, k, v))
    out = F.scaled_dot_product_attention(qb, kb, vb, enable_gqa=qb.shape[1] != kb.shape[1])
    return out.transpose(1, 2).flatten(0, 1)


def pixels_for(observations: np.ndarray) -> torch.Tensor:
    """[N, 8] observations -> [N, 3, S, S] the vision node's preprocessed camera images."""
    return torch.stack([preprocess_image(topdown_image(o), SIZE) for o in observations])


def encode_prefix(module: Pi0Module, pixels: torch.Tensor, state: torch.Tensor) -> _BatchedPrefix:
    """Runs B prefixes (image tokens, then the state token; no prompt) through the backbone."""
    b = pixels.shape[0]
    x = torch.cat([module.image_tokens(pixels), module.state_proj(state)[:, None]], 1)
    p = x.shape[1]
    record = _BatchedPrefix(b)
    module.run_prefix(x.flatten(0, 1), torch.arange(p).repeat(b), record)
    return record


def batched_velocity(module: Pi0Module, prefix: _BatchedPrefix, x: torch.Tensor,
                     tau: torch.Tensor) -> torch.Tensor:
    """The expert's velocity [B, H, A] for noisy chunks x [B, H, A] at per-action times [B, H]."""
    b, h, _a = x.shape
    p = prefix.k[0].shape[0] // b
    suffix = module.suffix_embeds(x.flatten(0, 1), tau.flatten())
    v = module.velocity(suffix, torch.arange(p, p + h).repeat(b), _BatchedSuffix(prefix))
    return v.view(b, h, -1)


def frozen_mask(delays: torch.Tensor, horizon: int) -> torch.Tensor:
    """[B, H] True where the chunk position is below the sample's delay."""
    return torch.arange(horizon)[None] < delays[:, None]


@torch.inference_mode()
def sample_chunks(module: Pi0Module, pixels: torch.Tensor, state: torch.Tensor,
                  noise: torch.Tensor, delays: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
    """Trained-RTC sampling as Pi0Policy does it, for B requests at once: the frozen rows start
    as `prev` at flow time 1 and never move; the rest take num_steps Euler steps from noise."""
    c = module.config
    frozen = frozen_mask(delays, c.action_horizon)
    prefix = encode_prefix(module, pixels, state)
    x = torch.where(frozen[..., None], prev, noise)
    for i in range(c.num_steps):
        tau = torch.where(frozen, torch.ones_like(x[..., 0]), torch.full_like(x[..., 0], i / c.num_steps))
        v = batched_velocity(module, prefix, x, tau)
        x = torch.where(frozen[..., None], x, x + v / c.num_steps)
    return x

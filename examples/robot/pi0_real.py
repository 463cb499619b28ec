"""A tiny pi0 of the real LeRobot architecture for the reaching task: its sizes, its LeRobot
checkpoint directory, and the client side that turns robot data into its requests and its chunks
back into joint set-points.

The network is LeRobot's ``PI0Pytorch`` as ``mstar_rt.models.lerobot_pi0`` rebuilds it (the tests
hold that to LeRobot's own outputs): a SigLIP tower and projector, the PaliGemma Gemma backbone
over image + prompt tokens, the Gemma action expert over the state token and the action tokens,
pi0's action-time MLP; at toy size (one 16 px camera in 8 px patches, 2 layers, 8 query heads
sharing 1 KV head as LeRobot hard-codes, a 76-piece tokenizer). It is served unchanged as
``LeRobotPi0Policy`` (``prefix`` + ``action_gen`` walks) and uses LeRobot's *guided* real-time
chunking: each request carries the delay d and the actions the loop will still execute, and the
flow steps are pulled towards them (``rtc_config`` in config.json).

The checkpoint is the directory LeRobot's ``save_pretrained`` writes -- ``config.json``,
``model.safetensors`` in LeRobot's key layout, the pre/post-processor files with the normaliser
statistics -- plus ``tokenizer/``. ``mstar-rt serve`` loads it with ``model: {checkpoint: DIR,
args: {sizes: {vision_heads: 2}}}`` (LeRobot's config names only the variants; the tiny tower's
head count cannot be read from the weights).

The dataset's ``action`` is the set-point offset from the measured joint angles (openpi's
``DeltaActions``, applied by the client as LeRobot's ``relative_actions_processor`` would; the
loader serves absolute actions only): near the goal the expert's job is to output ~0, which is
what a 2 cm radius needs.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any, Optional, Union

import numpy as np
import torch

from expert import HORIZON
from mstar_rt.models.gemma import GemmaSizes
from mstar_rt.models.lerobot_pi0_config import PiConfig
from mstar_rt.models.lerobot_pi0_layers import PiModule, lerobot_key
from mstar_rt.models.lerobot_pi0_load import LeRobotPi0, load_lerobot_pi0
from mstar_rt.models.lerobot_rtc import RtcSettings, guidance, guided_velocity
from mstar_rt.models.siglip import SiglipConfig
from pi0_policy import frozen_rows
from topdown import SIZE, topdown_image

WEIGHTS_DIR = pathlib.Path(__file__).resolve().parent / "pi0_real_weights"
CAMERA = "observation.images.top"
TASK = "reach the red target"
MAX_DELAY = HORIZON // 2  # the thread asks for a chunk when fewer than H / 2 actions are left
SIZES = {"vision_heads": 2}  # what the weights cannot tell the loader
STATE_DIM, ACTION_DIM = 8, 2
#: LeRobot's guided RTC as the checkpoint configures it (LeRobot's defaults but the weight cap:
#: with 5 flow steps instead of 10, a cap of 5 keeps dt * weight = 1, as LeRobot's 10 x 0.1).
RTC = RtcSettings(schedule="LINEAR", max_guidance_weight=5.0, execution_horizon=MAX_DELAY)


def tiny_config(num_steps: int = 5) -> PiConfig:
    """pi0's layout at toy size. The variant names stay LeRobot's (gemma_2b, gemma_300m); the
    widths and depths are the tensors'."""
    backbone = GemmaSizes(width=64, depth=2, mlp_dim=128, num_heads=8, num_kv_heads=1,
                          head_dim=16)
    expert = GemmaSizes(width=64, depth=2, mlp_dim=128, num_heads=8, num_kv_heads=1,
                        head_dim=16)
    vision = SiglipConfig(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2,
                          image_size=SIZE, patch_size=8, layer_norm_eps=1e-6)
    return PiConfig("pi0", backbone, expert, vision, vocab_size=len(_vocabulary()),
                    cameras=(CAMERA,), state_dim=STATE_DIM, action_dim=ACTION_DIM,
                    chunk_size=HORIZON, n_action_steps=HORIZON, max_state_dim=STATE_DIM,
                    max_action_dim=ACTION_DIM, num_steps=num_steps, tokenizer_max_length=16,
                    rtc=RTC)


# ---- the tokenizer -------------------------------------------------------------------------------

_SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>"]
_WORDS = "reach the red green target arm to move go".split()


def _vocabulary() -> list[tuple[str, float]]:
    """PaliGemma's layout in miniature (<pad> 0, <eos> 1, <bos> 2, <unk> 3, '▁' for spaces):
    the prompt's words whole, every lowercase letter alone and after a space, the newline."""
    letters = "abcdefghijklmnopqrstuvwxyz"
    vocab = [(s, 0.0) for s in _SPECIALS] + [("\n", -5.0), ("▁", -6.0)]
    vocab += [("▁" + w, -2.0) for w in _WORDS] + [(w, -3.0) for w in _WORDS]
    vocab += [(c, -8.0) for c in letters] + [("▁" + c, -9.0) for c in letters]
    return vocab


def write_tokenizer(folder: pathlib.Path) -> None:
    """A Gemma-style Unigram tokenizer (``tokenizers``; no training, so it is deterministic)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, processors

    tok = Tokenizer(models.Unigram(_vocabulary(), unk_id=3))
    tok.normalizer = normalizers.Replace(" ", "▁")
    tok.decoder = decoders.Replace("▁", " ")
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A",
                                                       special_tokens=[("<bos>", 2)])
    tok.add_special_tokens(_SPECIALS)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>", "unk_token": "<unk>",
         "model_max_length": 1 << 30}, indent=2) + "\n")


# ---- statistics and the checkpoint directory ---------------------------------------------------

def feature_stats(x: np.ndarray) -> dict[str, np.ndarray]:
    """LeRobot's per-feature statistics of samples ``[N, D]`` (MEAN_STD reads mean and std)."""
    x = np.asarray(x, np.float64)
    return {"mean": x.mean(0), "std": x.std(0), "min": x.min(0), "max": x.max(0),
            "q01": np.quantile(x, 0.01, 0), "q99": np.quantile(x, 0.99, 0),
            "count": np.array([len(x)])}


def _features(c: PiConfig) -> dict[str, Any]:
    return {CAMERA: {"type": "VISUAL", "shape": [3, SIZE, SIZE]},
            "observation.state": {"type": "STATE", "shape": [c.state_dim]},
            "action": {"type": "ACTION", "shape": [c.action_dim]}}


def lerobot_config(c: PiConfig) -> dict[str, Any]:
    """``config.json`` as LeRobot's ``PI0Config`` saves it (its defaults where the demo keeps
    them; its training fields are not used here)."""
    features = _features(c)
    rtc = c.rtc or RtcSettings()
    return {
        "type": "pi0", "n_obs_steps": 1,
        "input_features": {k: v for k, v in features.items() if k != "action"},
        "output_features": {"action": features["action"]},
        "device": "cpu", "use_amp": False, "use_peft": False, "push_to_hub": False,
        "repo_id": None, "private": None, "tags": None, "license": None,
        "pretrained_path": None, "pretrained_revision": None,
        "paligemma_variant": "gemma_2b", "action_expert_variant": "gemma_300m",
        "dtype": "float32", "chunk_size": c.chunk_size, "n_action_steps": c.n_action_steps,
        "max_state_dim": c.max_state_dim, "max_action_dim": c.max_action_dim,
        "num_inference_steps": c.num_steps,
        "time_sampling_beta_alpha": 1.5, "time_sampling_beta_beta": 1.0,
        "time_sampling_scale": 0.999, "time_sampling_offset": 0.001,
        "min_period": c.min_period, "max_period": c.max_period,
        "use_relative_actions": False, "relative_exclude_joints": ["gripper"],
        "action_feature_names": None,
        "rtc_config": {"enabled": rtc.enabled, "prefix_attention_schedule": rtc.schedule,
                       "max_guidance_weight": rtc.max_guidance_weight,
                       "execution_horizon": rtc.execution_horizon, "debug": False,
                       "debug_maxlen": 100},
        "image_resolution": [c.vision.image_size, c.vision.image_size], "empty_cameras": 0,
        "normalization_mapping": {"VISUAL": "IDENTITY", "STATE": "MEAN_STD",
                                  "ACTION": "MEAN_STD"},
        "gradient_checkpointing": False, "compile_model": False,
        "compile_mode": "max-autotune", "freeze_vision_encoder": False,
        "train_expert_only": False, "optimizer_lr": 2.5e-05, "optimizer_betas": [0.9, 0.95],
        "optimizer_eps": 1e-08, "optimizer_weight_decay": 0.01,
        "optimizer_grad_clip_norm": 1.0, "scheduler_warmup_steps": 1000,
        "scheduler_decay_steps": 30000, "scheduler_decay_lr": 2.5e-06,
        "tokenizer_max_length": c.tokenizer_max_length,
    }


_NORMALIZER = "policy_preprocessor_step_6_normalizer_processor.safetensors"
_UNNORMALIZER = "policy_postprocessor_step_0_unnormalizer_processor.safetensors"


def _processors(c: PiConfig) -> tuple[dict, dict]:
    """LeRobot's pi0 pre- and post-processor pipelines (``make_pi0_pre_post_processors``)."""
    norm_map = {"VISUAL": "IDENTITY", "STATE": "MEAN_STD", "ACTION": "MEAN_STD"}
    features = _features(c)
    pre = {"name": "policy_preprocessor", "steps": [
        {"registry_name": "rename_observations_processor", "config": {"rename_map": {}}},
        {"registry_name": "to_batch_processor", "config": {}},
        {"registry_name": "pi0_new_line_processor", "config": {}},
        {"registry_name": "tokenizer_processor", "config": {
            "max_length": c.tokenizer_max_length, "task_key": "task", "padding_side": "right",
            "padding": "max_length", "truncation": True,
            "tokenizer_name": "google/paligemma-3b-pt-224"}},
        {"registry_name": "device_processor", "config": {"device": "cpu", "float_dtype": None}},
        {"registry_name": "relative_actions_processor", "config": {
            "enabled": False, "exclude_joints": ["gripper"], "action_names": None}},
        {"registry_name": "normalizer_processor", "config": {
            "eps": 1e-08, "features": features, "norm_map": norm_map},
         "state_file": _NORMALIZER}]}
    post = {"name": "policy_postprocessor", "steps": [
        {"registry_name": "unnormalizer_processor", "config": {
            "eps": 1e-08, "features": {"action": features["action"]}, "norm_map": norm_map},
         "state_file": _UNNORMALIZER},
        {"registry_name": "absolute_actions_processor", "config": {"enabled": False}},
        {"registry_name": "device_processor", "config": {"device": "cpu", "float_dtype": None}}]}
    return pre, post


def save_checkpoint(module: PiModule, stats: dict[str, dict[str, np.ndarray]],
                    path: Union[str, pathlib.Path]) -> None:
    """Writes the LeRobot directory: ``stats`` maps ``observation.state`` and ``action`` to
    :func:`feature_stats`. The lm_heads LeRobot saves are written too (PaliGemma ties its
    head to the text embedding; the expert's is never used), so LeRobot's strict load finds
    every key."""
    from safetensors.torch import save_file

    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)
    c = module.config
    weights = {lerobot_key(k): v.detach().float().contiguous().clone()
               for k, v in module.state_dict().items()}
    embed = module.backbone.embed_tokens.weight.detach().float()
    weights["model.paligemma_with_expert.paligemma.lm_head.weight"] = embed.clone()
    weights["model.paligemma_with_expert.gemma_expert.lm_head.weight"] = torch.zeros(
        c.vocab_size, c.expert.width)
    save_file(weights, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(lerobot_config(c), indent=4) + "\n")
    pre, post = _processors(c)
    (path / "policy_preprocessor.json").write_text(json.dumps(pre, indent=2) + "\n")
    (path / "policy_postprocessor.json").write_text(json.dumps(post, indent=2) + "\n")
    flat = {f"{feature}.{k}": torch.from_numpy(np.asarray(v)).to(
                torch.int64 if k == "count" else torch.float32)
            for feature, s in stats.items() for k, v in s.items()}
    save_file(flat, str(path / _NORMALIZER))
    save_file(flat, str(path / _UNNORMALIZER))
    write_tokenizer(path / "tokenizer")


# ---- the client side ---------------------------------------------------------------------------

class RealPi0:
    """A loaded checkpoint and the robot-side transforms: the observation becomes the camera
    image, the state and the task; the chunk of set-point offsets becomes joint set-points; the
    plan the loop still executes becomes LeRobot's ``prev_actions``."""

    def __init__(self, policy: LeRobotPi0) -> None:
        self.policy = policy
        self.config = policy.config
        self.horizon = policy.config.chunk_size
        self.rtc = policy.config.rtc or RtcSettings()

    @staticmethod
    def load(path: Union[str, pathlib.Path] = WEIGHTS_DIR) -> "RealPi0":
        path = pathlib.Path(path)
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"{path} holds no LeRobot pi0 checkpoint (config.json); "
                                    "train one with examples/robot/train_pi0_real.py")
        return RealPi0(load_lerobot_pi0(path, sizes=SIZES, verbose=False))

    def camera(self, obs: np.ndarray) -> np.ndarray:
        """The top-down view at the checkpoint's resolution (``image_resolution``; the library
        resizes with padding as LeRobot does when a camera gives another size)."""
        return topdown_image(obs, self.config.vision.image_size)

    def request(self, obs: np.ndarray, delay: int = 0, plan: Optional[np.ndarray] = None,
                seed: int = 0, guided: bool = True) -> dict:
        """``LeRobotPi0Policy`` inputs for an observation. ``plan``: the actions the loop will
        still execute from the observation's tick on (``ActionChunkBuffer.remaining``, at least
        ``delay`` of them: where it runs out the loop holds its last action). With ``guided``
        and a plan they are LeRobot's ``prev_actions`` (in the checkpoint's action space: offsets
        from this observation's joint angles) and ``delay`` its d."""
        if isinstance(delay, bool) or not isinstance(delay, (int, np.integer)) \
                or not 0 <= delay < self.horizon:
            raise ValueError(f"delay must be an integer in [0, {self.horizon}) ticks (the "
                             f"chunk size); got {delay!r}")
        obs = np.asarray(obs, np.float32)
        out = {"images": {CAMERA: self.camera(obs)}, "state": obs, "task": TASK,
               "seed": int(seed)}
        left = 0 if plan is None else len(plan)
        if guided and max(left, delay) > 0:
            prev = frozen_rows(plan, max(left, int(delay)), obs)[: self.horizon]
            out.update(delay=int(delay), prev_actions=prev - obs[None, 0:2])
        return out

    def decode(self, actions: Any, obs: np.ndarray) -> np.ndarray:
        """The policy's chunk ``[H, 2]`` (offsets) -> joint set-points."""
        a = actions.numpy() if isinstance(actions, torch.Tensor) else np.asarray(actions)
        return (a + np.asarray(obs, np.float32)[None, 0:2]).astype(np.float32)

    def act(self, obs: np.ndarray, delay: int = 0, plan: Optional[np.ndarray] = None,
            seed: int = 0, guided: bool = True) -> np.ndarray:
        """The chunk ``[H, 2]`` of joint set-points without the runtime: the same request, the
        same noise, the dense forward (:func:`sample_chunk`)."""
        r = self.request(obs, delay, plan, seed, guided)
        return self.decode(sample_chunk(self.policy, r, self.rtc), obs)


# ---- batched dense forward for training and fast rollouts ---------------------------------------
# PiModule's layers take flat tokens and an attention object; these attend within each of B
# equal-length samples (one prompt for every sample, so nothing is padded) and keep the autograd
# graph. LeRobot runs prefix and suffix in one call; the prefix never sees the suffix, so running
# the prefix (with the state token) first and the actions against its keys and values computes
# the same thing. The tests hold act() to the served chunk and the library's reference.

class _Prefix:
    """Images + prompt attend to each other; the state token to them and itself. Keeps each
    layer's keys and values."""

    def __init__(self, batch: int, prefix_len: int) -> None:
        self.batch = batch
        n = prefix_len + 1
        self.mask = (torch.arange(n)[None, :] < prefix_len) | (torch.arange(n)[:, None] == n - 1)
        self.k: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
               ) -> torch.Tensor:
        self.k[layer], self.v[layer] = k, v
        return _attention(self.batch, q, k, v, self.mask)


class _Suffix:
    """The action tokens attend to their sample's prefix and state and to each other."""

    def __init__(self, prefix: _Prefix) -> None:
        self.prefix = prefix

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
               ) -> torch.Tensor:
        b = self.prefix.batch
        pk = self.prefix.k[layer].view(b, -1, *k.shape[1:])
        pv = self.prefix.v[layer].view(b, -1, *v.shape[1:])
        kk = torch.cat([pk, k.view(b, -1, *k.shape[1:])], 1).flatten(0, 1)
        vv = torch.cat([pv, v.view(b, -1, *v.shape[1:])], 1).flatten(0, 1)
        return _attention(b, q, kk, vv, None)


def _attention(b: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               mask: Optional[torch.Tensor]) -> torch.Tensor:
    """Flat ``q [b * T, H, D]``, ``k, v [b * S, Hk, D]``: attention within each of the b samples,
    the query heads of one KV head in one matrix product (at these sizes about a third faster on
    a CPU than scaled_dot_product_attention's flash kernel, forward and backward)."""
    qb, kb, vb = (t.view(b, -1, *t.shape[1:]) for t in (q, k, v))
    tq, h, d = qb.shape[1:]
    s, hk = kb.shape[1], kb.shape[2]
    g = h // hk
    qh = qb.view(b, tq, hk, g, d).permute(0, 2, 1, 3, 4).reshape(b * hk, tq * g, d)
    scores = torch.bmm(qh, kb.permute(0, 2, 3, 1).reshape(b * hk, d, s)) * d ** -0.5
    if mask is not None:
        scores = scores.view(b * hk, tq, g, s).masked_fill(~mask[:, None, :], float("-inf"))
        scores = scores.view(b * hk, tq * g, s)
    out = torch.bmm(scores.softmax(-1), vb.permute(0, 2, 1, 3).reshape(b * hk, s, d))
    return out.view(b, hk, tq, g, d).permute(0, 2, 1, 3, 4).reshape(b * tq, h, d)


def encode(module: PiModule, pixels: torch.Tensor, ids: torch.Tensor,
           state: torch.Tensor) -> _Prefix:
    """B prefixes (the camera's image tokens, then the prompt) through the backbone and the state
    tokens through the expert; ``state`` normalised ``[B, max_state_dim]``."""
    b = pixels.shape[0]
    prefix = torch.cat([module.image_tokens(pixels),
                        module.prompt_tokens(ids)[None].expand(b, -1, -1)], 1)
    p = prefix.shape[1]
    rows = torch.arange(b * (p + 1)).view(b, p + 1)
    record = _Prefix(b, p)
    module.run_prefix(prefix.flatten(0, 1), torch.arange(p + 1).repeat(b), record,
                      rows[:, :p].flatten(), module.state_token(state), rows[:, p])
    return record


def suffix_velocity(module: PiModule, record: _Prefix, x_t: torch.Tensor, t: torch.Tensor
                    ) -> torch.Tensor:
    """pi0's velocity ``[B, H, A]`` for noisy chunks ``x_t`` at flow times ``t [B]`` (LeRobot's
    convention: 1 is noise, 0 the actions)."""
    b, h, _ = x_t.shape
    p = record.k[0].shape[0] // b
    tokens, cond = module.action_tokens(x_t.flatten(0, 1), t,
                                        torch.arange(b).repeat_interleave(h))
    positions = torch.arange(p, p + h).repeat(b)
    return module.velocity(tokens, positions, _Suffix(record), cond).view(b, h, -1)


def velocity(module: PiModule, pixels: torch.Tensor, ids: torch.Tensor, state: torch.Tensor,
             x_t: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """The whole forward of LeRobot's ``PI0Pytorch.forward`` up to the velocity."""
    return suffix_velocity(module, encode(module, pixels, ids, state), x_t, t)


@torch.inference_mode()
def sample_chunk(policy: LeRobotPi0, inputs: dict, rtc: Optional[RtcSettings]) -> torch.Tensor:
    """One request's chunk ``[H, action_dim]`` (un-normalised) as the served walks compute it:
    LeRobot's Euler steps from t = 1, guided towards ``prev_actions`` when given."""
    from mstar_rt.models.lerobot_pi0_io import preprocess_image
    from mstar_rt.models.lerobot_pi0_request import check_request

    m, c, proc = policy.module, policy.config, policy.processor
    r = check_request(proc, inputs, m.device, rtc)
    pixels = torch.stack([preprocess_image(im, c.vision.image_size) for _i, im in r.images])
    record = encode(m, pixels, r.ids, r.state[None])
    n, h = c.num_steps, c.chunk_size
    dt = -1.0 / n
    x = r.noise[None]
    for k in range(n):
        time_ = 1.0 + k * dt
        v = suffix_velocity(m, record, x, torch.tensor([time_]))[0]
        guide = guidance([r], [time_], rtc, h, c.max_action_dim, m.device)
        if guide is not None:
            v = guided_velocity(v, x[0], guide)
        x = x + dt * v[None]
    return proc.actions(x[0])

"""V-JEPA 2-AC served: the encoder node in front of the KV-cached ``rollout`` walk.

    encoder (stateless engine) -> DynamicLoop(predictor) on the KV engine

``encoder`` turns the request's observed camera ``images`` into frame features (each image its
own still clip, layer-normed: :class:`~mstar_rt.models.vjepa2_encoder.VJEPA2FrameEncoder`); the
loop is :mod:`mstar_rt.models.world_model`'s ``rollout`` walk over the V-JEPA 2-AC predictor:
iteration 0 writes the observed frames' blocks into the paged cache, every later one runs only
the block of the frame it predicted, and each request stops at its own ``horizon``. Each
iteration EMITs the predicted ``frame [N, E]`` (layer-normed features) and ``state [7]`` (the
end-effector pose after the frame's action, upstream's planner update).

    wm = VJEPA2WorldModel.from_pretrained("vjepa2-ac-vitg.pt", encoder="vjepa2-vitg-fpc64-256")
    with mstar_rt.Runtime(wm) as rt:
        out = rt.submit({"images": rgb, "states": poses, "actions": a, "horizon": 4}).result()

Without an encoder the walk takes encoder features as ``frames`` (the plain ``WorldModel``
inputs). :func:`upstream_rollout` is upstream's loop: the predictor over every frame so far at
each step, the newest frame's prediction kept -- the reference the walk must equal.
"""

from __future__ import annotations

import os
from typing import Any, Mapping, Optional, Union

import torch
import torch.nn.functional as F

from mstar_rt.engines.kv_engine import KVCacheEngine
from mstar_rt.graph import DynamicLoop, GraphNode, Sequential
from mstar_rt.model import NodeSubmodule, WorkContext
from mstar_rt.models.vjepa2_encoder import VJEPA2FrameEncoder, check_images, load_vjepa2_encoder
from mstar_rt.models.vjepa2_checkpoint import load_vjepa2_predictor
from mstar_rt.models.vjepa2_predictor import VJEPA2ACConfig, VJEPA2ACPredictor, next_pose
from mstar_rt.models.world_model import LOOP, WorldModel, check_rollout_inputs

PathLike = Union[str, os.PathLike]


class EncoderNode(NodeSubmodule):
    """Encodes camera images into frame features; ``names`` maps each image input to the
    features output it becomes (``images -> frames``; the planner adds ``goal_image -> goal``,
    whose single image comes out as ``[N, E]``). The images of every request in a batch go
    through the encoder together, ``max_images`` at a time."""

    def __init__(self, encoder: VJEPA2FrameEncoder, names: Mapping[str, str],
                 out_device: Any, out_dtype: torch.dtype, max_batch: int = 8,
                 max_images: int = 16) -> None:
        self.encoder, self.names = encoder.eval(), dict(names)
        self.out_device, self.out_dtype = out_device, out_dtype
        self.max_batch, self.max_images = max_batch, max_images

    def prepare_inputs(self, ctx: WorkContext, inputs: dict) -> Any:
        crop = self.encoder.config.crop_size
        return [check_images(inputs[name], crop, name) for name in self.names]

    @torch.inference_mode()
    def forward(self, batch: list[Any]) -> list[Mapping[str, Any]]:
        images = torch.cat([x for item in batch for x in item])
        feats = torch.cat([self.encoder(images[i:i + self.max_images])
                           for i in range(0, images.shape[0], self.max_images)])
        feats = feats.to(device=self.out_device, dtype=self.out_dtype)
        outs, at = [], 0
        for item in batch:
            out = {}
            for (name, produced), x in zip(self.names.items(), item):
                f = feats[at:at + x.shape[0]]
                out[produced] = f if name == "images" else f[0]
                at += x.shape[0]
            outs.append(out)
        return outs


def check_encoder_fits(encoder: VJEPA2FrameEncoder, config: VJEPA2ACConfig) -> None:
    if (encoder.embed_dim, encoder.num_patches) != (config.embed_dim, config.num_patches):
        raise ValueError(f"the encoder gives {encoder.num_patches} patch features of width "
                         f"{encoder.embed_dim} per image, but the predictor reads "
                         f"{config.num_patches} of width {config.embed_dim}; pair the AC "
                         "predictor with the encoder it was trained on (ViT-g, 256 px)")


class VJEPA2WorldModel(WorldModel):
    """The ``rollout`` walk over a :class:`VJEPA2ACPredictor`, fed by ``encoder`` if given
    (inputs ``images``, ``states``, ``actions``, ``horizon``), else by the request's encoder
    features (inputs ``frames``, ``states``, ``actions``, ``horizon``). Other arguments as
    :class:`~mstar_rt.models.world_model.WorldModel`."""

    def __init__(self, predictor: VJEPA2ACPredictor, encoder: Optional[VJEPA2FrameEncoder] = None,
                 max_horizon: Optional[int] = None, engine: Optional[KVCacheEngine] = None,
                 max_batch: int = 64) -> None:
        predictor.kv_layout()  # refuses predictors the cached walk cannot serve, now
        super().__init__(predictor, max_horizon, engine, max_batch)
        self.encoder = encoder
        if encoder is None:
            return
        check_encoder_fits(encoder, predictor.config)
        self.inputs = ("images", "states", "actions", "horizon")
        self.nodes = [GraphNode("encoder", ["images"], ["frames"]), *self.nodes]
        self.walks = {"rollout": Sequential("encoder", DynamicLoop(
            "predictor", self.max_horizon, LOOP, outputs=["frames", "states"]))}
        self.submodules = {**self.submodules, "encoder": EncoderNode(
            encoder, {"images": "frames"}, predictor.device, predictor.dtype)}
        self.engines = {**self.engines, "encoder": "encoder"}

    def validate_inputs(self, inputs: Mapping[str, Any]) -> None:
        if self.encoder is None:
            return super().validate_inputs(inputs)
        images = check_images(inputs.get("images"), self.encoder.config.crop_size)
        c = self.predictor.config
        stand_in = torch.zeros(()).expand(images.shape[0], c.num_patches, c.embed_dim)
        check_rollout_inputs(c, {**inputs, "frames": stand_in}, self.max_horizon)

    @staticmethod
    def from_pretrained(path: PathLike, encoder: Optional[PathLike] = None,
                        config: Optional[VJEPA2ACConfig] = None, encoder_config: Any = None,
                        dtype: Optional[torch.dtype] = None, device: str = "cpu",
                        progress: bool = True, **kwargs: Any) -> "VJEPA2WorldModel":
        """The predictor of ``path`` (upstream's ``.pt``, a ``.safetensors`` file or a saved
        directory; see ``vjepa2_checkpoint``) and, if ``encoder`` is given, the encoder of that
        path (a Hugging Face directory, or upstream's ``.pt`` -- the same file as ``path`` for
        ``vjepa2-ac-vitg.pt``, which holds both)."""
        predictor = load_vjepa2_predictor(path, config, dtype, device, progress)
        enc = None if encoder is None else load_vjepa2_encoder(encoder, encoder_config, dtype,
                                                               device, progress)
        return VJEPA2WorldModel(predictor, enc, **kwargs)


@torch.inference_mode()
def upstream_rollout(step: Any, frames: torch.Tensor, states: torch.Tensor,
                     actions: torch.Tensor, horizon: int, num_patches: int,
                     normalize_reps: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Upstream's autoregressive rollout over ``step(frames [B, T*N, E], actions [B, T, 7],
    states [B, T, 7]) -> [B, T*N, E]`` (upstream's ``VisionTransformerPredictorAC`` or
    :meth:`VJEPA2ACPredictor.forward_frames`): at every step the predictor runs over all frames
    so far and the last frame's prediction (layer-normed) becomes the next frame, its pose
    :func:`next_pose`. ``frames [C, N, E]``, ``states [C, 7]``, ``actions [C - 1 + H, 7]``.
    Returns (states ``[H, 7]``, frames ``[H, N, E]``)."""
    zs, ss = frames, states
    out_frames, out_states = [], []
    for _ in range(horizon):
        t = zs.shape[0]
        pred = step(zs.flatten(0, 1)[None], actions[None, :t], ss[None])[0, -num_patches:]
        if normalize_reps:
            pred = F.layer_norm(pred, (pred.shape[-1],))
        s = next_pose(ss[-1], actions[t - 1])
        zs, ss = torch.cat([zs, pred[None]]), torch.cat([ss, s[None]])
        out_frames.append(pred)
        out_states.append(s)
    return torch.stack(out_states), torch.stack(out_frames)

"""pi0 and pi0.5 exactly as LeRobot defines them, served from a LeRobot checkpoint directory as
two walks on the KV engine.

* ``prefix`` = ``vision`` (LeRobot's image preprocessing, the SigLIP tower and the projector
  over every camera of every request in the batch; a stateless node) then ``prefix`` (the
  prompt tokenised and embedded; the Gemma backbone over images + prompt with bidirectional
  attention, written to the request's KV pages). pi0's state token joins this step: the expert
  runs it in the same attention call (it sees the prefix and itself, never the actions, so its
  keys and values are the same at every flow step and are cached after the prefix).
* ``action_gen`` = a Loop of ``num_steps`` ``denoise`` steps: the expert runs the chunk's action
  tokens against the cached pages read-only (``KVWork(persist=False)``) and takes one Euler step
  ``x <- x + dt v`` from t = 1 (noise) towards 0; the last step EMITs ``actions [chunk,
  action_dim]``, un-normalised with the checkpoint's statistics.

The prompt's padded positions are not cached (no token may see them, and the positions of the
valid ones do not count them), nor are cameras a request leaves out (LeRobot masks them): the
chunk equals LeRobot's (the tests compare with its fixtures within 1e-4 in float32).

    policy = load_lerobot_pi0("ckpt/pi05", tokenizer="paligemma_tokenizer/")
    with mstar_rt.Runtime(LeRobotPi0Policy(policy)) as rt:
        actions = rt.submit({"images": {"observation.images.base_0_rgb": rgb},
                             "state": q, "task": "pick up the cube"}).result()["actions"][0]

Real-time chunking: LeRobot's guided form (``delay``, ``prev_actions``; see
:mod:`~mstar_rt.models.lerobot_rtc`), with the checkpoint's ``rtc_config`` or LeRobot's
defaults. :func:`~mstar_rt.models.lerobot_pi0_reference.reference_actions` is the plain
PyTorch computation in LeRobot's order.
"""

from __future__ import annotations

import os
from typing import Any, Mapping, Optional, Union

import torch

from mstar_rt.engines.kv_engine import KVCacheEngine, KVNodeSubmodule, KVStep, KVWork
from mstar_rt.engines.masks import BlockCausal, PrefixBidirectional
from mstar_rt.engines.paged_kv import KVLayout
from mstar_rt.graph import EMIT, GraphEdge, GraphNode, Loop, Sequential
from mstar_rt.model import Model, NodeSubmodule, RequestContext, WorkContext
from mstar_rt.models.flow_graphs import (FlowGraphs, TimeEmbeddings, policy_graphs,
                                        same_batch)
from mstar_rt.models.lerobot_inputs import camera_images, unit_image
from mstar_rt.models.lerobot_pi0_graphs import PiFlowStep
from mstar_rt.models.lerobot_pi0_io import preprocess_image
from mstar_rt.models.lerobot_pi0_load import LeRobotPi0, load_lerobot_pi0
from mstar_rt.models.lerobot_pi0_request import PiRequest, check_request
from mstar_rt.models.lerobot_pi0_suffix import SuffixAttention, prefix_snapshot
from mstar_rt.models.lerobot_rtc import RtcSettings, guidance, guided_velocity


class VisionNode(NodeSubmodule):
    """Every camera image of every request in the batch through the tower at once."""

    def __init__(self, policy: LeRobotPi0, max_batch: int = 16) -> None:
        self.policy, self.max_batch = policy, max_batch

    @torch.inference_mode()
    def forward(self, batch: list[Any]) -> list[Mapping[str, Any]]:
        c, m = self.policy.config, self.policy.module
        pairs = [camera_images(c.cameras, b["images"]) for b in batch]
        pixels = torch.stack([preprocess_image(im, c.vision.image_size, c.cameras[i])
                              for ps in pairs for i, im in ps])
        tokens = m.image_tokens(pixels.to(m.device)).flatten(0, 1)
        outs: list[Mapping[str, Any]] = []
        start, n = 0, c.num_image_tokens
        for ps in pairs:
            outs.append({"image_tokens": tokens[start:start + n * len(ps)]})
            start += n * len(ps)
        return outs


class PrefixNode(KVNodeSubmodule):
    """Images + prompt through the backbone (and pi0's state token through the expert), written
    to the request's pages."""

    def __init__(self, policy: LeRobotPi0, rtc: Optional[RtcSettings], max_batch: int) -> None:
        self.policy, self.rtc, self.max_batch = policy, rtc, max_batch

    def kv_layout(self) -> KVLayout:
        return self.policy.module.kv_layout()

    def prepare_inputs(self, ctx: WorkContext, inputs: dict) -> KVWork:
        m, c = self.policy.module, self.policy.config
        r = check_request(self.policy.processor, inputs, m.device, self.rtc)
        with torch.inference_mode():
            # image tokens made elsewhere may be on another device (a placed parent keeps a
            # CUDA tensor's host copy; a worker on a GPU gets them on its own): onto this one's
            prefix = torch.cat([inputs["image_tokens"].to(m.device), m.prompt_tokens(r.ids)])
            state = None
            if c.family == "pi0":
                padded = torch.nn.functional.pad(r.state, (0, c.max_state_dim - r.state.numel()))
                state = m.state_token(padded[None])
        n = prefix.shape[0]
        cached = n + (state is not None)
        ctx.request.state.update(cached=cached, request=r)
        return KVWork(cached, mask=PrefixBidirectional(n), reserve=cached,
                      payload=(prefix, state, r.noise.to(m.head_dtype)))

    @torch.inference_mode()
    def forward_kv(self, works: list[KVWork], step: KVStep) -> list[Mapping[str, Any]]:
        m = self.policy.module
        prefixes = [w.payload[0] for w in works]
        states = [w.payload[1] for w in works]
        if states[0] is None:  # pi0.5: the backbone only
            m.run_prefix(torch.cat(prefixes), step.positions, step)
        else:  # pi0: each request's prefix rows, then its state row
            sizes = [p.shape[0] + 1 for p in prefixes]
            is_state = torch.zeros(sum(sizes), dtype=torch.bool)
            is_state[torch.tensor(sizes).cumsum(0) - 1] = True
            rows = torch.arange(sum(sizes))
            m.run_prefix(torch.cat(prefixes), step.positions, step, rows[~is_state].to(m.device),
                         torch.cat(states), rows[is_state].to(m.device))
        return [{"x": w.payload[2]} for w in works]


class DenoiseNode(KVNodeSubmodule):
    """One Euler step of the expert per request, reading the cached prefix: through a
    :class:`~mstar_rt.models.lerobot_pi0_suffix.SuffixAttention` set up at the chunk's first step
    and kept while the batch holds the same requests, or through ``graphs`` (static buckets,
    CUDA graphs on a GPU) where they serve the batch."""

    def __init__(self, policy: LeRobotPi0, rtc: Optional[RtcSettings], max_batch: int,
                 graphs: Optional[FlowGraphs] = None) -> None:
        self.policy, self.rtc, self.max_batch, self.graphs = policy, rtc, max_batch, graphs
        self.suffix: Optional[SuffixAttention] = None
        self.time_embedding = TimeEmbeddings(policy.module.time_embedding, policy.module.device)

    def kv_layout(self) -> KVLayout:
        return self.policy.module.kv_layout()

    def prepare_inputs(self, ctx: WorkContext, inputs: dict) -> KVWork:
        s = ctx.request.state
        h = self.policy.config.chunk_size
        # The action tokens see every cached token and each other; nothing is written.
        return KVWork(h, persist=False, mask=BlockCausal(h, start=s["cached"]),
                      payload=(inputs["x"], ctx.iteration, s["request"], ctx.request.cache_id))

    def snapshots(self, works: list[KVWork], step: KVStep) -> Optional[list[torch.Tensor]]:
        """The requests' prefix snapshots, each taken from the pages at its request's first
        step; None where the cache cannot hand the K/V out."""
        requests: list[PiRequest] = [w.payload[2] for w in works]
        for w, r in zip(works, requests):
            if r.prefix_kv is None:
                r.prefix_kv = prefix_snapshot(step, w.payload[3])
                if r.prefix_kv is None:
                    return None
        return [r.prefix_kv for r in requests if r.prefix_kv is not None]

    def attention(self, works: list[KVWork], step: KVStep) -> Optional[SuffixAttention]:
        """The batch's suffix attention: the last one while the batch holds the same request
        objects (compared by identity: a request prefixed again brings a new one), else a new one
        over their prefix snapshots; None where the cache cannot hand the K/V out."""
        requests: list[PiRequest] = [w.payload[2] for w in works]
        if self.suffix is not None and same_batch(self.suffix.key, requests):
            return self.suffix
        prefixes = self.snapshots(works, step)
        if prefixes is None:
            return None
        m = self.policy.module
        self.suffix = SuffixAttention.over(tuple(requests), prefixes,
                                           self.policy.config.chunk_size, m.rope, m.dtype)
        return self.suffix

    def dynamic_velocity(self, works: list[KVWork], step: KVStep, x: torch.Tensor,
                         times: list[float]) -> torch.Tensor:
        m, h = self.policy.module, self.policy.config.chunk_size
        suffix = self.attention(works, step)
        if suffix is None:  # through the engine's paged attention
            t = torch.tensor(times, dtype=torch.float32, device=m.device)
            rows = torch.arange(len(works), device=m.device).repeat_interleave(h)
            tokens, cond = m.action_tokens(x, t, rows)
            return m.velocity(tokens, step.positions, step, cond)
        tokens, cond = m.action_tokens(x, None, suffix.rows, self.time_embedding(times))
        return m.velocity(tokens, suffix.positions, suffix, cond, suffix.tables)

    @torch.inference_mode()
    def forward_kv(self, works: list[KVWork], step: KVStep) -> list[Mapping[str, Any]]:
        m, c = self.policy.module, self.policy.config
        h, n = c.chunk_size, c.num_steps
        dt = -1.0 / n
        # requests of one step may be at different iterations: each carries its own time
        times = [1.0 + w.payload[1] * dt for w in works]
        x = torch.cat([w.payload[0] for w in works])
        requests: list[PiRequest] = [w.payload[2] for w in works]
        v = None
        if self.graphs is not None:
            v = self.graphs.velocity(tuple(requests), lambda: self.snapshots(works, step), x,
                                     self.time_embedding(times))
        if v is None:
            v = self.dynamic_velocity(works, step, x, times)
        guide = guidance(requests, times, self.rtc, h, c.max_action_dim, m.device)
        if guide is not None:  # the batch's unguided requests have weight 0
            v = guided_velocity(v, x, guide)
        new = x + dt * v
        outs: list[Mapping[str, Any]] = []
        for i, w in enumerate(works):
            chunk = new[i * h:(i + 1) * h]
            out: dict[str, Any] = {"x": chunk}
            if w.payload[1] == n - 1:  # done: stream the chunk (earlier steps EMIT nothing)
                out["actions"] = self.policy.processor.actions(chunk).cpu()
                requests[i].prefix_kv = None  # the copies live only while the flow steps run
            outs.append(out)
        if all(w.payload[1] == n - 1 for w in works):
            self.suffix = None
            if self.graphs is not None:
                self.graphs.forget()
        return outs


class LeRobotPi0Policy(Model):
    """The ``prefix`` and ``action_gen`` walks over a :class:`~mstar_rt.models.lerobot_pi0_load.
    LeRobotPi0` (pi0 or pi0.5).

    Inputs: ``images`` (a dict by camera name, a list in camera order, or one image; float
    ``[3, H, W]`` in [0, 1] or uint8), ``state [state_dim]``, ``task`` (the instruction);
    optional ``noise [chunk, max_action_dim]`` (else drawn from ``seed``), and for guided
    real-time chunking ``delay`` and ``prev_actions [N, action_dim]``. EMITs ``actions
    [chunk, action_dim]``. ``rtc``: the guidance settings (default: the checkpoint's
    ``rtc_config``, else LeRobot's defaults; ``RtcSettings(enabled=False)`` refuses
    ``prev_actions``). ``cuda_graphs`` runs the flow steps through CUDA graphs of batch-size
    buckets (:class:`~mstar_rt.models.flow_graphs.FlowGraphs`; on the CPU the same padded
    static path runs eagerly); ``compile`` also ``torch.compile``s it.
    """

    inputs = ("images", "state", "task", "noise", "seed", "delay", "prev_actions")
    input_defaults = {"noise": None, "seed": None, "delay": 0, "prev_actions": None}

    def __init__(self, policy: LeRobotPi0, engine: Optional[KVCacheEngine] = None,
                 max_batch: int = 32, rtc: Optional[RtcSettings] = None,
                 cuda_graphs: bool = False, compile: Union[bool, str] = False) -> None:
        self.policy = policy
        policy.module.eval()
        c = policy.config
        self.rtc = rtc or c.rtc or RtcSettings()
        pages = max_batch * -(-c.max_prefix // 16)
        vla = engine or KVCacheEngine(page_size=16, num_pages=pages, max_batch=max_batch)
        self.engine_specs = {"vla": vla}
        self.graphs = policy_graphs(PiFlowStep(policy.module), vla.max_batch, cuda_graphs, compile)
        self.nodes = [
            GraphNode("vision", ["images"], ["image_tokens"],
                      submodule=VisionNode(policy), engine="vision"),
            GraphNode("prefix", ["image_tokens", "images", "state", "task", "noise", "seed",
                                 "delay", "prev_actions"],
                      [GraphEdge("denoise", "x", persist=True)],
                      submodule=PrefixNode(policy, self.rtc, max_batch), engine="vla"),
            GraphNode("denoise", ["x"], ["x", GraphEdge(EMIT, "actions")],
                      submodule=DenoiseNode(policy, self.rtc, max_batch, self.graphs),
                      engine="vla"),
        ]
        self.walks = {"prefix": Sequential("vision", "prefix"),
                      "action_gen": Loop("denoise", c.num_steps, outputs=["x"])}

    def warm_up(self) -> None:
        """Captures (compiles) the flow steps' graphs of every batch bucket now, not at the first
        chunk of each size; nothing without ``cuda_graphs`` or ``compile``."""
        if self.graphs is not None:
            self.graphs.warm_up()

    def openpi_defaults(self) -> dict[str, Any]:
        """How the openpi websocket maps LeRobot's observation keys onto the inputs."""
        from mstar_rt.models.lerobot import openpi_defaults

        return openpi_defaults(self.policy.config, self.policy.config.family, self.rtc)

    def validate_inputs(self, inputs: Mapping[str, Any]) -> None:
        r = check_request(self.policy.processor, inputs, "cpu", self.rtc)
        cameras = self.policy.config.cameras
        for i, im in r.images:  # shapes, dtypes, values: before the request reaches a batch
            unit_image(im, f"'images' of camera '{cameras[i]}'")

    def next_walk(self, request: RequestContext, finished_walk: str,
                  persisted: Mapping[str, Any]) -> Optional[str]:
        return "action_gen" if finished_walk == "prefix" else None

    @staticmethod
    def from_pretrained(path: Union[str, os.PathLike], tokenizer: Any = None,
                        dtype: Optional[torch.dtype] = None, device: str = "cpu",
                        sizes: Optional[Mapping[str, int]] = None, verbose: bool = True,
                        **kwargs: Any) -> "LeRobotPi0Policy":
        """Loads a LeRobot policy directory (:func:`load_lerobot_pi0`) and serves it."""
        return LeRobotPi0Policy(load_lerobot_pi0(path, tokenizer, dtype, device, sizes, verbose),
                                **kwargs)

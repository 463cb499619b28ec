"""LeRobot's SmolVLA served as two walks on the KV engine.

* ``prefix`` = ``vision`` (LeRobot's resize with left/top padding, the SmolVLM vision
  transformer and connector; a stateless node that batches every camera of every request) then
  ``prefix`` (the VLM's first ``num_vlm_layers`` layers over image tokens, task tokens and one
  state token, written to the request's KV pages once). The prefix node also maps each
  cross-attention layer's prefix K/V through that expert layer's ``k_proj``/``v_proj`` and
  passes them on as ``cross_kv`` (they are fixed for the request).
* ``action_gen`` = a Loop of ``num_steps`` ``denoise`` steps: the action expert runs the chunk's
  action tokens; its self-attention layers read the cached prefix read-only
  (``KVWork(persist=False)``: nothing is written) and attend causally to the action tokens, its
  cross-attention layers attend to ``cross_kv``; then one Euler step from t = 1 to 0. The last
  step EMITs ``actions [chunk_size, action_dim]``, unnormalised as LeRobot's postprocessor does.

Real-time chunking: LeRobot's guided form (``delay``, ``prev_actions``), the same guidance as
pi0's (:mod:`~mstar_rt.models.lerobot_rtc`), with the checkpoint's ``rtc_config`` or
LeRobot's defaults.

    smolvla = load_lerobot_smolvla("checkpoint_dir")
    with mstar_rt.Runtime(SmolVLAPolicy(smolvla)) as rt:
        chunk = rt.submit({"images": {"observation.images.camera1": rgb}, "state": q,
                           "task": "pick up the cube"}).result()["actions"][0]

:func:`~mstar_rt.models.smolvla_reference.sample_actions_reference` is the same computation
without the runtime (dense attention), checked against LeRobot's own outputs.
"""

from __future__ import annotations

import os
from typing import Any, Mapping, Optional, Union

import torch
import torch.nn.functional as F

from mstar_rt.engines.kv_engine import KVCacheEngine, KVNodeSubmodule, KVStep, KVWork
from mstar_rt.engines.masks import CAUSAL, PrefixBidirectional
from mstar_rt.engines.paged_kv import KVLayout
from mstar_rt.graph import EMIT, GraphEdge, GraphNode, Loop, Sequential
from mstar_rt.model import Model, NodeSubmodule, RequestContext, WorkContext
from mstar_rt.models.flow_graphs import (FlowGraphs, TimeEmbeddings, policy_graphs,
                                        same_batch)
from mstar_rt.models.lerobot_pi0_suffix import prefix_snapshot
from mstar_rt.models.lerobot_rtc import RtcSettings, guidance, guided_velocity
from mstar_rt.models.smolvla_checkpoint import LeRobotSmolVLA, load_lerobot_smolvla
from mstar_rt.models.smolvla_flow import FlowAttention, Prefix, SmolFlowStep
from mstar_rt.models.smolvla_inputs import (SmolVLARequest, camera_images, check_request, pixels,
                                            validate)

CrossKV = dict[int, tuple[torch.Tensor, torch.Tensor]]


class VisionNode(NodeSubmodule):
    """Every camera of every request in the batch through the vision model at once."""

    max_batch = 16

    def __init__(self, policy: LeRobotSmolVLA) -> None:
        self.policy = policy

    @torch.inference_mode()
    def forward(self, batch: list[Any]) -> list[Mapping[str, Any]]:
        m = self.policy.module
        per_request = [camera_images(self.policy, b["images"]) for b in batch]
        px = torch.stack([pixels(self.policy, im) for ims in per_request for im in ims])
        tokens = m.embed_images(px.to(device=m.device, dtype=m.dtype))
        outs: list[Mapping[str, Any]] = []
        start = 0
        for ims in per_request:
            outs.append({"image_embs": tokens[start:start + len(ims)].flatten(0, 1)})
            start += len(ims)
        return outs


class _KeepKV:
    """Passes attention to the KV step and keeps the K/V of the layers asked for."""

    def __init__(self, step: KVStep, layers: list[int]) -> None:
        self.step, self.layers = step, set(layers)
        self.kv: CrossKV = {}

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if layer in self.layers:
            self.kv[layer] = (k, v)
        return self.step.attend(layer, q, k, v)


class PrefixNode(KVNodeSubmodule):
    """The VLM over each request's prefix, written to its KV pages."""

    def __init__(self, policy: LeRobotSmolVLA, rtc: Optional[RtcSettings], max_batch: int) -> None:
        self.policy, self.rtc, self.max_batch = policy, rtc, max_batch

    def kv_layout(self) -> KVLayout:
        return self.policy.module.kv_layout()

    def prepare_inputs(self, ctx: WorkContext, inputs: dict) -> KVWork:
        r = check_request(self.policy, inputs, self.rtc)
        ctx.request.state["request"] = r  # the flow steps' guidance reads delay and prev
        with torch.inference_mode():
            m = self.policy.module  # image tokens made elsewhere may be on another device
            x = m.prefix_embeds(inputs["image_embs"].to(m.device), r.prompt, r.state)
        n = x.shape[0]
        # Image and task tokens see each other both ways; the state token (last) sees all.
        return KVWork(n, mask=PrefixBidirectional(n - 1), reserve=n, payload=(x, r.noise))

    @torch.inference_mode()
    def forward_kv(self, works: list[KVWork], step: KVStep) -> list[Mapping[str, Any]]:
        m = self.policy.module
        keep = _KeepKV(step, m.cross_layers)
        m.run_prefix(torch.cat([w.payload[0] for w in works]), step.positions, keep)
        outs: list[Mapping[str, Any]] = []
        start = 0
        for w in works:
            end = start + w.num_tokens
            cross = {i: m.cross_kv(i, k[start:end], v[start:end]) for i, (k, v) in keep.kv.items()}
            outs.append({"x": w.payload[1], "cross_kv": cross})
            start = end
        return outs


class _BatchedCross:
    """Cross-attention of every request's action tokens to its own ``cross_kv`` (padded to the
    longest prefix of the batch, masked)."""

    def __init__(self, kvs: list[CrossKV], h: int) -> None:
        self.kvs, self.h = kvs, h
        lengths = [next(iter(kv.values()))[0].shape[0] for kv in kvs] if kvs[0] else [0]
        self.longest = max(lengths)
        self.mask = None
        if min(lengths) != self.longest:
            dev = next(iter(kvs[0].values()))[0].device
            pos = torch.arange(self.longest, device=dev)
            self.mask = (pos[None, :] < torch.tensor(lengths, device=dev)[:, None])[:, None, None]

    def _padded(self, layer: int, which: int) -> torch.Tensor:
        return torch.stack([F.pad(kv[layer][which], (0, 0, 0, 0, 0, self.longest -
                                                      kv[layer][which].shape[0]))
                            for kv in self.kvs])

    def __call__(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        b, h = len(self.kvs), self.h
        k, v = self._padded(layer, 0), self._padded(layer, 1)  # [B, n, Hkv, D]
        qb = q.view(b, h, *q.shape[1:]).transpose(1, 2)
        out = F.scaled_dot_product_attention(qb, k.transpose(1, 2), v.transpose(1, 2),
                                             attn_mask=self.mask,
                                             enable_gqa=q.shape[1] != k.shape[2])
        return out.transpose(1, 2).reshape(q.shape)


class DenoiseNode(KVNodeSubmodule):
    """One Euler step of the action expert per request, reading the cached prefix: through a
    :class:`~mstar_rt.models.smolvla_flow.FlowAttention` set up at the chunk's first step and
    kept while the batch holds the same requests."""

    def __init__(self, policy: LeRobotSmolVLA, rtc: Optional[RtcSettings], max_batch: int,
                 graphs: Optional[FlowGraphs] = None) -> None:
        self.policy, self.rtc, self.max_batch, self.graphs = policy, rtc, max_batch, graphs
        self.flow: Optional[FlowAttention] = None
        self.time_embeds = TimeEmbeddings(policy.module.time_embeds, policy.module.device)

    def kv_layout(self) -> KVLayout:
        return self.policy.module.kv_layout()

    def prepare_inputs(self, ctx: WorkContext, inputs: dict) -> KVWork:
        h = self.policy.config.chunk_size
        # Action tokens see the whole prefix and the tokens before them; nothing is written.
        return KVWork(h, persist=False, mask=CAUSAL,
                      payload=(inputs["x"], ctx.iteration, inputs["cross_kv"],
                               ctx.request.state["request"], ctx.request.cache_id))

    def prefixes(self, works: list[KVWork], step: KVStep) -> Optional[list[Prefix]]:
        """Each request's prefix K/V (taken from the pages at its first step) and cross K/V;
        None where the cache cannot hand the K/V out (a tensor-parallel share)."""
        out: list[Prefix] = []
        for w in works:
            r: SmolVLARequest = w.payload[3]
            if r.prefix_kv is None:
                r.prefix_kv = prefix_snapshot(step, w.payload[4])
                if r.prefix_kv is None:
                    return None
            out.append((r.prefix_kv, w.payload[2]))
        return out

    def attention(self, works: list[KVWork], step: KVStep) -> Optional[FlowAttention]:
        """The batch's flow attention: the last one while the batch holds the same request
        objects (compared by identity), else a new one over their prefixes."""
        requests = [w.payload[3] for w in works]
        if self.flow is not None and same_batch(self.flow.key, requests):
            return self.flow
        prefixes = self.prefixes(works, step)
        if prefixes is None:
            return None
        m = self.policy.module
        self.flow = FlowAttention.over(tuple(requests), prefixes, self.policy.config.chunk_size,
                                       m.cross_layers)
        return self.flow

    def dynamic_velocity(self, works: list[KVWork], step: KVStep, x: torch.Tensor,
                         time: torch.Tensor) -> torch.Tensor:
        m, h = self.policy.module, self.policy.config.chunk_size
        rows = torch.arange(len(works), device=m.device).repeat_interleave(h)
        suffix = m.suffix_embeds(x, None, rows, time)
        flow = self.attention(works, step)
        if flow is not None:
            return m.velocity(m.expert_forward(suffix, None, flow, None, flow, flow.tables))
        # through the engine's paged attention, the cross K/V padded at every step
        cross = _BatchedCross([w.payload[2] for w in works], h)
        cross_positions = torch.arange(h, device=m.device).repeat(len(works))
        return m.velocity(m.expert_forward(suffix, step.positions, step, cross_positions, cross))

    @torch.inference_mode()
    def forward_kv(self, works: list[KVWork], step: KVStep) -> list[Mapping[str, Any]]:
        m, c = self.policy.module, self.policy.config
        h, n = c.chunk_size, c.num_steps
        dt = -1.0 / n
        # requests of one step may be at different iterations: each carries its own time
        times = [1.0 + w.payload[1] * dt for w in works]
        x = torch.cat([w.payload[0] for w in works])
        time = self.time_embeds(times)
        requests: list[SmolVLARequest] = [w.payload[3] for w in works]
        v = None
        if self.graphs is not None:
            v = self.graphs.velocity(tuple(requests), lambda: self.prefixes(works, step), x,
                                     time)
        if v is None:
            v = self.dynamic_velocity(works, step, x, time)
        guide = guidance(requests, times, self.rtc, h, c.max_action_dim, m.device)
        if guide is not None:  # the batch's unguided requests have weight 0
            v = guided_velocity(v, x, guide)
        outs: list[Mapping[str, Any]] = []
        for i, w in enumerate(works):
            chunk = w.payload[0] + dt * v[i * h:(i + 1) * h]
            out: dict[str, Any] = {"x": chunk}
            if w.payload[1] == n - 1:  # the chunk is done: stream it (earlier steps EMIT nothing)
                out["actions"] = self.policy.unnormalize_actions(chunk)
                requests[i].prefix_kv = None  # the copy lives only while the flow steps run
            outs.append(out)
        if all(w.payload[1] == n - 1 for w in works):
            self.flow = None
            if self.graphs is not None:
                self.graphs.forget()
        return outs


class SmolVLAPolicy(Model):
    """The ``prefix`` and ``action_gen`` walks over a loaded :class:`LeRobotSmolVLA`.

    Inputs: ``images`` (a dict by camera key -- any non-empty subset of the policy's cameras --
    or a list in the config's order; float ``[3, H, W]`` in [0, 1] or uint8 ``[3, H, W]`` /
    ``[H, W, 3]``), ``state [state_dim]`` (raw), ``task`` (the instruction, or its token ids);
    optional ``noise [chunk_size, max_action_dim]`` (else drawn from ``seed``), and for guided
    real-time chunking ``delay`` and ``prev_actions [N, action_dim]`` (raw). EMITs
    ``actions [chunk_size, action_dim]`` (unnormalised). ``rtc``: the guidance settings
    (default: the checkpoint's ``rtc_config``, else LeRobot's defaults;
    ``RtcSettings(enabled=False)`` refuses ``prev_actions``). ``cuda_graphs`` runs the flow
    steps through CUDA graphs of batch-size buckets (:class:`~mstar_rt.models.flow_graphs.
    FlowGraphs`; on the CPU the same padded static path runs eagerly); ``compile`` also
    ``torch.compile``s it.
    """

    inputs = ("images", "state", "task", "noise", "seed", "delay", "prev_actions")
    input_defaults = {"noise": None, "seed": None, "delay": 0, "prev_actions": None}

    def __init__(self, policy: LeRobotSmolVLA, engine: Optional[KVCacheEngine] = None,
                 max_batch: int = 32, rtc: Optional[RtcSettings] = None,
                 cuda_graphs: bool = False, compile: Union[bool, str] = False) -> None:
        policy.module.eval()
        self.policy = policy
        c = policy.config
        self.rtc = rtc or c.rtc or RtcSettings()
        pages = max_batch * -(-c.max_prefix // 16)
        vla = engine or KVCacheEngine(page_size=16, num_pages=pages, max_batch=max_batch)
        self.engine_specs = {"vla": vla}
        self.graphs = policy_graphs(SmolFlowStep(policy.module), vla.max_batch, cuda_graphs,
                                    compile)
        self.nodes = [
            GraphNode("vision", ["images"], ["image_embs"], submodule=VisionNode(policy),
                      engine="vision"),
            GraphNode("prefix", ["image_embs", "state", "task", "noise", "seed", "delay",
                                 "prev_actions"],
                      [GraphEdge("denoise", "x", persist=True),
                       GraphEdge("denoise", "cross_kv", persist=True)],
                      submodule=PrefixNode(policy, self.rtc, max_batch), engine="vla"),
            GraphNode("denoise", ["x", "cross_kv"], ["x", GraphEdge(EMIT, "actions")],
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

        return openpi_defaults(self.policy.config, "smolvla", self.rtc,
                               text_task=self.policy.tokenizer is not None)

    def validate_inputs(self, inputs: Mapping[str, Any]) -> None:
        validate(self.policy, inputs, self.rtc)

    def next_walk(self, request: RequestContext, finished_walk: str,
                  persisted: Mapping[str, Any]) -> Optional[str]:
        return "action_gen" if finished_walk == "prefix" else None

    @staticmethod
    def from_lerobot(path: Union[str, os.PathLike], dtype: Optional[torch.dtype] = None,
                     device: str = "cpu", vlm_dir: Optional[str] = None, progress: bool = True,
                     **kwargs: Any) -> "SmolVLAPolicy":
        """Serves the LeRobot checkpoint directory ``path`` (see :func:`load_lerobot_smolvla`)."""
        return SmolVLAPolicy(load_lerobot_smolvla(path, dtype, device, vlm_dir, progress),
                             **kwargs)

"""A pi0-style vision-language-action policy served as two walks on the KV engine.

* ``prefix`` = ``vision`` (OpenCV preprocessing + SigLIP tower + projector, a stateless node)
  then ``prefix`` (the backbone over image tokens, prompt tokens and a state token, written to
  the request's KV pages with bidirectional prefix attention).
* ``action_gen`` = a Loop of ``num_steps`` ``denoise`` steps: the action expert runs the H
  action tokens against the cached prefix read-only (``KVWork(persist=False)``: nothing is
  written, the prefix pages stay bit-identical) and takes one Euler step; the last step EMITs
  ``actions [H, A]``.

Real-time chunking: ``delay`` d and ``prev_actions`` (what the previous chunk still has to
execute). ``Pi0Policy(rtc="trained")`` (default) freezes the chunk's first d actions -- they start
equal to ``prev_actions[:d]``, enter the expert as clean actions (flow time 1) and no Euler step
moves them; ``rtc="guided"`` pulls the overlap towards ``prev_actions`` with a guidance term (a
backward pass of the expert per step). See :mod:`mstar_rt.models.pi0_rtc` and
docs/robot_models.md for the two forms.

    vla = Pi0Policy(random_pi0())          # or Pi0Policy.from_pretrained(dir)
    with mstar_rt.Runtime(vla) as rt:
        chunk = rt.submit({"images": [rgb], "prompt": ids, "state": q}).result()["actions"][0]

:func:`sample_actions_recompute` is the plain PyTorch reference: it recomputes the image
encoder and the whole prefix at every flow step.
"""

from __future__ import annotations

import math
import os
from typing import Any, Mapping, Optional, Union

import numpy as np
import torch
import torch.nn.functional as F

from mstar_rt.engines.kv_engine import KVCacheEngine, KVNodeSubmodule, KVStep, KVWork
from mstar_rt.engines.masks import BlockCausal, PrefixBidirectional
from mstar_rt.engines.paged_kv import KVLayout
from mstar_rt.graph import EMIT, GraphEdge, GraphNode, Loop, Sequential
from mstar_rt.model import Model, NodeSubmodule, RequestContext, WorkContext
from mstar_rt.models.pi0_layers import Pi0Module, load_pi0
from mstar_rt.models.pi0_rtc import (RTC_MODES, action_times, euler_step, guided_step,
                                     prefix_weights)
from mstar_rt.models.sampling import request_seed, whole_number
from mstar_rt.models.siglip import preprocess_image


class Pi0Request:
    """A request's checked inputs, on the module's device."""

    def __init__(self, images: list, prompt: torch.Tensor, state: torch.Tensor,
                 noise: torch.Tensor, delay: int, prev_actions: Optional[torch.Tensor]) -> None:
        self.images, self.prompt, self.state, self.noise = images, prompt, state, noise
        self.delay, self.prev_actions = delay, prev_actions

    def initial_actions(self, rtc: str) -> torch.Tensor:
        """The noise; in the trained form, with the frozen leading actions replaced by what
        must still execute."""
        x = self.noise.clone()
        if rtc == "trained" and self.delay:
            x[: self.delay] = self.prev_actions[: self.delay]
        return x

    def guidance(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The guided form's target ``[H, A]`` (the previous chunk's actions, zero past them)
        and weights ``[H]``."""
        target = torch.zeros_like(self.noise)
        h = target.shape[0]
        if self.prev_actions is None:
            return target, torch.zeros(h, device=target.device, dtype=target.dtype)
        overlap = min(h, self.prev_actions.shape[0])
        target[:overlap] = self.prev_actions[:overlap]
        return target, prefix_weights(self.delay, overlap, h, target.device, target.dtype)


def check_images(c: Any, images: Any) -> list:
    """``images`` as a list of uint8 ``[H, W, 3]`` arrays (a list, a dict by camera or one
    array); a ValueError names what is wrong."""
    if images is None:  # a state-only prefix
        images = []
    elif isinstance(images, Mapping):
        images = list(images.values())
    elif isinstance(images, (np.ndarray, torch.Tensor)) and images.ndim == 3:
        images = [images]  # one camera (a tensor's rows were counted as cameras)
    images = list(images)
    if len(images) > c.max_images:
        raise ValueError(f"'images' must hold 0 to {c.max_images} camera images; got "
                         f"{len(images)}")
    for i, im in enumerate(images):
        a = np.asarray(im)
        if a.dtype != np.uint8 or a.ndim != 3 or a.shape[2] != 3 or min(a.shape[:2]) < 1:
            raise ValueError(f"'images'[{i}] must be a uint8 array [H >= 1, W >= 1, 3] (RGB); "
                             f"got {a.dtype} {list(a.shape)}")
    return images


def check_pi0_inputs(module: Pi0Module, inputs: Mapping[str, Any]) -> Pi0Request:
    """Validates a request; raises a ValueError naming the input and what it needs."""
    c = module.config
    dev, dt = module.device, module.dtype
    for key in ("prompt", "state"):
        if inputs.get(key) is None:
            raise ValueError(f"pi0 input '{key}' is missing")
    images = check_images(c, inputs.get("images"))
    if isinstance(inputs["prompt"], (str, bytes)):
        raise ValueError("'prompt' must be token ids (this pi0 takes no text: tokenize it "
                         "first, e.g. with the checkpoint's tokenizer); got a string")
    prompt = torch.as_tensor(inputs["prompt"]).reshape(-1)
    if prompt.numel() == 0:  # an empty list comes out as float
        prompt = prompt.long()
    if prompt.dtype.is_floating_point or prompt.dtype == torch.bool:
        raise ValueError(f"'prompt' must be integer token ids; got {prompt.dtype}")
    if prompt.numel() > c.max_prompt_tokens:
        raise ValueError(f"'prompt' has {prompt.numel()} tokens; at most "
                         f"{c.max_prompt_tokens} fit (max_prompt_tokens)")
    if prompt.numel() and (int(prompt.min()) < 0 or int(prompt.max()) >= c.vocab_size):
        raise ValueError(f"'prompt' token ids must lie in [0, {c.vocab_size})")
    state = torch.as_tensor(inputs["state"]).to(device=dev, dtype=dt)
    if state.shape != (c.state_dim,):
        raise ValueError(f"'state' must be [{c.state_dim}]; got {list(state.shape)}")
    shape = (c.action_horizon, c.action_dim)
    noise = inputs.get("noise")
    if noise is None:
        g = torch.Generator().manual_seed(request_seed(inputs.get("seed")))
        noise = torch.randn(shape, generator=g)
    noise = torch.as_tensor(noise).to(device=dev, dtype=dt)
    if tuple(noise.shape) != shape:
        raise ValueError(f"'noise' must be [{shape[0]}, {shape[1]}] (action_horizon, "
                         f"action_dim); got {list(noise.shape)}")
    delay = whole_number(inputs.get("delay", 0) or 0, "delay")
    if delay >= c.action_horizon:
        raise ValueError(f"'delay' {delay} must be below the action horizon "
                         f"{c.action_horizon} (some actions must be left to generate)")
    prev = inputs.get("prev_actions")
    if delay and prev is None:
        raise ValueError(f"'delay' {delay} freezes the chunk's first {delay} actions; give "
                         "'prev_actions' [>= delay, action_dim] (the previous chunk's actions "
                         "still to execute)")
    if prev is not None:
        prev = torch.as_tensor(prev).to(device=dev, dtype=dt)
        if prev.dim() != 2 or prev.shape[0] < max(delay, 1) or prev.shape[1] != c.action_dim:
            raise ValueError(f"'prev_actions' must be [>= {max(delay, 1)}, {c.action_dim}]; got "
                             f"{list(prev.shape)}")
    for name, t in (("state", state), ("noise", noise), ("prev_actions", prev)):
        if t is not None and not bool(torch.isfinite(t).all()):
            raise ValueError(f"'{name}' holds NaN or infinite values; give finite numbers")
    return Pi0Request(images, prompt.to(device=dev, dtype=torch.long), state, noise, delay,
                      prev)


def encode_images(module: Pi0Module, images: list) -> torch.Tensor:
    """Preprocesses (OpenCV) and encodes images -> tokens ``[len * num_patches, width]``."""
    size = module.config.vision.image_size
    if not images:  # a state-only prefix
        return torch.zeros(0, module.config.width, device=module.device, dtype=module.dtype)
    pixels = torch.stack([preprocess_image(im, size) for im in images])
    tokens = module.image_tokens(pixels.to(device=module.device, dtype=module.dtype))
    return tokens.flatten(0, 1)


class VisionNode(NodeSubmodule):
    """Every image of every request in the batch through the tower at once."""

    max_batch = 16

    def __init__(self, module: Pi0Module) -> None:
        self.module = module

    @torch.inference_mode()
    def forward(self, batch: list[Any]) -> list[Mapping[str, Any]]:
        lists = [check_images(self.module.config, b["images"]) for b in batch]
        tokens = encode_images(self.module, [im for ims in lists for im in ims])
        n = self.module.config.vision.num_patches
        outs, start = [], 0
        for ims in lists:
            outs.append({"image_tokens": tokens[start:start + n * len(ims)]})
            start += n * len(ims)
        return outs


class PrefixNode(KVNodeSubmodule):
    """The backbone over each request's prefix, written to its KV pages."""

    def __init__(self, module: Pi0Module, rtc: str, max_batch: int = 32) -> None:
        self.module, self.rtc = module, rtc
        self.max_batch = max_batch

    def kv_layout(self) -> KVLayout:
        return self.module.kv_layout()

    def prepare_inputs(self, ctx: WorkContext, inputs: dict) -> KVWork:
        r = check_pi0_inputs(self.module, inputs)
        with torch.inference_mode():
            x = self.module.prefix_embeds(inputs["image_tokens"], r.prompt, r.state)
        n = x.shape[0]
        ctx.request.state.update(prefix_len=n, request=r)
        return KVWork(n, mask=PrefixBidirectional(n), reserve=n,
                      payload=(x, r.initial_actions(self.rtc)))

    @torch.inference_mode()
    def forward_kv(self, works: list[KVWork], step: KVStep) -> list[Mapping[str, Any]]:
        self.module.run_prefix(torch.cat([w.payload[0] for w in works]), step.positions, step)
        return [{"x": w.payload[1]} for w in works]


class DenoiseNode(KVNodeSubmodule):
    """One flow step of the action expert per request, reading the cached prefix."""

    def __init__(self, module: Pi0Module, rtc: str, beta: float, max_batch: int = 32) -> None:
        self.module, self.rtc, self.beta = module, rtc, beta
        self.max_batch = max_batch

    def kv_layout(self) -> KVLayout:
        return self.module.kv_layout()

    def prepare_inputs(self, ctx: WorkContext, inputs: dict) -> KVWork:
        s = ctx.request.state
        h = self.module.config.action_horizon
        # Action tokens see the whole prefix and each other; nothing is written.
        return KVWork(h, persist=False, mask=BlockCausal(h, start=s["prefix_len"]),
                      payload=(inputs["x"], ctx.iteration, s["request"]))

    def forward_kv(self, works: list[KVWork], step: KVStep) -> list[Mapping[str, Any]]:
        m = self.module
        c = m.config
        h, n = c.action_horizon, c.num_steps
        xs = [w.payload[0] for w in works]
        if self.rtc == "guided":
            taus = [action_times(it / n, h, 0, m.device, m.dtype) for _x, it, _r in
                    (w.payload for w in works)]
            guides = [w.payload[2].guidance() for w in works]

            def velocity(x: torch.Tensor) -> torch.Tensor:
                suffix = torch.cat([m.suffix_embeds(x[i * h:(i + 1) * h], t)
                                    for i, t in enumerate(taus)])
                return m.velocity(suffix, step.positions, step)

            new_all = guided_step(torch.cat(xs), torch.cat(taus),
                                  torch.cat([g[0] for g in guides]),
                                  torch.cat([g[1] for g in guides]), self.beta, n, velocity)
            news = [new_all[i * h:(i + 1) * h] for i in range(len(works))]
        else:
            with torch.inference_mode():
                d = [w.payload[2].delay for w in works]
                suffix = torch.cat([m.suffix_embeds(x, action_times(w.payload[1] / n, h, di,
                                                                     m.device, m.dtype))
                                    for x, w, di in zip(xs, works, d)])
                v = m.velocity(suffix, step.positions, step)
                news = [euler_step(x, v[i * h:(i + 1) * h], n, di)
                        for i, (x, di) in enumerate(zip(xs, d))]
        outs = []
        for w, new in zip(works, news):
            out: dict[str, Any] = {"x": new}
            if w.payload[1] == n - 1:  # the chunk is done: stream it (earlier steps EMIT nothing)
                out["actions"] = new
            outs.append(out)
        return outs


class Pi0Policy(Model):
    """The ``prefix`` and ``action_gen`` walks over a :class:`Pi0Module`.

    Inputs: ``images`` (1..max_images uint8 ``[H, W, 3]`` RGB arrays, a list or a dict by
    camera), ``prompt`` (token ids), ``state [state_dim]``; optional ``noise [H, A]`` (else drawn
    from ``seed``), ``delay`` and ``prev_actions`` for real-time chunking in the form ``rtc``
    (``"trained"`` or ``"guided"``, with ``guidance_beta``). EMITs ``actions``.
    """

    inputs = ("images", "prompt", "state", "noise", "seed", "delay", "prev_actions")
    input_defaults = {"images": None, "noise": None, "seed": None, "delay": 0, "prev_actions": None}

    def __init__(self, module: Pi0Module, engine: Optional[KVCacheEngine] = None,
                 max_batch: int = 32, rtc: str = "trained", guidance_beta: float = 5.0) -> None:
        if rtc not in RTC_MODES:
            raise ValueError(f"rtc must be one of {RTC_MODES}; got {rtc!r}")
        if isinstance(guidance_beta, bool) or not isinstance(guidance_beta, (int, float)) \
                or not 0 < guidance_beta < math.inf:  # NaN or inf served NaN actions
            raise ValueError(f"guidance_beta must be a finite number > 0; got {guidance_beta!r}")
        self.module = module.eval()
        self.rtc = rtc
        c = module.config
        self.nodes = [
            GraphNode("vision", ["images"], ["image_tokens"], submodule=VisionNode(module),
                      engine="vision"),
            GraphNode("prefix", ["image_tokens", "images", "prompt", "state", "noise", "seed",
                                 "delay", "prev_actions"],
                      [GraphEdge("denoise", "x", persist=True)],
                      submodule=PrefixNode(module, rtc, max_batch), engine="vla"),
            GraphNode("denoise", ["x"], ["x", GraphEdge(EMIT, "actions")],
                      submodule=DenoiseNode(module, rtc, guidance_beta, max_batch), engine="vla"),
        ]
        self.walks = {"prefix": Sequential("vision", "prefix"),
                      "action_gen": Loop("denoise", c.num_steps, outputs=["x"])}
        page = 16
        pages = max_batch * -(-c.max_prefix // page)
        self.engine_specs = {"vla": engine or KVCacheEngine(page_size=page, num_pages=pages,
                                                            max_batch=max_batch)}

    def validate_inputs(self, inputs: Mapping[str, Any]) -> None:
        check_pi0_inputs(self.module, inputs)

    def next_walk(self, request: RequestContext, finished_walk: str,
                  persisted: Mapping[str, Any]) -> Optional[str]:
        return "action_gen" if finished_walk == "prefix" else None

    @staticmethod
    def from_pretrained(path: Union[str, os.PathLike], dtype: Optional[torch.dtype] = None,
                        device: str = "cpu", progress: bool = True, **kwargs: Any) -> "Pi0Policy":
        """Serves the module saved in ``path`` (see ``pi0_layers.save_pi0``)."""
        return Pi0Policy(load_pi0(path, dtype, device, progress), **kwargs)


# ---- the reference: no cache, the whole prefix at every flow step --------------------------------

class _RecordPrefix:
    """Dense bidirectional attention over the prefix, keeping each layer's K/V."""

    def __init__(self) -> None:
        self.k: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.k[layer], self.v[layer] = k, v
        return _sdpa(q, k, v)


class _OverPrefix:
    """The action tokens attend to the recorded prefix K/V and to each other."""

    def __init__(self, prefix: _RecordPrefix) -> None:
        self.prefix = prefix

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return _sdpa(q, torch.cat([self.prefix.k[layer], k]), torch.cat([self.prefix.v[layer], v]))


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                         enable_gqa=q.shape[1] != k.shape[1])
    return out.transpose(0, 1)


@torch.inference_mode()
def sample_actions_recompute(module: Pi0Module, inputs: Mapping[str, Any], rtc: str = "trained",
                             guidance_beta: float = 5.0) -> torch.Tensor:
    """The action chunk ``[H, A]`` computed without the runtime or a cache: every flow step
    encodes the images and runs the whole prefix again, then the expert (``rtc``: the
    real-time-chunking form, as in :class:`Pi0Policy`)."""
    c = module.config
    h, n = c.action_horizon, c.num_steps
    r = check_pi0_inputs(module, inputs)
    x = r.initial_actions(rtc)
    for i in range(n):
        prefix = module.prefix_embeds(encode_images(module, r.images), r.prompt, r.state)
        p = prefix.shape[0]
        record = _RecordPrefix()
        module.run_prefix(prefix, torch.arange(p, device=module.device), record)
        positions = torch.arange(p, p + h, device=module.device)
        frozen = r.delay if rtc == "trained" else 0
        tau = action_times(i / n, h, frozen, module.device, module.dtype)

        def velocity(a: torch.Tensor) -> torch.Tensor:
            return module.velocity(module.suffix_embeds(a, tau), positions, _OverPrefix(record))

        if rtc == "guided":
            target, weights = r.guidance()
            x = guided_step(x, tau, target, weights, guidance_beta, n, velocity)
        else:
            x = euler_step(x, velocity(x), n, frozen)
    return x

"""SmolVLA's action chunk without the runtime or a paged cache: LeRobot's ``sample_actions``
for one request with dense attention, recording every intermediate the parity fixture holds
(the test compares them with LeRobot's)."""

from __future__ import annotations

from typing import Any, Mapping, Optional

import torch
import torch.nn.functional as F

from mstar_rt.models.lerobot_rtc import RtcSettings, guidance, guided_velocity
from mstar_rt.models.smolvla_checkpoint import LeRobotSmolVLA
from mstar_rt.models.smolvla_inputs import camera_images, check_request, pixels


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
          mask: Optional[torch.Tensor]) -> torch.Tensor:
    """Flat ``[Q, H, D]`` queries over ``[K, Hkv, D]`` keys (GQA), ``mask [Q, K]``."""
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                         attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])
    return out.transpose(0, 1)


class DensePrefix:
    """The prefix attending to itself: image and prompt tokens both ways, the state token (the
    last) to everything; keeps every layer's K/V (after RoPE)."""

    def __init__(self, n: int, device: Any) -> None:
        pos = torch.arange(n, device=device)
        self.mask = (pos[None, :] <= pos[:, None]) | (pos[None, :] < n - 1)
        self.k: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.k[layer], self.v[layer] = k, v
        return _sdpa(q, k, v, self.mask)


class DenseSuffix:
    """Action tokens attending to the whole prefix and causally to each other."""

    def __init__(self, prefix: DensePrefix, h: int) -> None:
        self.prefix = prefix
        n = prefix.mask.shape[0]
        causal = torch.ones(h, h, dtype=torch.bool, device=prefix.mask.device).tril()
        self.mask = torch.cat([torch.ones(h, n, dtype=torch.bool, device=causal.device), causal], 1)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return _sdpa(q, torch.cat([self.prefix.k[layer], k]), torch.cat([self.prefix.v[layer], v]),
                     self.mask)


@torch.inference_mode()
def sample_actions_reference(policy: LeRobotSmolVLA, inputs: Mapping[str, Any],
                             record: Optional[dict] = None,
                             rtc: Optional[RtcSettings] = None) -> torch.Tensor:
    """The chunk ``[chunk_size, action_dim]`` (unnormalised) for one request, as LeRobot's
    ``predict_action_chunk`` + postprocessor compute it. ``record`` (a dict) receives the
    intermediates under the fixture's names (without ``model.``): ``images.i``,
    ``image_embs.i``, ``state_padded``, ``prefix_embs``, ``prefix_out``, ``prefix_kv.L.keys`` /
    ``.values`` (``[kv_heads, n, head_dim]``), ``suffix_embs.step0``, ``suffix_out.step0``,
    ``x_t``, ``t``, ``v_t`` (stacked over steps; with guidance the guided velocity, the plain
    one in ``v_t_base``), ``actions_padded``, ``action_chunk_normalized``. ``rtc``: RtcSettings
    for guided real-time chunking (with ``delay`` / ``prev_actions`` in ``inputs``)."""
    m, c = policy.module, policy.config
    rec = record if record is not None else {}
    r = check_request(policy, inputs, rtc)
    embs = []
    for i, image in enumerate(camera_images(policy, inputs.get("images"))):
        px = pixels(policy, image).to(device=m.device, dtype=m.dtype)
        rec[f"images.{i}"] = px
        embs.append(m.embed_images(px[None])[0])
        rec[f"image_embs.{i}"] = embs[-1]
    rec["state_padded"] = r.state
    prefix = m.prefix_embeds(torch.cat(embs), r.prompt, r.state)
    rec["prefix_embs"] = prefix
    n, h = prefix.shape[0], c.chunk_size
    dense = DensePrefix(n, m.device)
    rec["prefix_out"] = m.run_prefix(prefix, torch.arange(n, device=m.device), dense,
                                     final_norm=True)
    for layer in sorted(dense.k):
        rec[f"prefix_kv.{layer}.keys"] = dense.k[layer].transpose(0, 1)
        rec[f"prefix_kv.{layer}.values"] = dense.v[layer].transpose(0, 1)
    cross_kv = {i: m.cross_kv(i, dense.k[i], dense.v[i]) for i in m.cross_layers}

    def cross(layer: int, q: torch.Tensor) -> torch.Tensor:
        return _sdpa(q, *cross_kv[layer], None)

    suffix_attn = DenseSuffix(dense, h)
    positions = torch.arange(n, n + h, device=m.device)
    cross_positions = torch.arange(h, device=m.device)
    dt = -1.0 / c.num_steps
    x = r.noise
    xs, ts, vs, bases = [], [], [], []
    for step in range(c.num_steps):
        time = 1.0 + step * dt
        t = torch.tensor(time, dtype=torch.float32, device=m.device)
        suffix = m.suffix_embeds(x, t)
        out = m.expert_forward(suffix, positions, suffix_attn, cross_positions, cross)
        v = m.velocity(out)
        if step == 0:
            rec["suffix_embs.step0"], rec["suffix_out.step0"] = suffix, out
        bases.append(v)
        guide = guidance([r], [time], rtc, h, c.max_action_dim, m.device)
        if guide is not None:
            v = guided_velocity(v, x, guide)
        xs.append(x)
        ts.append(t)
        vs.append(v)
        x = x + dt * v
    rec["x_t"], rec["t"], rec["v_t"] = torch.stack(xs), torch.stack(ts), torch.stack(vs)
    rec["v_t_base"] = torch.stack(bases)
    rec["actions_padded"] = x
    rec["action_chunk_normalized"] = x[:, : c.action_dim]
    return policy.unnormalize_actions(x)

"""The plain PyTorch computation of a LeRobot pi0 / pi0.5 action chunk, in LeRobot's order:
one request, the prompt padded to ``max_length`` with its padded positions masked (additive
mask 0 / -2.3819763e38, softmax in float32: transformers' eager attention), missing cameras as
-1 images with mask 0, positions ``cumsum(pad_mask) - 1``; the prefix run once into a K/V
record; then every Euler step runs the expert over the whole suffix (pi0: the state token and
the action tokens) against it.

It does not use the runtime or the KV engine, and keeps every intermediate LeRobot's fixtures
hold, so the tests compare both it and the served walks with the fixtures: the walks drop the
padded positions, cache the prefix (and pi0's state token, which never sees the actions) in the
engine's pages and batch requests, and must still give the same chunk.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

import torch

from mstar_rt.models.lerobot_pi0_io import preprocess_image
from mstar_rt.models.lerobot_pi0_load import LeRobotPi0
from mstar_rt.models.lerobot_pi0_request import check_request
from mstar_rt.models.lerobot_rtc import guidance, guided_velocity

#: openpi's "minus infinity" for masked attention scores.
MASKED = -2.3819763e38


class EagerAttention:
    """Attention over one request's tokens with an additive mask ``[Q, past + Q]``; with
    ``past`` (layer -> (k, v)) the keys start with those; with ``record`` each layer's keys and
    values are kept in ``kv``."""

    def __init__(self, allowed: torch.Tensor, past: Optional[dict] = None,
                 record: bool = False) -> None:
        self.bias = torch.where(allowed, 0.0, MASKED)
        self.past, self.record = past, record
        self.kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
               ) -> torch.Tensor:
        if self.past is not None:
            pk, pv = self.past[layer]
            k, v = torch.cat([pk, k]), torch.cat([pv, v])
        if self.record:
            self.kv[layer] = (k, v)
        rep = q.shape[1] // k.shape[1]
        qh = q.transpose(0, 1)
        kh = k.transpose(0, 1).repeat_interleave(rep, dim=0)
        vh = v.transpose(0, 1).repeat_interleave(rep, dim=0)
        scores = torch.matmul(qh, kh.transpose(1, 2)) * q.shape[-1] ** -0.5
        weights = torch.softmax(scores + self.bias.to(scores.dtype), dim=-1,
                                dtype=torch.float32).to(q.dtype)
        return torch.matmul(weights, vh).transpose(0, 1)


def _blocks(pad: torch.Tensor, ar: torch.Tensor) -> torch.Tensor:
    """big_vision's 2-D mask: a token sees valid tokens whose cumulative ``ar`` is at most its
    own."""
    cum = torch.cumsum(ar, dim=0)
    return (cum[None, :] <= cum[:, None]) & pad[None, :] & pad[:, None]


@torch.no_grad()
def reference_actions(policy: LeRobotPi0, observation: Mapping[str, Any],
                      rtc: Optional[Any] = None) -> dict[str, Any]:
    """The action chunk for one raw observation (the request inputs of
    :class:`~mstar_rt.models.lerobot_pi0.LeRobotPi0Policy`) and every intermediate: ``images``,
    ``image_embs``, ``prefix_embs``, ``prefix_pad_masks``, ``prefix_out``, ``prefix_kv``,
    ``suffix_embs``, ``suffix_out`` (step 0), ``adarms_cond`` (pi0.5, step 0), ``x_t``, ``t``,
    ``v_t`` (every step), ``actions_padded``, ``action_chunk_normalized``, ``action_chunk``.
    ``rtc``: RtcSettings for guidance (with ``delay`` / ``prev_actions`` in the observation)."""
    m, proc, c = policy.module, policy.processor, policy.config
    dev = m.device
    r = check_request(proc, observation, dev, rtc)
    out: dict[str, Any] = {}
    # images in LeRobot's order: the present cameras, then the missing ones as -1 images
    present = {i for i, _im in r.images}
    size = c.vision.image_size
    images = [preprocess_image(im, size, c.cameras[i]) for i, im in r.images]
    images += [torch.full((3, size, size), -1.0) for i in range(len(c.cameras))
               if i not in present]
    masks = [True] * len(r.images) + [False] * (len(c.cameras) - len(r.images))
    out["images"] = images
    embs = [m.image_tokens(im[None].to(dev))[0] for im in images]
    out["image_embs"] = embs
    ids, lang_mask = proc.padded(r.ids.cpu())
    n_img = c.num_image_tokens
    prefix = torch.cat(embs + [m.prompt_tokens(ids.to(dev))])
    pad = torch.cat([torch.full((n_img,), mk) for mk in masks] + [lang_mask]).to(dev)
    out.update(prefix_embs=prefix, prefix_pad_masks=pad, tokens=ids, attention_mask=lang_mask)
    positions = torch.cumsum(pad.long(), 0) - 1
    record = EagerAttention(_blocks(pad, torch.zeros_like(pad, dtype=torch.long)), record=True)
    out["prefix_out"] = m.run_prefix(prefix, positions, record, final=True)[0]
    out["prefix_kv"] = record.kv

    h, steps = c.chunk_size, c.num_steps
    n_valid = int(pad.sum())
    state_tok = None
    if c.family == "pi0":
        padded_state = torch.nn.functional.pad(r.state, (0, c.max_state_dim - r.state.numel()))
        out["state_padded"] = padded_state
        state_tok = m.state_token(padded_state[None])
    s_len = h + (state_tok is not None)
    ar = torch.zeros(s_len, dtype=torch.long, device=dev)
    ar[0] = 1
    if state_tok is not None:
        ar[1] = 1
    suffix_mask = torch.cat([pad[None, :].expand(s_len, -1),
                             _blocks(torch.ones(s_len, dtype=torch.bool, device=dev), ar)], 1)
    s_pos = n_valid + torch.arange(s_len, device=dev)
    rows = torch.zeros(h, dtype=torch.long, device=dev)

    dt = -1.0 / steps
    x = r.noise.to(m.head_dtype)
    xs, ts, vs = [], [], []
    for k in range(steps):
        time = 1.0 + k * dt
        t = torch.tensor(time, dtype=torch.float32, device=dev).expand(1)

        def velocity(a: torch.Tensor, k: int = k, t: torch.Tensor = t) -> torch.Tensor:
            tokens, cond = m.action_tokens(a, t, rows)
            if state_tok is not None:
                tokens = torch.cat([state_tok, tokens])
            attn = EagerAttention(suffix_mask, past=record.kv)
            hidden = m.expert_out(tokens, s_pos, attn, cond)
            if k == 0:
                out.update(suffix_embs=tokens, suffix_out=hidden)
                if cond is not None:
                    out["adarms_cond"] = cond.values
            return m.action_out_proj(hidden[-h:].to(m.head_dtype))

        guide = guidance([r], [time], rtc, h, c.max_action_dim, dev)
        v = velocity(x)
        if guide is not None:
            v = guided_velocity(v, x, guide)
        xs.append(x)
        ts.append(t)
        vs.append(v)
        x = x + dt * v
    out.update(x_t=torch.stack(xs), t=torch.stack(ts), v_t=torch.stack(vs), actions_padded=x,
               action_chunk_normalized=x[:, : c.action_dim], action_chunk=proc.actions(x))
    return out


"""Qwen3-Omni's code predictor: the small dense decoder that turns each talker frame's first
codec code into the remaining ``G - 1`` residual codes.

Per talker frame, with ``G = num_code_groups``, it runs a fresh sequence of at most ``G``
tokens: ``[past_hidden, embed(code 0)]`` (the talker's last hidden state and its embedding of
the code it just produced), then the embedding of each residual code as it is predicted.

* step 1 reads the two-token prompt; ``lm_head[0]`` at its last position gives code 1;
* step ``j`` (2 .. G-1) feeds ``codec_embedding[j - 2](code j-1)`` at position ``j`` and
  ``lm_head[j - 1]`` gives code ``j``.

Because the sequence is this short and starts over every frame, it keeps its own dense KV cache
in a :class:`PredictorState` instead of using the paged KV engine. A state holds rows for one or
several requests; rows at the same step from different requests :meth:`~PredictorState.stack`
into one batch and :meth:`~PredictorState.split` back, so a loop node can run step ``j`` for
every request that reached it. Parameter names match the checkpoint's
``talker.code_predictor.*`` tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence, Union

import torch
from torch import nn
from torch.nn import functional as F

from mstar_rt.engines.sampling import SamplingParams, make_generator, sample
from mstar_rt.models.llama import RMSNorm
from mstar_rt.models.qwen3_omni.moe import SwiGLU
from mstar_rt.models.qwen3_omni.text_lm import QKNormAttention
from mstar_rt.models.rope import RopeConfig, Rotary

#: What transformers uses when the talker samples: ``top_k=50, top_p=0.8`` at temperature 1.
PREDICTOR_SAMPLING = SamplingParams(temperature=1.0, top_k=50, top_p=0.8)
GREEDY = SamplingParams()

Sampling = Union[None, SamplingParams, Sequence[SamplingParams]]


@dataclass(frozen=True)
class CodePredictorConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    num_code_groups: int
    rms_norm_eps: float = 1e-6
    attention_bias: bool = False
    rope: RopeConfig = field(default_factory=RopeConfig)

    @staticmethod
    def from_hf(config: Mapping[str, Any],
                source: str = "the code_predictor_config") -> "CodePredictorConfig":
        """Reads transformers' ``Qwen3OmniMoeTalkerCodePredictorConfig`` dict (``talker_config
        ["code_predictor_config"]``); a bad field is a ValueError naming it."""
        from mstar_rt.models.checkpoint import MAX_LAYERS, ConfigFields

        c = ConfigFields(config, source)
        act = c.text("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"field 'hidden_act' of {source} is {act!r}; the code predictor's "
                             "MLP is SwiGLU ('silu')")
        heads = c.integer("num_attention_heads")
        kv_heads = c.integer("num_key_value_heads", heads)
        if heads % kv_heads:
            raise ValueError(f"field 'num_attention_heads' of {source} ({heads}) is not a "
                             f"multiple of 'num_key_value_heads' ({kv_heads})")
        hidden = c.integer("hidden_size")
        groups = c.integer("num_code_groups", minimum=2, maximum=4096)
        window = config.get("sliding_window")
        layer_types = config.get("layer_types") or ()
        if window is not None and "sliding_attention" in layer_types:
            if c.integer("sliding_window") < groups:
                raise ValueError(f"field 'sliding_window' of {source} ({window}) is shorter "
                                 f"than the {groups}-token sequence of one frame; the runtime "
                                 "only runs full attention here")
        if c.integer("max_position_embeddings", groups) < groups:
            raise ValueError(f"field 'max_position_embeddings' of {source} is below "
                             f"num_code_groups ({groups})")
        return CodePredictorConfig(
            vocab_size=c.integer("vocab_size"),
            hidden_size=hidden,
            intermediate_size=c.integer("intermediate_size"),
            num_hidden_layers=c.integer("num_hidden_layers", maximum=MAX_LAYERS),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=c.integer("head_dim", max(hidden // heads, 1)),
            num_code_groups=groups,
            rms_norm_eps=c.number("rms_norm_eps", 1e-6),
            attention_bias=c.flag("attention_bias", False),
            rope=RopeConfig.from_hf(config, source),
        )


@dataclass
class PredictorState:
    """The inner loop of one talker frame for ``B`` rows, all at the same step. ``step``
    writes into it in place; rows from several states are merged with :meth:`stack` (a copy)
    and taken apart with :meth:`split` (views of the merged tensors)."""

    keys: torch.Tensor            # [layers, B, kv_heads, G, head_dim]
    values: torch.Tensor          # [layers, B, kv_heads, G, head_dim]
    prompt: torch.Tensor          # [B, 2, hidden]: past_hidden, code0_embed
    codes: torch.Tensor           # [B, G - 1] long; -1 where not predicted yet
    params: tuple[SamplingParams, ...]
    generators: list[Optional[torch.Generator]]
    next_step: int = 1            # the step ``j`` that runs next; G when done

    @property
    def batch_size(self) -> int:
        return self.codes.shape[0]

    @property
    def done(self) -> bool:
        return self.next_step > self.codes.shape[1]

    @staticmethod
    def stack(states: Sequence["PredictorState"]) -> "PredictorState":
        if not states:
            raise ValueError("PredictorState.stack needs at least one state")
        steps = {s.next_step for s in states}
        if len(steps) != 1:
            raise ValueError(f"PredictorState.stack got states at steps {sorted(steps)}; rows "
                             "of one batch must be at the same step")
        return PredictorState(
            keys=torch.cat([s.keys for s in states], dim=1),
            values=torch.cat([s.values for s in states], dim=1),
            prompt=torch.cat([s.prompt for s in states]),
            codes=torch.cat([s.codes for s in states]),
            params=tuple(p for s in states for p in s.params),
            generators=[g for s in states for g in s.generators],
            next_step=steps.pop())

    def split(self, sizes: Optional[Sequence[int]] = None) -> list["PredictorState"]:
        """Per-row states (``sizes`` rows each; one row each by default)."""
        sizes = [1] * self.batch_size if sizes is None else list(sizes)
        if sum(sizes) != self.batch_size or min(sizes, default=1) < 1:
            raise ValueError(f"PredictorState.split sizes {sizes} do not cover its "
                             f"{self.batch_size} rows")
        out, start = [], 0
        for n in sizes:
            rows = slice(start, start + n)
            out.append(PredictorState(self.keys[:, rows], self.values[:, rows],
                                      self.prompt[rows], self.codes[rows], self.params[rows],
                                      self.generators[rows], self.next_step))
            start += n
        return out


class PredictorAttention(QKNormAttention):
    """Qwen3 attention over the state's dense cache (rows ``start ..`` of this frame)."""

    def __init__(self, c: CodePredictorConfig, layer: int) -> None:
        super().__init__(c.hidden_size, c.num_attention_heads, c.num_key_value_heads,
                         c.head_dim, c.attention_bias, c.rms_norm_eps, layer)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                state: PredictorState, start: int) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.project(x, cos, sin)
        end = start + t
        state.keys[self.layer, :, :, start:end] = k.transpose(1, 2)
        state.values[self.layer, :, :, start:end] = v.transpose(1, 2)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), state.keys[self.layer, :, :, :end],
            state.values[self.layer, :, :, :end], is_causal=t > 1, enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class PredictorLayer(nn.Module):
    def __init__(self, c: CodePredictorConfig, layer: int) -> None:
        super().__init__()
        self.self_attn = PredictorAttention(c, layer)
        self.mlp = SwiGLU(c.hidden_size, c.intermediate_size)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                state: PredictorState, start: int) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, state, start)
        return x + self.mlp(self.post_attention_layernorm(x))


class PredictorBody(nn.Module):
    def __init__(self, c: CodePredictorConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList(PredictorLayer(c, i) for i in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.codec_embedding = nn.ModuleList(nn.Embedding(c.vocab_size, c.hidden_size)
                                             for _ in range(c.num_code_groups - 1))


class CodePredictor(nn.Module):
    """``predict(past_hidden [B, H], code0_embed [B, H]) -> codes [B, G - 1]``, or the same
    one step at a time: ``state = start(...)``, then ``step(state, j)`` for j = 1 .. G-1."""

    def __init__(self, config: CodePredictorConfig) -> None:
        super().__init__()
        self.config = c = config
        self.model = PredictorBody(c)
        self.lm_head = nn.ModuleList(nn.Linear(c.hidden_size, c.vocab_size, bias=False)
                                     for _ in range(c.num_code_groups - 1))
        self.rotary = Rotary(c.rope, c.head_dim)

    @classmethod
    def from_hf(cls, config: Mapping[str, Any],
                source: str = "the code_predictor_config") -> "CodePredictor":
        """A randomly initialised predictor shaped by ``talker_config["code_predictor_config"]``."""
        return cls(CodePredictorConfig.from_hf(config, source))

    def init_buffers(self) -> None:
        """Recomputes the (non-checkpoint) RoPE frequencies; call after ``to_empty``."""
        device = self.model.norm.weight.device
        if device.type != "meta":
            self.rotary.inv_freq = self.config.rope.inv_freq(self.config.head_dim).to(device)

    @property
    def groups(self) -> int:
        return self.config.num_code_groups

    def start(self, past_hidden: torch.Tensor, code0_embed: torch.Tensor,
              sampling: Sampling = None) -> PredictorState:
        """A fresh state for ``B`` rows. ``sampling``: None (greedy), one SamplingParams for
        every row, or one per row; a seeded one gives each row its own generator, kept in the
        state so a row's codes do not depend on its batch mates."""
        c = self.config
        weight = self.model.norm.weight  # the dtype and device of every parameter
        if past_hidden.dim() != 2 or past_hidden.shape != code0_embed.shape \
                or past_hidden.shape[1] != c.hidden_size:
            raise ValueError(f"code predictor start: past_hidden {tuple(past_hidden.shape)} and "
                             f"code0_embed {tuple(code0_embed.shape)} must both be "
                             f"[batch, {c.hidden_size}]")
        b = past_hidden.shape[0]
        if sampling is None or isinstance(sampling, SamplingParams):
            params = (sampling or GREEDY,) * b
        else:
            params = tuple(sampling)
            if len(params) != b:
                raise ValueError(f"code predictor start: {len(params)} SamplingParams for "
                                 f"{b} rows; give one, or one per row")
        cache = (c.num_hidden_layers, b, c.num_key_value_heads, c.num_code_groups, c.head_dim)
        return PredictorState(
            keys=torch.zeros(cache, dtype=weight.dtype, device=weight.device),
            values=torch.zeros(cache, dtype=weight.dtype, device=weight.device),
            prompt=torch.stack([past_hidden, code0_embed], dim=1).to(weight),
            codes=torch.full((b, c.num_code_groups - 1), -1, dtype=torch.long,
                             device=weight.device),
            params=params,
            generators=[make_generator(p, weight.device) for p in params])

    @torch.no_grad()
    def step(self, state: PredictorState, j: int) -> torch.Tensor:
        """Runs inner step ``j`` for every row of ``state`` and returns code ``j`` ``[B]``
        (also written to ``state.codes[:, j - 1]``)."""
        if j != state.next_step or state.done:
            raise ValueError(f"code predictor step {j} given a state whose next step is "
                             f"{state.next_step} (steps run 1 .. {self.groups - 1} in order)")
        if j == 1:
            x, start = state.prompt, 0
        else:
            x, start = self.model.codec_embedding[j - 2](state.codes[:, j - 2])[:, None], j
        positions = torch.arange(start, start + x.shape[1], device=x.device)
        cos, sin = self.rotary.tables(positions, x.dtype)
        for layer in self.model.layers:
            x = layer(x, cos, sin, state, start)
        logits = self.lm_head[j - 1](self.model.norm(x[:, -1]))
        b = state.batch_size
        if any(p.repetition_penalty != 1.0 for p in state.params):
            histories = [state.codes[i, :j - 1] for i in range(b)]  # this frame's codes so far
        else:
            histories = [state.codes[0, :0]] * b
        codes = sample(logits, state.params, state.generators, histories)
        state.codes[:, j - 1] = codes
        state.next_step = j + 1
        return codes

    @torch.no_grad()
    def predict(self, past_hidden: torch.Tensor, code0_embed: torch.Tensor,
                sampling: Sampling = None) -> torch.Tensor:
        """All ``G - 1`` residual codes of one frame per row, ``[B, G - 1]``."""
        state = self.start(past_hidden, code0_embed, sampling)
        for j in range(1, self.groups):
            self.step(state, j)
        return state.codes

    def frame_embedding(self, code0_embed: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
        """The talker's next input for a finished frame: ``code0_embed`` plus the embedding of
        every residual code ``j`` by ``codec_embedding[j - 1]``, summed as transformers does."""
        if codes.dim() != 2 or codes.shape[1] != self.groups - 1 \
                or codes.shape[0] != code0_embed.shape[0]:
            raise ValueError(f"frame_embedding: codes {tuple(codes.shape)} must be "
                             f"[{code0_embed.shape[0]}, {self.groups - 1}]")
        parts = [code0_embed] + [emb(codes[:, i]).to(code0_embed.dtype)
                                 for i, emb in enumerate(self.model.codec_embedding)]
        return torch.stack(parts, dim=1).sum(1)

"""The Qwen3-MoE decoder that Qwen3-Omni's thinker and talker share, over the paged KV cache.

Each layer: RMSNorm, GQA attention with a per-head RMSNorm on q and k before RoPE, residual;
RMSNorm, a sparse MoE (or a dense SwiGLU where the config says), residual. Attention goes
through ``step.attend`` like :mod:`mstar_rt.models.llama`, so the engine's paged cache,
continuous batching and backends (torch, FlashInfer) serve it unchanged.

Positions: Qwen3-Omni rotates with interleaved MRoPE, three position axes (time, height, width)
sharing the rotary frequencies by ``mrope_section``. For text and audio every token carries the
same position on all three axes (transformers' ``get_rope_index`` gives audio sequential
positions), and then interleaved MRoPE *is* 1-D RoPE over that position; so this decoder rotates
by ``step.positions`` alone. Images and video (whose grid positions differ per axis) are not
supported.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

import torch
from torch import nn

from mstar_rt.distributed.split import WHOLE, TensorSplit
from mstar_rt.engines.kv_engine import KVStep
from mstar_rt.engines.paged_kv import KVLayout
from mstar_rt.models.llama import RMSNorm
from mstar_rt.models.qwen3_omni.moe import SparseMoE, SwiGLU
from mstar_rt.models.rope import RopeConfig, Rotary


@dataclass(frozen=True)
class TextLMConfig:
    """Sizes of one Qwen3-MoE decoder (the ``text_config`` of ``thinker_config`` or of
    ``talker_config``)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int          # dense layers; the talker's ResizeMLP width too
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    moe_intermediate_size: int
    num_experts: int
    num_experts_per_tok: int
    norm_topk_prob: bool
    shared_expert_intermediate_size: int = 0   # 0: no shared expert (the thinker)
    dense_layers: tuple[int, ...] = ()         # layers with a dense SwiGLU instead of the MoE
    rms_norm_eps: float = 1e-6
    attention_bias: bool = False
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = False
    rope: RopeConfig = field(default_factory=RopeConfig)

    @staticmethod
    def from_hf(config: Mapping[str, Any], source: str, talker: bool = False,
                tie_word_embeddings: Optional[bool] = None) -> "TextLMConfig":
        """Reads an HF ``text_config`` dict. ``talker``: the talker's decoder, where
        transformers gives every layer the MoE with a shared expert whatever
        ``mlp_only_layers`` says (its checkpoints hold those weights), and its
        ``norm_topk_prob`` defaults to False. ``tie_word_embeddings``: the flag of the parent
        config (``thinker_config`` / ``talker_config``), which is the one transformers obeys.
        A missing or wrong field is a ValueError naming it and ``source``."""
        from mstar_rt.models.checkpoint import MAX_LAYERS, ConfigFields

        c = ConfigFields(config, source)
        act = c.text("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"field 'hidden_act' of {source} is '{act}'; Qwen3-Omni's decoder "
                             "is SwiGLU ('silu')")
        hidden, heads = c.integer("hidden_size"), c.integer("num_attention_heads")
        kv_heads = c.integer("num_key_value_heads", heads)
        if heads % kv_heads:
            raise ValueError(f"field 'num_attention_heads' ({heads}) of {source} is not a "
                             f"multiple of 'num_key_value_heads' ({kv_heads})")
        layers = c.integer("num_hidden_layers", maximum=MAX_LAYERS)
        name = ("num_local_experts"  # how transformers 5 writes the talker's count
                if config.get("num_experts") is None and config.get("num_local_experts")
                is not None else "num_experts")
        experts = c.integer(name, minimum=1 if talker else 0)
        top_k = c.integer("num_experts_per_tok", minimum=1, maximum=max(experts, 1))
        dense: tuple[int, ...] = ()
        if not talker:
            step = c.integer("decoder_sparse_step", 1)
            only = config.get("mlp_only_layers") or []
            if not (isinstance(only, (list, tuple))
                    and all(type(i) is int and 0 <= i < layers for i in only)):
                raise ValueError(f"field 'mlp_only_layers' of {source} is {only!r}; it must be "
                                 f"a list of layer indices in [0, {layers})")
            dense = tuple(i for i in range(layers)
                          if i in only or experts == 0 or (i + 1) % step)
        if tie_word_embeddings is None:
            tie_word_embeddings = c.flag("tie_word_embeddings", False)
        return TextLMConfig(
            vocab_size=c.integer("vocab_size"),
            hidden_size=hidden,
            intermediate_size=c.integer("intermediate_size"),
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=c.integer("head_dim", max(hidden // heads, 1)),
            moe_intermediate_size=c.integer("moe_intermediate_size"),
            num_experts=experts,
            num_experts_per_tok=top_k,
            norm_topk_prob=c.flag("norm_topk_prob", not talker),
            shared_expert_intermediate_size=(c.integer("shared_expert_intermediate_size")
                                             if talker else 0),
            dense_layers=dense,
            rms_norm_eps=c.number("rms_norm_eps", 1e-6),
            attention_bias=c.flag("attention_bias", False),
            max_position_embeddings=c.integer("max_position_embeddings", 32768),
            tie_word_embeddings=tie_word_embeddings,
            rope=_rope(config, source),
        )


def _rope(config: Mapping[str, Any], source: str) -> RopeConfig:
    """The rope settings; ``mrope`` (the Qwen2-VL spelling of the type) is plain rope here,
    and the MRoPE keys (``mrope_section``, ``interleaved``) need nothing: see the module doc."""
    for key in ("rope_parameters", "rope_scaling"):
        params = config.get(key)
        if isinstance(params, Mapping) and "mrope" in (params.get("rope_type"),
                                                      params.get("type")):
            params = {k: v for k, v in params.items() if k not in ("rope_type", "type")}
            config = {**config, key: params}
    return RopeConfig.from_hf(config, source)


class QKNormAttention(nn.Module):
    """GQA projections with per-head RMSNorm on q and k (applied before RoPE), as Qwen3 has
    them: the part of attention that is the same whatever cache it attends over (the paged KV
    step here, the code predictor's dense per-frame cache)."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, bias: bool,
                 eps: float, layer: int) -> None:
        super().__init__()
        self.layer, self.heads, self.kv_heads, self.head_dim = layer, heads, kv_heads, head_dim
        self.q_proj = nn.Linear(hidden, heads * head_dim, bias)
        self.k_proj = nn.Linear(hidden, kv_heads * head_dim, bias)
        self.v_proj = nn.Linear(hidden, kv_heads * head_dim, bias)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias)
        self.q_norm = RMSNorm(head_dim, eps)
        self.k_norm = RMSNorm(head_dim, eps)

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x [..., hidden]`` -> rotated q ``[..., heads, d]``, rotated k and v
        ``[..., kv_heads, d]``."""
        lead = x.shape[:-1]
        q = self.q_norm(self.q_proj(x).view(*lead, self.heads, self.head_dim))
        k = self.k_norm(self.k_proj(x).view(*lead, self.kv_heads, self.head_dim))
        v = self.v_proj(x).view(*lead, self.kv_heads, self.head_dim)
        return Rotary.apply(q, cos, sin), Rotary.apply(k, cos, sin), v


class Attention(QKNormAttention):
    """Attends through the paged KV step, over ``split``'s share of the heads."""

    def __init__(self, c: TextLMConfig, layer: int, split: TensorSplit = WHOLE) -> None:
        super().__init__(c.hidden_size, c.num_attention_heads // split.size,
                         c.num_key_value_heads // split.size, c.head_dim, c.attention_bias,
                         c.rms_norm_eps, layer)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                step: KVStep) -> torch.Tensor:
        q, k, v = self.project(x, cos, sin)
        out = step.attend(self.layer, q, k, v)
        return self.o_proj(out.reshape(x.shape[0], self.heads * self.head_dim))


class DecoderLayer(nn.Module):
    """One layer, or ``split``'s share of it: its heads, and every expert's (or the dense MLP's)
    share of the columns -- or a block of whole experts (``split.experts``) -- the router
    whole. Each share's attention and MLP outputs are partial sums, added up over the ranks by
    ``split.reduce`` (a sigmoid-gated shared expert too: the gate scales every partial sum
    alike)."""

    def __init__(self, c: TextLMConfig, layer: int, split: TensorSplit = WHOLE) -> None:
        super().__init__()
        self.reduce = split.reduce
        self.self_attn = Attention(c, layer, split)
        self.mlp: nn.Module
        if layer in c.dense_layers:
            self.mlp = SwiGLU(c.hidden_size, c.intermediate_size // split.size)
        else:  # every expert's share of the columns, or whole experts (expert parallelism)
            block = split.expert_block()
            self.mlp = SparseMoE(c.hidden_size, c.num_experts, c.num_experts_per_tok,
                                 c.moe_intermediate_size // (1 if block else split.size),
                                 c.norm_topk_prob, c.shared_expert_intermediate_size // split.size,
                                 block)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                step: KVStep) -> torch.Tensor:
        a = self.self_attn(self.input_layernorm(x), cos, sin, step)
        x = x + (a if self.reduce is None else self.reduce(a))
        m = self.mlp(self.post_attention_layernorm(x))
        return x + (m if self.reduce is None else self.reduce(m))


class TextDecoder(nn.Module):
    """``layers`` and the final ``norm`` (the HF ``model.`` body without its embedding, which
    the thinker and the talker name differently and add themselves); ``split``: the share of a
    tensor-parallel decoder this one holds (the thinker's: models/qwen3_omni/thinker_tp.py)."""

    def __init__(self, config: TextLMConfig, split: TensorSplit = WHOLE) -> None:
        super().__init__()
        self.config, self.split = config, split
        self.layers = nn.ModuleList(DecoderLayer(config, i, split)
                                    for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = Rotary(config.rope, config.head_dim)

    def init_buffers(self) -> None:
        """Recomputes the rotary frequencies (float32), which a module built on the meta
        device and materialised with ``to_empty`` holds as garbage."""
        self.rotary.inv_freq = self.config.rope.inv_freq(self.config.head_dim).to(
            self.norm.weight.device)

    def run(self, x: torch.Tensor, step: KVStep,
            hidden_layer: Optional[int] = None) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """``x`` ``[T, H]`` (embeddings, flat over the step's works) -> ``(final [T, H]`` after
        the norm, ``hidden after hidden_layer layers or None)``, indexed as transformers'
        ``hidden_states``: 0 is ``x``, ``num_hidden_layers`` the normed output."""
        n = len(self.layers)
        if hidden_layer is not None and not 0 <= hidden_layer <= n:
            raise ValueError(f"hidden_layer {hidden_layer} is not in [0, {n}] (0: the input "
                             f"embeddings, {n}: the normed output)")
        cos, sin = self.rotary.tables(step.positions, x.dtype)
        at = x if hidden_layer == 0 else None
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, step)
            if hidden_layer == i + 1 and hidden_layer < n:
                at = x
        x = self.norm(x)
        return x, (x if hidden_layer == n else at)

    def kv_layout(self) -> KVLayout:
        p, c = self.norm.weight, self.config
        return KVLayout(c.num_hidden_layers, c.num_key_value_heads // self.split.size,
                        c.head_dim, p.dtype, str(p.device))

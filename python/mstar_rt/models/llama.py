"""A Llama-architecture causal LM (RMSNorm, RoPE with Llama-3 scaling, GQA, SwiGLU, tied or
untied embeddings) whose attention runs over the engine's paged KV cache. Parameter names
follow Hugging Face checkpoints, so their safetensors load as they are.

Built with a :class:`~mstar_rt.distributed.split.TensorSplit`, a module holds one rank's share
of a tensor-parallel model: its heads and MLP columns, with the output projections' partial
sums added up across ranks (:mod:`mstar_rt.distributed.llama_tp` runs such ranks)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Union

import torch
from torch import nn

from mstar_rt.distributed.split import WHOLE, TensorSplit
from mstar_rt.engines.kv_engine import KVStep
from mstar_rt.engines.paged_kv import KVLayout
from mstar_rt.models.rope import RopeConfig, Rotary

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    rope: RopeConfig = field(default_factory=RopeConfig)
    bos_token_id: Optional[int] = None
    eos_token_ids: tuple[int, ...] = ()
    dtype: str = "float32"

    @staticmethod
    def from_hf(config: Mapping[str, Any], source: str = "the Llama config") -> "LlamaConfig":
        """Reads a transformers ``config.json`` (4.x or 5.x dialect); a missing field, a wrong
        type or an absurd size is a ValueError naming the field and ``source``."""
        from mstar_rt.models.checkpoint import MAX_LAYERS, ConfigFields

        c = ConfigFields(config, source)
        kind = config.get("model_type")
        window = config.get("sliding_window")
        if kind not in (None, "llama", "mistral"):
            # Granite's multipliers, Qwen's biases and norms, ...: the weights would load and
            # the outputs be wrong
            raise ValueError(f"{source} is a {kind!r} model (model_type); this loader runs the "
                             "Llama architecture (model_type 'llama', or 'mistral' without a "
                             "sliding window)")
        if window is not None and not (type(window) is int and window >= c.integer(
                "max_position_embeddings", 2048)):
            raise ValueError(f"{source} sets sliding_window {window!r}: each token attends only "
                             "to the last ones, which this loader's attention does not do "
                             "(null, or at least max_position_embeddings, is full attention)")
        act = c.text("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"hidden_act '{act}' in {source} is not a Llama SwiGLU ('silu')")
        heads = c.integer("num_attention_heads")
        hidden = c.integer("hidden_size")
        kv_heads = c.integer("num_key_value_heads", heads)
        if heads % kv_heads:
            raise ValueError(f"num_attention_heads {heads} in {source} is not a multiple of "
                             f"num_key_value_heads {kv_heads}")
        eos = config.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
        if not all(type(e) is int and e >= 0 for e in eos_ids):
            raise ValueError(f"field 'eos_token_id' of {source} must be a token id or a list "
                             f"of them, not {eos!r}")
        bos = config.get("bos_token_id")
        if bos is not None and (type(bos) is not int or bos < 0):
            raise ValueError(f"field 'bos_token_id' of {source} must be a token id, not {bos!r}")
        dtype = config.get("dtype") or config.get("torch_dtype") or "float32"
        return LlamaConfig(
            vocab_size=c.integer("vocab_size"),
            hidden_size=hidden,
            intermediate_size=c.integer("intermediate_size"),
            num_hidden_layers=c.integer("num_hidden_layers", maximum=MAX_LAYERS),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=c.integer("head_dim", max(hidden // heads, 1)),
            rms_norm_eps=c.number("rms_norm_eps", 1e-6),
            max_position_embeddings=c.integer("max_position_embeddings", 2048),
            tie_word_embeddings=c.flag("tie_word_embeddings", False),
            attention_bias=c.flag("attention_bias", False),
            mlp_bias=c.flag("mlp_bias", False),
            rope=RopeConfig.from_hf(config, source),
            bos_token_id=bos,
            eos_token_ids=eos_ids,
            dtype=str(dtype).removeprefix("torch."),
        )

    @staticmethod
    def from_dir(path: Union[str, os.PathLike]) -> "LlamaConfig":
        from mstar_rt.models.checkpoint import read_config

        return LlamaConfig.from_hf(read_config(path), os.path.join(path, "config.json"))


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class LlamaAttention(nn.Module):
    """Attention over ``split``'s share of the heads (all of them unless tensor-parallel)."""

    def __init__(self, c: LlamaConfig, layer: int, split: TensorSplit = WHOLE) -> None:
        super().__init__()
        self.layer, self.head_dim = layer, c.head_dim
        self.heads = c.num_attention_heads // split.size
        self.kv_heads = c.num_key_value_heads // split.size
        self.reduce = split.reduce
        self.q_proj = nn.Linear(c.hidden_size, self.heads * c.head_dim, c.attention_bias)
        self.k_proj = nn.Linear(c.hidden_size, self.kv_heads * c.head_dim, c.attention_bias)
        self.v_proj = nn.Linear(c.hidden_size, self.kv_heads * c.head_dim, c.attention_bias)
        self.o_proj = nn.Linear(self.heads * c.head_dim, c.hidden_size, c.attention_bias)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                step: KVStep) -> torch.Tensor:
        t = x.shape[0]
        q = Rotary.apply(self.q_proj(x).view(t, self.heads, self.head_dim), cos, sin)
        k = Rotary.apply(self.k_proj(x).view(t, self.kv_heads, self.head_dim), cos, sin)
        v = self.v_proj(x).view(t, self.kv_heads, self.head_dim)
        out = step.attend(self.layer, q, k, v)
        out = self.o_proj(out.reshape(t, self.heads * self.head_dim))
        return out if self.reduce is None else self.reduce(out)


class LlamaMLP(nn.Module):
    """SwiGLU over ``split``'s share of the MLP columns."""

    def __init__(self, c: LlamaConfig, split: TensorSplit = WHOLE) -> None:
        super().__init__()
        width = c.intermediate_size // split.size
        self.reduce = split.reduce
        self.gate_proj = nn.Linear(c.hidden_size, width, c.mlp_bias)
        self.up_proj = nn.Linear(c.hidden_size, width, c.mlp_bias)
        self.down_proj = nn.Linear(width, c.hidden_size, c.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))
        return out if self.reduce is None else self.reduce(out)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, c: LlamaConfig, layer: int, split: TensorSplit = WHOLE) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(c, layer, split)
        self.mlp = LlamaMLP(c, split)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                step: KVStep) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, step)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaBody(nn.Module):
    def __init__(self, c: LlamaConfig, split: TensorSplit = WHOLE) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(c, i, split)
                                    for i in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """Runs flat ragged batches: ``forward(token_ids [T], step) -> hidden [T, hidden]`` with the
    step's positions and paged attention; :meth:`logits` projects chosen rows to the vocabulary.
    ``split``: the share of a tensor-parallel model this module holds (see the module doc).
    """

    def __init__(self, config: LlamaConfig, split: TensorSplit = WHOLE) -> None:
        super().__init__()
        self.config = config
        self.split = split
        self.model = LlamaBody(config, split)
        self.rotary = Rotary(config.rope, config.head_dim)
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def kv_layout(self) -> KVLayout:
        p = self.model.embed_tokens.weight
        c = self.config
        return KVLayout(c.num_hidden_layers, c.num_key_value_heads // self.split.size,
                        c.head_dim, p.dtype, str(p.device))

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(token_ids)

    def forward(self, token_ids: Optional[torch.Tensor], step: KVStep,
                embeds: Optional[torch.Tensor] = None) -> torch.Tensor:
        x = self.embed(token_ids) if embeds is None else embeds
        cos, sin = self.rotary.tables(step.positions, x.dtype)
        for layer in self.model.layers:
            x = layer(x, cos, sin, step)
        return self.model.norm(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.config.tie_word_embeddings:
            return hidden @ self.model.embed_tokens.weight.T
        return self.lm_head(hidden)


def load_llama(path: Union[str, os.PathLike], dtype: Optional[torch.dtype] = None,
               device: str = "cpu", progress: bool = True) -> LlamaForCausalLM:
    """Builds a :class:`LlamaForCausalLM` from a HF checkpoint directory (``config.json`` and
    safetensors, sharded or not). ``dtype`` defaults to the checkpoint's."""
    from mstar_rt.models.checkpoint import check_weights, load_weights, meta_module

    config = LlamaConfig.from_dir(path)
    dtype = checkpoint_dtype(config, path, dtype)
    tied = ("lm_head.weight",) if config.tie_word_embeddings else ()
    module = meta_module(lambda: LlamaForCausalLM(config), os.path.join(path, "config.json"))
    check_weights(module, path, allow_missing=tied, ignore=tied)  # before allocating anything
    module = module.to_empty(device=device).to(dtype)
    module.rotary.inv_freq = config.rope.inv_freq(config.head_dim).to(device)
    load_weights(module, path, progress=progress, allow_missing=tied, ignore=tied)
    return module.eval()


def checkpoint_dtype(config: LlamaConfig, path: Union[str, os.PathLike],
                     dtype: Union[torch.dtype, str, None] = None) -> torch.dtype:
    """``dtype`` (a torch dtype, or its name as JSON data gives it: "bfloat16"), or else the
    checkpoint's (a ValueError when torch has no such dtype here)."""
    if isinstance(dtype, str):  # it reached torch as a device string: "Invalid device string"
        if dtype.removeprefix("torch.") not in _DTYPES:
            raise ValueError(f"dtype={dtype!r}: give one of {list(_DTYPES)} (or a torch dtype)")
        return _DTYPES[dtype.removeprefix("torch.")]
    if dtype is not None:
        return dtype
    if config.dtype not in _DTYPES:
        raise ValueError(f"checkpoint dtype '{config.dtype}' in "
                         f"{os.path.join(path, 'config.json')} is not one of "
                         f"{list(_DTYPES)}; pass dtype=")
    return _DTYPES[config.dtype]

"""One rank's share of a Hugging Face Llama checkpoint, read slice by slice from safetensors.

Column-parallel projections (q/k/v, gate/up) keep this rank's rows (its heads, its MLP
columns); row-parallel ones (o_proj, down_proj) keep its input columns, and their bias lives on
rank 0 alone, since the ranks' partial sums are added up after it. Everything else is whole on
every rank. Only the slice is read from the file, so a rank never holds another's weights.
"""

from __future__ import annotations

import os
from typing import Optional, Union

import torch

from mstar_rt.distributed.split import TensorSplit, check_split
from mstar_rt.models.llama import LlamaConfig, LlamaForCausalLM

COLUMN = ("self_attn.q_proj.", "self_attn.k_proj.", "self_attn.v_proj.", "mlp.gate_proj.",
          "mlp.up_proj.")
ROW = ("self_attn.o_proj.", "mlp.down_proj.")


def split_rule(key: str) -> Optional[str]:
    """``"column"``, ``"row"``, ``"row_bias"`` or None (whole) for a checkpoint key."""
    if any(p in key for p in COLUMN):
        return "column"
    if any(p in key for p in ROW):
        return "row_bias" if key.endswith(".bias") else "row"
    return None


def checked_config(path: Union[str, os.PathLike], tp_size: int) -> LlamaConfig:
    """The checkpoint's config, refused when ``tp_size`` does not split it evenly."""
    config = LlamaConfig.from_dir(path)
    check_split(config.num_attention_heads, config.num_key_value_heads,
                config.intermediate_size, tp_size, os.path.join(path, "config.json"))
    return config


def load_llama_shard(path: Union[str, os.PathLike], split: TensorSplit, dtype: torch.dtype,
                     device: str = "cpu") -> LlamaForCausalLM:
    """Rank ``split.rank``'s :class:`LlamaForCausalLM` of the checkpoint at ``path``, its
    collectives ``split.reduce``. The checkpoint is checked whole (keys, shapes) from its
    headers first, as :func:`~mstar_rt.models.llama.load_llama` does."""
    from safetensors import safe_open

    from mstar_rt.models.checkpoint import check_weights, checkpoint_files, meta_module

    config = checked_config(path, split.size)
    source = os.path.join(path, "config.json")
    tied = ("lm_head.weight",) if config.tie_word_embeddings else ()
    check_weights(meta_module(lambda: LlamaForCausalLM(config), source), path,
                  allow_missing=tied, ignore=tied)
    module = meta_module(lambda: LlamaForCausalLM(config, split), source)
    module = module.to_empty(device=device).to(dtype)
    module.rotary.inv_freq = config.rope.inv_freq(config.head_dim).to(device)
    params = dict(module.state_dict())
    with torch.no_grad():
        for file in checkpoint_files(path):
            with safe_open(file, framework="pt") as f:
                for key in f.keys():
                    if key in tied:
                        continue
                    params[key].copy_(_slice(f.get_slice(key), split_rule(key), split)
                                      .to(dtype))
    return module.eval()


def _slice(tensor: object, rule: Optional[str], split: TensorSplit) -> torch.Tensor:
    shape = tensor.get_shape()  # type: ignore[attr-defined]
    if rule == "column":
        a, b = split.part(shape[0])
        return tensor[a:b]  # type: ignore[index]
    if rule == "row":
        a, b = split.part(shape[1])
        return tensor[:, a:b]  # type: ignore[index]
    whole = tensor[:]  # type: ignore[index]
    if rule == "row_bias" and split.rank != 0:
        return torch.zeros_like(whole)
    return whole

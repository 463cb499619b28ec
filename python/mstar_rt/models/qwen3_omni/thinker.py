"""Qwen3-Omni's thinker language model: token (or audio) embeddings in, text logits out, and the
hidden states of one chosen layer for the talker.

Parameter names follow the checkpoint under ``thinker.`` (``model.embed_tokens.weight``,
``model.layers.{i}...``, ``model.norm.weight``, ``lm_head.weight``) except the experts, fused
per layer into ``model.layers.{i}.mlp.experts.gate_up_proj`` / ``down_proj`` (the names
transformers uses in memory); :mod:`.checkpoint` maps the hub's one-tensor-per-expert keys.
The audio encoder (``thinker.audio_tower``) is a separate module: its outputs reach
:meth:`ThinkerLM.forward` as rows of ``embeds``.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from mstar_rt.distributed.split import WHOLE, TensorSplit
from mstar_rt.engines.kv_engine import KVStep
from mstar_rt.engines.paged_kv import KVLayout
from mstar_rt.models.qwen3_omni.text_lm import TextDecoder, TextLMConfig


class ThinkerBody(TextDecoder):
    """HF's ``thinker.model`` (text part): ``embed_tokens`` + the decoder."""

    def __init__(self, config: TextLMConfig, split: TensorSplit = WHOLE) -> None:
        super().__init__(config, split)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)


class ThinkerLM(nn.Module):
    """Runs flat ragged batches over the paged KV cache::

        final, at_k = thinker(token_ids [T], step, hidden_layer=k)   # or embeds=[T, H]
        logits = thinker.logits(final[step.last_token])

    ``final`` is the normed last hidden state; ``at_k`` what transformers returns as
    ``hidden_states[k]`` (0: the input embeddings; the talker reads
    ``talker_config.accept_hidden_layer``), or None when ``hidden_layer`` is None.

    ``split``: one rank's share of a tensor-parallel thinker (its heads, expert columns and KV
    heads; embeddings, norms, routers and the LM head whole), see :mod:`.thinker_tp`.
    """

    def __init__(self, config: TextLMConfig, split: TensorSplit = WHOLE) -> None:
        super().__init__()
        self.config = config
        self.model = ThinkerBody(config, split)
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(token_ids)

    def forward(self, token_ids: Optional[torch.Tensor], step: KVStep,
                embeds: Optional[torch.Tensor] = None,
                hidden_layer: Optional[int] = None
                ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        if (token_ids is None) == (embeds is None):
            raise ValueError("ThinkerLM.forward takes token_ids or embeds, exactly one")
        if embeds is None:
            assert token_ids is not None
            embeds = self.embed(token_ids)
        return self.model.run(embeds, step, hidden_layer)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.config.tie_word_embeddings:
            return hidden @ self.model.embed_tokens.weight.T
        return self.lm_head(hidden)

    def kv_layout(self) -> KVLayout:
        return self.model.kv_layout()

    def init_buffers(self) -> None:
        """See :meth:`TextDecoder.init_buffers` (after ``to_empty``)."""
        self.model.init_buffers()

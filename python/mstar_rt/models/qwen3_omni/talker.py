"""Qwen3-Omni's talker language model: embeddings built from the thinker's states and codec
tokens in, the first codebook's logits out.

The caller assembles the talker's inputs (the talker does not embed its own sequence: prompt
rows are projected thinker embeddings or hidden states plus codec embeddings, and each decode
row sums the previous step's codec embeddings with the next thinker text row); this module
holds the pieces for that -- :attr:`TalkerLM.text_projection`, :attr:`TalkerLM.hidden_projection`
and :meth:`TalkerLM.embed` -- and runs the decoder. Its post-norm hidden state is what the code
predictor (``talker.code_predictor.*``, a separate module loaded by :mod:`.checkpoint`)
receives as ``past_hidden``.

Parameter names follow the checkpoint under ``talker.`` (``model.codec_embedding.weight``,
``model.layers.{i}...``, ``text_projection.linear_fc1.weight``, ``codec_head.weight``) except the
fused experts (see :mod:`.moe`).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from mstar_rt.engines.kv_engine import KVStep
from mstar_rt.engines.paged_kv import KVLayout
from mstar_rt.models.qwen3_omni.text_lm import TextDecoder, TextLMConfig


class ResizeMLP(nn.Module):
    """``fc2(silu(fc1(x)))`` with biases: thinker width -> talker width (HF
    ``Qwen3OmniMoeTalkerResizeMLP``, its hidden width the talker's ``intermediate_size``)."""

    def __init__(self, thinker_hidden: int, intermediate: int, hidden: int) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(thinker_hidden, intermediate, bias=True)
        self.linear_fc2 = nn.Linear(intermediate, hidden, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.silu(self.linear_fc1(x)))


class TalkerBody(TextDecoder):
    """HF's ``talker.model``: ``codec_embedding`` + the decoder (every layer an MoE with a
    shared expert)."""

    def __init__(self, config: TextLMConfig) -> None:
        super().__init__(config)
        self.codec_embedding = nn.Embedding(config.vocab_size, config.hidden_size)


class TalkerLM(nn.Module):
    """Runs flat ragged batches over the paged KV cache::

        hidden = talker(embeds [T, H_talker], step)        # post-norm: the predictor's input
        logits = talker.logits(hidden[step.last_token])     # codebook 0 (+ codec specials)
    """

    def __init__(self, config: TextLMConfig, thinker_hidden_size: int) -> None:
        super().__init__()
        if not config.shared_expert_intermediate_size or config.dense_layers:
            raise ValueError("the talker's TextLMConfig must come from "
                             "TextLMConfig.from_hf(..., talker=True): every layer an MoE with "
                             "a shared expert")
        self.config = config
        self.text_projection = ResizeMLP(thinker_hidden_size, config.intermediate_size,
                                         config.hidden_size)
        self.hidden_projection = ResizeMLP(thinker_hidden_size, config.intermediate_size,
                                           config.hidden_size)
        self.model = TalkerBody(config)
        if not config.tie_word_embeddings:
            self.codec_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def embed(self, codec_ids: torch.Tensor) -> torch.Tensor:
        """Codec token ids (codebook 0 and the codec specials) -> talker-width rows."""
        return self.model.codec_embedding(codec_ids)

    def forward(self, embeds: torch.Tensor, step: KVStep) -> torch.Tensor:
        return self.model.run(embeds, step)[0]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.config.tie_word_embeddings:
            return hidden @ self.model.codec_embedding.weight.T
        return self.codec_head(hidden)

    def kv_layout(self) -> KVLayout:
        return self.model.kv_layout()

    def init_buffers(self) -> None:
        """See :meth:`TextDecoder.init_buffers` (after ``to_empty``)."""
        self.model.init_buffers()

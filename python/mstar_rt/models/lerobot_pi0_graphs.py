"""pi0 / pi0.5's flow step as :class:`~mstar_rt.models.flow_graphs.FlowGraphs` runs it: the
expert over the action tokens of a static
:class:`~mstar_rt.models.lerobot_pi0_suffix.SuffixAttention` (prefix K/V padded to the policy's
longest prefix), the flow times given as their sine-cosine embeddings."""

from __future__ import annotations

import torch

from mstar_rt.models.lerobot_pi0_layers import PiModule
from mstar_rt.models.lerobot_pi0_suffix import SuffixAttention


class PiFlowStep:
    def __init__(self, module: PiModule) -> None:
        self.module, self.device = module, module.device
        self.chunk = module.config.chunk_size

    def inputs(self, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        m, c = self.module, self.module.config
        x = torch.zeros(size * c.chunk_size, c.max_action_dim, dtype=m.head_dtype,
                        device=m.device)
        return x, torch.zeros(size, c.expert.width, dtype=m.head_dtype, device=m.device)

    def attention(self, size: int, like: torch.Tensor) -> SuffixAttention:
        m, c = self.module, self.module.config
        return SuffixAttention(size, c.max_prefix, c.chunk_size, like, m.rope, m.dtype,
                               static=True)

    def empty_prefix(self) -> torch.Tensor:
        m, b = self.module, self.module.config.backbone
        return torch.zeros(b.depth, 2, 1, b.num_kv_heads, b.head_dim, dtype=m.dtype,
                           device=m.device)

    def velocity(self, x: torch.Tensor, time: torch.Tensor, attention: SuffixAttention
                 ) -> torch.Tensor:
        m, s = self.module, attention
        tokens, cond = m.action_tokens(x, None, s.rows, time)
        return m.velocity(tokens, s.positions, s, cond, s.tables)

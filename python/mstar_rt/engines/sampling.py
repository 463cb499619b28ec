"""Per-request sampling: greedy, temperature, top-k, top-p and repetition penalty, each request
drawing from its own seeded generator so its tokens do not depend on what it was batched with."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch


@dataclass(frozen=True)
class SamplingParams:
    """How one request picks tokens. ``temperature == 0`` is greedy."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0                  # 0: off
    top_p: float = 1.0              # 1: off
    repetition_penalty: float = 1.0  # 1: off; >1 discourages tokens already in the sequence
    seed: Optional[int] = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        # Checked whole here, at submit: a value that fails later fails inside a batch step,
        # where every request of the step is run again to find the culprit.
        for name in ("max_tokens", "top_k", "seed", "temperature", "top_p", "repetition_penalty"):
            v = getattr(self, name)  # NumPy scalars (a count computed with NumPy) as Python's
            if isinstance(v, numbers.Integral) and not isinstance(v, (int, bool, np.bool_)):
                object.__setattr__(self, name, int(v))
            elif isinstance(v, numbers.Real) and not isinstance(v, (numbers.Integral, float)):
                object.__setattr__(self, name, float(v))
        problems = []
        if not _integer(self.max_tokens) or self.max_tokens < 1:
            problems.append(f"max_tokens={self.max_tokens!r} (needs an integer >= 1)")
        if not _real(self.temperature) or not self.temperature >= 0:
            problems.append(f"temperature={self.temperature!r} (needs a number >= 0)")
        if not _integer(self.top_k) or self.top_k < 0:
            problems.append(f"top_k={self.top_k!r} (needs an integer >= 0)")
        if not _real(self.top_p) or not 0 < self.top_p <= 1:
            problems.append(f"top_p={self.top_p!r} (needs 0 < top_p <= 1)")
        if not _real(self.repetition_penalty) or not self.repetition_penalty > 0:
            problems.append(f"repetition_penalty={self.repetition_penalty!r} (needs > 0)")
        if self.seed is not None and (not _integer(self.seed)
                                      or not -2**63 <= self.seed < 2**64):
            problems.append(f"seed={self.seed!r} (needs None or an integer in [-2**63, 2**64))")
        stops = self.stop_token_ids
        if isinstance(stops, (str, bytes)) or not isinstance(stops, (tuple, list)) or not all(
                _integer(t) and t >= 0 for t in stops):
            problems.append(f"stop_token_ids={stops!r} (needs a tuple of token ids >= 0)")
        else:
            object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in stops))
        if not isinstance(self.ignore_eos, bool):
            problems.append(f"ignore_eos={self.ignore_eos!r} (needs true or false)")
        if problems:
            raise ValueError("SamplingParams: " + "; ".join(problems))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _integer(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _real(v: object) -> bool:
    return _integer(v) or isinstance(v, float) and math.isfinite(v)


_TINY = torch.finfo(torch.float32).tiny
_HUGE = torch.finfo(torch.float32).max


def make_generator(params: SamplingParams, device: torch.device) -> Optional[torch.Generator]:
    if params.greedy:
        return None
    g = torch.Generator(device=device)
    if params.seed is None:
        g.seed()  # fresh entropy, without reseeding torch's global generator
    else:
        g.manual_seed(params.seed)
    return g


def sample(logits: torch.Tensor, params: Sequence[SamplingParams],
           generators: Sequence[Optional[torch.Generator]],
           histories: Sequence[torch.Tensor]) -> torch.Tensor:
    """``logits [B, V]`` (one row per request) -> token ids ``[B]``. ``histories[i]`` holds the
    request's token ids so far (prompt and output), read by the repetition penalty."""
    out = torch.empty(logits.shape[0], dtype=torch.long, device=logits.device)
    all_greedy = all(p.greedy and p.repetition_penalty == 1.0 for p in params)
    if all_greedy:
        return logits.argmax(dim=-1)
    for i, p in enumerate(params):
        row = logits[i].float()
        if p.repetition_penalty != 1.0 and histories[i].numel():
            seen = torch.unique(histories[i].to(row.device))
            picked = row[seen]
            row = row.clone()
            row[seen] = torch.where(picked > 0, picked / p.repetition_penalty,
                                    picked * p.repetition_penalty)
        if p.greedy:
            out[i] = row.argmax()
            continue
        # Shifted so the best logit is 0 and every other one <= 0: a temperature so small (or
        # large) that float32 over- or underflows then still gives the top token, or the
        # uniform draw, instead of NaN probabilities failing the whole batch step.
        row = (row - row.max()) / min(max(p.temperature, _TINY), _HUGE)
        if p.top_k > 0 and p.top_k < row.shape[0]:
            kth = torch.topk(row, p.top_k).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        if p.top_p < 1.0:
            sorted_logits, order = torch.sort(row, descending=True)
            probs = sorted_logits.softmax(-1)
            # Drop a token once the mass before it already reaches top_p (the first always stays).
            drop = probs.cumsum(-1) - probs >= p.top_p
            drop[0] = False  # a top_p below float32's resolution compared as 0
            row = row.clone()
            row[order[drop]] = float("-inf")
        out[i] = torch.multinomial(row.softmax(-1), 1, generator=generators[i])[0]
    return out

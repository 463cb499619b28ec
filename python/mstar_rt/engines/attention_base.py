"""What every attention backend is given and shares: a sequence's part of a step
(:class:`SeqStep`), the fixed-address plan of a CUDA-graph decode bucket
(:class:`StaticDecodePlan`, filled from :func:`decode_rows`), and which dtypes each backend runs
on which device (:func:`check_dtype`). The backends and :mod:`mstar_rt.engines.attention` (the
interface and the choice between backends) build on this module; it imports neither.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence as Seq

import torch

from mstar_rt.engines.masks import CAUSAL, BlockCausal, Causal, PrefixBidirectional


@dataclass
class SeqStep:
    """One sequence's part of a step, as the backend sees it."""

    cached: int                  # tokens readable from the pages
    new: int                     # tokens this step computes (queries)
    pages: list[int]             # block table (covers at least cached (+ new if persist))
    persist: bool = True         # write the new tokens' K/V into the pages
    mask: object = CAUSAL


def causal_equivalent(s: SeqStep) -> bool:
    """True when ``s.mask`` allows exactly the causal pattern over ``cached + new`` keys. The
    built-in masks all allow at least causal, so a single query token (which sees every key up
    to itself) is causal under any of them, and so is a bidirectional prefix already cached."""
    if isinstance(s.mask, Causal):
        return True
    known = isinstance(s.mask, (PrefixBidirectional, BlockCausal))
    if known and s.new == 1:
        return True
    return isinstance(s.mask, PrefixBidirectional) and s.mask.prefix <= s.cached + 1


# ---- static decode (CUDA-graph buckets) ---------------------------------------------------------

def decode_rows(steps: Seq[SeqStep], size: int, page_size: int) -> torch.Tensor:
    """Host ``[4, size]`` int64: positions, write slots, write sources (row whose K/V is written)
    and key counts, for ``steps`` padded to ``size`` rows."""
    rows = torch.zeros(4, size, dtype=torch.long)
    for i, s in enumerate(steps):
        pos = s.cached
        rows[0, i] = pos
        rows[1, i] = s.pages[pos // page_size] * page_size + pos % page_size
        rows[2, i] = i
        rows[3, i] = pos + 1
    n = len(steps)
    rows[1, n:] = rows[1, 0]  # padding rewrites row 0's slot with row 0's K/V
    rows[2, n:] = 0
    rows[3, n:] = 1
    return rows


class StaticDecodePlan:
    """The fixed-address buffers of one bucket; what :class:`KVStep` and the attention read."""

    def __init__(self, size: int, device: Any) -> None:
        self.size = size
        self.rows = torch.zeros(4, size, dtype=torch.long, device=device)
        self.positions, self.w_slot, self.w_src, self.kv_len = self.rows.unbind(0)
        self.last_token = torch.arange(size, device=device)
        self.block_table: Optional[torch.Tensor] = None   # torch flavour
        self.c_slots: Optional[torch.Tensor] = None       # derived inside the graph
        self.mask: Optional[torch.Tensor] = None
        self.wrapper: Any = None                          # FlashInfer flavour: its wrapper
        self.indptr: Optional[torch.Tensor] = None        # and the wrapper's index buffers
        self.indices: Optional[torch.Tensor] = None
        self.last_page_len: Optional[torch.Tensor] = None


# ---- what each backend runs ---------------------------------------------------------------------

SUPPORTED = {
    "torch": {"cpu": (torch.float32, torch.bfloat16),
              "cuda": (torch.float32, torch.float16, torch.bfloat16)},
    "flashinfer": {"cuda": (torch.float16, torch.bfloat16)},
}


def runs(backend: str, dtype: torch.dtype, device: str) -> bool:
    """Whether ``backend`` runs a cache of ``dtype`` on ``device``."""
    return dtype in SUPPORTED.get(backend, {}).get(torch.device(device).type, ())


def check_dtype(backend: str, dtype: torch.dtype, device: str) -> None:
    """Raises a ValueError naming what to change when ``backend`` cannot run ``dtype`` on
    ``device``."""
    kind = torch.device(device).type
    ok = SUPPORTED.get(backend, {}).get(kind)
    if ok is None:
        where = ", ".join(SUPPORTED.get(backend, {})) or "nowhere"
        raise ValueError(f"the {backend} attention backend does not run on {kind} (it runs on "
                         f"{where}); pick attention_backend='torch' or move the model")
    if dtype not in ok:
        names = ", ".join(str(t).removeprefix("torch.") for t in ok)
        raise ValueError(f"the {backend} attention backend cannot run "
                         f"{str(dtype).removeprefix('torch.')} on {kind}; load the model as one "
                         f"of: {names}")

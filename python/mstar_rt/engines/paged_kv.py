"""A paged KV cache: fixed-size pages shared by sequences through block tables.

A sequence is one (request, label) pair: ``main``, or a branch such as ``cfg_text`` forked from
it. Forking shares pages (reference counts); a write into a shared, partly filled page copies
that page first, so a fork never changes what its source reads. Pages go back to the free list
when their last sequence drops them (request end, cancel, or an explicit drop).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Optional

import torch


class OutOfPages(RuntimeError):
    """The cache cannot hold a sequence even when every other sequence has gone."""


class SequenceTooLarge(OutOfPages):
    """A sequence of ``tokens`` needs ``pages`` pages of ``page_size``, more than the cache's
    ``num_pages``: it can never be admitted, however many others end."""

    def __init__(self, tokens: int, pages: int, page_size: int, num_pages: int) -> None:
        super().__init__(f"a sequence of {tokens} tokens needs {pages} pages of {page_size} "
                         f"tokens but the KV cache has {num_pages}; raise num_pages or "
                         "page_size, or shorten the request")
        self.tokens, self.pages, self.page_size, self.num_pages = (tokens, pages, page_size,
                                                                   num_pages)

    def __reduce__(self) -> tuple:  # (pickle would call it with the message alone)
        return type(self), (self.tokens, self.pages, self.page_size, self.num_pages)


@dataclass(frozen=True)
class KVLayout:
    """What one cache holds: per layer, K and V of ``num_kv_heads`` x ``head_dim`` per token."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype = torch.float32
    device: str = "cpu"


@dataclass
class Sequence:
    pages: list[int] = field(default_factory=list)
    length: int = 0        # tokens whose K/V are in the pages
    reserve: int = 0       # tokens the sequence may grow to (admission control)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class SequenceKV:
    """One sequence's K/V lifted out of a cache, to be written into another (another process's,
    with other page ids and maybe another page size). ``data`` is
    ``[num_layers, 2 (K, V), length, num_kv_heads, head_dim]``: token-major, so only the used
    tokens travel and neither page size nor page ids do. ``reserve``: the tokens the sequence
    may grow to (the receiver admits it only when that many tokens' pages are free)."""

    data: torch.Tensor
    reserve: int = 0

    @property
    def length(self) -> int:
        return int(self.data.shape[2])

    def describe(self) -> dict:
        """The layout as plain data (for a transfer's description)."""
        n, _two, length, heads, dim = self.data.shape
        return dict(num_layers=int(n), num_kv_heads=int(heads), head_dim=int(dim),
                    dtype=str(self.data.dtype).removeprefix("torch."), length=int(length),
                    reserve=self.reserve)


class PagedKVCache:
    """K/V storage ``[num_pages, page_size, num_kv_heads, head_dim]`` per layer, a page
    allocator with reference counts, and the block table of every live sequence.

    Thread-safety: the engine's worker does every allocation and write; :meth:`release` may come
    from any thread (a cancel). One lock guards the bookkeeping; page contents are written only
    by the worker, into pages no one else holds.
    """

    def __init__(self, layout: KVLayout, page_size: int = 16, num_pages: int = 1024) -> None:
        if page_size < 1 or num_pages < 1:
            raise ValueError(f"page_size ({page_size}) and num_pages ({num_pages}) must be >= 1")
        self.layout, self.page_size, self.num_pages = layout, page_size, num_pages
        shape = (num_pages, page_size, layout.num_kv_heads, layout.head_dim)
        try:
            self.k = [torch.zeros(shape, dtype=layout.dtype, device=layout.device)
                      for _ in range(layout.num_layers)]
            self.v = [torch.zeros(shape, dtype=layout.dtype, device=layout.device)
                      for _ in range(layout.num_layers)]
        except (RuntimeError, MemoryError) as e:  # torch.OutOfMemoryError is a RuntimeError
            per_token = (2 * layout.num_layers * layout.num_kv_heads * layout.head_dim
                         * torch.empty((), dtype=layout.dtype).element_size())
            need = per_token * page_size * num_pages
            raise ValueError(f"the KV cache cannot be allocated: {num_pages} pages of {page_size} "
                             f"tokens need {need / 2**30:.3g} GiB on {layout.device} "
                             f"({type(e).__name__}); lower kv_cache.num_pages or page_size") from None
        self._free = list(range(num_pages - 1, -1, -1))  # pop() hands out low pages first
        self._refs = [0] * num_pages
        self._seqs: dict[tuple[int, str], Sequence] = {}
        # request -> every label it created, held now or dropped since: a read of a dropped
        # label is then told apart from one of a label never written (until the request ends)
        self._made: dict[int, set[str]] = {}
        self._lock = threading.Lock()
        #: When a list, every copy-on-write appends ``(source page, new page)`` to it, so a
        #: mirror of this cache (a tensor-parallel follower's share) can repeat the copy.
        self.copy_log: Optional[list[tuple[int, int]]] = None

    # ---- queries -----------------------------------------------------------------------------

    @property
    def free_pages(self) -> int:
        return len(self._free)

    def sequence(self, request: int, label: str) -> Optional[Sequence]:
        return self._seqs.get((request, label))

    def labels(self, request: int) -> list[str]:
        with self._lock:
            return [label for (r, label) in self._seqs if r == request]

    def dropped_labels(self, request: int) -> list[str]:
        """The labels ``request`` created here and no longer holds (dropped, or exported with
        ``free``), sorted; forgotten when the request is released."""
        with self._lock:
            made = self._made.get(request, ())
            return sorted(label for label in made if (request, label) not in self._seqs)

    @property
    def live_sequences(self) -> int:
        return len(self._seqs)

    def holders(self) -> set[int]:
        """The requests that hold pages."""
        with self._lock:
            return {r for (r, _label), s in self._seqs.items() if s.pages}

    def pages_in_use(self) -> set[int]:
        """The pages some sequence holds."""
        with self._lock:
            return {p for p, refs in enumerate(self._refs) if refs}

    def _outstanding(self, exclude: Optional[Sequence] = None) -> int:
        """Pages promised to sequences' reservations but not yet taken."""
        total = 0
        for s in self._seqs.values():
            if s is not exclude:
                total += max(0, _ceil_div(s.reserve, self.page_size) - len(s.pages))
        return total

    # ---- growing sequences (worker thread) ---------------------------------------------------

    def pages_for(self, length: int, new: int, pages_held: int) -> int:
        return max(0, _ceil_div(length + new, self.page_size) - pages_held)

    def admit(self, request: int, label: str, new: int, reserve: int = 0,
              fork_from: Optional[str] = None) -> Optional[Sequence]:
        """Makes room to append ``new`` tokens to (request, label), creating the sequence
        (empty, or forked from ``fork_from``) if needed. Returns the sequence, or None when the
        pages are not free now (the caller retries later). Raises :class:`SequenceTooLarge` when
        the cache could never hold it."""
        ps = self.page_size
        with self._lock:
            key = (request, label)
            seq = self._seqs.get(key)
            created = seq is None
            if created:
                if fork_from is not None:
                    if (request, fork_from) not in self._seqs:
                        raise KeyError(f"request {request} has no KV label '{fork_from}' to fork "
                                       f"'{label}' from; run the walk that fills it first")
                    seq = self._fork_locked(request, fork_from, label)
                else:
                    seq = Sequence()
                    self._seqs[key] = seq
            reserve = max(seq.reserve, reserve, seq.length + new)
            need = self.pages_for(seq.length, new, len(seq.pages))
            cow = new > 0 and seq.length % ps != 0 and self._refs[seq.pages[-1]] > 1
            if _ceil_div(reserve, ps) + int(cow) > self.num_pages:
                if created:
                    self._drop(self._seqs.pop(key))
                raise SequenceTooLarge(reserve, _ceil_div(reserve, ps) + int(cow), ps,
                                       self.num_pages)
            # Admit only if this sequence's whole reservation fits beside everyone else's.
            own = max(need, _ceil_div(reserve, ps) - len(seq.pages)) + int(cow)
            if len(self._free) - own < self._outstanding(exclude=seq):
                if created:
                    self._drop(self._seqs.pop(key))
                return None
            seq.reserve = reserve
            if cow:
                self._copy_on_write(seq)
            for _ in range(need):
                page = self._free.pop()
                self._refs[page] = 1
                seq.pages.append(page)
            if created:
                self._made.setdefault(request, set()).add(label)
            return seq

    def commit(self, request: int, label: str, new: int) -> None:
        """The step wrote ``new`` tokens' K/V: count them (unless the request ended meanwhile)."""
        with self._lock:
            seq = self._seqs.get((request, label))
            if seq is not None:
                seq.length += new

    def _copy_on_write(self, seq: Sequence) -> None:
        old = seq.pages[-1]
        new = self._free.pop()
        self._refs[new] = 1
        self.copy_page(old, new)
        if self.copy_log is not None:
            self.copy_log.append((old, new))
        self._decref(old)
        seq.pages[-1] = new

    # ---- moving a sequence to another cache (KV transfer) -------------------------------------

    def export_sequence(self, request: int, label: str = "main",
                        device: Optional[str] = None) -> SequenceKV:
        """A copy of (request, label)'s cached K/V (every layer; the used tokens only), on
        ``device`` (default: the cache's). The sequence stays; :meth:`drop` frees it."""
        self._check_unmirrored("export")
        with self._lock:
            seq = self._seqs.get((request, label))
            if seq is None:
                raise KeyError(f"request {request} has no KV label '{label}' to export; its "
                               f"labels are {[lb for (r, lb) in self._seqs if r == request]}")
            pages, length, reserve = list(seq.pages), seq.length, seq.reserve
        lay = self.layout
        out = torch.empty((lay.num_layers, 2, length, lay.num_kv_heads, lay.head_dim),
                          dtype=lay.dtype, device=lay.device)
        slots = self._slots(pages, length)
        for layer, (k, v) in enumerate(zip(self.k, self.v)):
            flat = (-1, lay.num_kv_heads, lay.head_dim)
            torch.index_select(k.view(flat), 0, slots, out=out[layer, 0])
            torch.index_select(v.view(flat), 0, slots, out=out[layer, 1])
        return SequenceKV(out if device is None else out.to(device), reserve)

    def import_sequence(self, request: int, label: str, kv: SequenceKV,
                        reserve: int = 0) -> Optional[Sequence]:
        """Creates (request, label) holding ``kv``'s tokens in pages of this cache, reserved up
        to ``max(reserve, kv.reserve)`` tokens. Returns the sequence, or None when the pages are
        not free now (nothing taken; retry later). Raises :class:`OutOfPages` when the cache
        could never hold it, ValueError when ``kv`` has another layout or the label exists."""
        self._check_unmirrored("import")
        self.check_layout(kv)
        if self.sequence(request, label) is not None:
            raise ValueError(f"request {request} already holds KV label '{label}'; a transfer "
                             "creates the sequence, so drop it first")
        seq = self.admit(request, label, kv.length, max(reserve, kv.reserve))
        if seq is None:
            return None
        lay = self.layout
        slots = self._slots(seq.pages, kv.length)
        data = kv.data.to(lay.device)
        flat = (-1, lay.num_kv_heads, lay.head_dim)
        for layer, (k, v) in enumerate(zip(self.k, self.v)):
            k.view(flat).index_copy_(0, slots, data[layer, 0])
            v.view(flat).index_copy_(0, slots, data[layer, 1])
        self.commit(request, label, kv.length)
        return seq

    def check_layout(self, kv: SequenceKV) -> None:
        """ValueError naming the difference when ``kv`` was cut from a cache of another layout
        (page size and device may differ; layers, KV heads, head size and dtype may not)."""
        lay, got = self.layout, kv.describe()
        want = dict(num_layers=lay.num_layers, num_kv_heads=lay.num_kv_heads,
                    head_dim=lay.head_dim, dtype=str(lay.dtype).removeprefix("torch."))
        diff = [f"{k} {got[k]} (here {v})" for k, v in want.items() if got[k] != v]
        if diff or kv.data.dim() != 5 or kv.data.shape[1] != 2:
            raise ValueError(f"the transferred KV does not fit this cache: it has "
                             f"{', '.join(diff) or f'shape {tuple(kv.data.shape)}'}; both sides "
                             "must serve the same model at the same dtype (page sizes may differ)")

    def _slots(self, pages: list[int], length: int) -> torch.Tensor:
        """Rows of the flattened ``[num_pages * page_size, ...]`` cache holding the tokens."""
        ps = self.page_size
        index = torch.tensor(pages, dtype=torch.long)[:, None] * ps + torch.arange(ps)
        return index.reshape(-1)[:length].to(self.layout.device)

    def _check_unmirrored(self, what: str) -> None:
        if self.copy_log is not None:
            raise ValueError(f"cannot {what} KV pages of a tensor-parallel cache: it holds one "
                             "rank's share of the KV heads; serve the LM at tp_size 1 on both "
                             "sides of a transfer")

    def copy_page(self, src: int, dst: int) -> None:
        """Copies page ``src``'s K/V into page ``dst`` in every layer (contents only)."""
        for k, v in zip(self.k, self.v):
            k[dst].copy_(k[src])
            v[dst].copy_(v[src])

    # ---- forks and release (any thread) ------------------------------------------------------

    def fork(self, request: int, src: str, dst: str) -> None:
        """Makes ``dst`` a copy of ``src`` that shares its pages (snapshot / CFG branch)."""
        with self._lock:
            if (request, src) not in self._seqs:
                raise KeyError(f"request {request} has no KV label '{src}' to fork")
            old = self._seqs.pop((request, dst), None)
            if old is not None:
                self._drop(old)
            self._fork_locked(request, src, dst)
            self._made.setdefault(request, set()).add(dst)

    def _fork_locked(self, request: int, src: str, dst: str) -> Sequence:
        s = self._seqs[(request, src)]
        # Only the pages holding the source's committed tokens: a page it took for this step's
        # append (admitted, not yet committed) is its own, or both would write into it.
        pages = s.pages[:_ceil_div(s.length, self.page_size)]
        for p in pages:
            self._refs[p] += 1
        seq = Sequence(list(pages), s.length, s.length)
        self._seqs[(request, dst)] = seq
        return seq

    def drop(self, request: int, label: str) -> None:
        with self._lock:
            seq = self._seqs.pop((request, label), None)
            if seq is not None:
                self._drop(seq)

    def release(self, request: int) -> int:
        """Frees every label of ``request``; returns how many sequences it dropped."""
        with self._lock:
            keys = [k for k in self._seqs if k[0] == request]
            for k in keys:
                self._drop(self._seqs.pop(k))
            self._made.pop(request, None)
            return len(keys)

    def _drop(self, seq: Sequence) -> None:
        for p in seq.pages:
            self._decref(p)
        seq.pages = []

    def _decref(self, page: int) -> None:
        self._refs[page] -= 1
        if self._refs[page] == 0:
            self._free.append(page)

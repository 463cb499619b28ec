"""The paged KV cache and attention over it: pages spanned and released, forks sharing pages with
copy-on-write of the shared partial page, reservations holding pages back, a sequence that can
never fit refused naming num_pages; and the torch attention backend against a float64 dense
reference (written out in kv_models.py) under every mask, persisting or not, on block tables
scattered over the cache. The engine that serves them: test_kv_engine.py."""

from __future__ import annotations

import random

import pytest
import torch

from mstar_rt.engines.attention_base import SeqStep
from mstar_rt.engines.masks import BlockCausal, Causal, PrefixBidirectional
from mstar_rt.engines.paged_kv import KVLayout, OutOfPages, PagedKVCache
from mstar_rt.engines.torch_backend import TorchAttention

from kv_models import DenseHistory, gather


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conftest.py


def make_cache(page_size: int = 4, num_pages: int = 8, layers: int = 1, kv_heads: int = 2,
               head_dim: int = 4) -> PagedKVCache:
    return PagedKVCache(KVLayout(layers, kv_heads, head_dim), page_size, num_pages)


def write(cache: PagedKVCache, backend: TorchAttention, request: int, label: str, new: int,
          seed: int):
    """One persisted causal step of random q/k/v on (request, label); returns k, v."""
    seq = cache.admit(request, label, new)
    assert seq is not None
    g = torch.Generator().manual_seed(seed)
    hkv, d = cache.k[0].shape[2:]
    q, k, v = (torch.randn(new, hkv, d, generator=g) for _ in range(3))
    backend.attend(0, q, k, v, backend.plan([SeqStep(seq.length, new, list(seq.pages))]))
    cache.commit(request, label, new)
    return k, v


# ---- the paged cache ---------------------------------------------------------------------------

def test_allocation_spans_pages_and_release_returns_every_page():
    cache = make_cache(page_size=4, num_pages=8)
    seq = cache.admit(1, "main", 6)
    assert len(seq.pages) == 2 and cache.free_pages == 6
    cache.commit(1, "main", 6)
    before = list(seq.pages)
    cache.admit(1, "main", 2)  # positions 6, 7 still fit in the second page
    assert seq.pages == before and cache.free_pages == 6
    cache.commit(1, "main", 2)
    cache.admit(1, "main", 1)
    assert len(seq.pages) == 3 and len(set(seq.pages)) == 3 and cache.free_pages == 5
    other = cache.admit(2, "main", 5)
    assert not set(other.pages) & set(seq.pages)
    assert cache.live_sequences == 2
    assert cache.release(1) == 1 and cache.free_pages == 6
    assert cache.release(2) == 1
    assert cache.free_pages == cache.num_pages and cache.live_sequences == 0
    assert cache.release(2) == 0  # a second release is harmless


def test_a_fork_in_the_step_of_its_sources_append_gets_none_of_that_appends_pages():
    """The source at a page boundary takes a fresh page for this step's tokens; a fork admitted
    in the same step (before the commit) shared it, and both wrote their next tokens there."""
    cache = make_cache(page_size=4, num_pages=16)
    cache.admit(1, "main", 4, reserve=16)
    cache.commit(1, "main", 4)
    main = cache.admit(1, "main", 2, reserve=16)  # a new page for positions 4..5
    branch = cache.admit(1, "branch", 3, reserve=16, fork_from="main")
    assert branch.pages[0] == main.pages[0], "the committed page stays shared"
    assert branch.pages[1] != main.pages[1], "the source's new page is not the fork's"
    cache.commit(1, "main", 2)
    cache.commit(1, "branch", 3)
    assert (cache.sequence(1, "main").length, cache.sequence(1, "branch").length) == (6, 7)
    cache.release(1)
    assert cache.free_pages == cache.num_pages


def test_fork_shares_pages_and_a_write_copies_the_shared_partial_page():
    cache = make_cache(page_size=4, num_pages=8)
    backend = TorchAttention(cache)
    k0, v0 = write(cache, backend, 1, "main", 6, seed=0)
    main = cache.sequence(1, "main")
    free = cache.free_pages
    cache.fork(1, "main", "b")
    b = cache.sequence(1, "b")
    assert b.pages == main.pages and b.length == 6 and cache.free_pages == free  # shared
    main_pages = list(main.pages)
    snapshot = [t[main_pages].clone() for t in (cache.k[0], cache.v[0])]
    kb, vb = write(cache, backend, 1, "b", 3, seed=1)  # positions 6..8
    assert main.pages == main_pages and main.length == 6
    assert b.pages[0] == main.pages[0], "the full first page stays shared"
    assert b.pages[1] != main.pages[1], "the shared partial page must be copied before writing"
    assert cache.free_pages == free - 2  # the copy and one page for position 8
    assert torch.equal(cache.k[0][main_pages], snapshot[0])  # every slot, used or not
    assert torch.equal(cache.v[0][main_pages], snapshot[1])
    k, v = gather(cache, 1, "b")
    assert torch.equal(k, torch.cat([k0, kb])) and torch.equal(v, torch.cat([v0, vb]))

    cache.drop(1, "b")
    assert cache.free_pages == free  # the fork's own pages are back, the shared one is not
    assert torch.equal(gather(cache, 1)[0], k0)

    # The source writing after a fork copies too; the fork keeps reading the old prefix.
    cache.fork(1, "main", "c")
    km, _ = write(cache, backend, 1, "main", 1, seed=2)
    assert torch.equal(gather(cache, 1, "c")[0], k0)
    assert torch.equal(gather(cache, 1)[0], torch.cat([k0, km]))
    cache.drop(1, "main")  # c still holds the prefix pages
    assert torch.equal(gather(cache, 1, "c")[0], k0)

    # A fork at a page boundary needs no copy.
    write(cache, backend, 2, "main", 4, seed=3)
    cache.fork(1, "c", "unused")
    cache.fork(2, "main", "d")
    free = cache.free_pages
    write(cache, backend, 2, "d", 1, seed=4)
    assert cache.free_pages == free - 1
    cache.release(1)
    cache.release(2)
    assert cache.free_pages == cache.num_pages and cache.live_sequences == 0


def test_reservations_hold_pages_back_and_refusal_returns_none():
    cache = make_cache(page_size=4, num_pages=8)
    a = cache.admit(1, "main", 4, reserve=24)  # 6 pages promised, 1 taken
    assert a is not None and len(a.pages) == 1 and cache.free_pages == 7
    assert cache.admit(2, "main", 4, reserve=12) is None  # 3 pages do not fit beside 5 promised
    assert cache.live_sequences == 1 and cache.free_pages == 7  # a refusal leaves nothing behind
    b = cache.admit(2, "main", 4, reserve=8)
    assert b is not None and cache.free_pages == 6
    assert cache.admit(3, "main", 1) is None  # even one page is promised to someone
    cache.commit(1, "main", 4)
    for _ in range(20):  # the reserved sequence can always grow to its reservation
        assert cache.admit(1, "main", 1) is not None
        cache.commit(1, "main", 1)
    assert len(a.pages) == 6 and cache.free_pages == 1
    cache.commit(2, "main", 4)
    assert cache.admit(2, "main", 4) is not None and cache.free_pages == 0
    cache.release(1)
    cache.release(2)
    assert cache.free_pages == cache.num_pages and cache.live_sequences == 0


def test_a_sequence_that_can_never_fit_raises_out_of_pages_naming_num_pages():
    cache = make_cache(page_size=4, num_pages=8)
    with pytest.raises(OutOfPages, match="num_pages"):
        cache.admit(3, "main", 33)
    with pytest.raises(OutOfPages, match="num_pages"):
        cache.admit(3, "main", 4, reserve=40)
    assert cache.live_sequences == 0 and cache.free_pages == 8
    assert cache.admit(3, "main", 32) is not None  # exactly the capacity fits


# ---- attention against a dense reference -------------------------------------------------------

MASKS = [(Causal(), ("causal",)), (PrefixBidirectional(6), ("prefix", 6)),
         (BlockCausal(3), ("block", 3, 0)), (BlockCausal(4, start=2), ("block", 4, 2)),
         (PrefixBidirectional(2), ("prefix", 2)), (BlockCausal(5, start=9), ("block", 5, 9))]


@pytest.mark.parametrize("page_size", [3, 4])
@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (2, 2)])
def test_torch_attention_matches_dense_reference(page_size, heads, kv_heads):
    cache = PagedKVCache(KVLayout(2, kv_heads, 8), page_size, 64)
    run = DenseHistory(cache, heads, seed=page_size * 10 + heads)
    rng = random.Random(page_size)
    # Build prefixes in interleaved causal chunks, so block tables are scattered over the cache.
    todo = {0: 0, 1: 5, 2: 7, 3: 12, 4: 3}
    while any(todo.values()):
        specs = []
        for sid, left in todo.items():
            if left:
                n = min(left, rng.randint(1, 4))
                todo[sid] -= n
                specs.append((sid, n, MASKS[0], True))
        run.step(specs)
    run.check_pages()
    assert len({p for s in range(1, 5) for p in cache.sequence(s, "main").pages}) == sum(
        len(cache.sequence(s, "main").pages) for s in range(1, 5))  # no page shared by accident

    news = [4, 1, 6, 3, 8]
    for shift in range(len(MASKS)):  # every mask on every sequence, mixed within each step
        masks = [MASKS[(i + shift) % len(MASKS)] for i in range(5)]
        # A read that does not persist: the cache is untouched, bit for bit, lengths too.
        before = [t.clone() for t in cache.k + cache.v]
        lengths = [cache.sequence(s, "main").length if cache.sequence(s, "main") else 0
                   for s in range(5)]
        run.step([(s, news[s], masks[s], False) for s in range(5)], scale=0.3 if shift else None)
        assert all(torch.equal(a, b) for a, b in zip(before, cache.k + cache.v))
        assert lengths == [cache.sequence(s, "main").length if cache.sequence(s, "main") else 0
                           for s in range(5)]
    # Then persisting and non-persisting sequences side by side; later reads see only what
    # was persisted.
    for shift in range(3):
        run.step([(s, news[(s + shift) % 5], MASKS[(s + shift) % len(MASKS)], (s + shift) % 2 == 0)
                  for s in range(5)])
        run.check_pages()


def test_a_cache_too_large_to_allocate_names_its_size_and_the_settings():
    from mstar_rt.engines.paged_kv import KVLayout, PagedKVCache

    # DefaultCPUAllocator's RuntimeError ("can't allocate 51200000000000 bytes") named nothing
    with pytest.raises(ValueError, match=r"100000000000 pages of 16 tokens need .* GiB on cpu.*"
                                         r"lower kv_cache.num_pages or page_size"):
        PagedKVCache(KVLayout(2, 2, 8), page_size=16, num_pages=100_000_000_000)

"""Section 1 of benchmarks/gpu_check.py: random paged caches, steps mixing prefill, decode,
appends, non-persisted works, a fork reading shared pages, and the Causal / PrefixBidirectional /
BlockCausal masks; the torch and FlashInfer backends each against a float32 torch reference (max
abs diff), and the pages each wrote (must be identical)."""

from __future__ import annotations

from typing import Any, Callable

import torch

import gpu_check_common as common
from gpu_check_common import DTYPE, Report, sync


# ---- 1. attention: FlashInfer and torch vs a float32 reference --------------------------------

def scenarios(quick: bool) -> dict[str, list]:
    from mstar_rt.engines.masks import CAUSAL, BlockCausal, PrefixBidirectional

    g = torch.Generator().manual_seed(0)

    def rand(lo: int, hi: int) -> int:
        return int(torch.randint(lo, hi, (1,), generator=g))

    decode = [(rand(1, 2000), 1, True, CAUSAL) for _ in range(8 if quick else 32)]
    out = {
        "decode": decode,
        "prefill": [(0, 512, True, CAUSAL), (0, 77, True, CAUSAL), (0, 1, True, CAUSAL)],
        "append": [(300, 64, True, CAUSAL), (1000, 17, True, CAUSAL), (5, 200, True, CAUSAL)],
        "mixed": decode[:12] + [(0, 333, True, CAUSAL), (40, 90, True, CAUSAL)],
        "prefix_bidirectional": [(0, 300, True, PrefixBidirectional(256)),
                                 (0, 100, True, PrefixBidirectional(40)),
                                 (20, 50, True, PrefixBidirectional(45))] + decode[:4],
        "block_causal": [(0, 256, True, BlockCausal(64)),
                         (128, 128, True, BlockCausal(32, start=128)),
                         (7, 1, True, BlockCausal(16))] + decode[:4],
        "non_persisted": [(700, 50, False, BlockCausal(10, start=700)), (300, 1, False, CAUSAL),
                          (0, 20, False, CAUSAL), (64, 64, True, CAUSAL)] + decode[:4],
    }
    if quick:
        for name in ("append", "prefix_bidirectional"):
            del out[name]
    return out


def build_step(layout: Any, spec: list, page_size: int, fork: bool = False):
    from mstar_rt.engines.attention_base import SeqStep
    from mstar_rt.engines.masks import CAUSAL
    from mstar_rt.engines.paged_kv import PagedKVCache

    tokens = sum(c + n for c, n, _p, _m in spec) + 64
    cache = PagedKVCache(layout, page_size, num_pages=tokens // page_size + 2 * len(spec) + 8)
    for t in cache.k + cache.v:
        t.normal_()
    steps = []
    for r, (cached, new, persist, mask) in enumerate(spec):
        if cached:
            cache.admit(r, "main", cached)
            cache.commit(r, "main", cached)
        if fork and r == 0:
            cache.fork(r, "main", "branch")
        seq = cache.admit(r, "main", new) if persist else cache.sequence(r, "main")
        steps.append(SeqStep(cached, new, list(seq.pages) if seq else [], persist, mask))
    if fork:
        b = cache.sequence(0, "branch")
        steps.append(SeqStep(b.length, 3, list(b.pages), False, CAUSAL))
    return cache, steps


def attention_check(report: Report, use_fi: bool) -> None:
    from mstar_rt.engines.masks import CAUSAL
    from mstar_rt.engines.paged_kv import KVLayout, PagedKVCache
    from mstar_rt.engines.torch_backend import TorchAttention

    hq, hkv, d, ps = 32, 8, 64, 16
    specs = scenarios(report.args.quick)
    specs["fork"] = [(37, 1, True, CAUSAL), (100, 5, True, CAUSAL)]
    rows = []
    for name, spec in specs.items():
        if report.left() < 60:
            report.note(f"attention scenario '{name}' skipped: budget")
            continue
        layout = KVLayout(1, hkv, d, DTYPE, common.DEVICE)
        cache, steps = build_step(layout, spec, ps, fork=name == "fork")
        ref_cache = PagedKVCache(KVLayout(1, hkv, d, torch.float32, common.DEVICE), ps,
                                 cache.num_pages)
        n = sum(s.new for s in steps)
        g = torch.Generator(device=common.DEVICE).manual_seed(1)
        q = torch.randn(n, hq, d, generator=g, device=common.DEVICE)
        k, v = (torch.randn(n, hkv, d, generator=g, device=common.DEVICE) for _ in range(2))
        before = [cache.k[0].clone(), cache.v[0].clone()]
        ref_cache.k[0].copy_(before[0])
        ref_cache.v[0].copy_(before[1])
        ref = TorchAttention(ref_cache)
        expect = ref.attend(0, q, k, v, ref.plan(steps))
        row = {"scenario": name, "tokens": n, "works": len(steps)}
        backends: list[tuple[str, Callable]] = [("torch", TorchAttention)]
        if use_fi:
            from mstar_rt.engines.flashinfer_backend import FlashInferAttention
            backends.append(("flashinfer", FlashInferAttention))
        pages = {}
        for bname, make in backends:
            cache.k[0].copy_(before[0])
            cache.v[0].copy_(before[1])
            be = make(cache)
            qb, kb, vb = (t.to(DTYPE) for t in (q, k, v))
            got = be.attend(0, qb, kb, vb, be.plan(steps))
            sync()
            row[bname] = (got.float() - expect).abs().max().item()
            pages[bname] = (cache.k[0].clone(), cache.v[0].clone())
        if "flashinfer" in pages:
            same = all(torch.equal(a, b) for a, b in zip(pages["torch"], pages["flashinfer"]))
            report.check(f"attention_{name}_pages_written_identically", 0.0 if same else 1.0, 0.0)
            # bf16 inputs: allow FlashInfer twice the torch backend's error, at least 2e-2.
            report.check(f"attention_{name}_flashinfer_maxdiff", row["flashinfer"],
                         max(2 * row["torch"], 2e-2))
            report.data["figures"][f"attn_maxdiff_{name}_flashinfer"] = round(row["flashinfer"], 5)
        report.data["figures"][f"attn_maxdiff_{name}_torch"] = round(row["torch"], 5)
        rows.append(row)
        report.write()
    print("\nattention max |diff| vs float32 torch reference (bf16 inputs)")
    print(f"{'scenario':24s} {'tokens':>7s} {'works':>6s} {'torch':>10s} {'flashinfer':>11s}")
    for r in rows:
        fi = f"{r['flashinfer']:.2e}" if "flashinfer" in r else "-"
        print(f"{r['scenario']:24s} {r['tokens']:7d} {r['works']:6d} {r['torch']:10.2e} {fi:>11s}")
    print()

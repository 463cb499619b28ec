"""The CUDA path of the engines layer: FlashInfer attention and bucketed (CUDA-graph) decode.

On the CPU: the static bucketed decode plan against the dynamic path (hidden, logits, the pages
it writes, the cache's bookkeeping), end-to-end greedy decoding with ``cuda_graphs=True``, the
FlashInfer backend's plan logic against a stand-in module that follows FlashInfer's documented
wrapper semantics, and the errors for FlashInfer on CPU / float32 / without the package. On a
CUDA machine also the real FlashInfer kernels and captured graphs against the torch backend.
"""

from __future__ import annotations

import math
import sys
import types
from typing import Any, Optional

import pytest
import torch

from mstar_rt import Runtime
from mstar_rt.engines import KVCacheEngine, SamplingParams
from mstar_rt.engines import flashinfer_backend as fib
from mstar_rt.engines.attention import select_backend
from mstar_rt.engines.attention_base import SeqStep
from mstar_rt.engines.cuda_graphs import DecodeGraphs
from mstar_rt.engines.kv_engine import KVStep
from mstar_rt.engines.masks import CAUSAL, BlockCausal, PrefixBidirectional
from mstar_rt.engines.paged_kv import KVLayout, PagedKVCache
from mstar_rt.engines.torch_backend import TorchAttention
from mstar_rt.models.causal_lm import CausalLM
from mstar_rt.models.llama import LlamaConfig, LlamaForCausalLM

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
T = 60.0  # seconds: the longest a request may take


def has_flashinfer() -> bool:
    try:
        import flashinfer  # noqa: F401
        return True
    except ImportError:
        return False


def tiny_llama(device: str = "cpu", dtype: torch.dtype = torch.float32,
               head_dim: int = 16, seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=96, hidden_size=4 * head_dim, intermediate_size=96,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=head_dim, max_position_embeddings=64)
    m = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.2)  # sharp attention: a mis-read slot moves the logits visibly
    m = m.to(device=device, dtype=dtype)
    m.rotary.inv_freq = cfg.rope.inv_freq(head_dim).to(device)  # float32, as load_llama keeps it
    return m.eval()


def rel_diff(got: torch.Tensor, want: torch.Tensor) -> float:
    """Max abs difference over the reference's scale (bf16 logits of a sharp model run to ~10)."""
    want = want.float()
    return (got.float() - want).abs().max().item() / max(1.0, want.abs().max().item())


def snapshot(cache: PagedKVCache) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    return [k.clone() for k in cache.k], [v.clone() for v in cache.v]


def restore(cache: PagedKVCache, snap) -> None:
    for dst, src in zip(cache.k + cache.v, snap[0] + snap[1]):
        dst.copy_(src)


def bookkeeping(cache: PagedKVCache) -> tuple:
    return (list(cache._free), list(cache._refs),
            {k: (list(s.pages), s.length, s.reserve) for k, s in cache._seqs.items()})


# ---- the bucketed static decode path (CPU) -------------------------------------------------

def prefilled(model: LlamaForCausalLM, lens: list[int], page_size: int = 4):
    """A cache holding one prefilled sequence per length, and the next decode step's SeqSteps."""
    cache = PagedKVCache(model.kv_layout(), page_size=page_size, num_pages=96)
    for k in cache.k + cache.v:
        k.normal_()  # garbage in free slots: reading a wrong slot shows
    backend = TorchAttention(cache)
    g = torch.Generator().manual_seed(1)
    steps, ids = [], []
    for r, n in enumerate(lens):
        seq = cache.admit(r, "main", n, reserve=n + 8)
        steps.append(SeqStep(0, n, list(seq.pages)))
        ids.append(torch.randint(0, 96, (n,), generator=g))
    with torch.inference_mode():
        model(torch.cat(ids).to(cache.layout.device), KVStep(backend, backend.plan(steps)))
    decode = []
    for r, n in enumerate(lens):
        cache.commit(r, "main", n)
        seq = cache.admit(r, "main", 1)
        decode.append(SeqStep(seq.length, 1, list(seq.pages)))
    tokens = torch.randint(0, 96, (len(lens),), generator=g).to(cache.layout.device)
    return cache, backend, decode, tokens


def dynamic_decode(model, backend, steps, tokens):
    with torch.inference_mode():
        plan = backend.plan(steps)
        hidden = model(tokens, KVStep(backend, plan))
        return hidden, model.logits(hidden[plan.last_token])


@pytest.mark.parametrize("lens", [[5], [5, 9, 3], [5, 9, 3, 12, 7], [4, 8, 1, 2, 16, 11]])
def test_static_bucketed_decode_matches_dynamic(lens):
    model = tiny_llama()
    cache, backend, steps, tokens = prefilled(model, lens)
    before, books = snapshot(cache), bookkeeping(cache)
    hidden, logits = dynamic_decode(model, backend, steps, tokens)
    dyn_cache = snapshot(cache)
    restore(cache, before)
    graphs = DecodeGraphs(model, cache, buckets=(1, 2, 4, 8), max_seq_len=64)
    assert graphs.bucket_for(steps) == next(b for b in (1, 2, 4, 8) if b >= len(lens))
    out = graphs.run(tokens, steps)
    assert out is not None and graphs.runs == 1 and graphs.captures == 0
    assert (out.hidden - hidden).abs().max().item() < 1e-5
    assert (out.logits - logits).abs().max().item() < 1e-5
    # Pages: the static step wrote exactly what the dynamic step wrote (one slot per real row);
    # padding rows changed nothing, and no page was taken or freed.
    ps = cache.page_size
    written = {s.pages[s.cached // ps] * ps + s.cached % ps for s in steps}
    for now, dyn, old in zip(cache.k + cache.v, dyn_cache[0] + dyn_cache[1],
                             before[0] + before[1]):
        assert (now - dyn).abs().max().item() < 1e-5
        changed = (now.view(-1, *now.shape[2:]) != old.view(-1, *old.shape[2:]))
        assert set(changed.flatten(1).any(1).nonzero().flatten().tolist()) <= written
    assert bookkeeping(cache) == books


def test_static_path_declines_what_it_does_not_serve():
    model = tiny_llama()
    cache, _backend, steps, tokens = prefilled(model, [5, 9, 3])
    graphs = DecodeGraphs(model, cache, buckets=(1, 2), max_seq_len=9)
    s = steps[0]
    assert graphs.bucket_for([steps[0], steps[2]]) == 2
    assert graphs.bucket_for(steps) is None                                   # beyond the buckets
    assert graphs.bucket_for([SeqStep(s.cached, 2, s.pages)]) is None         # two new tokens
    assert graphs.bucket_for([SeqStep(s.cached, 1, s.pages, persist=False)]) is None
    assert graphs.bucket_for([steps[1]]) is None                              # 10 keys > 9
    assert graphs.bucket_for([SeqStep(s.cached, 1, s.pages, mask=BlockCausal(4))]) == 1
    assert graphs.run(tokens, steps) is None and graphs.runs == 0
    with pytest.raises(ValueError, match="buckets"):
        DecodeGraphs(model, cache, buckets=())
    if not CUDA:
        with pytest.raises(ValueError, match="CUDA"):
            DecodeGraphs(model, cache, capture=True)


def generate(model, cuda_graphs, prompts, max_tokens=12, **kw):
    lm = CausalLM(model, engine=KVCacheEngine(page_size=4, num_pages=128, **kw),
                  max_batch=8, emit_logits=True, cuda_graphs=cuda_graphs)
    with Runtime(lm) as rt:
        hs = [rt.submit({"prompt": p, "params": SamplingParams(max_tokens=max_tokens)})
              for p in prompts]
        res = [h.result(timeout=T) for h in hs]
        cache = rt.engines["lm"].cache
        assert cache.free_pages == cache.num_pages and cache.live_sequences == 0
    return res, lm.lm._graphs


def test_causal_lm_with_cuda_graphs_flag_decodes_like_the_dynamic_path():
    model = tiny_llama()
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 96, (n,), generator=g).tolist() for n in (5, 9, 13, 3, 7)]
    plain, _ = generate(model, False, prompts)
    static, graphs = generate(model, True, prompts)
    assert graphs is not None and graphs.runs > 0
    for a, b in zip(plain, static):
        assert a["token"] == b["token"]
        assert max((x - y).abs().max().item() for x, y in zip(a["logits"], b["logits"])) < 1e-4


def test_compile_flag_runs_the_static_path():
    # Dynamo traces the whole static step (writes into the pages included); the "eager"
    # compile backend keeps that under a few seconds on a CPU.
    model = tiny_llama()
    cache, backend, steps, tokens = prefilled(model, [5, 9, 3])
    before = snapshot(cache)
    _, logits = dynamic_decode(model, backend, steps, tokens)
    restore(cache, before)
    out = DecodeGraphs(model, cache, buckets=(4,), max_seq_len=64, compile="eager").run(
        tokens, steps)
    assert out is not None and (out.logits - logits).abs().max().item() < 1e-5


@pytest.mark.skipif(not CUDA, reason="inductor compiles the tiny model's static decode step in "
                    "~70 s on a 2-core CPU (over this file's budget); checked on CUDA only")
def test_inductor_compile_of_static_decode_matches_eager():
    model = tiny_llama("cuda", torch.bfloat16, head_dim=64)
    cache, backend, steps, tokens = prefilled(model, [5, 9, 3])
    before = snapshot(cache)
    _, logits = dynamic_decode(model, backend, steps, tokens)
    restore(cache, before)
    out = DecodeGraphs(model, cache, buckets=(4,), max_seq_len=64, compile=True).run(
        tokens, steps)
    assert out is not None and rel_diff(out.logits, logits) < 2e-2


# ---- FlashInfer: clear errors --------------------------------------------------------------

class _Stub:
    """Just the layout FlashInferAttention reads before it allocates anything."""

    def __init__(self, dtype: torch.dtype, device: str) -> None:
        self.layout = KVLayout(2, 2, 64, dtype, device)
        self.page_size = 16


def test_flashinfer_refuses_cpu_and_float32_clearly():
    cache = PagedKVCache(KVLayout(1, 2, 16), page_size=4, num_pages=4)
    with pytest.raises(ValueError, match="does not run on cpu"):
        fib.FlashInferAttention(cache)
    with pytest.raises(ValueError, match="does not run on cpu"):
        select_backend("flashinfer", cache)
    with pytest.raises(ValueError, match="cannot run float32 on cuda.*float16, bfloat16"):
        fib.FlashInferAttention(_Stub(torch.float32, "cuda"))


def test_missing_flashinfer_names_the_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "flashinfer", None)  # import flashinfer -> ImportError
    with pytest.raises(ImportError, match=r"pip install 'mstar_rt\[cuda\]'.*flashinfer-python"):
        fib.FlashInferAttention(_Stub(torch.bfloat16, "cuda"))


# ---- FlashInfer's plan logic against a stand-in with the documented semantics -----------------

def _attend(q, k, v, allowed, scale):
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k.float()) * scale
    scores = scores.masked_fill(~allowed[None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v.float()).to(q.dtype)


class _FakeWrapper:
    """Paged/ragged wrappers as the FlashInfer docs describe them: int32 indptrs, NHD pages,
    ``1 <= last_page_len <= page_size``, causal aligned to the last keys, custom masks flattened
    ``[qo_len, kv_len]`` per request; in cuda-graph mode plan() copies into the user's buffers
    and run() reads them (what a replay sees)."""

    def __init__(self, workspace, kv_layout="NHD", use_cuda_graph=False, use_tensor_cores=False,
                 paged_kv_indptr_buffer=None, paged_kv_indices_buffer=None,
                 paged_kv_last_page_len_buffer=None):
        assert kv_layout == "NHD" and workspace.dtype == torch.uint8
        self.graph, self.tensor_cores = use_cuda_graph, use_tensor_cores
        self.bufs = (paged_kv_indptr_buffer, paged_kv_indices_buffer,
                     paged_kv_last_page_len_buffer)
        if use_cuda_graph:
            assert all(torch.is_tensor(b) for b in self.bufs)
            assert len(self.bufs[0]) == len(self.bufs[2]) + 1

    def _plan(self, qo, kv_indptr, indices, last, hq, hkv, d, ps, mask, causal, sm_scale,
              q_data_type):
        for t in (qo, kv_indptr) + ((indices, last) if indices is not None else ()):
            assert t.dtype == torch.int32
        qo_len, kv_len = (qo[1:] - qo[:-1]).tolist(), (kv_indptr[1:] - kv_indptr[:-1]).tolist()
        if indices is not None:
            assert len(indices) == kv_indptr[-1] and ((last >= 1) & (last <= ps)).all()
            kv_len = [(n - 1) * ps + int(lp) for n, lp in zip(kv_len, last.tolist())]
        if mask is not None:
            assert mask.dtype == torch.bool and mask.numel() == sum(
                a * b for a, b in zip(qo_len, kv_len))
        if self.graph:
            assert len(last) == len(self.bufs[2]), "cuda-graph wrappers keep their batch size"
            self.bufs[0].copy_(kv_indptr)
            self.bufs[1][: len(indices)].copy_(indices)
            self.bufs[2].copy_(last)
        self.p = dict(qo=qo.cpu(), kv_indptr=kv_indptr.cpu(), ps=ps, mask=mask, causal=causal,
                      scale=sm_scale or 1 / math.sqrt(d), dtype=q_data_type, hq=hq, hkv=hkv,
                      indices=None if indices is None else indices.cpu(),
                      last=None if last is None else last.cpu())

    def _run(self, q, keys_of):
        p = self.p
        assert q.dtype == p["dtype"] and q.shape[1] == p["hq"]
        if self.graph:
            p = {**p, "kv_indptr": self.bufs[0].cpu(), "indices": self.bufs[1].cpu(),
                 "last": self.bufs[2].cpu()}
        qo = p["qo"].tolist()
        assert q.shape[0] == qo[-1]
        outs, moff = [], 0
        for i in range(len(qo) - 1):
            k, v = keys_of(p, i)
            nq, nk = qo[i + 1] - qo[i], k.shape[0]
            if p["mask"] is not None:
                allowed = p["mask"][moff: moff + nq * nk].view(nq, nk).cpu()
                moff += nq * nk
            elif p["causal"]:
                allowed = torch.arange(nk)[None, :] <= (nk - nq + torch.arange(nq))[:, None]
            else:
                allowed = torch.ones(nq, nk, dtype=torch.bool)
            outs.append(_attend(q[qo[i]: qo[i + 1]], k, v, allowed.to(q.device), p["scale"]))
        return torch.cat(outs)

    @staticmethod
    def _paged_keys(kv):
        kc, vc = kv

        def keys(p, i):
            a, b = p["kv_indptr"][i].item(), p["kv_indptr"][i + 1].item()
            pages = p["indices"][a:b].long().to(kc.device)
            n = (b - a - 1) * p["ps"] + int(p["last"][i])
            return (kc[pages].flatten(0, 1)[:n], vc[pages].flatten(0, 1)[:n])
        return keys


class _FakeDecode(_FakeWrapper):
    def plan(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim,
             page_size, *, q_data_type="float16", kv_data_type=None, sm_scale=None):
        # the CUDA-core decode kernels exist for some head groups only (DISPATCH_GQA_GROUP_SIZE)
        if not self.tensor_cores and num_qo_heads // num_kv_heads not in (1, 2, 3, 4, 8):
            raise RuntimeError(f"Unsupported group_size: {num_qo_heads // num_kv_heads}")
        qo = torch.arange(len(last_page_len) + 1, dtype=torch.int32)
        self._plan(qo, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim,
                   page_size, None, False, sm_scale, q_data_type)

    def run(self, q, paged_kv_cache):
        return self._run(q, self._paged_keys(paged_kv_cache))


class _FakePrefill(_FakeWrapper):
    """FlashInfer's prefill ``backend``: "auto" picks the kernels at the first plan for the
    wrapper's life, and on Hopper a plan without a custom mask picks FA3, which refuses custom
    masks (flashinfer/prefill.py, hopper/prefill_sm90.cuh)."""

    def __init__(self, workspace, kv_layout="NHD", backend="auto", **kwargs):
        super().__init__(workspace, kv_layout, **kwargs)
        self.backend = backend

    def _pick(self, custom_mask):
        if self.backend == "auto":
            self.backend = "fa2" if custom_mask is not None else "fa3"
        if self.backend == "fa3" and custom_mask is not None:
            raise RuntimeError("FA3 prefill does not support custom masks")


class _FakePagedPrefill(_FakePrefill):
    def plan(self, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len,
             num_qo_heads, num_kv_heads, head_dim_qk, page_size, head_dim_vo=None,
             custom_mask=None, causal=False, sm_scale=None, q_data_type="float16",
             kv_data_type=None):
        self._pick(custom_mask)
        self._plan(qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len,
                   num_qo_heads, num_kv_heads, head_dim_qk, page_size, custom_mask, causal,
                   sm_scale, q_data_type)

    def run(self, q, paged_kv_cache):
        return self._run(q, self._paged_keys(paged_kv_cache))


class _FakeRagged(_FakePrefill):
    def plan(self, qo_indptr, kv_indptr, num_qo_heads, num_kv_heads, head_dim_qk,
             head_dim_vo=None, custom_mask=None, causal=False, sm_scale=None,
             q_data_type="float16", kv_data_type=None):
        self._pick(custom_mask)
        self._plan(qo_indptr, kv_indptr, None, None, num_qo_heads, num_kv_heads, head_dim_qk,
                   0, custom_mask, causal, sm_scale, q_data_type)

    def run(self, q, k, v):
        def keys(p, i):
            a, b = p["kv_indptr"][i].item(), p["kv_indptr"][i + 1].item()
            return k[a:b], v[a:b]
        return self._run(q, keys)


@pytest.fixture
def fake_flashinfer(monkeypatch):
    mod = types.ModuleType("flashinfer")
    mod.BatchDecodeWithPagedKVCacheWrapper = _FakeDecode
    mod.BatchPrefillWithPagedKVCacheWrapper = _FakePagedPrefill
    mod.BatchPrefillWithRaggedKVCacheWrapper = _FakeRagged
    monkeypatch.setitem(sys.modules, "flashinfer", mod)
    monkeypatch.setattr(fib, "check_dtype", lambda *a: None)  # the stand-in runs on the CPU
    return mod


# (cached, new, persist, mask) per sequence of a step
SCENARIOS = {
    "decode": [(7, 1, True, CAUSAL), (16, 1, True, CAUSAL), (1, 1, True, BlockCausal(3))],
    "prefill": [(0, 9, True, CAUSAL), (0, 4, True, CAUSAL)],
    "mixed": [(0, 6, True, CAUSAL), (11, 1, True, CAUSAL), (5, 3, True, CAUSAL)],
    "masks": [(0, 10, True, PrefixBidirectional(6)), (3, 8, True, BlockCausal(4, start=2)),
              (9, 1, True, CAUSAL)],
    "transient": [(6, 5, False, BlockCausal(5, start=6)), (10, 1, True, CAUSAL),
                  (0, 3, False, CAUSAL), (13, 2, False, CAUSAL)],
}


def build_step(layout: KVLayout, spec, page_size: int = 4, fork: bool = False):
    """A cache with random contents, sequences holding ``cached`` tokens, and the step's
    SeqSteps (admitted like the engine does). ``fork`` adds a branch forked from sequence 0 that
    reads its (shared, partly filled) pages in the same step that sequence 0 appends."""
    cache = PagedKVCache(layout, page_size=page_size, num_pages=64)
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
        pages = list(seq.pages) if seq is not None else []
        steps.append(SeqStep(cached, new, pages, persist, mask))
    if fork:
        b = cache.sequence(0, "branch")
        steps.append(SeqStep(b.length, 2, list(b.pages), False, CAUSAL))
    return cache, steps


def compare_backends(cache, steps, make_other, atol, heads=4):
    layout = cache.layout
    n = sum(s.new for s in steps)
    g = torch.Generator(device=layout.device).manual_seed(7)
    q = torch.randn(n, heads, layout.head_dim, generator=g, device=layout.device).to(layout.dtype)
    k, v = (torch.randn(n, layout.num_kv_heads, layout.head_dim, generator=g,
                        device=layout.device).to(layout.dtype) for _ in range(2))
    before = snapshot(cache)
    results = []
    for backend in (TorchAttention(cache), make_other(cache)):
        restore(cache, before)
        plan = backend.plan(steps)
        outs = [backend.attend(layer, q, k, v, plan) for layer in range(layout.num_layers)]
        results.append((outs, snapshot(cache)))
    (ref, ref_cache), (got, got_cache) = results
    for a, b in zip(ref, got):
        assert (a.float() - b.float()).abs().max().item() < atol
    for a, b in zip(ref_cache[0] + ref_cache[1], got_cache[0] + got_cache[1]):
        assert torch.equal(a, b)  # the same slots written with the same values


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_flashinfer_plan_logic_matches_torch(fake_flashinfer, name):
    cache, steps = build_step(KVLayout(2, 2, 16), SCENARIOS[name])
    compare_backends(cache, steps, lambda c: fib.FlashInferAttention(c, workspace_bytes=256),
                     1e-5)


def test_flashinfer_prefill_keeps_custom_masks_after_a_causal_first_plan(fake_flashinfer):
    """A wrapper's first plan fixes its kernels: with backend "auto" a causal first plan would
    take FA3 on Hopper, and a masked step after it (a VLA prefix, a flow step) would fail."""
    cache, steps = build_step(KVLayout(2, 2, 16), [(0, 5, True, CAUSAL)] + SCENARIOS["masks"])
    fi = fib.FlashInferAttention(cache, workspace_bytes=256)
    assert fi._paged.backend == fi._ragged.backend == "fa2"
    q = torch.randn(5, 4, 16)
    before = snapshot(cache)
    fi.attend(0, q, q[:, :2], q[:, :2], fi.plan(steps[:1]))  # the causal step first
    restore(cache, before)
    compare_backends(cache, steps[1:], lambda c: fi, 1e-5)


@pytest.mark.parametrize("heads", [7, 16])
def test_flashinfer_decode_of_head_groups_without_cuda_core_kernels(fake_flashinfer, heads):
    """Qwen2.5's 7 query heads per KV head, or 16: the tensor-core decode kernels."""
    cache, steps = build_step(KVLayout(2, 1, 16), SCENARIOS["decode"])
    compare_backends(cache, steps, lambda c: fib.FlashInferAttention(c, workspace_bytes=256),
                     1e-5, heads=heads)
    assert fib.tensor_cores(heads, 1) and not fib.tensor_cores(32, 8)


def test_flashinfer_plan_logic_with_a_fork_reading_shared_pages(fake_flashinfer):
    cache, steps = build_step(KVLayout(2, 2, 16), [(6, 1, True, CAUSAL), (3, 2, True, CAUSAL)],
                              fork=True)
    compare_backends(cache, steps, lambda c: fib.FlashInferAttention(c, workspace_bytes=256),
                     1e-5)


def test_flashinfer_static_decode_matches_dynamic(fake_flashinfer):
    model = tiny_llama()
    cache, backend, steps, tokens = prefilled(model, [5, 9, 3])
    before, books = snapshot(cache), bookkeeping(cache)
    _, logits = dynamic_decode(model, backend, steps, tokens)
    restore(cache, before)
    fi = fib.FlashInferAttention(cache, workspace_bytes=256)
    graphs = DecodeGraphs.for_backend(model, fi, 64, buckets=(1, 4))
    out = graphs.run(tokens, steps)
    assert out is not None and (out.logits - logits).abs().max().item() < 1e-5
    # and again, one row fewer, through the same (re-planned) bucket
    restore(cache, before)
    _, logits = dynamic_decode(model, backend, steps[:2], tokens[:2])
    restore(cache, before)
    out = graphs.run(tokens[:2], steps[:2])
    assert out is not None and (out.logits - logits).abs().max().item() < 1e-5
    assert bookkeeping(cache) == books


@pytest.mark.parametrize("cuda_graphs", [False, True])
def test_flashinfer_backend_serves_causal_lm_like_torch(fake_flashinfer, cuda_graphs):
    model = tiny_llama()
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 96, (n,), generator=g).tolist() for n in (6, 11, 2, 9)]
    plain, _ = generate(model, False, prompts, attention_backend="torch")
    served, graphs = generate(model, cuda_graphs, prompts, attention_backend="flashinfer")
    assert (graphs is not None and graphs.runs > 0) == cuda_graphs
    for a, b in zip(plain, served):
        assert a["token"] == b["token"]
        assert max((x - y).abs().max().item() for x, y in zip(a["logits"], b["logits"])) < 1e-4


# ---- on a CUDA machine: the real kernels and captured graphs -------------------------------------

needs_flashinfer = pytest.mark.skipif(not (CUDA and has_flashinfer()),
                                      reason="needs a CUDA GPU and flashinfer-python")


@needs_flashinfer
@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_flashinfer_kernels_match_torch_on_cuda(name):
    cache, steps = build_step(KVLayout(2, 2, 64, torch.bfloat16, "cuda"), SCENARIOS[name],
                              page_size=16)
    compare_backends(cache, steps, fib.FlashInferAttention, 3e-2)


@needs_cuda
@pytest.mark.parametrize("backend_name", ["torch", "flashinfer"])
def test_cuda_graph_decode_matches_eager_on_cuda(backend_name):
    if backend_name == "flashinfer" and not has_flashinfer():
        pytest.skip("needs flashinfer-python")
    model = tiny_llama("cuda", torch.bfloat16, head_dim=64)
    cache, torch_backend, steps, tokens = prefilled(model, [5, 9, 3, 17, 2], page_size=16)
    backend = select_backend(backend_name, cache)
    before = snapshot(cache)
    graphs = DecodeGraphs.for_backend(model, backend, 64, buckets=(2, 8))
    for n in (5, 2, 5):  # capture, replay another bucket, replay the first
        restore(cache, before)
        _, logits = dynamic_decode(model, backend, steps[:n], tokens[:n])
        restore(cache, before)
        out = graphs.run(tokens[:n], steps[:n])
        assert out is not None and rel_diff(out.logits, logits) < 2e-2
    assert graphs.captures == 2 and graphs.runs == 3

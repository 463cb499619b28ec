"""Helpers for the KV engine tests: an independent dense attention reference, a one-layer
attention node over random projections, a tiny random Llama, steps on a bare cache checked
against the reference, greedy decoding by full recompute, and a Conductor that dawdles.

The reference masks are written out from the rules in words (not from the mask classes), so a
bug in ``allowed`` or in the paged gather shows up as a numeric mismatch.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Mapping, Optional

import torch

from mstar_rt.engines.attention_base import SeqStep
from mstar_rt.engines.kv_engine import KVNodeSubmodule, KVStep, KVWork
from mstar_rt.engines.masks import CAUSAL
from mstar_rt.engines.paged_kv import KVLayout, PagedKVCache
from mstar_rt.engines.torch_backend import TorchAttention


# ---- dense reference -----------------------------------------------------------------------------

def ref_allowed(mask: tuple, q: int, k: int) -> bool:
    """``mask``: ("causal",), ("prefix", P) or ("block", B, start)."""
    kind = mask[0]
    if kind == "causal":
        return k <= q
    if kind == "prefix":
        return k <= q or k < mask[1]
    if kind == "block":
        block, start = mask[1], mask[2]
        if k <= q:
            return True
        return q >= start and k >= start and (k - start) // block <= (q - start) // block
    raise ValueError(kind)


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_start: int,
                    mask: tuple, scale: Optional[float] = None) -> torch.Tensor:
    """q ``[Tq, Hq, D]`` at positions ``q_start..``, k/v ``[Tk, Hkv, D]`` at positions
    ``0..Tk-1`` -> ``[Tq, Hq, D]`` (float64, then back to q's dtype). Query head h reads KV head
    ``h // (Hq / Hkv)``."""
    tq, hq, d = q.shape
    tk, hkv = k.shape[0], k.shape[1]
    group = hq // hkv
    allowed = torch.tensor([[ref_allowed(mask, q_start + i, j) for j in range(tk)]
                            for i in range(tq)], dtype=torch.bool)
    scale = d ** -0.5 if scale is None else scale
    out = torch.empty(tq, hq, d, dtype=torch.float64)
    for h in range(hq):
        kh, vh = k[:, h // group].double(), v[:, h // group].double()
        scores = (q[:, h].double() @ kh.T) * scale
        scores = scores.masked_fill(~allowed, float("-inf"))
        # by hand: float64 softmax is very slow on CPU in some torch builds
        e = (scores - scores.amax(-1, keepdim=True)).exp()
        out[:, h] = (e / e.sum(-1, keepdim=True)) @ vh
    return out.to(q.dtype)


def assert_close(got: torch.Tensor, want: torch.Tensor, tol: float = 1e-5, what: str = "") -> None:
    """Max abs difference within ``tol`` (relative to magnitudes above 1); shapes must match.
    (torch.testing.assert_close costs seconds on first use: it imports torch.distributed.)"""
    assert got.shape == want.shape, (what, got.shape, want.shape)
    err = ((got.double() - want.double()).abs() / want.double().abs().clamp(min=1)).max().item()
    assert err <= tol, f"{what}: max difference {err:.3g} > {tol}"


# ---- a one-layer attention node ------------------------------------------------------------------

class Proj:
    """Random projections of one attention layer: x ``[T, E]`` -> q, k, v, and back to E."""

    def __init__(self, embed: int = 16, heads: int = 4, kv_heads: int = 2, head_dim: int = 8,
                 seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.embed, self.heads, self.kv_heads, self.head_dim = embed, heads, kv_heads, head_dim
        s = embed ** -0.5
        self.wq = torch.randn(embed, heads * head_dim, generator=g) * s
        self.wk = torch.randn(embed, kv_heads * head_dim, generator=g) * s
        self.wv = torch.randn(embed, kv_heads * head_dim, generator=g) * s
        self.wo = torch.randn(heads * head_dim, embed, generator=g) * (heads * head_dim) ** -0.5

    def qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        t = x.shape[0]
        return ((x @ self.wq).view(t, self.heads, self.head_dim),
                (x @ self.wk).view(t, self.kv_heads, self.head_dim),
                (x @ self.wv).view(t, self.kv_heads, self.head_dim))

    def out(self, o: torch.Tensor) -> torch.Tensor:
        return o.reshape(o.shape[0], -1) @ self.wo

    def layout(self) -> KVLayout:
        return KVLayout(1, self.kv_heads, self.head_dim)


class ProjNode(KVNodeSubmodule):
    """Attends ``inputs[src]`` (``[N, E]``, or ``[iters, N, E]`` indexed by the loop iteration)
    over sequence ``label``; outputs ``dst`` = ``x + out`` (residual) or ``out``.

    ``mask(inputs) -> (mask object, reference tuple)``. ``probe(node, works)`` runs inside
    forward_kv after attention (K/V written, not yet committed). ``stop_loop`` stops that
    DynamicLoop once ``iteration + 1 >= inputs['steps']``. ``fail_if(inputs)`` makes forward_kv
    raise when any work's inputs match; ``hold`` (an Event) blocks a work whose inputs have
    ``hold`` true until it is set, with ``entered`` set on arrival.
    """

    max_batch = 16

    def __init__(self, proj: Proj, src: str, dst: str, label: str = "main",
                 fork_from: Optional[str] = None, persist: bool = True,
                 mask: Callable[[Mapping], tuple] = lambda inputs: (CAUSAL, ("causal",)),
                 residual: bool = False, stop_loop: Optional[str] = None,
                 fail_if: Optional[Callable[[Mapping], bool]] = None) -> None:
        self.proj, self.src, self.dst = proj, src, dst
        self.label, self.fork_from, self.persist = label, fork_from, persist
        self.mask, self.residual, self.stop_loop, self.fail_if = mask, residual, stop_loop, fail_if
        self.probe: Optional[Callable] = None
        self.calls: list[list[tuple[int, int]]] = []  # per forward_kv: (request, iteration)
        self.hold = threading.Event()
        self.entered = threading.Event()

    def kv_layout(self) -> KVLayout:
        return self.proj.layout()

    def prepare_inputs(self, ctx: Any, inputs: dict) -> KVWork:
        x = inputs[self.src]
        if x.dim() == 3:
            x = x[ctx.iteration]
        mask, _ref = self.mask(inputs)
        return KVWork(x.shape[0], self.label, self.persist, mask, self.fork_from,
                      payload=(x, ctx.request.id, ctx.iteration, inputs))

    def forward_kv(self, works: list[KVWork], step: KVStep) -> list[Mapping[str, Any]]:
        self.calls.append([(w.payload[1], w.payload[2]) for w in works])
        if any(w.payload[3].get("hold") for w in works):
            self.entered.set()
            if not self.hold.wait(10):
                raise TimeoutError("the test never released the held work")
        if self.fail_if is not None and any(self.fail_if(w.payload[3]) for w in works):
            raise RuntimeError("boom: the node refuses this request")
        x = torch.cat([w.payload[0] for w in works])
        q, k, v = self.proj.qkv(x)
        o = self.proj.out(step.attend(0, q, k, v))
        if self.probe is not None:
            self.probe(self, works)
        y = x + o if self.residual else o
        outs, start = [], 0
        for w in works:
            outs.append({self.dst: y[start:start + w.num_tokens].clone()})
            start += w.num_tokens
        return outs

    def check_stop(self, works: list[KVWork], outputs: list) -> list:
        if self.stop_loop is None:
            return [() for _ in works]
        return [(self.stop_loop,) if w.payload[2] + 1 >= int(w.payload[3]["steps"]) else ()
                for w in works]


# ---- a tiny random Llama -------------------------------------------------------------------------

def tiny_llama(vocab: int = 64, hidden: int = 32, layers: int = 2, heads: int = 4,
               kv_heads: int = 2, seed: int = 0, max_positions: int = 256) -> Any:
    from mstar_rt.models.llama import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 2,
                         num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=kv_heads, head_dim=hidden // heads,
                         max_position_embeddings=max_positions)
    torch.manual_seed(seed)
    module = LlamaForCausalLM(config)
    with torch.no_grad():  # RMSNorm weights start at one; spread the logits a little more
        for p in module.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.3)
    return module.eval()


# ---- running steps on a bare cache --------------------------------------------------------------

def gather(cache: PagedKVCache, request: int, label: str = "main", layer: int = 0):
    """The K and V a sequence's block table points at, positions 0..length-1."""
    seq = cache.sequence(request, label)
    hkv, d = cache.k[layer].shape[2:]
    k = cache.k[layer][seq.pages].reshape(-1, hkv, d)[: seq.length]
    v = cache.v[layer][seq.pages].reshape(-1, hkv, d)[: seq.length]
    return k, v


class DenseHistory:
    """Runs steps on a cache and checks each against the dense reference, remembering the K/V
    every sequence persisted."""

    def __init__(self, cache: PagedKVCache, heads: int, seed: int) -> None:
        self.cache, self.backend, self.heads = cache, TorchAttention(cache), heads
        self.layers = len(cache.k)
        self.g = torch.Generator().manual_seed(seed)
        self.k: dict = {}
        self.v: dict = {}

    def step(self, specs: list, scale=None) -> None:
        """``specs``: (sequence id, new tokens, (mask, reference mask), persist)."""
        cache = self.cache
        hkv, d = cache.k[0].shape[2:]
        steps = []
        for sid, n, (mask, _ref), persist in specs:
            seq = cache.admit(sid, "main", n) if persist else cache.sequence(sid, "main")
            steps.append(SeqStep(seq.length if seq else 0, n, list(seq.pages) if seq else [],
                                 persist, mask))
        plan = self.backend.plan(steps)
        total = sum(s[1] for s in specs)
        written = []
        for layer in range(self.layers):
            q = torch.randn(total, self.heads, d, generator=self.g)
            k = torch.randn(total, hkv, d, generator=self.g)
            v = torch.randn(total, hkv, d, generator=self.g)
            out = self.backend.attend(layer, q, k, v, plan, scale)
            assert out.shape == (total, self.heads, d)
            off = 0
            for (sid, n, (_m, ref), _p), st in zip(specs, steps):
                old_k = self.k.get((layer, sid), k[:0])
                old_v = self.v.get((layer, sid), v[:0])
                assert old_k.shape[0] == st.cached
                want = dense_attention(q[off:off + n], torch.cat([old_k, k[off:off + n]]),
                                       torch.cat([old_v, v[off:off + n]]), st.cached, ref, scale)
                assert_close(out[off:off + n], want, what=f"seq {sid} layer {layer} {ref}")
                off += n
            written.append((k, v))
        off = 0
        for sid, n, _m, persist in specs:
            if persist:
                cache.commit(sid, "main", n)
                for layer, (k, v) in enumerate(written):
                    key = (layer, sid)
                    self.k[key] = torch.cat([self.k.get(key, k[:0]), k[off:off + n]])
                    self.v[key] = torch.cat([self.v.get(key, v[:0]), v[off:off + n]])
            off += n

    def check_pages(self) -> None:
        for (layer, sid), k in self.k.items():
            got_k, got_v = gather(self.cache, sid, layer=layer)
            assert torch.equal(got_k, k) and torch.equal(got_v, self.v[(layer, sid)])


@torch.inference_mode()
def recompute_greedy(module, prompt: list[int], n: int) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy tokens by recomputing the whole sequence every token in a fresh cache: no decode
    path, no batching, no page reuse."""
    ids, logits = list(prompt), []
    for _ in range(n):
        cache = PagedKVCache(module.kv_layout(), 4, 64)
        backend = TorchAttention(cache)
        seq = cache.admit(0, "main", len(ids))
        step = KVStep(backend, backend.plan([SeqStep(0, len(ids), list(seq.pages))]))
        row = module.logits(module(torch.tensor(ids), step)[-1:])[0]
        logits.append(row)
        ids.append(int(row.argmax()))
    return ids[len(prompt):], logits


# ---- runtime races -------------------------------------------------------------------------------

class SlowSubmit:
    """The Conductor, but ``submit`` dawdles after queuing the request's first item, so the
    worker sees that item before ``Runtime.submit`` has registered the request's handle (what a
    busy machine does now and then)."""

    def __init__(self, real) -> None:
        self._real = real

    def __getattr__(self, name):
        return getattr(self._real, name)

    def submit(self, *args):
        out = self._real.submit(*args)
        time.sleep(0.2)
        return out

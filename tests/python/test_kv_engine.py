"""The KV engine layer through the Runtime: a non-LM KV model (labels, CFG-style forks,
non-persisting flow steps), continuous batching, back-pressure, leaks under cancellation, failure
isolation, and ``stack_pad``. The paged cache and attention over it: test_paged_kv.py.

Every numeric check compares against a float64 dense computation written out in kv_models.py;
every wait has a timeout.
"""

from __future__ import annotations

import random
import time

import pytest
import torch

from mstar_rt import (EMIT, DynamicLoop, GraphEdge, GraphNode, Loop, Model, Parallel,
                      RequestCancelled, RequestFailed, Sequential)
from mstar_rt.engines import KVCacheEngine, SamplingParams, stack_pad
from mstar_rt.engines.masks import BlockCausal, PrefixBidirectional
from mstar_rt.models.causal_lm import CausalLM

from kv_models import (Proj, ProjNode, SlowSubmit, assert_close, dense_attention,
                       recompute_greedy, tiny_llama)
from walk_models import ZERO_LIVE, settled, wait_until

TIMEOUT = 30.0


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conftest.py


# ---- a KV model beyond the LM: forks (CFG-style) and non-persisting flow steps -------------------

ITERS = 2  # appends per CFG branch


class CfgFlowModel(Model):
    """Walk ``context``: prefill a prompt on ``main`` (bidirectional prefix), then two branches in
    parallel, each forked from ``main`` and appended to twice. Walk ``flow``: residual steps of
    noise tokens that read ``main`` without persisting, ``steps`` times."""

    inputs = ("prompt", "cond_x", "uncond_x", "x", "steps")

    def __init__(self, proj: Proj, engine: KVCacheEngine) -> None:
        plen = lambda i: i["prompt"].shape[0]  # noqa: E731
        self.prefill = ProjNode(proj, "prompt", "h", mask=lambda i: (
            PrefixBidirectional(plen(i)), ("prefix", plen(i))))
        self.cond = ProjNode(proj, "cond_x", "cond_out", label="cond", fork_from="main")
        self.uncond = ProjNode(proj, "uncond_x", "uncond_out", label="uncond", fork_from="main")
        self.denoise = ProjNode(proj, "x", "x", persist=False, residual=True, stop_loop="flow",
                                mask=lambda i: (BlockCausal(i["x"].shape[0], start=plen(i)),
                                                ("block", i["x"].shape[0], plen(i))))
        self.nodes = [GraphNode("prefill", ["prompt"], [GraphEdge(EMIT, "h")]),
                      GraphNode("cond", ["cond_x", "prompt"], [GraphEdge(EMIT, "cond_out")]),
                      GraphNode("uncond", ["uncond_x", "prompt"], [GraphEdge(EMIT, "uncond_out")]),
                      GraphNode("denoise", ["x", "prompt", "steps"], ["x", GraphEdge(EMIT, "x")])]
        self.walks = {"context": Sequential("prefill", Parallel(Loop("cond", ITERS),
                                                                Loop("uncond", ITERS))),
                      "flow": DynamicLoop("denoise", 8, "flow")}
        self.submodules = {"prefill": self.prefill, "cond": self.cond, "uncond": self.uncond,
                           "denoise": self.denoise}
        self.engines = {n: "kv" for n in self.submodules}
        self.engine_specs = {"kv": engine}

    def next_walk(self, request, finished_walk, persisted):
        return "flow" if finished_walk == "context" else None


def cfg_flow_reference(proj: Proj, inputs: dict) -> dict:
    prompt = inputs["prompt"]
    plen = prompt.shape[0]
    q, k, v = proj.qkv(prompt)
    out = {"h": [proj.out(dense_attention(q, k, v, 0, ("prefix", plen)))]}
    for name in ("cond", "uncond"):
        keys, values, outs = k, v, []
        for it in range(ITERS):
            qi, ki, vi = proj.qkv(inputs[f"{name}_x"][it])
            start = keys.shape[0]
            keys, values = torch.cat([keys, ki]), torch.cat([values, vi])
            outs.append(proj.out(dense_attention(qi, keys, values, start, ("causal",))))
        out[f"{name}_out"] = outs
    x, xs = inputs["x"], []
    for _ in range(inputs["steps"]):
        qx, kx, vx = proj.qkv(x)
        o = dense_attention(qx, torch.cat([k, kx]), torch.cat([v, vx]), plen,
                            ("block", x.shape[0], plen))
        x = x + proj.out(o)
        xs.append(x)
    out["x"] = xs
    return out


def test_cfg_forks_and_flow_steps_through_the_runtime(serve):
    proj = Proj(seed=3)
    engine = KVCacheEngine(page_size=4, num_pages=64)
    model = CfgFlowModel(proj, engine)
    rt = serve(model)
    cache = engine.cache
    snapshots: dict = {}
    seen: list = []

    def probe(node, works):
        for w in works:
            rid, inputs = w.payload[1], w.payload[3]
            if node is model.prefill:  # written, not yet committed: remember main's pages
                pages = list(cache.sequence(rid, "main").pages)
                snapshots[rid] = (pages, cache.k[0][pages].clone(), cache.v[0][pages].clone())
            else:
                main = cache.sequence(rid, "main")
                pages, k, v = snapshots[rid]
                extra = {lab: cache.sequence(rid, lab).length for lab in ("cond", "uncond")
                         if node is model.denoise}
                seen.append((node is model.denoise, rid, main.length, inputs["prompt"].shape[0],
                             main.pages == pages and torch.equal(cache.k[0][pages], k)
                             and torch.equal(cache.v[0][pages], v), extra))

    for node in (model.prefill, model.cond, model.uncond, model.denoise):
        node.probe = probe
    g = torch.Generator().manual_seed(11)
    requests = []
    for plen, nc, nu, nx, steps in [(6, 3, 2, 4, 3), (5, 2, 3, 3, 2), (9, 1, 4, 5, 4),
                                    (8, 2, 2, 2, 1)]:
        inputs = dict(prompt=torch.randn(plen, proj.embed, generator=g),
                      cond_x=torch.randn(ITERS, nc, proj.embed, generator=g),
                      uncond_x=torch.randn(ITERS, nu, proj.embed, generator=g),
                      x=torch.randn(nx, proj.embed, generator=g), steps=steps)
        requests.append((inputs, rt.submit(inputs)))
    for inputs, h in requests:
        got = h.result(timeout=TIMEOUT)
        want = cfg_flow_reference(proj, inputs)
        assert sorted(got) == sorted(want)
        for name, values in want.items():
            assert len(got[name]) == len(values), name
            for a, b in zip(got[name], values):
                assert_close(a, b, what=name)
    # Forks and flow steps never changed main: same length, same pages, same bits.
    assert len(seen) == 4 * 2 * ITERS + sum(i["steps"] for i, _ in requests)
    by_id = {h.id: inputs for inputs, h in requests}
    for is_flow, rid, length, plen, unchanged, extra in seen:
        assert length == plen and unchanged, (rid, is_flow)
        if is_flow:  # and the branches kept what they appended
            assert extra == {"cond": plen + ITERS * by_id[rid]["cond_x"].shape[1],
                             "uncond": plen + ITERS * by_id[rid]["uncond_x"].shape[1]}
    assert settled(rt) == ZERO_LIVE
    assert wait_until(lambda: cache.free_pages == cache.num_pages and cache.live_sequences == 0)


# ---- continuous batching ------------------------------------------------------------------------

def record_steps(lm: CausalLM) -> list[list[bool]]:
    """Wraps the LM node's forward_kv; returns, per call (one engine step), whether each work
    is a prefill (no token generated yet)."""
    calls: list[list[bool]] = []
    real = lm.lm.forward_kv

    def forward_kv(works, step):
        calls.append([w.payload[1]["generated"] == 0 for w in works])
        return real(works, step)

    lm.lm.forward_kv = forward_kv
    return calls


def decodes(h) -> int:
    return sum(r["node"] == "decode" for r in h.stats())


def test_continuous_batching_mixes_prefill_and_decode_and_matches_solo_runs(serve):
    module = tiny_llama(seed=0)
    rng = random.Random(1)
    prompts = [[rng.randrange(64) for _ in range(rng.randint(3, 12))] for _ in range(5)]
    n = 16
    expected = [recompute_greedy(module, p, n) for p in prompts]

    solo_rt = serve(CausalLM(module, engine=KVCacheEngine(page_size=4, num_pages=128),
                             emit_logits=True))
    solo = [solo_rt.submit({"prompt": p, "params": SamplingParams(max_tokens=n)})
            .result(timeout=TIMEOUT) for p in prompts]

    engine = KVCacheEngine(page_size=4, num_pages=128)
    lm = CausalLM(module, engine=engine, emit_logits=True)
    calls = record_steps(lm)
    rt = serve(lm)
    handles = []
    for i, p in enumerate(prompts):  # each arrives while the earlier ones are decoding
        handles.append(rt.submit({"prompt": p, "params": SamplingParams(max_tokens=n)}))
        if i < len(prompts) - 1:
            assert wait_until(lambda: decodes(handles[-1]) >= 2, timeout=10)
    for p, h, (want_tokens, want_logits), alone in zip(prompts, handles, expected, solo):
        got = h.result(timeout=TIMEOUT)
        assert got["token"] == want_tokens == alone["token"], p
        for a, b, c in zip(got["logits"], want_logits, alone["logits"]):
            assert_close(a, b, 1e-4, "logits vs recompute")
            assert_close(a, c, 1e-4, "logits vs solo")
    mixed = [c for c in calls if any(c) and not all(c)]
    assert mixed, f"no step mixed prefill with decode: {calls}"
    assert max(engine.step_sizes) > 1
    assert wait_until(lambda: engine.cache.free_pages == engine.num_pages)


# ---- back-pressure ------------------------------------------------------------------------------

def test_back_pressure_when_the_cache_holds_only_a_few_requests(serve):
    module = tiny_llama(seed=1)
    rng = random.Random(5)
    prompts = [[rng.randrange(64) for _ in range(rng.randint(3, 8))] for _ in range(16)]
    n = 8  # each request reserves prompt + 8 <= 16 tokens: 3-4 pages of 4; the cache has 12
    expected = [recompute_greedy(module, p, n)[0] for p in prompts]
    engine = KVCacheEngine(page_size=4, num_pages=12)
    lm = CausalLM(module, engine=engine)
    calls = record_steps(lm)
    rt = serve(lm)
    handles = [rt.submit({"prompt": p, "params": SamplingParams(max_tokens=n)})
               for p in prompts[:8]]
    too_big = rt.submit({"prompt": list(range(10)), "params": SamplingParams(max_tokens=60)})
    handles += [rt.submit({"prompt": p, "params": SamplingParams(max_tokens=n)})
                for p in prompts[8:]]
    with pytest.raises(RequestFailed, match="num_pages"):
        too_big.result(timeout=TIMEOUT)
    for p, h, want in zip(prompts, handles, expected):
        assert h.result(timeout=TIMEOUT)["token"] == want, p
    assert max(len(c) for c in calls) <= 4, "more requests ran at once than their pages allow"
    assert len(calls) >= 16 * n // 4  # so they did wait for each other
    assert wait_until(lambda: engine.cache.free_pages == engine.num_pages
                      and engine.cache.live_sequences == 0)
    assert settled(rt) == ZERO_LIVE


# ---- leaks under cancellation -------------------------------------------------------------------

def tokens_of(h) -> tuple[list[int], Exception | None]:
    """The tokens a request emitted and its cancellation (None if it finished)."""
    error = None
    try:
        h.result(timeout=TIMEOUT)
    except RequestCancelled as e:
        error = e
    tokens: list[int] = []
    try:  # it has ended, so iterating replays its events without blocking
        for name, value in h:
            if name == "token":
                tokens.append(value)
    except RequestCancelled:
        pass
    return tokens, error


def test_no_pages_or_handles_leak_over_10k_requests_with_random_cancels(serve):
    module = tiny_llama(vocab=32, hidden=16, layers=1, heads=2, kv_heads=1, seed=2)
    engine = KVCacheEngine(page_size=4, num_pages=96, max_batch=64)  # ~30 of 64 fit at once
    rt = serve(CausalLM(module, engine=engine, max_batch=64))
    rng = random.Random(7)
    total, wave = 10_000, 64
    known: dict[tuple, list[int]] = {}  # prompt -> longest greedy continuation seen
    counts = dict(finished=0, cancelled_early=0, cancelled_mid=0)
    t0 = time.monotonic()
    for start in range(0, total, wave):
        batch = []
        for _ in range(min(wave, total - start)):
            prompt = [rng.randrange(32) for _ in range(rng.randint(1, 8))]
            n = rng.randint(1, 6)
            h = rt.submit({"prompt": prompt, "params": SamplingParams(max_tokens=n)})
            if rng.random() < 0.1:
                h.cancel()  # right after submit
            batch.append((h, tuple(prompt), n))
        for h, _p, _n in batch:
            if rng.random() < 0.22:  # later, at a random moment: queued, mid-decode or done
                time.sleep(rng.random() * 0.0008)
                h.cancel()
        for h, prompt, n in batch:
            tokens, error = tokens_of(h)
            if error is None:
                assert len(tokens) == n
                counts["finished"] += 1
            else:
                assert isinstance(error, RequestCancelled), error
                assert tokens == []  # what a cancelled request made is dropped, not yielded
                counts["cancelled_mid" if h.stats() else "cancelled_early"] += 1
            # Greedy: a request's tokens never depend on who it was batched with.
            seen = known.setdefault(prompt, tokens)
            short, long = sorted((seen, tokens), key=len)
            assert long[: len(short)] == short, (prompt, seen, tokens)
            if len(tokens) > len(seen):
                known[prompt] = tokens
    took = time.monotonic() - t0
    assert min(counts.values()) > 50, counts
    assert settled(rt, timeout=10) == ZERO_LIVE
    assert wait_until(lambda: engine.cache.free_pages == engine.num_pages
                      and engine.cache.live_sequences == 0, timeout=5), (
        engine.cache.free_pages, engine.cache.live_sequences)
    print(f"10k requests in {took:.1f} s, {engine.steps} steps, {counts}")


# ---- a node that raises fails only its own request -----------------------------------------------

def attn_model(node: ProjNode, engine: KVCacheEngine) -> Model:
    model = Model()
    model.inputs = ("x", "boom", "hold")
    model.input_defaults = {"boom": False, "hold": False}
    model.nodes = [GraphNode("attn", ["x", "boom", "hold"], [GraphEdge(EMIT, "y")])]
    model.walks = {"run": "attn"}
    model.submodules = {"attn": node}
    model.engines = {"attn": "kv"}
    model.engine_specs = {"kv": engine}
    return model


def test_a_node_raising_in_forward_kv_fails_only_its_request(serve):
    proj = Proj(seed=4)
    node = ProjNode(proj, "x", "y", fail_if=lambda inputs: inputs["boom"])
    engine = KVCacheEngine(page_size=4, num_pages=32)
    rt = serve(attn_model(node, engine))
    g = torch.Generator().manual_seed(0)
    blocker = rt.submit({"x": torch.randn(2, proj.embed, generator=g), "hold": True})
    assert node.entered.wait(10)
    xs = [torch.randn(t, proj.embed, generator=g) for t in (3, 5, 2, 6)]
    handles = [rt.submit({"x": x, "boom": i == 1}) for i, x in enumerate(xs)]
    node.hold.set()
    blocker.result(timeout=TIMEOUT)
    with pytest.raises(RequestFailed, match="boom"):
        handles[1].result(timeout=TIMEOUT)
    for i in (0, 2, 3):
        q, k, v = proj.qkv(xs[i])
        want = proj.out(dense_attention(q, k, v, 0, ("causal",)))
        assert_close(handles[i].result(timeout=TIMEOUT)["y"][0], want, what=f"request {i}")
    ids = {h.id for h in handles}
    assert any({rid for rid, _it in call} == ids for call in node.calls), (
        f"the four requests never shared a step: {node.calls}")
    assert wait_until(lambda: engine.cache.free_pages == engine.num_pages
                      and engine.cache.live_sequences == 0)
    calls = len(node.calls)
    with pytest.raises(RequestFailed, match="boom"):  # alone in its step: run once, not twice
        rt.submit({"x": xs[0], "boom": True}).result(timeout=TIMEOUT)
    assert len(node.calls) == calls + 1, node.calls[calls:]
    assert settled(rt) == ZERO_LIVE


def test_a_cancel_racing_admission_leaves_no_sequence_behind(serve):
    """A cancel can land between the engine's check that a request is live and its admission
    of that request's pages; the pages must still come back."""
    proj = Proj(seed=5)
    node = ProjNode(proj, "x", "y")
    engine = KVCacheEngine(page_size=4, num_pages=32)
    rt = serve(attn_model(node, engine))
    cache = engine.cache
    blocker = rt.submit({"x": torch.randn(2, proj.embed), "hold": True})
    assert node.entered.wait(10)
    victim = rt.submit({"x": torch.randn(3, proj.embed)})
    real_admit = cache.admit

    def admit(request, *args, **kwargs):
        if request == victim.id and not victim.done:
            victim.cancel()  # from the worker thread, just before the pages are taken
        return real_admit(request, *args, **kwargs)

    cache.admit = admit
    node.hold.set()
    blocker.result(timeout=TIMEOUT)
    with pytest.raises(RequestCancelled):
        victim.result(timeout=TIMEOUT)
    assert settled(rt) == ZERO_LIVE
    assert wait_until(lambda: cache.live_sequences == 0, timeout=2), cache.labels(victim.id)
    assert cache.free_pages == cache.num_pages


def test_a_request_picked_up_before_submit_returns_is_served_normally(serve):
    module = tiny_llama(seed=3)
    engine = KVCacheEngine(page_size=4, num_pages=32)
    rt = serve(CausalLM(module, engine=engine))
    rt.conductor = SlowSubmit(rt.conductor)
    prompt = [4, 8, 15, 16]
    h = rt.submit({"prompt": prompt, "params": SamplingParams(max_tokens=5)})
    assert h.result(timeout=TIMEOUT)["token"] == recompute_greedy(module, prompt, 5)[0]
    assert wait_until(lambda: engine.cache.free_pages == engine.num_pages)


# ---- stack_pad ----------------------------------------------------------------------------------

def test_stack_pad_pads_to_the_longest_and_returns_lengths():
    a, b, c = torch.ones(2, 3), torch.full((4, 3), 2.0), torch.full((1, 3), 3.0)
    out, lengths = stack_pad([a, b, c], pad_value=-1)
    assert out.shape == (3, 4, 3) and lengths.tolist() == [2, 4, 1]
    assert torch.equal(out[0, :2], a) and torch.equal(out[1], b) and torch.equal(out[2, :1], c)
    assert (out[0, 2:] == -1).all() and (out[2, 1:] == -1).all()
    same, lengths = stack_pad([a, a * 5])
    assert torch.equal(same, torch.stack([a, a * 5])) and lengths.tolist() == [2, 2]
    ids, _ = stack_pad([torch.tensor([1, 2]), torch.tensor([3])])
    assert ids.dtype == torch.long and ids.tolist() == [[1, 2], [3, 0]]


def test_stack_pad_rejects_mismatched_trailing_shapes():
    with pytest.raises(ValueError, match="differ beyond the first dimension"):
        stack_pad([torch.zeros(2, 3), torch.zeros(2, 4)])
    with pytest.raises(ValueError, match="differ"):
        stack_pad([torch.zeros(2, 3), torch.zeros(2, 3, dtype=torch.float64)])


def test_each_engine_keeps_its_own_torch_thread_count():
    """Engines with different ``num_threads`` in one process: each worker thread keeps its
    own count, whatever another thread sets before the worker's first parallel op (torch
    applies the process-wide count to a thread lazily, at that op)."""
    import torch

    from mstar_rt import EMIT, GraphEdge, GraphNode, Model, NodeSubmodule, Runtime, Sequential
    from mstar_rt.engines import StatelessEngine

    big = torch.randn(1 << 20)

    class Threads(NodeSubmodule):
        def __init__(self, name):
            self.name = name

        def forward(self, batch):
            big.mul(2)  # a parallel op: the thread's lazy init, if it has not happened
            return [{self.name: torch.get_num_threads()} for _ in batch]

    class TwoEngines(Model):
        inputs = ("x",)
        nodes = [GraphNode("a", ["x"], [GraphEdge(EMIT, "na")], submodule=Threads("na"),
                           engine="one"),
                 GraphNode("b", ["x"], [GraphEdge(EMIT, "nb")], submodule=Threads("nb"),
                           engine="two")]
        walks = {"main": Sequential("a", "b")}

    before = torch.get_num_threads()
    model = TwoEngines()
    model.engine_specs = {"one": StatelessEngine(num_threads=1),
                          "two": StatelessEngine(num_threads=2)}
    try:
        with Runtime(model) as rt:
            torch.set_num_threads(3)  # after both workers started, before their first op
            assert dict(rt.submit({"x": 1})) == {"na": 1, "nb": 2}
    finally:
        torch.set_num_threads(before)

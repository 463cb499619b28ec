"""Moving a request's KV pages between caches and processes (prefill/decode disaggregation):
export/import round trips onto other page ids and another page size with a partial last page,
layout mismatches and full receivers refused with nothing leaked, the gloo KV channel (bytes in
the description, several dtypes, a timeout that breaks it for good), the walk boundary in one
process, and a two-process :class:`DisaggregatedLM` against the colocated LM: greedy tokens
equal and float32 logits within 1e-4 on concurrent requests of different lengths, a seeded
sampled request equal too, pages freed on both sides, a request the decode cache can never hold
failing alone, and a killed decode process failing its requests clearly with no process left.
NCCL on CUDA is the same code with another backend and has never run here.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from mstar_rt import RequestCancelled, RequestFailed, Runtime
from mstar_rt.distributed.disagg import DisaggregatedLM
from mstar_rt.distributed.group import join_store, open_store
from mstar_rt.distributed.kv_handoff import DecodeSide, PrefillSide
from mstar_rt.distributed.kv_transfer import KVChannel, TransferError
from mstar_rt.engines import KVCacheEngine, SamplingParams
from mstar_rt.engines.paged_kv import KVLayout, OutOfPages, PagedKVCache, SequenceKV
from mstar_rt.models.causal_lm import CausalLM

from child_env import child_env
from kv_models import gather, tiny_llama
from placement_support import alive
from tp_support import children
from walk_models import close_within, wait_until

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conftest.py

TOL = 1e-4
T = 60.0
HERE = os.path.dirname(os.path.abspath(__file__))
LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=4)


def build_lm(engine: KVCacheEngine, emit_logits: bool = True, seed: int = 0) -> CausalLM:
    """The factory both processes build the LM from (same seed: same weights)."""
    return CausalLM(tiny_llama(seed=seed), engine=engine, emit_logits=emit_logits)


def fill(cache: PagedKVCache, request: int, length: int, seed: int, reserve: int = 0) -> None:
    """A sequence of ``length`` tokens of random K/V (written through its block table)."""
    seq = cache.admit(request, "main", length, reserve)
    g = torch.Generator().manual_seed(seed)
    for k, v in zip(cache.k, cache.v):
        k[seq.pages] = torch.randn(k[seq.pages].shape, generator=g)
        v[seq.pages] = torch.randn(v[seq.pages].shape, generator=g)
    cache.commit(request, "main", length)


def gathered(cache: PagedKVCache, request: int) -> list:
    return [gather(cache, request, layer=i) for i in range(len(cache.k))]


# ---- export / import in one process ------------------------------------------------------------

def test_round_trip_onto_other_page_ids_and_page_size_with_a_partial_last_page():
    sender = PagedKVCache(LAYOUT, page_size=4, num_pages=16)
    fill(sender, 7, 5, seed=1)                      # another request owns the low pages
    fill(sender, 3, 10, seed=2, reserve=20)         # 2.5 pages
    kv = sender.export_sequence(3)
    assert kv.data.shape == (2, 2, 10, 2, 4) and kv.reserve == 20 and kv.length == 10
    for layer, (k, v) in enumerate(gathered(sender, 3)):
        assert torch.equal(kv.data[layer, 0], k) and torch.equal(kv.data[layer, 1], v)

    receiver = PagedKVCache(LAYOUT, page_size=8, num_pages=8)
    fill(receiver, 1, 3, seed=3)
    seq = receiver.import_sequence(42, "main", kv)
    assert seq is not None and seq.length == 10 and seq.reserve == 20
    assert len(seq.pages) == 2 and 0 not in seq.pages  # its own page ids, in its page size
    for (k0, v0), (k1, v1) in zip(gathered(sender, 3), gathered(receiver, 42)):
        assert torch.equal(k0, k1) and torch.equal(v0, v1)
    assert receiver.free_pages == 8 - 1 - 2

    sender.drop(3, "main")  # the sender frees; the other request keeps its pages
    assert sender.free_pages == 16 - 2 and receiver.sequence(42, "main").length == 10
    receiver.release(42)
    receiver.release(1)
    assert receiver.free_pages == 8


def test_layout_mismatch_existing_label_and_full_receiver_are_refused_with_nothing_taken():
    sender = PagedKVCache(LAYOUT, page_size=4, num_pages=16)
    fill(sender, 0, 9, seed=4)
    kv = sender.export_sequence(0)
    for other, named in ((KVLayout(2, 1, 4), r"num_kv_heads 2 \(here 1\)"),
                         (KVLayout(3, 2, 4), r"num_layers 2 \(here 3\)"),
                         (KVLayout(2, 2, 4, torch.bfloat16), r"dtype float32 \(here bfloat16\)")):
        with pytest.raises(ValueError, match=named + ".*same model at the same dtype"):
            PagedKVCache(other, 4, 16).import_sequence(0, "main", kv)
    small = PagedKVCache(LAYOUT, page_size=4, num_pages=2)
    with pytest.raises(OutOfPages, match="needs 3 pages of 4 tokens but the KV cache has 2; "
                                         "raise num_pages"):
        small.import_sequence(0, "main", kv)
    busy = PagedKVCache(LAYOUT, page_size=4, num_pages=4)
    fill(busy, 1, 8, seed=5)
    assert busy.import_sequence(0, "main", kv) is None  # not now: nothing taken
    for cache, free in ((small, 2), (busy, 2)):
        assert cache.free_pages == free and cache.sequence(0, "main") is None
    with pytest.raises(ValueError, match="already holds KV label 'main'"):
        busy.import_sequence(1, "main", kv)
    with pytest.raises(KeyError, match="no KV label 'draft' to export"):
        sender.export_sequence(0, "draft")
    sender.copy_log = []  # what a tensor-parallel driver sets on its cache
    with pytest.raises(ValueError, match="tensor-parallel cache"):
        sender.export_sequence(0)


def test_engine_import_request_says_when_the_cache_is_full_now(serve):
    engine = KVCacheEngine(page_size=4, num_pages=4)
    serve(build_lm(engine))
    kv = SequenceKV(torch.randn(2, 2, 9, 2, 8), reserve=12)
    engine.import_request(5, kv)
    assert engine.cache.free_pages == 1
    with pytest.raises(OutOfPages, match="cannot take 9 tokens .* now: 1 of 4 pages are free"):
        engine.import_request(6, kv)
    assert engine.cache.sequence(6, "main") is None
    back = engine.export_request(5, free=True)
    assert torch.equal(back.data, kv.data) and engine.cache.free_pages == 4


# ---- the channel -----------------------------------------------------------------------------

def channel_pair() -> tuple[KVChannel, KVChannel]:
    """Both ranks of a channel, in this process (gloo does not mind)."""
    store, key = open_store(2, 20), f"test-{os.getpid()}-{time.monotonic_ns()}"
    made: dict = {}

    def join(rank: int) -> None:
        s = store if rank == 0 else join_store(store.port, 2, 20)
        made[rank] = KVChannel(s, key, rank, "cpu", 20.0)

    threads = [threading.Thread(target=join, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    return made[0], made[1]


def test_channel_moves_descriptions_and_tensors_and_a_timeout_breaks_it_for_good():
    a, b = channel_pair()
    bf = torch.randn(3, 5).to(torch.bfloat16)
    kv = SequenceKV(torch.randn(2, 2, 7, 2, 4), reserve=11)
    sent = threading.Thread(target=lambda: (a.send({"x": [1, "y"], "g": b"\x00\xff"},
                                                   [bf, torch.arange(4)]),
                                            a.send_kv({"key": 3}, kv)))
    sent.start()
    description, tensors = b.recv()
    assert description == {"x": [1, "y"], "g": b"\x00\xff"}
    assert torch.equal(tensors[0], bf) and torch.equal(tensors[1], torch.arange(4))
    description, got = b.recv_kv()
    sent.join(10)
    assert description["key"] == 3 and description["kv"]["length"] == 7
    assert torch.equal(got.data, kv.data) and got.reserve == 11
    b.timeout_s = 1.0  # a peer that sends nothing more
    t0 = time.monotonic()
    with pytest.raises(TransferError, match="failed to recv: .*[Tt]imed out"):
        b.recv()
    assert time.monotonic() - t0 < 5
    with pytest.raises(TransferError, match="cannot be reused"):
        b.recv()
    with pytest.raises(TypeError, match="plain data"):
        a.send({"bad": object()})


# ---- the walk boundary, in one process -------------------------------------------------------

REQUESTS = [([5, 9, 2], SamplingParams(max_tokens=10)),
            ([3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5], SamplingParams(max_tokens=10)),
            ([7] * 17, SamplingParams(max_tokens=6)),
            ([8, 8, 1, 2, 30, 12], SamplingParams(max_tokens=10, temperature=0.8, seed=5)),
            ([11, 12], SamplingParams(max_tokens=1))]  # done after prefill: nothing moves


def inputs(prompt: list, params: SamplingParams) -> dict:
    return {"prompt": prompt, "params": params}


@pytest.fixture(scope="module")
def colocated():
    with Runtime(build_lm(KVCacheEngine(page_size=4, num_pages=128))) as rt:
        return [h.result(timeout=T) for h in [rt.submit(inputs(*r)) for r in REQUESTS]]


def assert_same(want: list, got: list) -> None:
    for i, (a, b) in enumerate(zip(want, got)):
        assert a["token"] == b["token"], f"request {i}: tokens differ"
        diff = (torch.stack(a["logits"]) - torch.stack(b["logits"])).abs().max().item()
        assert diff < TOL, f"request {i}: logits differ by {diff}"


def test_prefill_side_hands_off_to_a_decode_side_in_one_process(serve, colocated):
    prefill = PrefillSide(build_lm(KVCacheEngine(page_size=4, num_pages=64)))
    decode = DecodeSide(build_lm(KVCacheEngine(page_size=8, num_pages=32)))
    ra, rb = serve(prefill), serve(decode)
    got = []
    for key, handle in enumerate([ra.submit(inputs(*r)) for r in REQUESTS]):
        first = handle.result(timeout=T)
        handoff = handle.context.state.get("handoff")
        if handoff is None:
            got.append(first)
            continue
        rest = rb.submit(decode.request(key, handoff)).result(timeout=T)
        got.append({name: first[name] + rest[name] for name in first})
    assert_same(colocated, got)
    for rt in (ra, rb):
        cache = rt.engines["lm"].cache
        assert wait_until(lambda: cache.free_pages == cache.num_pages, T)
    assert len(decode.pending) == 0


def test_a_non_sampling_prefill_and_a_foreign_layout_at_the_walk_boundary(serve):
    """prefill_samples=False hands the last prompt token to decode; a decode side serving
    another model refuses the K/V for that request alone, keeping no pages."""
    prompt, params = [4, 8, 15, 16, 23, 42], SamplingParams(max_tokens=7)
    quiet = lambda pages: CausalLM(tiny_llama(), engine=KVCacheEngine(page_size=4,  # noqa: E731
                                                                     num_pages=pages),
                                   emit_logits=True, prefill_samples=False)
    want = serve(quiet(32)).submit(inputs(prompt, params)).result(timeout=T)
    ra = serve(PrefillSide(quiet(32)))
    decode = DecodeSide(quiet(32))
    rb = serve(decode)
    first = ra.submit(inputs(prompt, params)).result(timeout=T)
    assert first == {}  # a non-sampling prefill emits nothing
    assert ra.engines["lm"].cache.free_pages == 32
    sub = ra.submit(inputs(prompt, params))
    sub.result(timeout=T)
    got = rb.submit(decode.request("a", sub.context.state["handoff"])).result(timeout=T)
    assert_same([want], [got])
    other = DecodeSide(CausalLM(tiny_llama(kv_heads=1), engine=KVCacheEngine(page_size=4,
                                                                            num_pages=32)))
    rc = serve(other)
    sub = ra.submit(inputs(prompt, params))
    sub.result(timeout=T)
    with pytest.raises(RequestFailed, match=r"does not fit this cache: it has num_kv_heads 2 "
                                            r"\(here 1\)"):
        rc.submit(other.request("b", sub.context.state["handoff"])).result(timeout=T)
    cache = rc.engines["lm"].cache
    assert cache.free_pages == cache.num_pages and len(other.pending) == 0


def test_decode_stops_when_its_prefill_process_is_killed(tmp_path):
    script = (f"import sys, time\n"
              f"sys.path.insert(0, {HERE!r})\n"
              f"from test_kv_transfer import start\n"
              f"lm = start()\n"
              f"print(lm.proc.pid, flush=True)\n"
              f"time.sleep(120)\n")
    driver = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                              env=child_env(HERE))
    try:
        line = driver.stdout.readline()
        pid = int(line)
        assert alive(pid), f"the driver printed {line!r}"
        driver.kill()
        driver.wait(10)
        assert wait_until(lambda: not alive(pid), 10), "the decode process outlived its driver"
    finally:
        driver.kill()
        driver.wait()


# ---- two processes ---------------------------------------------------------------------------

def start(decode_pages: int = 12, **options) -> DisaggregatedLM:
    return DisaggregatedLM(f"{__name__}:build_lm", {"emit_logits": True},
                           prefill_engine={"page_size": 4, "num_pages": 64},
                           decode_engine={"page_size": 8, "num_pages": decode_pages},
                           timeout_s=20.0, start_timeout_s=T, import_path=[HERE], **options)


def test_two_processes_equal_the_colocated_lm_and_free_pages_on_both_sides(colocated):
    before = set(children())
    lm = start()
    try:
        handles = [lm.submit(inputs(*r)) for r in REQUESTS]
        too_long = lm.submit(inputs([4] * 60, SamplingParams(max_tokens=60)))  # 15 pages of 8
        got = [h.result(timeout=T) for h in handles]
        assert_same(colocated, got)
        with pytest.raises(RequestFailed, match=r"decode of request 5 in process \d+ failed: .*"
                                                r"needs 15 pages of 8 tokens but the KV cache "
                                                r"has 12; raise num_pages"):
            too_long.result(timeout=T)
        streamed = list(lm.submit(inputs(*REQUESTS[0])))  # iterating gives the same stream
        assert [v for n, v in streamed if n == "token"] == colocated[0]["token"]
        long = lm.submit(inputs([1, 2, 3], SamplingParams(max_tokens=80, ignore_eos=True)))
        assert wait_until(lambda: len(long.outputs.get("token", ())) >= 3, T)
        assert long.cancel() and not long.cancel()
        with pytest.raises(RequestCancelled):
            long.result(timeout=T)
        assert wait_until(lambda: lm.decode_stats()["free_pages"] == 12, T), \
            "a cancelled decode kept its pages"
        assert wait_until(lambda: lm.prefill_stats()["free_pages"] == 64, T)
        stats = lm.decode_stats()
        assert (stats["free_pages"], stats["pending_handoffs"], stats["live_sequences"]) == \
            (12, 0, 0), stats
        assert stats["received"] == lm.prefill_stats()["sent"] == 7  # not the max_tokens=1 one
    finally:
        lm.close()
    assert not alive(lm.proc.pid) and set(children()) <= before


def _kill_decode_mid_run(lm: DisaggregatedLM) -> tuple[list, int]:
    """Three requests decoding, then the decode process SIGKILLed: (their handles, its pid)."""
    long = [lm.submit(inputs([3, 4, 5][: i + 1], SamplingParams(max_tokens=100,
                                                                ignore_eos=True)))
            for i in range(3)]
    assert wait_until(lambda: all(len(h.outputs.get("token", ())) >= 3 or h.done
                                  for h in long), T)
    assert not any(h.done for h in long)
    pid = lm.proc.pid
    os.kill(pid, signal.SIGKILL)
    return long, pid


def test_a_killed_decode_process_fails_its_requests_and_a_new_one_serves_the_next(colocated):
    before = set(children())
    lm = start(decode_pages=64, max_restarts=1)  # the last restart allowed is waited for too
    try:
        long, pid = _kill_decode_mid_run(lm)
        t0 = time.monotonic()
        for h in long:
            with pytest.raises(RequestFailed, match=rf"decode process .* failed.*\[pid {pid} "
                                                    r"exited with code -9\]; a new decode "
                                                    "process is starting"):
                h.result(timeout=T)
        assert time.monotonic() - t0 < 10, "the failure waited for a timeout"
        assert lm.health() is None  # a new decode process is coming
        streamed = list(lm.submit(inputs(*REQUESTS[0])))
        assert [v for n, v in streamed if n == "token"] == colocated[0]["token"]
        assert lm.restarts == 1 and lm.proc.pid != pid and not alive(pid)
        assert lm.prefill_stats()["free_pages"] == 64
        assert wait_until(lambda: lm.decode_stats()["free_pages"] == 64, T)
    finally:
        close_within(lm, 20)
    assert set(children()) <= before


def test_with_restart_manual_a_killed_decode_process_fails_every_later_request():
    before = set(children())
    lm = start(decode_pages=64, restart="manual")
    try:
        long, pid = _kill_decode_mid_run(lm)
        for h in long:
            with pytest.raises(RequestFailed, match=rf"\[pid {pid} exited with code -9\]; "
                                                    "close this DisaggregatedLM and start it "
                                                    "again"):
                h.result(timeout=T)
        with pytest.raises(RequestFailed, match="start it again"):
            lm.submit(inputs([1, 2], SamplingParams(max_tokens=4))).result(timeout=T)
        assert lm.restarts == 0 and lm.prefill_stats()["free_pages"] == 64
        assert re.search(rf"\[pid {pid} exited with code -9\]; close this DisaggregatedLM and "
                         "start it again", lm.health() or "")
    finally:
        close_within(lm, 20)
    assert lm.health() == "this DisaggregatedLM is closed; start it again"
    assert set(children()) <= before
    with pytest.raises(ValueError, match="restart must be 'auto' or 'manual'"):
        start(restart="sometimes")
    with pytest.raises(ValueError, match="tp_size=2: .*tensor-parallel cache.*give tp_size 1"):
        DisaggregatedLM("never:built", {"tp_size": 2})  # before any process starts
    assert set(children()) <= before


@pytest.mark.parametrize("kw, error, needle", [
    (dict(kwargs={"engine": KVCacheEngine(page_size=4, num_pages=8)}), ValueError,
     "engine: each side builds a KVCacheEngine of its own; give their settings as "
     "prefill_engine="),
    (dict(kwargs={"logits_processor": lambda x: x}), TypeError,
     r"kwargs\['logits_processor'\] \(function\) cannot reach the decode process"),
    (dict(max_restarts=-1), ValueError, "max_restarts=-1: give a count >= 0"),
    (dict(timeout_s=0), ValueError, "timeout_s=0: give seconds > 0"),
    (dict(devices=("cpu",)), ValueError, "devices=.*give two of 'cpu' or 'cuda:N'"),
], ids=["engine", "lambda", "max_restarts", "timeout", "devices"])
def test_arguments_the_decode_process_cannot_take_are_refused_before_it_starts(kw, error,
                                                                              needle):
    # a pickling error (with a decode process left running), or nothing at all (-1 restarts)
    before = children()
    with pytest.raises(error, match=needle):
        DisaggregatedLM("kv_models:tiny_llm", **kw)
    assert children() == before

"""Prefill/decode disaggregation through placement (issue 17, item 2): a CausalLM's ``prefill``
walk on worker 1 and its ``decode`` walk on worker 2 (one KV engine, two workers). At the walk
change the request's K/V and decode state move from worker 1 to worker 2 over a gloo channel
(placement/kv_moves.py). Greedy tokens equal and float32 logits within 1e-4 of the in-process
Runtime and of the colocated placement, concurrent requests of different lengths, pages freed on
both workers, a cancel mid-decode or during the move leaving nothing, a request done at prefill
moving nothing, one the decode cache can never hold failing alone, the config form, a killed
decode worker failing its requests clearly (and a restart serving again), and splits that
cannot move K/V refused at start naming the groups."""

from __future__ import annotations

import dataclasses
import os
import signal
import time

import pytest
import torch

from mstar_rt import Part, RequestCancelled, RequestFailed, Runtime
from mstar_rt.engines import KVCacheEngine, SamplingParams
from mstar_rt.engines.kv_engine import KVNodeSubmodule
from mstar_rt.engines.paged_kv import KVLayout
from mstar_rt.placement import NodeGroup, PlacedRuntime
from mstar_rt.model import RequestContext
from mstar_rt.placement.config import make_plan
from mstar_rt.placement.kv_moves import ParentMoves

import placement_models as pm
from placement_support import T, idle, our_segments
from walk_models import wait_until

TOL = 1e-4
SPLIT = [NodeGroup(["prefill"], rank=1), NodeGroup(["decode"], rank=2)]
COLOCATED = [NodeGroup(["prefill", "decode"], rank=1)]
# different prompt lengths (partial last pages of 4 tokens) and different max_tokens
CASES = [([1, 2, 3], 9), ([5] * 9, 4), ([7, 8, 9, 10, 11], 12), ([100, 3, 64, 2, 9, 17, 40], 7),
         (list(range(20, 33)), 10), ([42], 6)]


def run_all(rt, cases=CASES) -> list[dict]:
    handles = [rt.submit({"prompt": p, "params": SamplingParams(max_tokens=n)}) for p, n in cases]
    return [h.result(T) for h in handles]


def assert_close(got: list[dict], want: list[dict]) -> None:
    for g, w in zip(got, want, strict=True):
        assert g["token"] == w["token"]
        assert len(g["logits"]) == len(w["logits"])
        for a, b in zip(g["logits"], w["logits"]):
            assert a.dtype == torch.float32 and torch.allclose(a, b, atol=TOL, rtol=0)


@pytest.fixture(scope="module")
def reference():
    with Runtime(pm.tiny_llama()) as rt:
        return run_all(rt)


@pytest.fixture(scope="module")
def split():
    rt = PlacedRuntime("placement_models:tiny_llama", SPLIT, progress=False,
                       engines={"lm": KVCacheEngine(page_size=4, num_pages=96, max_batch=8)})
    yield rt
    rt.close()
    assert our_segments(rt) == []


def both_idle(rt) -> tuple[dict, dict]:
    return idle(rt, 1), idle(rt, 2)


def test_split_walks_equal_the_in_process_and_colocated_runs(split, reference):
    before = split.worker_stats(1)["kv_sent"]
    got = run_all(split)
    assert_close(got, reference)
    with PlacedRuntime("placement_models:tiny_llama", COLOCATED, progress=False) as rt:
        assert_close(run_all(rt), got)
    one, two = both_idle(split)
    assert one["kv_pages_in_use"] == two["kv_pages_in_use"] == 0
    assert one["kv_sent"] - before == len(CASES)  # every request went on to decode
    assert two["kv_waiting"] == 0 and one["live_requests"] == two["live_requests"] == 0
    assert split.plan.kv_moves == {"lm": {"prefill": 1, "decode": 2}}


def test_each_worker_runs_its_walk_as_a_segment(split, reference):
    """The decode loop runs inside worker 2 (no crossing per token), equal to the per-node
    split; a prefill that ends its request names the decode loop no segment of worker 1 holds."""
    assert {"segment:prefill:0", "segment:decode:0"} <= {n.name for n in split.model.nodes}
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    before = split.worker_stats(2)["messages"]
    got = split.submit({"prompt": [1, 2, 3], "params": params}).result(T)
    assert len(got["token"]) == 40
    # kv_recv, the decode walk's one batch, its release (and this stats call): not one per token
    assert split.worker_stats(2)["messages"] - before <= 5
    with PlacedRuntime("placement_models:tiny_llama", SPLIT, progress=False,
                       segments=False) as rt:
        assert not rt.segments_enabled
        assert_close(run_all(rt, CASES[:3]) + [rt.submit({"prompt": [1, 2, 3],
                                                          "params": params}).result(T)],
                     reference[:3] + [got])
        both_idle(rt)
    both_idle(split)


class _Link:
    """What ParentMoves would post to a worker."""

    gen, state = 0, "up"

    def __init__(self, rank: int = 1) -> None:
        self.rank, self.sent, self.moved, self.msgs = rank, [], [], []

    def post(self, msg: dict, gen: int, wait: bool) -> None:
        self.sent.append(msg["kind"])
        self.msgs.append(msg)

    def moved_out(self, rid: int) -> None:
        self.moved.append(rid)


@pytest.mark.parametrize("alive", [True, False])
def test_a_request_ended_before_its_walk_change_moves_nothing(alive):
    """A cancel on another thread can end the request while the hub's thread is in next_walk:
    then no K/V notice leaves and nothing stays registered (else the receiver would wait for
    K/V that never come, and no release would follow)."""
    links = {1: _Link(), 2: _Link()}
    moves = ParentMoves({"lm": {"prefill": 1, "decode": 2}}, links, 5.0,
                        alive=lambda rid: alive)
    request = RequestContext(id=7, inputs={})
    moves.begin(request, "prefill", "decode")
    if alive:
        moves.ended(7)
    assert wait_until(lambda: links[2].sent[-1:] == ["release"], timeout=T)
    moves.close()
    assert links[1].sent == (["kv_send"] if alive else [])
    assert links[2].sent == (["kv_recv", "release"] if alive else ["release"])
    assert moves.receivers == {} and moves.where == {}


def test_a_request_done_at_prefill_moves_nothing(split, reference):
    sent, (received, batches) = split.worker_stats(1)["kv_sent"], \
        [split.worker_stats(2)[k] for k in ("kv_received", "batches")]
    out = split.submit({"prompt": [1, 2, 3], "params": SamplingParams(max_tokens=1)}).result(T)
    assert out["token"] == reference[0]["token"][:1]
    one, two = both_idle(split)
    assert (one["kv_sent"], two["kv_received"]) == (sent, received)
    assert two["batches"] == batches  # worker 2 never saw it


def test_cancel_mid_decode_and_during_the_move_leave_no_pages(split, reference):
    params = SamplingParams(max_tokens=60, ignore_eos=True)
    handle = split.submit({"prompt": list(range(1, 20)), "params": params})
    tokens = iter(handle)
    for _ in range(3):  # the prefill's token, then two decoded on worker 2
        next(tokens)
    assert split.worker_stats(2)["kv_pages_in_use"] >= 5  # 21+ tokens, 4 a page
    assert handle.cancel()
    with pytest.raises(RequestCancelled):
        handle.result(T)
    # cancelled as soon as the prefill's token is out: the K/V may still be on the way
    for k in range(4):
        h = split.submit({"prompt": [9, 8, 7, 6, 5][:k + 2], "params": params})
        next(iter(h))
        h.cancel()
        with pytest.raises(RequestCancelled):
            h.result(T)
    one, two = both_idle(split)
    assert one["kv_pages_in_use"] == two["kv_pages_in_use"] == 0 and two["kv_waiting"] == 0
    assert_close(run_all(split, CASES[:2]), reference[:2])  # and it still serves


def test_cancels_racing_the_walk_change_leave_no_pages_and_hang_nothing(split):
    """Found by a chaos run (4 clients, half the requests cancelled 0-20 ms after submit): the
    decode worker kept the K/V of ~1 % of them for good -- its engine freed a gone request's
    pages under the run's own id, not the request's cache id -- until full caches hung later
    requests; and a release while a run's step was taking pages freed them too early."""
    import random
    import threading

    def client(k: int, errors: list) -> None:
        rng = random.Random(k)
        for _ in range(60):
            prompt = [rng.randrange(128) for _ in range(rng.randint(1, 20))]
            h = split.submit({"prompt": prompt, "params": SamplingParams(
                max_tokens=rng.randint(1, 24), ignore_eos=True)})
            if rng.random() < 0.5:
                threading.Timer(rng.uniform(0.0, 0.02), h.cancel).start()
            try:
                h.result(T)
            except RequestCancelled:
                pass
            except BaseException as e:
                errors.append(e)

    errors: list = []
    clients = [threading.Thread(target=client, args=(k, errors)) for k in range(4)]
    for c in clients:
        c.start()
    for c in clients:
        c.join()
    assert errors == []
    one, two = both_idle(split)
    assert one["kv_pages_in_use"] == two["kv_pages_in_use"] == 0 and two["kv_waiting"] == 0


def test_workers_that_moved_kv_exit_cleanly_at_close(capfd):
    # The sender's channel thread dropped its gloo group while the worker process finalized:
    # "terminate called without an active exception" and SIGABRT at every close.
    with PlacedRuntime("placement_models:tiny_llama", SPLIT, progress=True) as rt:
        run_all(rt, CASES[:2])
        assert rt.kv_moves.moved == 2
    err = capfd.readouterr().err
    assert "terminate called" not in err and "killed by signal" not in err, err[-2000:]


def test_config_form():
    config = {"model": {"class": "placement_models:tiny_llama", "args": {"num_pages": 64}},
              "node_groups": [{"nodes": ["prefill"], "rank": 1}, {"nodes": ["decode"], "rank": 2}],
              "progress": False}
    with PlacedRuntime.from_config(config) as rt:
        assert rt.plan.kv_moves == {"lm": {"prefill": 1, "decode": 2}}
        with Runtime(pm.tiny_llama(num_pages=64)) as ref:
            assert_close(run_all(rt, CASES[2:4]), run_all(ref, CASES[2:4]))
        both_idle(rt)


def test_a_killed_decode_worker_fails_its_requests_and_a_restart_serves_again(reference):
    with PlacedRuntime("placement_models:tiny_llama", SPLIT, progress=False) as rt:
        params = SamplingParams(max_tokens=100, ignore_eos=True)
        handles = [rt.submit({"prompt": [3, 1, 4, 1, 5][:k + 1], "params": params})
                   for k in range(3)]
        for h in handles:
            it = iter(h)
            next(it), next(it)  # decoding on worker 2
        os.kill(rt.workers[2]["pid"], signal.SIGKILL)
        for h in handles:
            with pytest.raises(RequestFailed, match="worker process rank 2"):
                h.result(T)
        assert idle(rt, 1)["kv_pages_in_use"] == 0
        rt.restart_worker(2)  # a new generation: a new channel between the two
        assert_close(run_all(rt, CASES[:3]), reference[:3])
        both_idle(rt)


def test_after_a_decode_worker_dies_the_next_requests_wait_for_its_restart_not_forever(
        reference):
    """The walk change of a request that prefilled while the decode worker was dead or
    restarting: its K/V notices wait for the new generation (they went to the dead one and
    the request hung for good, 8 runs in 19, until 2026-12-07)."""
    with PlacedRuntime("placement_models:tiny_llama", SPLIT, progress=False, restart="auto",
                       max_restarts=5, kv_timeout_s=20) as rt:
        for _ in range(3):
            first = rt.submit({"prompt": [3, 1, 4], "params": SamplingParams(
                max_tokens=200, ignore_eos=True)})
            tokens = (v for name, v in first if name == "token")
            next(tokens), next(tokens), next(tokens)  # decoding on worker 2
            os.kill(rt.workers[2]["pid"], signal.SIGKILL)
            with pytest.raises(RequestFailed, match="worker process rank 2"):
                first.result(T)
            # submitted as the death is seen: they prefill while worker 2 is dead or starting
            after = [rt.submit({"prompt": p, "params": SamplingParams(max_tokens=n)})
                     for p, n in CASES[:3]]
            assert_close([h.result(T) for h in after], reference[:3])
        both_idle(rt)


def test_a_dead_prefill_worker_spares_the_requests_that_moved_on_to_decode():
    with PlacedRuntime("placement_models:tiny_llama", SPLIT, progress=False,
                       restart="auto") as rt:
        params = SamplingParams(max_tokens=60, ignore_eos=True)
        handles = [rt.submit({"prompt": [3, 1, 4, 1, 5][:k + 1], "params": params})
                   for k in range(3)]
        for h in handles:  # a few tokens decoded on worker 2: nothing of theirs is on worker 1
            tokens = (v for name, v in h if name == "token")
            next(tokens), next(tokens), next(tokens)
        os.kill(rt.workers[1]["pid"], signal.SIGKILL)
        assert [len(h.result(T)["token"]) for h in handles] == [60] * 3
        assert wait_until(lambda: rt.workers[1]["state"] == "up", timeout=T)  # restarted
        both_idle(rt)


def test_a_move_to_a_worker_that_is_restarting_waits_and_to_one_that_is_down_fails():
    links = {1: _Link(1), 2: _Link(2)}
    links[2].state = "starting"
    failed: list = []
    moves = ParentMoves({"lm": {"prefill": 1, "decode": 2}}, links, 5.0,
                        fail=lambda rid, message: failed.append((rid, message)))
    moves.begin(RequestContext(id=7, inputs={}), "prefill", "decode")
    assert links[1].moved == [7]  # worker 1's death no longer fails it
    time.sleep(0.2)
    assert links[2].sent == [] and links[1].sent == []  # waiting for the new generation
    links[2].gen, links[2].state = 1, "up"
    assert wait_until(lambda: links[1].sent == ["kv_send"], timeout=T)
    assert links[2].sent == ["kv_recv"]
    links[2].state = "down"
    moves.begin(RequestContext(id=8, inputs={}), "prefill", "decode")
    assert wait_until(lambda: failed, timeout=T)
    assert failed == [(8, "its K/V could not move from worker rank 1 to 2: worker rank 2 is "
                          "down")]
    moves.close()


def test_moves_wait_apart_a_dead_sender_fails_at_once_and_a_broken_channel_is_retired():
    links = {r: _Link(r) for r in (1, 2, 3)}
    failed: list = []
    moves = ParentMoves({"lm": {"prefill": 1, "decode": 2, "other": 3}}, links, 5.0,
                        fail=lambda rid, message: failed.append((rid, message)))
    links[2].state = "starting"
    moves.begin(RequestContext(id=1, inputs={}), "prefill", "decode")  # waits for rank 2
    moves.begin(RequestContext(id=2, inputs={}), "prefill", "other")  # not behind it
    assert wait_until(lambda: links[3].sent == ["kv_recv"], timeout=T)
    assert links[2].sent == [] and failed == []
    links[2].state = "up"
    assert wait_until(lambda: links[2].sent == ["kv_recv"], timeout=T)
    assert links[2].msgs[0]["key"] == "1g0-2g0e0"
    # the sender died between the walk change and the notice: failed now, not after a timeout
    links[1].state = "starting"
    moves.begin(RequestContext(id=3, inputs={}), "prefill", "decode")
    links[1].gen = 1
    assert wait_until(lambda: failed, timeout=T)
    assert failed == [(3, "its K/V could not move from worker rank 1 to 2: worker rank 1 "
                          "died at the walk change (starting)")]
    links[1].state = "up"
    # a request failed by a broken channel: the next move meets on a fresh one
    moves.ended(1, RequestFailed("its K/V never arrived: the K/V channel broke (1g0-2g0e0)"))
    moves.begin(RequestContext(id=4, inputs={}), "prefill", "decode")
    assert wait_until(lambda: len(links[2].msgs) == 3, timeout=T)  # kv_recv, release, kv_recv
    assert links[2].msgs[-1]["key"] == "1g1-2g0e1"
    moves.close()


def test_a_receiver_fails_items_whose_kv_never_come_within_kv_timeout_s():
    """Items that overtook their move's notice are held; if the K/V never come (the notice
    went to a generation that died), the heartbeat's expire() fails them by name."""
    from types import SimpleNamespace

    from mstar_rt.placement.kv_moves import MOVING, WorkerMoves

    handle = SimpleNamespace(context=SimpleNamespace(state={MOVING: 1}))
    host = SimpleNamespace(requests={7: handle}, every_engine={})
    failed: list = []
    moves = WorkerMoves(host, 2, lambda ids, message: failed.append((ids, message)),
                        lambda *a: None)
    item = SimpleNamespace(id=70, request=7)
    assert moves.hold(3, 0, [item]) == []  # held: its K/V are on the way
    moves.expire()
    assert failed == [] and moves.stats()["kv_waiting"] == 1
    moves.timeout_s = 0.05
    time.sleep(0.1)
    moves.expire()
    assert failed == [([70], "its K/V did not arrive within kv_timeout_s=0.05")]
    assert moves.hold(3, 0, [SimpleNamespace(id=71, request=7)]) == []  # later ones fail too
    assert failed[-1][0] == [71]


def test_k_v_that_cannot_move_fail_their_request_naming_the_other_worker():
    """The channel broke (here it never came up: no store answers; in the soak, the other
    worker was killed mid-move): on the sender, the request fails naming rank 2, the worker the
    K/V were for, and the channel, the K/V it exported not kept; on the receiver, its held
    items fail naming rank 1, the worker they were to come from."""
    import socket
    from types import SimpleNamespace

    from mstar_rt.placement.kv_moves import WorkerMoves

    exported: list = []
    engine = SimpleNamespace(export_request=lambda rid, free, device: exported.append(rid) or [],
                             release=lambda rid: None)
    sub = SimpleNamespace(handoff_state=lambda state: {})
    host = SimpleNamespace(requests={5: SimpleNamespace(context=SimpleNamespace(state={}))},
                           every_engine={"lm": engine}, submodules_of=lambda name: [sub])
    failed: list = []
    moves = WorkerMoves(host, 1, lambda ids, message: None, lambda *a: None,
                        lambda rid, message: failed.append((rid, message)))
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    try:
        moves.notice("kv_send", {"request": 5, "engine": "lm", "key": "1g0-2g0e0", "port": port,
                                 "timeout_s": 0.3, "peer": 2})
        assert wait_until(lambda: failed, timeout=T)
        assert exported == [5]  # freed from the sender's pages as it was exported
        (rid, message), = failed
        assert rid == 5 and message.startswith(
            "its K/V could not be sent to worker rank 2: the K/V channel broke (1g0-2g0e0): it "
            "could not be set up"), message
    finally:
        moves.close()
    sub.handoffs = None
    items: list = []
    receiver = WorkerMoves(host, 2, lambda ids, message: items.append((ids, message)),
                           lambda *a: None)
    try:
        receiver.notice("kv_recv", {"request": 5, "engine": "lm", "key": "1g0-2g0e0",
                                    "port": port, "timeout_s": 0.3, "peer": 1})
        assert receiver.hold(3, 0, [SimpleNamespace(id=50, request=5)]) == []  # held: coming
        assert wait_until(lambda: items, timeout=T)
        (ids, message), = items
        assert ids == [50] and message.startswith(
            "its K/V never arrived from worker rank 1: the K/V channel broke (1g0-2g0e0)"), message
    finally:
        receiver.close()


def test_a_request_the_decode_cache_can_never_hold_fails_alone(reference):
    small = [NodeGroup(["prefill"], rank=1),
             NodeGroup(["decode"], rank=2, model_kwargs={"num_pages": 6})]
    with PlacedRuntime("placement_models:tiny_llama", small, progress=False) as rt:
        big = rt.submit({"prompt": list(range(1, 20)),
                         "params": SamplingParams(max_tokens=60, ignore_eos=True)})
        fits = rt.submit({"prompt": [1, 2, 3], "params": SamplingParams(max_tokens=9)})
        with pytest.raises(RequestFailed, match="num_pages"):
            big.result(T)
        assert_close([fits.result(T)], reference[:1])
        one, two = both_idle(rt)
        assert one["kv_pages_in_use"] == two["kv_pages_in_use"] == 0 and two["kv_waiting"] == 0


# ---- refused at start --------------------------------------------------------------------------

class NoHandoff(KVNodeSubmodule):
    """A KV node with no handoff: its requests' K/V cannot move."""

    def kv_layout(self) -> KVLayout:
        return KVLayout(num_layers=1, num_kv_heads=1, head_dim=4)

    def forward_kv(self, works, step):
        raise AssertionError("never run")


def no_handoff_lm():
    lm = pm.tiny_llama()
    lm.nodes = [dataclasses.replace(n, submodule=NoHandoff()) for n in lm.nodes]
    return lm


def parted_lm():
    """The tiny LM whose decode walk is a Part (its sub-walk the decode loop)."""
    lm = pm.tiny_llama()
    lm.walks = {"prefill": "prefill", "decode": Part("gen", {"d": lm.walks["decode"]})}
    return lm


def test_a_walk_whose_engine_nodes_sit_in_a_part_moves_its_kv(reference):
    """The decode loop inside a Part of the decode walk: the walk still runs the engine on
    one rank, so the K/V move at the walk change, as without the Part. Either way the decode
    walk is a segment whose first step reads the token the prefill walk persisted (colocated
    too: that read was missed until 2026-12-05)."""
    for groups in (SPLIT, COLOCATED):
        with PlacedRuntime("test_placement_disagg:parted_lm", groups, progress=False) as rt:
            assert "segment:decode:0" in rt.node_names
            assert_close(run_all(rt, CASES[:3]), reference[:3])
            stats = [idle(rt, rank) for rank in sorted(rt.workers)]
            assert all(s["kv_pages_in_use"] == 0 for s in stats)
            if groups is SPLIT:
                assert rt.plan.kv_moves == {"lm": {"prefill": 1, "decode": 2}}
                assert stats[1]["kv_received"] >= 3


def test_splits_that_cannot_move_kv_are_refused_naming_the_groups():
    one_walk = pm.tiny_llama(num_pages=8)
    one_walk.walks = {"all": Part("gen", {"p": "prefill", "d": one_walk.walks["decode"]})}
    with pytest.raises(ValueError, match=r"walk 'all' runs nodes of KV engine 'lm' on ranks "
                                         r"\[1, 2\].*not between a Part's sub-walks"):
        make_plan(one_walk, SPLIT)
    with pytest.raises(ValueError, match=r"NoHandoff.*no KV handoff.*\['prefill'\] on rank 1, "
                                         r"\['decode'\] on rank 2"):
        PlacedRuntime("test_placement_disagg:no_handoff_lm", SPLIT, progress=False)
    with pytest.raises(ValueError, match="share engine 'lm'.*rank 0.*parent"):
        make_plan(pm.tiny_llama(num_pages=8), [NodeGroup(["prefill"], rank=1)])
    with pytest.raises(ValueError, match=r"group \['decode'\] on rank 2 has tp_size 2.*give those "
                                         "groups tp_size 1"):
        make_plan(pm.tiny_llama(num_pages=8), [NodeGroup(["prefill"], rank=1),
                                               NodeGroup(["decode"], rank=2, tp_size=2)])
    with pytest.raises(ValueError, match=r"group \['decode'\] on rank 2 has tp_size 2"):
        make_plan(pm.tiny_llama(num_pages=8), [  # the size given as the factory's argument too
            NodeGroup(["prefill"], rank=1), NodeGroup(["decode"], rank=2,
                                                      model_kwargs={"tp_size": 2})])
    with pytest.raises(ValueError, match=r"rank 1 \(nodes \['prefill'\] and \['decode'\]\) give "
                                         r"different model_kwargs \(tp_size included\)"):
        make_plan(pm.tiny_llama(num_pages=8), [NodeGroup(["prefill"], rank=1),
                                               NodeGroup(["decode"], rank=1, tp_size=2)])

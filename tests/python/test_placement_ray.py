"""Placement ranks as Ray actors (issue 17, item 4): ``PlacedRuntime(..., launcher="ray")`` runs
each worker rank as a Ray actor on the node whose resources its NodeGroup asks for, on a
two-node local cluster (tests/python/ray_cluster.py, every address on loopback). Control crosses
over ZeroMQ ``tcp://`` and tensors inside the messages, except a large one that one actor makes
for another, which that one fetches from its maker, and a request's K/V moving from a prefill
actor to a decode actor on the other node; the outputs equal the in-process Runtime's (the
pipeline's every value kind, and greedy tokens and logits of a KV-cache LM); an
actor killed mid-run fails only the requests it held and, restarted by Ray, serves again; a
rank that cannot start fails clearly; close leaves no actor or process."""

from __future__ import annotations

import os
import signal
import time
from typing import Iterator

import pytest

# The shared cluster helper sets this run's Ray token; it must come before Ray is imported.
from ray_cluster import HEAD_IP, NODE2_IP, local_cluster

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'mstar_rt[ray]'; CI "
                                        "installs it)")

from mstar_rt import RequestFailed, Runtime  # noqa: E402
from mstar_rt.config import ConfigError  # noqa: E402
from mstar_rt.placement import (ModelSpec, NodeGroup, PlacedRuntime,  # noqa: E402
                                WorkerStartError, read_config)

import placement_models as pm  # noqa: E402
from placement_support import (PROMPTS, T, alive, generate, pipeline_inputs,  # noqa: E402
                               reference_outputs, same, worker_children)
from walk_models import wait_until  # noqa: E402

# Each node: 2 CPUs and a slot resource that pins a rank to it.
HEAD, NODE2 = {"head_slot": 4}, {"node2_slot": 4}
ON_HEAD = dict(num_cpus=0.25, resources={"head_slot": 1})
ON_NODE2 = dict(num_cpus=0.25, resources={"node2_slot": 1})
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture(scope="module")
def cluster():
    with local_cluster(HEAD, NODE2) as c:
        yield c


@pytest.fixture(scope="module")
def reference() -> dict:
    return reference_outputs()


def _slots() -> dict[str, float]:
    free = ray.available_resources()
    return {k: free.get(k, 0.0) for k in ("head_slot", "node2_slot")}


def _closed_cleanly(rt: PlacedRuntime, pids: list[int], before: dict[str, float]) -> None:
    """Closes ``rt``: its actors' processes end and their resources are free again."""
    rt.close()
    assert wait_until(lambda: not [p for p in pids if alive(p)], timeout=T), \
        "actor processes outlived close()"
    assert wait_until(lambda: _slots() == before, timeout=T), (_slots(), before)


@pytest.fixture(scope="module")
def placed(cluster) -> Iterator[PlacedRuntime]:
    """The pipeline with its encoder on the head node and its loop on the second node."""
    before = _slots()
    rt = PlacedRuntime("placement_models:pipeline",
                       [NodeGroup(["encoder"], rank=1, **ON_HEAD),
                        NodeGroup(["backbone", "collect"], rank=2, **ON_NODE2)],
                       launcher="ray", ray_address=cluster.address, restart="auto",
                       progress=False)
    yield rt
    _closed_cleanly(rt, [w["pid"] for w in rt.workers.values()], before)


def test_ranks_run_as_actors_on_the_nodes_their_resources_name(placed):
    w = placed.workers
    assert (w[1]["node"], w[2]["node"]) == (HEAD_IP, NODE2_IP)
    assert w[1]["endpoint"].startswith(f"tcp://{HEAD_IP}:")
    assert w[2]["endpoint"].startswith(f"tcp://{NODE2_IP}:")
    assert w[1]["shm"] == [] and w[2]["shm"] == []  # tensors travel inside the messages
    assert w[1]["pid"] != os.getpid() and alive(w[1]["pid"]) and alive(w[2]["pid"])
    assert _slots() == {"head_slot": 3, "node2_slot": 3}


def test_cross_actor_outputs_equal_in_process(placed, reference):
    inputs = pipeline_inputs(6)
    handles = [placed.submit(inp) for inp in inputs]  # concurrent: batched across requests
    for handle, want in zip(handles, reference["walk"]):
        assert same(handle.result(T), want)
    stats = placed.worker_stats(2)
    assert stats["live_requests"] == 0 and stats["p2w_bytes_in_use"] == 0


def test_a_kv_cache_lm_on_the_second_node_equals_in_process(cluster, reference):
    before = _slots()
    rt = PlacedRuntime("placement_models:tiny_llama",
                       [NodeGroup(["prefill", "decode"], rank=1, **ON_NODE2)],
                       launcher="ray", progress=False)  # joins the connected cluster
    try:
        assert rt.workers[1]["node"] == NODE2_IP
        got = generate(rt, PROMPTS)  # one at a time, as the reference ran (same batches)
        for g, want in zip(got, reference["lm"]):
            assert same(g, want)  # tokens and float32 logits, exactly
        assert rt.worker_stats(1)["kv_pages_in_use"] == 0
    finally:
        _closed_cleanly(rt, [rt.workers[1]["pid"]], before)


def test_prefill_on_one_node_and_decode_on_the_other_equal_in_process(cluster):
    """Disaggregation across machines: the request's K/V move from the head node's actor to the
    second node's over gloo, rendezvous at the parent's node address (placement/kv_moves.py)."""
    from test_placement_disagg import CASES, assert_close, run_all

    with Runtime(pm.tiny_llama()) as local:
        want = run_all(local)
    before = _slots()
    rt = PlacedRuntime("placement_models:tiny_llama",
                       [NodeGroup(["prefill"], rank=1, **ON_HEAD),
                        NodeGroup(["decode"], rank=2, **ON_NODE2)],
                       launcher="ray", progress=False)
    try:
        assert (rt.workers[1]["node"], rt.workers[2]["node"]) == (HEAD_IP, NODE2_IP)
        assert_close(run_all(rt), want)  # tokens exact, float32 logits within 1e-4
        one, two = rt.worker_stats(1), rt.worker_stats(2)
        assert one["kv_sent"] == len(CASES) and two["kv_waiting"] == 0
        assert one["kv_pages_in_use"] == 0 and two["kv_pages_in_use"] == 0
    finally:
        _closed_cleanly(rt, [rt.workers[1]["pid"], rt.workers[2]["pid"]], before)


def _llama_at_tp1(tmp_path) -> tuple[list, list]:
    """A tiny Llama checkpoint saved at ``tmp_path``, three greedy requests, and what the
    in-process Runtime at tp_size 1 answers them."""
    from llama_ref import BASE, greedy, make_prompts, run_all
    from tp_support import save_llama

    save_llama(tmp_path)
    prompts = make_prompts(BASE["vocab_size"], (5, 9, 3), seed=7)
    reqs = [greedy(p, 6) for p in prompts]
    with Runtime(pm.checkpoint_lm(str(tmp_path))) as local:
        return reqs, run_all(local, reqs)


def _equal_to_tp1(rt: PlacedRuntime, reqs: list, want: list) -> None:
    """Tokens equal and float32 logits within 1e-4 of ``want``."""
    import torch
    from llama_ref import run_all

    for g, w in zip(run_all(rt, reqs), want, strict=True):
        assert g["token"] == w["token"]
        assert all(torch.allclose(a, b, atol=1e-4, rtol=0)
                   for a, b in zip(g["logits"], w["logits"], strict=True))


def test_a_tensor_parallel_rank_runs_in_an_actor_equal_to_tp1(cluster, tmp_path):
    """A node group with ``tp_size: 2`` as a Ray actor on the second node: the actor drives
    the LM and starts its follower beside it (gloo on that node); greedy tokens equal and
    float32 logits within 1e-4 of the same checkpoint at tp_size 1 in process."""
    reqs, want = _llama_at_tp1(tmp_path)
    before = _slots()
    rt = PlacedRuntime.from_config({
        "model": {"class": "placement_models:checkpoint_lm", "args": {"path": str(tmp_path)}},
        "launcher": "ray", "progress": False,
        "node_groups": [{"nodes": ["prefill", "decode"], "rank": 1, "tp_size": 2, **ON_NODE2}]})
    actor = rt.workers[1]["pid"]
    followers = sorted(worker_children(actor, b"mstar_rt.distributed"))
    try:
        assert rt.workers[1]["node"] == NODE2_IP
        assert len(followers) == 1, "the actor did not start its tensor-parallel follower"
        _equal_to_tp1(rt, reqs, want)
    finally:
        _closed_cleanly(rt, [actor, *followers], before)


def test_one_models_tensor_parallel_ranks_on_two_nodes_equal_tp1(cluster, tmp_path):
    """``tp_resources`` puts the follower in a Ray actor of its own on the second node while the
    driver's actor sits on the head node (the group meets at the driver's node address): tokens
    equal and float32 logits within 1e-4 of tp_size 1 in process; the follower holds a slot of
    the second node while it runs. Killed mid-request, it fails that request naming its rank
    and node, and the group is rebuilt with a new follower actor there (restart auto) that
    answers the next requests as before; close frees every slot."""
    from llama_ref import greedy

    reqs, want = _llama_at_tp1(tmp_path)
    before = _slots()
    rt = PlacedRuntime.from_config({
        "model": {"class": "placement_models:checkpoint_lm", "args": {"path": str(tmp_path)}},
        "launcher": "ray", "progress": False,
        "node_groups": [{"nodes": ["prefill", "decode"], "rank": 1, "tp_size": 2, **ON_HEAD,
                         "tp_resources": [{"node2_slot": 1}]}]})
    actor = rt.workers[1]["pid"]
    follower = worker_children(None, b"FollowerActor")  # Ray titles it ray::FollowerActor
    try:
        assert rt.workers[1]["node"] == HEAD_IP
        assert not worker_children(actor, b"mstar_rt.distributed"), "a local follower started"
        assert len(follower) == 1
        assert _slots() == {"head_slot": before["head_slot"] - 1,
                            "node2_slot": before["node2_slot"] - 1}
        _equal_to_tp1(rt, reqs, want)
        long = iter(rt.submit(greedy(reqs[0]["prompt"], 100, ignore_eos=True)))
        next(long), next(long)
        os.kill(next(iter(follower)), signal.SIGKILL)
        with pytest.raises(RequestFailed, match=rf"rank 1 \(pid \d+ on {NODE2_IP}\)"):
            list(long)
        _equal_to_tp1(rt, reqs, want)
        again = worker_children(None, b"FollowerActor")
        assert len(again) == 1 and again != follower
        follower |= again
        assert _slots()["node2_slot"] == before["node2_slot"] - 1
    finally:
        _closed_cleanly(rt, [actor, *follower], before)


def test_a_follower_no_node_can_hold_fails_at_once_and_leaves_no_actor(cluster, tmp_path):
    from tp_support import save_llama

    save_llama(tmp_path)
    before = _slots()
    t0 = time.monotonic()
    with pytest.raises(WorkerStartError, match=r"follower rank 1 asks for 1 'nowhere'"):
        PlacedRuntime.from_config({
            "model": {"class": "placement_models:checkpoint_lm", "args": {"path": str(tmp_path)}},
            "launcher": "ray", "progress": False,
            "node_groups": [{"nodes": ["prefill", "decode"], "rank": 1, "tp_size": 2, **ON_HEAD,
                             "tp_resources": [{"nowhere": 1}]}]})
    assert time.monotonic() - t0 < 60, "it waited for a placement that cannot happen"
    assert wait_until(lambda: _slots() == before, timeout=T), (_slots(), before)


def test_tp_resources_need_the_ray_launcher_and_one_map_per_follower():
    with pytest.raises(ValueError, match="tp_resources places tensor-parallel followers as Ray"):
        PlacedRuntime("placement_models:pipeline",
                      [NodeGroup(["encoder"], rank=1, tp_size=2, tp_resources=[{"x": 1}])],
                      progress=False)
    with pytest.raises(ConfigError, match=r"node_groups\[0\].tp_resources: 2 resource maps "
                                          r"for tp_size 2"):
        read_config({"model": "placement_models:pipeline", "launcher": "ray", "node_groups": [
            {"nodes": ["encoder"], "rank": 1, "tp_size": 2, "tp_resources": [{"a": 1}, {"b": 1}]}]})


def test_a_large_tensor_goes_actor_to_actor_not_through_the_parent(cluster):
    """The 1 MiB tensor rank 1 (head node) makes for rank 2 (second node): the parent routes a
    handle, rank 2 fetches the bytes from rank 1 over tcp (placement/peer_bytes.py)."""
    import torch
    from test_placement_direct import expected

    before = _slots()
    rt = PlacedRuntime("test_placement_direct:pipe",
                       [NodeGroup(["make"], rank=1, **ON_HEAD),
                        NodeGroup(["use"], rank=2, **ON_NODE2)],
                       launcher="ray", progress=False)
    try:
        assert rt.workers[1]["direct"] == ["big", "small"]  # small stays below direct_bytes
        handles = [rt.submit({"x": torch.tensor([float(i)])}) for i in range(6)]
        for i, h in enumerate(handles):
            assert torch.allclose(h.result(T)["y"][0], expected(float(i)))
        assert rt.workers[1]["exports"] == 6  # the parent got six handles, not six MiB
        assert rt.worker_stats(1)["exports_served"] == 6  # rank 2 fetched each from rank 1
        assert wait_until(lambda: rt.worker_stats(1)["export_bytes_in_use"] == 0, T)
    finally:
        _closed_cleanly(rt, [rt.workers[1]["pid"], rt.workers[2]["pid"]], before)


def test_a_killed_actor_fails_only_its_requests_and_ray_restarts_it(placed, reference):
    inp = pipeline_inputs(1)[0]
    victim = placed.submit({**inp, "delay": 5.0})  # in the encoder, on rank 1
    assert wait_until(lambda: placed.workers[1]["inflight_items"] == 1, timeout=T)
    other = placed.submit({"x": inp["x"], "mode": "direct", "pause": 0.2})  # rank 2 only
    old_pid, old_gen = placed.workers[1]["pid"], placed.workers[1]["gen"]
    t0 = time.monotonic()
    os.kill(old_pid, signal.SIGKILL)
    with pytest.raises(RequestFailed) as err:
        victim.result(T)
    took = time.monotonic() - t0
    assert "node 'encoder'" in str(err.value) and "rank 1" in str(err.value), err.value
    assert "Ray actor" in str(err.value), err.value
    assert took < 5.0, f"the request failed {took:.2f} s after the kill"
    with Runtime(pm.pipeline()) as rt:
        assert same(other.result(T), rt.submit({"x": inp["x"], "mode": "direct",
                                                "pause": 0.2}).result(T))
    # Ray restarts the actor's process; the link (restart="auto") rebuilds the rank there
    assert wait_until(lambda: placed.workers[1]["state"] == "up"
                      and placed.workers[1]["gen"] > old_gen, timeout=90)
    assert placed.workers[1]["pid"] != old_pid and not alive(old_pid)
    assert placed.workers[1]["node"] == HEAD_IP
    assert same(placed.submit(inp).result(T), reference["walk"][0])
    # by hand: ray.kill ends the process, Ray starts another, the rank is rebuilt there
    second = placed.workers[1]["pid"]
    placed.restart_worker(1)
    assert placed.workers[1]["state"] == "up" and placed.workers[1]["pid"] != second
    assert same(placed.submit(inp).result(T), reference["walk"][0])


def test_a_thinker_streams_into_a_talker_segment_across_ray_nodes(cluster):
    """Streams entering a segment (placement/stream_in.py) between actors on two nodes, over
    tcp: the thinker's loop (head) pushes its items, they enter the talker's loop (second
    node) window by window; outputs equal one process."""
    import torch

    import placement_segment_models as sm
    before = _slots()
    rt = PlacedRuntime("placement_segment_models:fed",
                       [NodeGroup(["prefill", "think"], rank=1, **ON_HEAD),
                        NodeGroup(["talk", "voice"], rank=2, **ON_NODE2)],
                       launcher="ray", progress=False)
    try:
        assert [n for n in rt.node_names if n.startswith("segment:")] == \
            ["segment:speak:0", "segment:speak:1"]
        with Runtime(sm.fed()) as local:
            for kw in ({}, {"n": 8, "m": 3}, {"n": 2, "m": 9}):
                c = {"x": torch.tensor(0.4), **kw}
                want = sorted((k, round(float(v), 6)) for k, v in local.submit(c))
                assert sorted((k, round(float(v), 6)) for k, v in rt.submit(c)) == want
    finally:
        _closed_cleanly(rt, [w["pid"] for w in rt.workers.values()], before)


def test_a_rank_that_cannot_start_fails_clearly_and_leaves_no_actor(cluster):
    before = _slots()
    with pytest.raises(WorkerStartError, match=r"rank 1 failed to start.*missing_dependency"):
        PlacedRuntime(ModelSpec("placement_models:pipeline"),
                      [NodeGroup(["backbone"], rank=1, model_kwargs={"fail": True}, **ON_NODE2)],
                      launcher="ray", progress=False)
    assert wait_until(lambda: _slots() == before, timeout=T), (_slots(), before)


def test_the_config_names_the_launcher_and_each_ranks_resources():
    kwargs = read_config({"model": "placement_models:pipeline", "launcher": "ray",
                          "ray_address": "10.0.0.5:6379",
                          "node_groups": [{"nodes": ["encoder"], "rank": 1, "num_gpus": 0.5,
                                           "resources": {"vision_box": 1}}]})
    assert kwargs["launcher"] == "ray" and kwargs["ray_address"] == "10.0.0.5:6379"
    group = kwargs["node_groups"][0]
    assert (group.num_gpus, group.resources) == (0.5, {"vision_box": 1.0})
    with pytest.raises(ConfigError, match="launcher: must be 'process'"):
        read_config({"model": "placement_models:pipeline", "launcher": "slurm"})
    with pytest.raises(ConfigError, match=r"node_groups\[0\].resources: an in-process group"):
        read_config({"model": "placement_models:pipeline", "node_groups": [
            {"nodes": ["encoder"], "process": False, "resources": {"x": 1}}]})

"""Tensor-parallel Llama (tp_size 2: this process and one follower, gloo on CPU) against the same
checkpoint at tp_size 1: greedy tokens equal and float32 logits within 1e-4 through the KV
engine (concurrent requests of different lengths, small pages, decode steps), pages copied on
write reaching the follower, splits that cannot work refused before any process starts, the
``tp_size`` key of a node group, a follower killed mid-generation failing its requests with a
clear error and the group rebuilt for the next ones, a hung follower given up after the
collective timeout, and no follower outliving its driver (closed or killed). What a rebuilt
group refuses is in test_tensor_parallel_restart.py. NCCL on CUDA is the same code with
another backend and has never run here.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from mstar_rt import RequestFailed  # noqa: E402
from mstar_rt.distributed.llama_tp import load_llama_tp  # noqa: E402
from mstar_rt.distributed.tp_driver import TensorParallelLM  # noqa: E402
from mstar_rt.models.causal_lm import CausalLM  # noqa: E402
from mstar_rt.models.llama import load_llama  # noqa: E402

from child_env import child_env  # noqa: E402
from llama_ref import BASE, greedy, make_lm, make_prompts, run_all  # noqa: E402
from placement_support import alive  # noqa: E402
from tp_support import children, follower_pids, run_steps, save_llama  # noqa: E402
from walk_models import close_within, wait_until  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conftest.py

TOL = 1e-4
T = 60.0
HANG_S = 5.0  # the shared group's collective timeout: how long a hung follower is waited for


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama_tp")
    save_llama(path)
    return path


@pytest.fixture(scope="module")
def tp2(checkpoint):
    module = load_llama_tp(checkpoint, 2, timeout_s=HANG_S)
    pids = follower_pids(module)
    assert len(pids) == 1 and all(alive(p) for p in pids)
    yield module
    module.close()
    assert not any(alive(p) for p in pids), "close() left a follower running"


def logit_diff(a: dict, b: dict) -> float:
    return (torch.stack(a["logits"]) - torch.stack(b["logits"])).abs().max().item()


# ---- parity ------------------------------------------------------------------------------------

def test_tp2_equals_tp1_on_concurrent_requests_through_the_kv_engine(checkpoint, tp2, serve):
    one = load_llama(checkpoint, progress=False)
    assert tp2.kv_layout().num_kv_heads * 2 == one.kv_layout().num_kv_heads
    prompts = make_prompts(BASE["vocab_size"], (1, 4, 7, 12, 19, 26), seed=3)
    results = {}
    for name, module in (("tp1", one), ("tp2", tp2)):
        rt = serve(make_lm(module, page_size=4, num_pages=128))
        results[name] = run_all(rt, [greedy(p, 24) for p in prompts])
        engine = rt.engines["lm"]
        assert max(engine.step_sizes) > 1, "the requests never shared a step"
        assert wait_until(lambda: engine.cache.free_pages == engine.cache.num_pages, T), \
            "finished requests kept KV pages"
        close_within(rt)
    for p, a, b in zip(prompts, results["tp1"], results["tp2"]):
        assert len(b["token"]) == 24
        assert a["token"] == b["token"], f"prompt of {len(p)}: greedy tokens differ"
        assert logit_diff(a, b) < TOL, f"prompt of {len(p)}: logits differ by {logit_diff(a, b)}"
    assert len({tuple(r["token"]) for r in results["tp2"]}) > 1  # the prompts mattered


def test_pages_copied_on_write_reach_the_follower(checkpoint, tp2):
    """A fork shares main's half-filled last page; the branch's first write copies it on the
    driver, and the follower must copy its share too or the branch reads zeros there."""
    one = load_llama(checkpoint, progress=False)
    script = [[("main", [5, 9, 2, 7, 11, 3])],            # 1.5 pages
              ("fork", "main", "branch"),
              [("branch", [8, 1]), ("main", [4])],        # both write into the shared page
              [("branch", [6]), ("main", [12])]]
    want, got = run_steps(one, script), run_steps(tp2, script)
    for i, (a, b) in enumerate(zip(want, got)):
        assert (a - b).abs().max().item() < TOL, f"step {i} differs"


# ---- refusals ----------------------------------------------------------------------------------

def test_splits_that_do_not_divide_are_refused_before_any_process_starts(checkpoint, tmp_path,
                                                                         tp2):
    save_llama(tmp_path / "kv1", num_key_value_heads=1)
    before = set(children())
    with pytest.raises(ValueError, match=r"tp_size 2 does not divide num_key_value_heads 1 .*"
                                         r"use a tp_size that divides .* \(one of \[1\]\)"):
        load_llama_tp(tmp_path / "kv1", 2)
    with pytest.raises(ValueError, match=r"tp_size 3 does not divide num_attention_heads 4, "
                                         r"num_key_value_heads 2 .*\(one of \[1, 2\]\)"):
        CausalLM.from_pretrained(checkpoint, tp_size=3)
    with pytest.raises(ValueError, match=r"expert_parallel=True splits a mixture of experts .* "
                                         r"has none: drop expert_parallel"):
        CausalLM.from_pretrained(checkpoint, tp_size=2, expert_parallel=True)
    with pytest.raises(ValueError, match="tp_restart must be 'auto', 'eager' or 'manual'"):
        CausalLM.from_pretrained(checkpoint, tp_restart="bogus")  # unread at tp_size 1
    if torch.cuda.device_count() < 2:  # each follower died of a torch._C error
        with pytest.raises(ValueError, match=r"device='cuda:0' with tp_size 2 needs CUDA "
                                             r"devices cuda:0 and the 1 after it"):
            CausalLM.from_pretrained(checkpoint, tp_size=2, device="cuda:0")
    assert set(children()) == before
    with pytest.raises(ValueError, match="tensor-parallel .* drop cuda_graphs"):
        CausalLM(tp2, cuda_graphs=True)


def test_a_hung_follower_fails_the_step_after_the_timeout_and_is_stopped(checkpoint, tp2):
    """Runs last of the tests that share ``tp2``: its group is rebuilt after the hang."""
    pid = follower_pids(tp2)[0]
    os.kill(pid, signal.SIGSTOP)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"tensor-parallel group .* failed: .*[Tt]imed out.*"
                                           rf"\[rank 1 \(pid {pid}\) is running\]; the next "
                                           "step restarts it"):
        run_steps(tp2, [[("main", [1, 2, 3])]])
    took = time.monotonic() - t0
    assert HANG_S - 1 < took < HANG_S + 10, f"gave up after {took:.1f} s"
    assert wait_until(lambda: not alive(pid), 10), "the hung follower was not stopped"
    script = [[("main", [5, 9, 2, 7, 11])], [("main", [4])]]
    got, want = run_steps(tp2, script), run_steps(load_llama(checkpoint, progress=False), script)
    assert tp2.restarts == 1 and follower_pids(tp2)[0] != pid
    assert max((a - b).abs().max().item() for a, b in zip(got, want)) < TOL


# ---- the config key, and a follower that dies ----------------------------------------------------

def test_node_group_tp_size_serves_it_and_a_killed_follower_fails_only_its_requests(checkpoint):
    """A follower SIGKILLed mid-generation fails the requests it was serving, naming the rank;
    the next step rebuilds the group (restart auto, the default) and serves the same tokens."""
    from mstar_rt.serve.config import build_model, build_runtime, load_config

    before = set(children())
    config = load_config({"model": {"checkpoint": str(checkpoint)},
                          "kv_cache": {"page_size": 4, "num_pages": 128},
                          "node_groups": [{"nodes": ["prefill", "decode"], "tp_size": 2}]})
    assert config.model.args == {"tp_size": 2}
    model = build_model(config)
    try:
        assert isinstance(model.module, TensorParallelLM) and model.module.tp_size == 2
        pids = follower_pids(model.module)
        rt = build_runtime(config, model)
        prompt = make_prompts(BASE["vocab_size"], (6,), seed=9)[0]
        want = run_all(rt, [greedy(prompt, 8)])[0]["token"]
        long = [rt.submit(greedy(p, 100)) for p in make_prompts(BASE["vocab_size"], (3, 9),
                                                                seed=4)]
        assert wait_until(lambda: all(len(h.stats()) >= 4 for h in long), T)
        assert rt.health() is None
        os.kill(pids[0], signal.SIGKILL)
        t0 = time.monotonic()
        for h in long:
            with pytest.raises(RequestFailed, match=r"tensor-parallel group .* failed.*rank 1 "
                                                    rf"\(pid {pids[0]}\) exited with code -9"):
                h.result(timeout=T)
        assert time.monotonic() - t0 < 15, "the failure took as long as a collective timeout"
        assert rt.submit(greedy(prompt, 8)).result(timeout=T)["token"] == want
        assert model.module.restarts == 1 and follower_pids(model.module)[0] != pids[0]
        assert rt.health() is None  # what /health and Ray Serve's check_health report
        engine = rt.engines["lm"]
        assert wait_until(lambda: engine.cache.free_pages == engine.cache.num_pages, T)
        assert len(want) == 8
        new = follower_pids(model.module)
        close_within(rt)
        assert not alive(pids[0])
    finally:
        model.close()
    assert not any(alive(p) for p in new) and set(children()) <= before, \
        "a follower outlived close()"


def test_followers_exit_when_their_driver_is_killed(checkpoint, tmp_path):
    script = (f"import sys, time\n"
              f"from mstar_rt.distributed.llama_tp import load_llama_tp\n"
              f"m = load_llama_tp({str(checkpoint)!r}, 2)\n"
              f"print(*[f.proc.pid for f in m.followers], flush=True)\n"
              f"time.sleep(120)\n")
    driver = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                              env=child_env())
    try:
        line = driver.stdout.readline()
        pids = [int(p) for p in line.split()]
        assert len(pids) == 1 and alive(pids[0]), f"the driver printed {line!r}"
        driver.kill()
        driver.wait(10)
        assert wait_until(lambda: not alive(pids[0]), 10), "the follower outlived its driver"
    finally:
        driver.kill()
        driver.wait()


def test_tp_size_key_reaches_the_factory_or_is_refused_with_the_fix():
    from mstar_rt.config import ConfigError, NodeGroup, load_config

    worker = NodeGroup(["prefill", "decode"], rank=1, tp_size=2)  # a worker builds with these
    assert worker.model_kwargs == {"tp_size": 2}
    assert NodeGroup(["decode"], rank=1).model_kwargs == {}
    with pytest.raises(ConfigError, match=r"tp_size: 2 but model_kwargs.tp_size is 4"):
        NodeGroup(["decode"], rank=1, tp_size=2, model_kwargs={"tp_size": 4})
    with pytest.raises(ConfigError, match=r"tp_size: must be a positive integer"):
        NodeGroup(["decode"], rank=1, tp_size=0)
    spec = {"class": "pkg.mod:build", "kwargs": {"size": 3}}
    config = load_config({"model": spec, "node_groups": [{"nodes": ["lm"], "tp_size": 2}]})
    assert config.model.args == {"size": 3, "tp_size": 2}
    short = load_config({"model": "pkg.mod:build", "node_groups": [{"nodes": ["lm"],
                                                                    "tp_size": 2}]})
    assert short.model.args == {"tp_size": 2}
    mixed = [{"nodes": ["lm"], "tp_size": 2}, {"nodes": ["vision"], "rank": 1, "process": True}]
    with pytest.raises(ConfigError, match="beside worker processes .* not supported yet"):
        load_config({"model": spec, "node_groups": mixed})
    with pytest.raises(ConfigError, match=r"args.tp_size is 4 .* give it once"):
        load_config({"model": {**spec, "kwargs": {"tp_size": 4}},
                     "node_groups": [{"nodes": ["lm"], "tp_size": 2}]})


def test_a_placed_group_that_lost_a_rank_is_replaced_by_a_restart(checkpoint):
    """A tensor-parallel group with tp_restart="manual" on a placement worker cannot take a
    rank back; its worker's heartbeat says so (Model.health) and the parent kills it, so
    restart="auto" brings up a new worker with a whole group that serves the same tokens."""
    from mstar_rt.placement import ModelSpec, NodeGroup, PlacedRuntime
    from placement_support import worker_children

    spec = ModelSpec("placement_models:checkpoint_lm", {"path": str(checkpoint),
                                                        "tp_restart": "manual"})
    prompt = make_prompts(BASE["vocab_size"], (6,), seed=9)[0]
    with PlacedRuntime(spec, [NodeGroup(["prefill", "decode"], rank=1, tp_size=2)],
                       restart="auto", progress=False) as rt:
        want = rt.submit(greedy(prompt, 8)).result(T)["token"]
        (follower,) = worker_children(rt.workers[1]["pid"], b"mstar_rt")
        os.kill(follower, signal.SIGKILL)
        assert wait_until(lambda: rt.workers[1]["restarts"] == 1
                          and rt.workers[1]["state"] == "up", T)
        last = rt.workers[1]["last_exit"]
        assert "could not serve" in last and "rank 1" in last and "load it again" in last, last
        assert rt.submit(greedy(prompt, 8)).result(T)["token"] == want and len(want) == 8
        assert rt.health() is None

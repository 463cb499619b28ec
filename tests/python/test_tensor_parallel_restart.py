"""A tensor-parallel group that lost a rank is rebuilt at its next step (restart "auto", the
default): new sequences run equal to tp_size 1, even in pages a lost sequence held before;
a sequence whose K/V was built before the rebuild is refused (the new followers hold none of
it), and so is a copy of it; "manual" and an exhausted ``max_restarts`` leave the group failing
with the fix named; a rebuild that cannot start says why and the next step tries again."""

from __future__ import annotations

import os
import shutil
import signal
import threading

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from mstar_rt.distributed.kv_loss import LostPages  # noqa: E402
from mstar_rt.distributed.llama_tp import load_llama_tp  # noqa: E402
from mstar_rt.engines.attention_base import SeqStep  # noqa: E402
from mstar_rt.engines.paged_kv import PagedKVCache  # noqa: E402
from mstar_rt.models.llama import load_llama  # noqa: E402

from tp_support import follower_pids, run_steps, save_llama, steps_of  # noqa: E402
from walk_models import wait_until  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conftest.py

TOL = 1e-4
PROMPT = [5, 9, 2, 7, 11, 3]  # 1.5 pages of 4


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama_tp_restart") / "lm"
    save_llama(path)
    return path


def kill_follower(module) -> int:
    """SIGKILLs the follower between steps, and waits until the driver can see it gone (a
    process shows as a zombie before it can be reaped)."""
    (follower,) = module.followers
    os.kill(follower.proc.pid, signal.SIGKILL)
    assert wait_until(lambda: follower.proc.poll() is not None, 10)
    return follower.proc.pid


@torch.inference_mode()
def step(module, cache: PagedKVCache, entry: list) -> torch.Tensor:
    out = module(torch.tensor([t for _label, toks in entry for t in toks]),
                 steps_of(cache, entry))
    for label, toks in entry:
        cache.commit(0, label, len(toks))
    return out


def test_lost_pages_follow_copies_and_become_whole_when_written_from_their_start():
    lost = LostPages({1, 2}, page_size=4)
    lost.follow_copies([(1, 5), (3, 2)])  # a copy of a lost page is lost; of a whole one, whole
    assert lost.pages == {1, 5}
    assert lost.reader([SeqStep(4, 1, [0, 9]), SeqStep(5, 1, [0, 1])]) == 1
    assert lost.reader([SeqStep(4, 1, [1, 9])]) == 0
    assert lost.reader([SeqStep(0, 9, [1, 5, 7])]) is None  # nothing cached: nothing read
    lost.written([SeqStep(2, 6, [1, 5])])  # slot 0 of page 5 written, page 1 only from slot 2
    assert lost.pages == {1}
    lost.written([SeqStep(0, 1, [1], persist=False)])  # not persisted: writes nothing
    assert lost.pages == {1}
    lost.written([SeqStep(0, 1, [1])])
    assert not lost


def test_a_rebuilt_group_refuses_kv_built_before_it_and_serves_new_sequences(checkpoint):
    one = load_llama(checkpoint, progress=False)
    m = load_llama_tp(checkpoint, 2)
    try:
        cache = PagedKVCache(m.kv_layout(), page_size=4, num_pages=32)
        step(m, cache, [("main", PROMPT)])
        pid = kill_follower(m)
        with pytest.raises(RuntimeError, match=r"K/V was built before the tensor-parallel group "
                                               r".* was restarted .*rank 1 \(pid \d+\) exited "
                                               r"with code -9.*submit the request again"):
            step(m, cache, [("main", [4])])
        assert m.restarts == 1 and follower_pids(m)[0] != pid and m.health() is None
        cache.fork(0, "main", "branch")  # its first write copies main's lost half page
        with pytest.raises(RuntimeError, match="built before"):
            step(m, cache, [("branch", [8])])
        # a new sequence beside them runs as at tp_size 1 ...
        script = [[("fresh", PROMPT)], [("fresh", [4])], [("fresh", [12])]]
        want = run_steps(one, script)
        got = [step(m, cache, entry) for entry in script]
        assert max((a - b).abs().max().item() for a, b in zip(want, got)) < TOL
        # ... and so does one in the pages the lost sequences held
        held = {p for label in ("main", "branch") for p in cache.sequence(0, label).pages}
        cache.drop(0, "main")
        cache.drop(0, "branch")
        again = [[("again", PROMPT + [1, 2, 3])], [("again", [4])]]
        got = [step(m, cache, entry) for entry in again]
        assert held & set(cache.sequence(0, "again").pages)
        want = run_steps(one, again)
        assert max((a - b).abs().max().item() for a, b in zip(want, got)) < TOL
    finally:
        m.close()


def test_kv_lost_at_one_rebuild_stays_lost_through_the_next(checkpoint):
    # The second rebuild counted only the caches stepped since the first: a refused step had
    # mirrored none, so the K/V lost at the first rebuild read as whole and decoded wrong (3.08).
    m = load_llama_tp(checkpoint, 2)
    try:
        cache = PagedKVCache(m.kv_layout(), page_size=4, num_pages=32)
        step(m, cache, [("main", PROMPT)])
        for restarts in (1, 2):
            kill_follower(m)
            with pytest.raises(RuntimeError, match="K/V was built before"):
                step(m, cache, [("main", [4])])
            assert m.restarts == restarts
    finally:
        m.close()


def test_manual_restart_and_spent_restarts_leave_the_group_failing_with_the_fix(checkpoint):
    manual = load_llama_tp(checkpoint, 2, restart="manual")
    try:
        cache = PagedKVCache(manual.kv_layout(), page_size=4, num_pages=32)
        pid = kill_follower(manual)
        assert f"rank 1 (pid {pid}) exited with code -9" in (manual.health() or "")
        for _ in range(2):
            with pytest.raises(RuntimeError, match=r"restart='manual' cannot take a rank back: "
                                                   "close this model and load it again"):
                step(manual, cache, [("main", PROMPT)])
        assert manual.restarts == 0
    finally:
        manual.close()
    once = load_llama_tp(checkpoint, 2, max_restarts=1)
    try:
        cache = PagedKVCache(once.kv_layout(), page_size=4, num_pages=32)
        kill_follower(once)
        step(once, cache, [("main", PROMPT)])  # rebuilt: restart 1 of 1
        kill_follower(once)
        with pytest.raises(RuntimeError, match=r"restarted 1 times \(max_restarts 1\): close "
                                               "this model and load it again"):
            step(once, cache, [("next", PROMPT)])
        assert "max_restarts 1" in (once.health() or "")
    finally:
        once.close()
    with pytest.raises(ValueError, match="restart must be 'auto', 'eager' or 'manual'"):
        load_llama_tp(checkpoint, 2, restart="always")


def _watchers() -> int:
    return sum(t.name == "mstar-tp-watch" for t in threading.enumerate())


def test_eager_rebuilds_as_soon_as_a_rank_is_lost_not_at_the_next_step(checkpoint):
    """restart="eager": the group is rebuilt while nothing runs, so the next request does not
    wait for a follower's start; lost K/V is refused as with "auto"; max_restarts holds; close
    ends the watcher."""
    one = load_llama(checkpoint, progress=False)
    before = _watchers()
    m = load_llama_tp(checkpoint, 2, restart="eager", max_restarts=2)
    try:
        assert _watchers() == before + 1
        cache = PagedKVCache(m.kv_layout(), page_size=4, num_pages=32)
        step(m, cache, [("main", PROMPT)])
        pid = kill_follower(m)
        assert wait_until(lambda: m.restarts == 1 and m.broken is None and len(m.followers) == 1
                          and follower_pids(m)[0] != pid, 60)  # no step asked for it
        assert m.health() is None
        with pytest.raises(RuntimeError, match="built before"):
            step(m, cache, [("main", [4])])
        got = step(m, cache, [("fresh", PROMPT)])
        assert m.restarts == 1  # the step found the group whole
        assert (got - run_steps(one, [[("fresh", PROMPT)]])[0]).abs().max().item() < TOL
        kill_follower(m)
        assert wait_until(lambda: m.restarts == 2 and m.broken is None, 60)
        kill_follower(m)  # restarts spent: the watcher leaves it broken, saying so
        assert wait_until(lambda: "max_restarts 2" in (m.health() or ""), 30)
        assert m.restarts == 2
        with pytest.raises(RuntimeError, match=r"restarted 2 times \(max_restarts 2\)"):
            step(m, cache, [("next", PROMPT)])
    finally:
        m.close()
    assert wait_until(lambda: _watchers() == before, 5)


def test_a_rebuild_that_cannot_start_says_why_and_the_next_step_tries_again(checkpoint,
                                                                               tmp_path):
    path = tmp_path / "lm"
    shutil.copytree(checkpoint, path)
    one = load_llama(checkpoint, progress=False)
    m = load_llama_tp(path, 2)
    try:
        cache = PagedKVCache(m.kv_layout(), page_size=4, num_pages=32)
        kill_follower(m)
        shutil.move(path, tmp_path / "moved")  # the new follower cannot load its share
        with pytest.raises(RuntimeError, match=r"restart 1 of 3 failed: RuntimeError: "
                                               r"tensor-parallel rank 1 .*; the next step "
                                               "restarts it"):
            step(m, cache, [("main", PROMPT)])
        assert m.health() is None and not m.followers
        shutil.move(tmp_path / "moved", path)
        got = step(m, cache, [("main", PROMPT)])
        assert m.restarts == 2
        assert (got - run_steps(one, [[("main", PROMPT)]])[0]).abs().max().item() < TOL
    finally:
        m.close()


def _torch_distributed_threads() -> int:
    """This process's threads that a process group or its store runs (gloo's loops, the
    store's libuv loop)."""
    names = []
    for t in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{t}/comm") as f:
                names.append(f.read().strip())
        except OSError:
            pass
    return sum(n.startswith(("gloo", "pt_gloo", "pt_tcpstore")) for n in names)


def test_close_lets_the_process_group_go_with_its_threads(checkpoint):
    """A closed model (kept referenced, as a server's config may keep it) holds no process
    group: the threads a group runs end with close, and a rebuild replaces them rather than
    adding to them."""
    before = _torch_distributed_threads()
    m = load_llama_tp(checkpoint, 2)
    try:
        cache = PagedKVCache(m.kv_layout(), page_size=4, num_pages=32)
        step(m, cache, [("main", PROMPT)])
        running = _torch_distributed_threads()
        assert running > before
        kill_follower(m)
        step(m, cache, [("fresh", PROMPT)])  # rebuilt
        assert wait_until(lambda: _torch_distributed_threads() == running, 10)
    finally:
        m.close()
    assert wait_until(lambda: _torch_distributed_threads() == before, 10)

"""A KV work on a label its request does not hold: a read (no persist) of a label never written
or freed already fails its request alone, naming the node, the label and the labels the request
holds, frees the request's pages, and the engine goes on serving; ``KVWork.must_exist`` makes a
persisting work need its label too, or lets a read attend over nothing on purpose.

Every numeric check compares against the float64 dense attention of kv_models.py.
"""

from __future__ import annotations

from typing import Any, Optional

import pytest
import torch

from mstar_rt import EMIT, GraphEdge, GraphNode, Model, RequestFailed
from mstar_rt.engines import KVCacheEngine
from mstar_rt.engines.kv_engine import KVWork
from mstar_rt.engines.paged_kv import PagedKVCache

from kv_models import Proj, ProjNode, assert_close, dense_attention
from walk_models import ZERO_LIVE, settled, wait_until

TIMEOUT = 30.0

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conftest.py


class ReadNode(ProjNode):
    """A ProjNode whose label, persist and must_exist come with the request's inputs."""

    def prepare_inputs(self, ctx: Any, inputs: dict) -> KVWork:
        work = super().prepare_inputs(ctx, inputs)
        work.label, work.persist = inputs["label"], inputs["persist"]
        work.must_exist = {"yes": True, "no": False}.get(inputs["must_exist"])
        return work


class LabelModel(Model):
    """Walk ``write``: ``prompt`` persisted on ``main``. Walk ``read``: ``x`` on the label the
    request names, after ``write`` unless ``write`` is false; ``drop`` names a label exported
    with ``free=True`` between the two walks (as a move to another process does)."""

    inputs = ("prompt", "x", "label", "persist", "must_exist", "write", "drop")
    input_defaults = {"label": "main", "persist": False, "must_exist": "", "write": True,
                      "drop": ""}

    def __init__(self, proj: Proj, engine: KVCacheEngine) -> None:
        self.engine = engine
        self.nodes = [GraphNode("prefill", ["prompt"], [GraphEdge(EMIT, "h")]),
                      GraphNode("read", ["x", "label", "persist", "must_exist"],
                                [GraphEdge(EMIT, "y")])]
        self.walks = {"write": "prefill", "read": "read"}
        self.submodules = {"prefill": ProjNode(proj, "prompt", "h"),
                           "read": ReadNode(proj, "x", "y")}
        self.engines = {"prefill": "kv", "read": "kv"}
        self.engine_specs = {"kv": engine}

    def initial_walk(self, request: Any) -> str:
        return "write" if request.inputs["write"] else "read"

    def next_walk(self, request: Any, finished_walk: str, persisted: Any) -> Optional[str]:
        if finished_walk != "write":
            return None
        if request.inputs["drop"]:
            rid = request.cache_id if request.cache_id >= 0 else request.id
            self.engine.export_request(rid, request.inputs["drop"], free=True)
        return "read"


def read_reference(proj: Proj, prompt: Optional[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """``x`` attending causally after ``prompt``'s cached K/V (none when ``prompt`` is None)."""
    qx, kx, vx = proj.qkv(x)
    if prompt is None:
        return proj.out(dense_attention(qx, kx, vx, 0, ("causal",)))
    _q, kp, vp = proj.qkv(prompt)
    return proj.out(dense_attention(qx, torch.cat([kp, kx]), torch.cat([vp, vx]),
                                    prompt.shape[0], ("causal",)))


@pytest.fixture
def setup(serve):
    proj = Proj(seed=11)
    engine = KVCacheEngine(page_size=4, num_pages=32)
    rt = serve(LabelModel(proj, engine))
    g = torch.Generator().manual_seed(0)

    def tensors(plen: int = 6, n: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
        return (torch.randn(plen, proj.embed, generator=g),
                torch.randn(n, proj.embed, generator=g))

    return proj, engine, rt, tensors


def all_freed(engine: KVCacheEngine) -> bool:
    cache = engine.attached_cache()
    return wait_until(lambda: cache.free_pages == cache.num_pages
                      and cache.live_sequences == 0 and not cache.holders(), timeout=5)


def test_a_read_of_a_label_never_written_fails_only_its_request_and_frees_its_pages(setup):
    proj, engine, rt, tensors = setup
    cases = [(tensors(5 + i), "prefix" if i % 2 else "main") for i in range(6)]
    handles = [rt.submit({"prompt": p, "x": x, "label": label}) for (p, x), label in cases]
    for h, ((p, x), label) in zip(handles, cases):
        if label == "main":
            assert_close(h.result(timeout=TIMEOUT)["y"][0], read_reference(proj, p, x),
                         what=f"request {h.id}")
            continue
        with pytest.raises(RequestFailed) as err:
            h.result(timeout=TIMEOUT)
        message = str(err.value)
        for part in ("node 'read'", "KV label 'prefix'", "engine 'kv'", "it holds ['main']",
                     "persists under that label"):
            assert part in message, message
    assert all_freed(engine), engine.cache.labels
    assert settled(rt) == ZERO_LIVE
    # the engine goes on serving, right
    p, x = tensors()
    assert_close(rt.submit({"prompt": p, "x": x}).result(timeout=TIMEOUT)["y"][0],
                 read_reference(proj, p, x), what="after the failures")
    assert all_freed(engine)


def test_a_read_of_a_label_freed_earlier_fails_naming_it(setup):
    proj, engine, rt, tensors = setup
    p, x = tensors()
    h = rt.submit({"prompt": p, "x": x, "drop": "main"})
    with pytest.raises(RequestFailed) as err:
        h.result(timeout=TIMEOUT)
    message = str(err.value)
    for part in ("node 'read'", "KV label 'main'", "freed that label earlier",
                 "it holds no label on this engine"):
        assert part in message, message
    assert all_freed(engine)
    assert wait_until(lambda: engine.cache.dropped_labels(h.id) == [], timeout=5)  # forgotten
    assert settled(rt) == ZERO_LIVE
    p, x = tensors()
    assert_close(rt.submit({"prompt": p, "x": x}).result(timeout=TIMEOUT)["y"][0],
                 read_reference(proj, p, x), what="after the failure")


def test_must_exist_true_fails_a_persisting_work_or_a_first_read_on_a_missing_label(setup):
    proj, engine, rt, tensors = setup
    p, x = tensors()
    # a decode step after its K/V left: without must_exist it would start from nothing
    with pytest.raises(RequestFailed, match=r"appends to KV label 'main'.*freed that label"):
        rt.submit({"prompt": p, "x": x, "drop": "main", "persist": True,
                   "must_exist": "yes"}).result(timeout=TIMEOUT)
    with pytest.raises(RequestFailed, match=r"reads \(without persisting\) KV label 'main'.*"
                                            r"holds no label on this engine"):
        rt.submit({"prompt": p, "x": x, "write": False,
                   "must_exist": "yes"}).result(timeout=TIMEOUT)
    assert all_freed(engine)
    assert settled(rt) == ZERO_LIVE


def test_a_read_meant_to_see_nothing_attends_over_its_own_tokens(setup):
    """must_exist=False (the Qwen3-Omni talker's skipped step reads an empty label so), also as
    the request's first work on the engine; without it that first read fails."""
    proj, engine, rt, tensors = setup
    p, x = tensors()
    got = rt.submit({"prompt": p, "x": x, "label": "other", "must_exist": "no"})
    assert_close(got.result(timeout=TIMEOUT)["y"][0], read_reference(proj, None, x),
                 what="must_exist=False")
    got = rt.submit({"prompt": p, "x": x, "write": False, "must_exist": "no"})
    assert_close(got.result(timeout=TIMEOUT)["y"][0], read_reference(proj, None, x),
                 what="first work")
    with pytest.raises(RequestFailed, match=r"KV label 'main'.*holds no label on this engine"):
        rt.submit({"prompt": p, "x": x, "write": False}).result(timeout=TIMEOUT)
    assert all_freed(engine)
    assert settled(rt) == ZERO_LIVE


def test_the_cache_remembers_dropped_labels_until_the_request_is_released():
    cache = PagedKVCache(Proj().layout(), page_size=4, num_pages=8)
    cache.admit(1, "main", 5)
    cache.commit(1, "main", 5)
    cache.admit(1, "cfg", 0, fork_from="main")
    cache.admit(2, "main", 2)
    assert cache.dropped_labels(1) == []
    cache.drop(1, "cfg")
    cache.export_sequence(1, "main")
    assert cache.dropped_labels(1) == ["cfg"]
    cache.drop(1, "main")
    assert cache.dropped_labels(1) == ["cfg", "main"] and cache.labels(1) == []
    cache.fork(2, "main", "b")
    cache.drop(2, "b")
    assert cache.dropped_labels(2) == ["b"]
    cache.release(1)
    cache.release(2)
    assert cache.dropped_labels(1) == cache.dropped_labels(2) == []
    assert cache.free_pages == cache.num_pages

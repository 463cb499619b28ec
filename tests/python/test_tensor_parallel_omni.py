"""Qwen3-Omni's thinker split over two processes (models/qwen3_omni/thinker_tp.py, gloo on CPU)
equals the whole thinker: step by step (final hidden states, the talker's layer and logits
within 1e-4, through prefill, decode and a copy-on-write fork), and end to end through the
runtime (thinker tokens exact and speech within 1e-4, text and audio in, requests batched);
a bad split is refused before anything starts; a follower killed mid-request fails only the
requests it served and the next request is answered by a rebuilt group; a serving config's
``tp_size`` reaches it."""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

import mstar_rt  # noqa: E402
from mstar_rt import RequestFailed  # noqa: E402
from mstar_rt.distributed.split import TensorSplit  # noqa: E402
from mstar_rt.distributed.tp_driver import TensorParallelLM  # noqa: E402
from mstar_rt.models.qwen3_omni.checkpoint import load_thinker  # noqa: E402
from mstar_rt.models.qwen3_omni.omni import Qwen3Omni  # noqa: E402
from mstar_rt.models.qwen3_omni.thinker_tp import load_thinker_tp, thinker_share  # noqa: E402

import omni_tiny as ot  # noqa: E402
from omni_tp_support import (assert_same_steps, omni_answers, omni_requests,  # noqa: E402
                              with_dense_layer_and_biases)
from placement_support import alive  # noqa: E402
from tp_support import children, follower_pids  # noqa: E402
from walk_models import close_within, wait_until  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conftest.py

TOL = 1e-4
T = 60.0


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return ot.save(ot.model(), str(tmp_path_factory.mktemp("omni_tp")))


@pytest.fixture(scope="module")
def whole(checkpoint):
    return Qwen3Omni.from_pretrained(checkpoint, progress=False)


@pytest.fixture(scope="module")
def split(checkpoint):
    model = Qwen3Omni.from_pretrained(checkpoint, progress=False, tp_size=2)
    pids = follower_pids(model.weights.thinker)
    yield model
    model.close()
    assert not any(alive(p) for p in pids), "close() left a follower running"


# ---- step by step ------------------------------------------------------------------------------

def test_the_split_thinker_equals_the_whole_one_step_by_step(checkpoint, split):
    tp = split.weights.thinker
    assert isinstance(tp, TensorParallelLM) and tp.tp_size == 2
    one = load_thinker(checkpoint)
    assert tp.kv_layout().num_kv_heads * 2 == one.kv_layout().num_kv_heads
    g = torch.Generator().manual_seed(5)
    ids = lambda n: torch.randint(0, ot.THINKER_VOCAB, (n,), generator=g).tolist()  # noqa: E731
    script = [[("a", ids(9)), ("b", ids(4))],                  # two prefills in one step
              [("a", ids(1)), ("b", ids(1))],                  # decode both
              ("fork", "a", "c"),                              # c shares a's pages
              [("c", ids(1)), ("a", ids(3))],                  # c's write copies a page
              [("b", ids(1)), ("c", ids(1)), ("a", ids(1))]]
    assert_same_steps(one, tp, script, split.config.accept_hidden_layer)


def test_dense_layers_and_attention_biases_split_too(tmp_path):
    """A thinker with a dense MLP layer among the MoE ones and biases on q/k/v/o (o_proj's
    bias must be added once, not once per rank)."""
    path = ot.save(with_dense_layer_and_biases(seed=1), str(tmp_path))
    one = load_thinker(path)
    assert one.config.dense_layers == (1,) and one.config.attention_bias
    tp = load_thinker_tp(path, 2)
    try:
        g = torch.Generator().manual_seed(2)
        script = [[("a", torch.randint(0, ot.THINKER_VOCAB, (7,), generator=g).tolist())],
                  [("a", [5])], [("a", [6])]]
        assert_same_steps(one, tp, script, 1)
    finally:
        tp.close()


def test_fused_expert_tensors_split_like_the_per_expert_ones():
    """A checkpoint may hold the fused experts ([E, 2I, H] gate rows then up rows, [E, H, I]):
    a rank's slice of them equals its slices of the per-expert tensors, fused."""
    E, I, H = 3, 8, 5
    gate, up, down = torch.randn(E, I, H), torch.randn(E, I, H), torch.randn(E, H, I)
    key = "model.layers.0.mlp.experts"
    for rank in (0, 1):
        s = TensorSplit(rank, 2)
        share = thinker_share(f"{key}.gate_up_proj", torch.cat([gate, up], dim=1), s)
        want = torch.stack([torch.cat([thinker_share(f"{key}.{e}.gate_proj.weight", gate[e], s),
                                       thinker_share(f"{key}.{e}.up_proj.weight", up[e], s)])
                            for e in range(E)])
        assert torch.equal(share, want)
        assert torch.equal(thinker_share(f"{key}.down_proj", down, s),
                           torch.stack([thinker_share(f"{key}.{e}.down_proj.weight", down[e], s)
                                        for e in range(E)]))
    router = torch.randn(4, 5)
    assert thinker_share("model.layers.0.mlp.gate.weight", router, TensorSplit(1, 2)) is router


def test_a_split_that_does_not_divide_the_thinker_is_refused_before_anything_starts(checkpoint):
    before = set(children())
    with pytest.raises(ValueError, match=r"tp_size 3 does not divide num_attention_heads 4, "
                                         r"num_key_value_heads 2.* of the thinker of .*config"):
        Qwen3Omni.from_pretrained(checkpoint, progress=False, tp_size=3)
    assert set(children()) <= before


# ---- through the runtime -----------------------------------------------------------------------

def test_the_split_thinker_answers_and_speaks_as_the_whole_one(whole, split):
    got, want = omni_answers(split, omni_requests()), omni_answers(whole, omni_requests())
    for (tokens, audio), (ref_tokens, ref_audio) in zip(got, want):
        assert tokens == ref_tokens and len(tokens) > 0
        assert audio.shape == ref_audio.shape
        assert audio.size == 0 or np.abs(audio - ref_audio).max() < TOL
    assert any(a.size for _, a in want), "no request spoke: the audio check proved nothing"
    assert split.health() is None


def test_a_killed_follower_fails_its_requests_and_a_rebuilt_group_answers_the_next(whole, split):
    tp = split.weights.thinker
    before = tp.restarts
    ref = omni_answers(whole, omni_requests()[:1])[0]
    long = {**omni_requests()[2], "thinker_sampling": {"max_tokens": 400, "ignore_eos": True}}
    with mstar_rt.Runtime(split) as rt:
        h = rt.submit(long)
        assert wait_until(lambda: len(h.stats()) >= 4, T)
        pid = follower_pids(tp)[0]
        os.kill(pid, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(RequestFailed, match=r"tensor-parallel group of .* failed.*rank 1 "
                                                rf"\(pid {pid}\) exited with code -9"):
            h.result(timeout=T)
        assert time.monotonic() - t0 < 15, "the failure took as long as a collective timeout"
        assert rt.health() is None  # the next step restarts it
        again = rt.submit(omni_requests()[0])
        items = list(again)
        assert [v for k, v in items if k == "token"] == ref[0]
        audio = np.concatenate([v for k, v in items if k == "audio"] or [np.zeros(0)])
        assert audio.shape == ref[1].shape and np.abs(audio - ref[1]).max() < TOL
        assert tp.restarts == before + 1 and follower_pids(tp)[0] != pid
        engine = rt.engines["thinker"]
        assert wait_until(lambda: engine.cache.free_pages == engine.cache.num_pages, T)
        close_within(rt)
    assert not alive(pid)


def test_a_placed_thinker_group_with_tp_size_drives_its_own_followers(checkpoint, whole):
    """The thinker's nodes on worker 1 with ``tp_size: 2`` (the worker drives the split
    thinker, its follower a child of the worker), the talker, code predictor and code2wav on
    worker 2: tokens exact and speech within 1e-4 of the whole model in process."""
    from mstar_rt.placement import NodeGroup, PlacedRuntime
    from placement_support import worker_children

    nodes = [n.name for n in whole.nodes]
    thinker = [n for n in nodes if n.startswith(("text_", "thinker_", "audio_encoder"))]
    groups = [NodeGroup(thinker, rank=1, tp_size=2),
              NodeGroup([n for n in nodes if n not in thinker], rank=2)]
    want = omni_answers(whole, omni_requests())
    with PlacedRuntime("placement_models:tiny_omni", groups, progress=False,
                       model_kwargs={"directory": checkpoint}) as rt:
        assert len(worker_children(rt.workers[1]["pid"], b"mstar_rt")) == 1  # its follower
        assert not worker_children(rt.workers[2]["pid"], b"mstar_rt")
        handles = [rt.submit(r) for r in omni_requests()]
        for h, (ref_tokens, ref_audio) in zip(handles, want):
            items = list(h)
            audio = np.concatenate([v for k, v in items if k == "audio"] or [np.zeros(0)])
            assert [v for k, v in items if k == "token"] == ref_tokens
            assert audio.shape == ref_audio.shape
            assert audio.size == 0 or np.abs(audio - ref_audio).max() < TOL
        assert rt.health() is None


def test_a_serving_config_tp_size_splits_the_thinker(checkpoint):
    from mstar_rt.serve.config import build_model, load_config

    before = set(children())
    config = load_config({"model": {"checkpoint": checkpoint},
                          "node_groups": [{"nodes": ["thinker_prefill", "thinker_decode",
                                                     "text_prefill", "text_decode"],
                                           "tp_size": 2}]})
    assert config.model.args == {"tp_size": 2}
    model = build_model(config)
    try:
        assert isinstance(model, Qwen3Omni)
        assert model.weights.thinker.tp_size == 2 and model.health() is None
        pids = follower_pids(model.weights.thinker)
    finally:
        model.close()
    assert not any(alive(p) for p in pids) and set(children()) <= before

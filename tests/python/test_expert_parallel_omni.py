"""Expert parallelism for Qwen3-Omni's MoE thinker (``expert_parallel=True`` beside
``tp_size``: models/qwen3_omni/thinker_tp.py): each rank holds a block of whole experts and
computes only the (token, expert) pairs routed to them; the all-reduce adds the shares. Equal to
the whole thinker step by step (final hidden states, the talker's layer and logits within 1e-4;
a dense layer and attention biases among the MoE layers) and end to end through a serving
config (tokens exact, speech within 1e-4); a rank keeps only its experts' tensors; a split that
does not divide the experts is refused before anything starts."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from mstar_rt.distributed.split import TensorSplit  # noqa: E402
from mstar_rt.models.qwen3_omni.checkpoint import load_thinker  # noqa: E402
from mstar_rt.models.qwen3_omni.moe import FusedExperts  # noqa: E402
from mstar_rt.models.qwen3_omni.omni import Qwen3Omni  # noqa: E402
from mstar_rt.models.qwen3_omni.thinker_tp import load_thinker_tp, thinker_share  # noqa: E402

import omni_tiny as ot  # noqa: E402
from omni_tp_support import (assert_same_steps, omni_answers, omni_requests,  # noqa: E402
                              with_dense_layer_and_biases)
from placement_support import alive  # noqa: E402
from tp_support import children, follower_pids  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conftest.py

TOL = 1e-4


def test_blocks_of_whole_experts_add_up_to_all_of_them():
    """In one process: each block's partial output (the pairs routed to its experts, zero
    elsewhere) sums to the whole layer's, whatever the routing (experts no token chose too)."""
    g = torch.Generator().manual_seed(0)
    E, H, I, T, k = 6, 8, 5, 11, 2
    whole = FusedExperts(E, H, I)
    with torch.no_grad():
        whole.gate_up_proj.normal_(generator=g)
        whole.down_proj.normal_(generator=g)
    x = torch.randn(T, H, generator=g)
    experts = torch.stack([torch.randperm(E - 1, generator=g)[:k] for _ in range(T)])  # not 5
    weights = torch.rand(T, k, generator=g)
    want = whole(x, experts, weights)
    for size in (2, 3):
        total = torch.zeros_like(want)
        for rank in range(size):
            start, stop = TensorSplit(rank, size).part(E)
            block = FusedExperts(stop - start, H, I, first=start, routed=E)
            with torch.no_grad():
                block.gate_up_proj.copy_(whole.gate_up_proj[start:stop])
                block.down_proj.copy_(whole.down_proj[start:stop])
            total += block(x, experts, weights)
        assert (total - want).abs().max() < 1e-5
    idle = FusedExperts(1, H, I, first=E - 1, routed=E)  # expert 5: no token chose it
    assert torch.equal(idle(x, experts, weights), torch.zeros_like(x))


def test_a_rank_reads_only_its_experts_tensors():
    E, I, H = 4, 6, 5
    gate, up, down = torch.randn(E, I, H), torch.randn(E, I, H), torch.randn(E, H, I)
    key = "model.layers.0.mlp.experts"
    for rank, mine in ((0, (0, 1)), (1, (2, 3))):
        s = TensorSplit(rank, 2, experts=E)
        for e in range(E):
            got = thinker_share(f"{key}.{e}.gate_proj.weight", gate[e], s)
            assert torch.equal(got, gate[e]) if e in mine else got is None
        assert torch.equal(thinker_share(f"{key}.gate_up_proj", torch.cat([gate, up], 1), s),
                           torch.cat([gate, up], 1)[mine[0]:mine[1] + 1])
        assert torch.equal(thinker_share(f"{key}.down_proj", down, s), down[mine[0]:mine[1] + 1])
    # attention and a dense MLP still split by heads and columns
    q = torch.randn(8, 5)
    assert torch.equal(thinker_share("model.layers.0.self_attn.q_proj.weight", q,
                                     TensorSplit(1, 2, experts=E)), q[4:])


@pytest.mark.parametrize("dense", [False, True])
def test_the_expert_parallel_thinker_equals_the_whole_one_step_by_step(tmp_path, dense):
    hf = with_dense_layer_and_biases(seed=3) if dense else ot.model(seed=3)
    path = ot.save(hf, str(tmp_path))
    one = load_thinker(path)
    ep = load_thinker_tp(path, 2, expert_parallel=True)
    try:
        layers = ep.shard.model.layers
        moe = next(i for i, layer in enumerate(layers) if hasattr(layer.mlp, "experts"))
        experts = layers[moe].mlp.experts
        whole = one.model.layers[moe].mlp.experts
        assert experts.num_experts * 2 == whole.num_experts == experts.routed
        assert torch.equal(experts.gate_up_proj, whole.gate_up_proj[:experts.num_experts])
        assert torch.equal(experts.down_proj, whole.down_proj[:experts.num_experts])
        if dense:  # the dense MLP's columns split as without expert parallelism
            assert layers[1].mlp.gate_proj.weight.shape[0] * 2 == \
                one.model.layers[1].mlp.gate_proj.weight.shape[0]
        g = torch.Generator().manual_seed(5)
        ids = lambda n: torch.randint(0, ot.THINKER_VOCAB, (n,), generator=g).tolist()  # noqa
        script = [[("a", ids(9)), ("b", ids(4))], [("a", ids(1)), ("b", ids(1))],
                  ("fork", "a", "c"), [("c", ids(1)), ("a", ids(3))],
                  [("b", ids(1)), ("c", ids(1)), ("a", ids(1))]]
        assert_same_steps(one, ep, script, 1)
    finally:
        ep.close()


def test_a_split_that_does_not_divide_the_experts_is_refused_before_anything_starts(tmp_path):
    path = ot.save(ot.model(thinker_text={"num_attention_heads": 6, "num_key_value_heads": 3,
                                          "num_experts": 3}), str(tmp_path))
    before = set(children())
    with pytest.raises(ValueError, match=r"tp_size 3 does not divide num_experts 3|"
                                         r"tp_size 2 does not divide num_experts 3"):
        Qwen3Omni.from_pretrained(path, progress=False, tp_size=2, expert_parallel=True)
    with pytest.raises(ValueError, match="give tp_size > 1 as well"):
        Qwen3Omni.from_pretrained(path, progress=False, expert_parallel=True)
    assert set(children()) <= before


def test_a_serving_config_runs_the_thinker_expert_parallel(tmp_path):
    from mstar_rt.serve.config import build_model, load_config

    path = ot.save(ot.model(), str(tmp_path))
    whole = Qwen3Omni.from_pretrained(path, progress=False)
    config = load_config({"model": {"checkpoint": path, "args": {"expert_parallel": True}},
                          "node_groups": [{"nodes": ["thinker_prefill", "thinker_decode",
                                                     "text_prefill", "text_decode"],
                                           "tp_size": 2}]})
    model = build_model(config)
    try:
        thinker = model.weights.thinker
        assert thinker.tp_size == 2
        assert thinker.shard.model.layers[0].mlp.experts.num_experts == 2  # of 4
        pids = follower_pids(thinker)
        got, want = omni_answers(model, omni_requests()), omni_answers(whole, omni_requests())
        for (tokens, audio), (ref_tokens, ref_audio) in zip(got, want):
            assert tokens == ref_tokens and len(tokens) > 0
            assert audio.shape == ref_audio.shape
            assert audio.size == 0 or np.abs(audio - ref_audio).max() < TOL
        assert any(a.size for _, a in want)
    finally:
        model.close()
    assert not any(alive(p) for p in pids)

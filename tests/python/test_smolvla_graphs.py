"""SmolVLA's flow steps through static batch buckets (FlowGraphs over a static FlowAttention):
the path CUDA graphs capture, run eagerly on the CPU, equal to the dynamic path and to
LeRobot's chunks."""

from __future__ import annotations

import pytest
import torch

from mstar_rt.engines import KVCacheEngine
from mstar_rt.models.flow_graphs import FlowGraphs
from mstar_rt.models.smolvla import SmolVLAPolicy
from mstar_rt.models.smolvla_flow import FlowAttention, SmolFlowStep
from mstar_rt.models.smolvla_reference import sample_actions_reference
from test_lerobot_smolvla import TIMEOUT, TOL, io, max_diff, other_requests, pages_back, policy
from walk_models import ZERO_LIVE, settled

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conftest.py
__all__ = ["io", "policy"]  # the fixtures, imported for pytest


def prefixes(policy, lengths: list[int], seed: int) -> list:
    m, t = policy.module, policy.config.text
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        kv = torch.randn(policy.config.num_layers, 2, n, t.num_kv_heads, t.head_dim, generator=g)
        cross = {i: m.cross_kv(i, kv[i, 0], kv[i, 1]) for i in m.cross_layers}
        out.append((kv, cross))
    return out


def dynamic(policy, given: list, x: torch.Tensor, time: torch.Tensor) -> torch.Tensor:
    m = policy.module
    a = FlowAttention.over(("k",), given, policy.config.chunk_size, m.cross_layers)
    with torch.inference_mode():
        return SmolFlowStep(m).velocity(x, time, a)


def test_a_padded_bucket_gives_the_dynamic_velocity_and_refills_only_for_a_new_batch(policy):
    c = policy.config
    assert policy.module.cross_layers and len(policy.module.cross_layers) < c.num_layers
    g = FlowGraphs(SmolFlowStep(policy.module), buckets=(1, 4), capture=False)
    gen = torch.Generator().manual_seed(0)
    batches = [prefixes(policy, [5, c.max_prefix, 9], 1), prefixes(policy, [7, 3], 2)]
    for i, given in enumerate(batches + [batches[1]]):
        key = tuple(p[0] for p in given)  # the third batch is the second again: no refill
        x = torch.randn(len(given) * c.chunk_size, c.max_action_dim, generator=gen)
        t = policy.module.time_embeds(torch.rand(len(given), generator=gen))
        got = g.velocity(key, lambda: given, x, t)
        assert got is not None
        assert max_diff(got, dynamic(policy, given, x, t)) <= 1e-5, f"batch {i}"
    assert (g.fills, g.runs, g.holding) == (2, 3, 1)
    x = torch.zeros(5 * c.chunk_size, c.max_action_dim)
    assert g.velocity(tuple(range(5)), lambda: prefixes(policy, [2] * 5, 3), x,
                      torch.zeros(5, c.expert_width)) is None  # past the largest bucket: the dynamic path


def test_served_through_static_buckets_equals_the_dynamic_path_and_lerobot(serve, policy, io):
    cases = other_requests(io)
    guided = {**cases[0], "delay": 2, "prev_actions": torch.linspace(-1, 1, 8 * 6).view(8, 6)}
    cases.append(guided)
    chunks = {}
    for graphs in (False, True):
        engine = KVCacheEngine(page_size=16, num_pages=48, max_batch=4)
        model = SmolVLAPolicy(policy, engine=engine, max_batch=4, cuda_graphs=graphs)
        if graphs:
            assert model.graphs is not None and model.graphs.buckets == (1, 2, 4)
            model.warm_up()
            assert model.graphs.runs == 3 and model.graphs.holding == 0
        rt = serve(model)
        handles = [rt.submit(r) for r in cases]
        chunks[graphs] = [h.result(timeout=TIMEOUT)["actions"][0] for h in handles]
        assert settled(rt) == ZERO_LIVE and pages_back(engine)
        if graphs:
            assert model.graphs.runs > 3 and model.graphs.holding == 0
    for i, (a, b) in enumerate(zip(chunks[False], chunks[True])):
        assert max_diff(a, b) <= 1e-5, f"request {i}: static buckets against the dynamic path"
    for r, got in zip(cases[:4], chunks[True]):
        assert max_diff(got, sample_actions_reference(policy, r)) <= TOL

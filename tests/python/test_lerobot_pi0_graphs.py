"""pi0 / pi0.5 flow steps through static batch buckets (FlowGraphs): the path CUDA graphs
capture, run eagerly on the CPU, equal to the dynamic path and to LeRobot's chunks."""

from __future__ import annotations

import pytest
import torch

from mstar_rt.engines import KVCacheEngine
from mstar_rt.models.lerobot_pi0 import LeRobotPi0Policy
from mstar_rt.models.lerobot_pi0_config import RtcSettings
from mstar_rt.models.flow_graphs import FlowGraphs
from mstar_rt.models.lerobot_pi0_graphs import PiFlowStep
from mstar_rt.models.lerobot_pi0_reference import reference_actions
from mstar_rt.models.lerobot_pi0_suffix import SuffixAttention
from test_lerobot_pi0 import FAMILIES, TIMEOUT, Fixture, close, pages_back
from walk_models import ZERO_LIVE, settled

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conftest.py


@pytest.fixture(scope="module", params=FAMILIES)
def fx(request) -> Fixture:
    return Fixture(request.param)


def prefixes(fx: Fixture, lengths: list[int], seed: int) -> list[torch.Tensor]:
    b = fx.policy.config.backbone
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b.depth, 2, n, b.num_kv_heads, b.head_dim, generator=g) for n in lengths]


def step_inputs(fx: Fixture, batch: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    m, c = fx.policy.module, fx.policy.config
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch * c.chunk_size, c.max_action_dim, generator=g)
    return x, m.time_embedding(torch.rand(batch, generator=g))


def dynamic(fx: Fixture, snapshots: list[torch.Tensor], x: torch.Tensor, time: torch.Tensor
            ) -> torch.Tensor:
    m = fx.policy.module
    s = SuffixAttention.over(("k",), snapshots, fx.policy.config.chunk_size, m.rope, m.dtype)
    with torch.inference_mode():
        tokens, cond = m.action_tokens(x, None, s.rows, time)
        return m.velocity(tokens, s.positions, s, cond, s.tables)


def test_a_padded_bucket_gives_the_dynamic_velocity_and_refills_only_for_a_new_batch(fx):
    longest = fx.policy.config.max_prefix
    g = FlowGraphs(PiFlowStep(fx.policy.module), buckets=(1, 4), capture=False)
    first = prefixes(fx, [5, longest, 9], seed=1)
    key = tuple(object() for _ in first)
    asked = []

    def given(snapshots):
        return lambda: asked.append(1) or snapshots

    for seed in (2, 3):  # the same batch twice: its prefixes are copied in once
        x, time = step_inputs(fx, 3, seed)
        got = g.velocity(key, given(first), x, time)
        assert got is not None and got.shape == x.shape
        close(got, dynamic(fx, first, x, time), f"3 requests in a bucket of 4 (step {seed})")
    assert (g.fills, len(asked), g.runs) == (1, 1, 2)
    # a new batch, shorter prefixes than the slots held: nothing of the last one is seen
    second = prefixes(fx, [7, 3], seed=4)
    x, time = step_inputs(fx, 2, 5)
    close(g.velocity(tuple(object() for _ in second), given(second), x, time),
          dynamic(fx, second, x, time), "2 requests after 3 in the same bucket")
    one = prefixes(fx, [longest], seed=6)
    x, time = step_inputs(fx, 1, 7)
    close(g.velocity((object(),), given(one), x, time), dynamic(fx, one, x, time), "bucket of 1")
    assert g.fills == 3
    # what the static path does not serve: the caller runs it dynamically
    x, time = step_inputs(fx, 5, 8)
    assert g.velocity(tuple(object() for _ in range(5)), given(prefixes(fx, [4] * 5, 9)), x,
                      time) is None
    x, time = step_inputs(fx, 2, 10)
    assert g.velocity((object(), object()), lambda: None, x, time) is None
    too_long = prefixes(fx, [3, longest + 1], seed=11)
    assert g.velocity((object(), object()), given(too_long), x, time) is None
    assert g.holding == 2  # buckets 4 and 1
    g.forget()
    assert g.holding == 0 and g.fills == 3 and len(asked) == 4


def test_served_through_static_buckets_each_request_equals_lerobot(serve, fx):
    io, c = fx.io, fx.policy.config
    cams = fx.meta["cameras_in_order"]
    rtc = RtcSettings("LINEAR", max_guidance_weight=10.0, execution_horizon=8)
    cases = [
        fx.observation(),
        fx.observation(images={cams[1]: io[f"input.{cams[1]}"]}, task="open the drawer",
                       noise=None, seed=3),  # one camera: a shorter prefix
        fx.observation(delay=3, prev_actions=fx.chunk[3:] + 0.5),  # guided
    ]
    engine = KVCacheEngine(page_size=16, num_pages=64, max_batch=4)
    policy = LeRobotPi0Policy(fx.policy, engine=engine, max_batch=4, rtc=rtc, cuda_graphs=True)
    graphs = policy.graphs
    assert graphs is not None and graphs.buckets == (1, 2, 4) and not graphs.capture
    rt = serve(policy)
    for _round in range(2):
        handles = [rt.submit(o) for o in cases]
        for i, (o, h) in enumerate(zip(cases, handles)):
            close(h.result(timeout=TIMEOUT)["actions"][0],
                  reference_actions(fx.policy, o, rtc)["action_chunk"], f"request {i}")
    sizes = [s["batch_size"] for h in handles for s in h.stats() if s["node"] == "denoise"]
    assert graphs.runs >= 2 * c.num_steps and max(sizes) >= 2
    assert settled(rt) == ZERO_LIVE and pages_back(engine)
    # done chunks hold nothing: no request object, no snapshot
    assert graphs.holding == 0


def test_warm_up_runs_every_bucket_before_any_request(serve, fx):
    policy = LeRobotPi0Policy(fx.policy, max_batch=3, cuda_graphs=True)
    graphs = policy.graphs
    assert graphs is not None
    policy.warm_up()
    assert graphs.buckets == (1, 2, 3) and graphs.runs == 3 and graphs.fills == 3
    rt = serve(policy)
    close(rt.submit(fx.observation()).result(timeout=TIMEOUT)["actions"][0], fx.chunk,
          "chunk after the warm-up")
    with pytest.raises(ValueError, match="not one of the buckets"):
        graphs.warm_up([5])


def test_compiled_flow_steps_give_lerobots_chunk(serve):
    fx = Fixture("pi0")
    policy = LeRobotPi0Policy(fx.policy, max_batch=1, compile=True)
    assert policy.graphs is not None and not policy.graphs.capture
    rt = serve(policy)
    close(rt.submit(fx.observation()).result(timeout=300)["actions"][0], fx.chunk,
          "chunk through torch.compile")


def test_cuda_graphs_on_a_cpu_policy_are_refused_naming_the_fix(fx):
    with pytest.raises(ValueError, match="capture=False"):
        FlowGraphs(PiFlowStep(fx.policy.module), capture=True)
    with pytest.raises(ValueError, match="positive batch sizes"):
        FlowGraphs(PiFlowStep(fx.policy.module), buckets=(0, 2), capture=False)


def test_bursts_of_mixed_requests_some_cancelled_each_equal_lerobot(serve, fx):
    """Requests in bursts of random sizes (so batches change mid-chunk and buckets refill), with
    other cameras, prompts, seeds and guidance, a few cancelled mid-chunk: every finished one
    equals its reference, and no page or held batch is left."""
    import random

    io, cams = fx.io, fx.meta["cameras_in_order"]
    rtc = RtcSettings("LINEAR", max_guidance_weight=10.0, execution_horizon=8)
    rng = random.Random(7)

    def case(i: int) -> dict:
        images = {c: io[f"input.{c}"] for c in rng.sample(cams, rng.randint(1, len(cams)))}
        extra = dict(delay=2, prev_actions=fx.chunk[2:] + 0.1 * i) if i % 3 == 0 else {}
        return fx.observation(images=images, noise=None, seed=i,
                              task=rng.choice(["pick", "open the drawer", "stack the red cubes"]),
                              **extra)

    # an engine step may join batches of the flow-step node: the buckets reach its max_batch
    engine = KVCacheEngine(page_size=16, num_pages=128, max_batch=12)
    policy = LeRobotPi0Policy(fx.policy, engine=engine, max_batch=4, rtc=rtc, cuda_graphs=True)
    assert policy.graphs is not None and policy.graphs.buckets == (1, 2, 4, 8, 12)
    rt = serve(policy)
    done, cancelled, i = [], 0, 0
    while i < 24:
        burst = [case(i + k) for k in range(rng.randint(1, 5))]
        handles = [rt.submit(o) for o in burst]
        i += len(burst)
        if rng.random() < 0.3:
            cancelled += int(handles[-1].cancel())
            burst, handles = burst[:-1], handles[:-1]
        done += list(zip(burst, handles))
    for o, h in done:
        close(h.result(timeout=TIMEOUT)["actions"][0],
              reference_actions(fx.policy, o, rtc)["action_chunk"], "a request of the bursts")
    assert policy.graphs.fills > 1 and policy.graphs.runs >= 2 * fx.policy.config.num_steps
    assert settled(rt) == ZERO_LIVE and pages_back(engine)

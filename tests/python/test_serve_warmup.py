"""The serving warm-up (mstar_rt.serve.warmup): before the first client, the policy runs at every
batch size each node can take, so that what a new batch shape allocates and keeps (1-3 MB per
size for the vision policy, a step in the server's RSS whenever traffic first formed one) is
allocated at start; a policy that declares no fixed shapes, or fails on zeros, is served
without one."""

from __future__ import annotations

import threading
from collections import Counter

import numpy as np
import pytest

import mstar_rt
from mstar_rt import EMIT, GraphEdge, GraphNode, Loop, Model, NodeSubmodule, Sequential
from mstar_rt.serve import Deployment, PolicySpec
from mstar_rt.serve.warmup import warm_up

SHAPES = PolicySpec(observation={"observation/state": "obs"}, shapes={"obs": [3]},
                    dtypes={"obs": "float32"})


class _Counted(NodeSubmodule):
    """Doubles its input; counts the batch sizes it ran."""

    def __init__(self, max_batch: int, given: str, out: str) -> None:
        self.max_batch, self.given, self.out = max_batch, given, out
        self.sizes: Counter = Counter()
        self._lock = threading.Lock()

    def forward(self, batch):
        with self._lock:
            self.sizes[len(batch)] += 1
        return [{self.out: np.asarray(x[self.given]) * 2} for x in batch]


class _Policy(Model):
    """obs [3] -> embed (batches up to 6) -> step x2 (Loop) -> head (batches up to 4) -> actions."""

    inputs = ("obs",)

    def __init__(self, fail_on_zeros: bool = False) -> None:
        self.fail_on_zeros = fail_on_zeros
        self.nodes = [GraphNode("embed", ["obs"], ["h"]), GraphNode("step", ["h"], ["h"]),
                      GraphNode("head", ["h"], [GraphEdge(EMIT, "actions")])]
        self.walks = {"act": Sequential("embed", Loop("step", 2, outputs=["h"]), "head")}
        self.submodules = {"embed": _Counted(6, "obs", "h"), "step": _Counted(6, "h", "h"),
                           "head": _Counted(4, "h", "actions")}

    def validate_inputs(self, inputs):
        if self.fail_on_zeros and not np.any(inputs["obs"]):
            raise ValueError("'obs' must not be all zeros")


def _deployment(model: Model, rt, policy: PolicySpec = SHAPES) -> Deployment:
    return Deployment.for_model(model, rt, policy=policy, max_concurrent_requests=64)


def test_warm_up_runs_every_batch_size_of_every_node_before_serving():
    model = _Policy()
    with mstar_rt.Runtime(model) as rt:
        report = warm_up(_deployment(model, rt))
        assert rt.live["requests"] == 0
    assert report.skipped is None and report.missing == {}
    assert report.sizes == {"embed": [1, 2, 3, 4, 5, 6], "step": [1, 2, 3, 4, 5, 6],
                            "head": [1, 2, 3, 4]}
    subs = model.submodules
    assert set(subs["embed"].sizes) == set(range(1, 7))
    assert set(subs["head"].sizes) == set(range(1, 5))  # 5 and 6 requests: 4 + 1, 4 + 2
    assert subs["step"].sizes.total() == 2 * subs["embed"].sizes.total()
    assert "bursts of 1..6 requests (embed, step, head)" in report.describe()


def test_warm_up_stops_at_max_concurrent_requests():
    model = _Policy()
    with mstar_rt.Runtime(model) as rt:
        report = warm_up(Deployment.for_model(model, rt, policy=SHAPES,
                                              max_concurrent_requests=3))
    assert report.largest_burst == 3 and report.sizes["embed"] == [1, 2, 3]
    assert max(model.submodules["embed"].sizes) == 3


@pytest.mark.parametrize("policy, fail_on_zeros, why", [
    (PolicySpec(), False, "no fixed shape and dtype for model input 'obs'"),
    (PolicySpec(shapes={"obs": [None]}, dtypes={"obs": "float32"}), False, "no fixed shape"),
    (SHAPES, True, "the policy failed on a zero observation (ValueError: 'obs' must not be all "
                   "zeros)"),
], ids=["no-shapes", "open-shape", "fails-on-zeros"])
def test_a_policy_without_a_warm_up_observation_is_served_without_one(policy, fail_on_zeros,
                                                                      why):
    model = _Policy(fail_on_zeros)
    with mstar_rt.Runtime(model) as rt:
        report = warm_up(_deployment(model, rt, policy))
        assert why in report.skipped and report.describe().startswith("warm-up skipped: ")
        assert sum(model.submodules["embed"].sizes.values()) == 0
        out = rt.submit({"obs": np.ones(3, np.float32)}).result(10)  # still serves
    np.testing.assert_allclose(out["actions"][-1], np.full(3, 16.0))

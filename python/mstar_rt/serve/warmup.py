"""The policy run once at every batch size before the first client: what a batch shape
allocates the first time it is seen, and keeps (torch's per-shape kernels and oneDNN
primitives, the allocator's high-water mark: 1-3 MB per size for
examples/serve/vision_policy.yaml), is then allocated at start rather than under traffic.
Without it the dynamic batching first forms some sizes at random times (a soak formed batch
size 10 for the first time 34 s into its traffic), the server's memory steps up each time
before it stays flat, and the first request at each size is slow.

Each size n is a burst of n requests submitted in one stretch that holds the GIL: an engine
worker waiting for the GIL takes them as one batch (see the Conductor's wait_batch). The
handles' timelines say which sizes every node really ran; a size that a burst split is tried
again.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

WARM_UP_IMAGE = (224, 224, 3)  # a camera frame, where the policy declares no image size
ROUNDS = 3  # bursts per size at most (a burst splits only if the switch interval interrupts it)


@dataclass
class WarmUp:
    """What the warm-up ran: per node, the batch sizes seen (and those wanted but never
    formed); ``skipped`` says why nothing ran."""

    sizes: dict[str, list[int]] = field(default_factory=dict)
    missing: dict[str, list[int]] = field(default_factory=dict)
    largest_burst: int = 0
    seconds: float = 0.0
    skipped: Optional[str] = None

    def describe(self) -> str:
        if self.skipped is not None:
            return f"warm-up skipped: {self.skipped}"
        text = (f"warmed up with bursts of 1..{self.largest_burst} requests "
                f"({', '.join(self.sizes) or 'batch sizes not recorded'}) in "
                f"{self.seconds:.1f} s")
        if self.missing:
            text += f"; never formed: {self.missing}"
        return text


def warm_up(deployment: Any, budget_s: float = 60.0) -> WarmUp:
    """Runs the deployment's policy on zero observations (shapes and dtypes as ``policy``
    declares them) once at every batch size 1..max_batch of its nodes (at most
    ``max_concurrent_requests``), within ``budget_s``. Never raises for the model's trouble:
    a warm-up that cannot run says why in ``skipped``."""
    from mstar_rt.serve.openpi import PolicyAdapter

    runtime = deployment.runtime
    t0 = time.monotonic()
    graph_nodes = getattr(getattr(runtime, "graph", None), "nodes", None)
    if not graph_nodes:
        return WarmUp(skipped="the runtime has no compiled graph to read batch sizes from")
    prepare = getattr(getattr(runtime, "model", None), "warm_up", None)
    try:
        if callable(prepare):  # e.g. a flow policy's CUDA graphs / compiled buckets, every size
            prepare()
    except Exception as e:  # noqa: BLE001  (the server serves anyway; the first clients pay)
        return WarmUp(skipped=f"the model's warm_up() failed ({type(e).__name__}: {e})",
                      seconds=time.monotonic() - t0)
    cap = max(1, int(deployment.max_concurrent_requests))
    wanted = {name: set(range(1, min(int(max_batch), cap) + 1))
              for name, _, max_batch, *_ in graph_nodes}
    try:
        adapter = PolicyAdapter(deployment.policy, deployment.inputs, deployment.name,
                                deployment.optional_inputs)
        observation = zero_observation(deployment.policy, adapter.mapping)
        adapter.inputs(observation)
    except ValueError as e:
        return WarmUp(skipped=str(e))
    seen: dict[str, set[int]] = {}
    ran: set[str] = set()  # nodes of the walk the observation takes
    largest = 0
    timeout = deployment.request_timeout_s or budget_s
    try:
        for _ in range(ROUNDS):
            todo = sorted({n for node in (ran or wanted) for n in wanted[node]
                           - seen.get(node, set())}, reverse=True)
            for n in todo:  # the biggest first: it sets the allocator's high-water mark
                if time.monotonic() - t0 > budget_s:
                    break
                largest = max(largest, n)
                for node, size in _burst(runtime, adapter, observation, n, timeout):
                    seen.setdefault(node, set()).add(size)
                    ran.add(node)
            if not todo or not ran or time.monotonic() - t0 > budget_s:
                break
    except Exception as e:  # noqa: BLE001  (the server serves anyway; the first clients pay)
        return WarmUp(skipped=f"the policy failed on a zero observation "
                              f"({type(e).__name__}: {e})", seconds=time.monotonic() - t0)
    missing = {node: sorted(wanted[node] - seen.get(node, set())) for node in sorted(ran)}
    return WarmUp(sizes={node: sorted(s) for node, s in seen.items()},
                  missing={k: v for k, v in missing.items() if v}, largest_burst=largest,
                  seconds=time.monotonic() - t0)


def zero_observation(policy: Any, mapping: dict[str, str]) -> dict[str, Any]:
    """An observation of zeros, one array per key of ``mapping`` (observation key -> model
    input) at the shape and dtype that ``policy`` declares for that input (text: empty); an
    optional key is left out, an image without a declared size is a black WARM_UP_IMAGE (a
    policy resizes its images: the batch shapes are its own); a ValueError names an input
    whose shape or dtype is not fully declared."""
    obs = {}
    for key, name in mapping.items():
        if key in policy.images and policy.shapes.get(name) is None:
            obs[key] = np.zeros(WARM_UP_IMAGE, np.uint8)
            continue
        if key in policy.optional:
            continue
        shape, dtype = policy.shapes.get(name), policy.dtypes.get(name)
        if dtype == "str":  # text: an empty instruction
            obs[key] = ""
            continue
        if shape is None or dtype is None or None in shape:
            raise ValueError(f"policy.shapes / policy.dtypes declare no fixed shape and dtype "
                             f"for model input {name!r}, so there is no observation to warm up "
                             f"with")
        obs[key] = np.zeros(shape, dtype)
    return obs


def _burst(runtime: Any, adapter: Any, observation: dict, n: int,
           timeout: float) -> list[tuple[str, int]]:
    """``n`` requests submitted back to back, waited for; (node, batch size) per execution."""
    inputs = [adapter.inputs(observation) for _ in range(n)]  # before the burst: kept short
    handles = [runtime.submit(x) for x in inputs]
    for h in handles:
        h.result(timeout)
    return [(s["node"], int(s["batch_size"])) for h in handles
            for s in (h.stats() if hasattr(h, "stats") else ())]

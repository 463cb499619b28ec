"""The VLA soak section: LeRobot's pi0, pi0.5 and SmolVLA (the committed tiny fixtures) with
their flow steps through the static batch buckets (``cuda_graphs=True``: the path CUDA graphs
replay, eager on a CPU), a third of the time each, under random bursts of 1-8 requests (random
cameras, prompts and seeds; a third of pi0's and pi0.5's guided with random delays), 15 %
cancelled mid-chunk. Every finished chunk is checked against the reference computation
(``reference_actions`` / ``sample_actions_reference``, float32, 1e-4). After each family: no KV
page in use, no live request, no bucket holding a batch."""

from __future__ import annotations

import os
import random
import sys
import time
from typing import Any, Callable

from bench_common import ROOT
from soak_proc import Sampler, snapshot

sys.path.insert(0, str(ROOT / "tests" / "python"))  # the fixtures' loaders
TOL = 1e-4
CANCEL = 0.15


def _pi(family: str) -> tuple[Any, Callable[[random.Random, int], dict], Callable]:
    from mstar_rt.engines import KVCacheEngine
    from mstar_rt.models.lerobot_pi0 import LeRobotPi0Policy
    from mstar_rt.models.lerobot_pi0_config import RtcSettings
    from mstar_rt.models.lerobot_pi0_reference import reference_actions
    from test_lerobot_pi0 import Fixture

    fx = Fixture(family)
    cams = fx.meta["cameras_in_order"]
    rtc = RtcSettings("LINEAR", max_guidance_weight=10.0, execution_horizon=8)

    def case(rng: random.Random, i: int) -> dict:
        images = {c: fx.io[f"input.{c}"] for c in rng.sample(cams, rng.randint(1, len(cams)))}
        guided = dict(delay=rng.randint(0, 4), prev_actions=fx.chunk[2:] + 0.05 * (i % 7))
        return fx.observation(images=images, noise=None, seed=i % 50,
                              task=rng.choice(["pick", "open the drawer", "stack the cubes"]),
                              **(guided if i % 3 == 0 else {}))

    engine = KVCacheEngine(page_size=16, num_pages=256, max_batch=12)
    policy = LeRobotPi0Policy(fx.policy, engine=engine, max_batch=6, rtc=rtc, cuda_graphs=True)
    return policy, case, lambda o: reference_actions(fx.policy, o, rtc)["action_chunk"]


def _smolvla() -> tuple[Any, Callable[[random.Random, int], dict], Callable]:
    from safetensors.torch import load_file

    from mstar_rt.engines import KVCacheEngine
    from mstar_rt.models.smolvla import SmolVLAPolicy
    from mstar_rt.models.smolvla_checkpoint import load_lerobot_smolvla
    from mstar_rt.models.smolvla_reference import sample_actions_reference
    from test_lerobot_smolvla import CHECKPOINT, FIXTURE, other_requests

    loaded = load_lerobot_smolvla(CHECKPOINT, progress=False)
    base = other_requests(load_file(str(FIXTURE / "io.safetensors")))

    def case(rng: random.Random, i: int) -> dict:
        return dict(rng.choice(base), noise=None, seed=i % 50)

    engine = KVCacheEngine(page_size=16, num_pages=256, max_batch=12)
    policy = SmolVLAPolicy(loaded, engine=engine, max_batch=6, cuda_graphs=True)
    return policy, case, lambda o: sample_actions_reference(loaded, o)


def _family(name: str, seconds: float, seed: int) -> dict:
    from mstar_rt import Runtime

    policy, case, reference = _smolvla() if name == "smolvla" else _pi(name)
    policy.warm_up()
    rng = random.Random(seed)
    counts = {"finished": 0, "cancelled": 0, "wrong": 0, "errors": 0}
    worst, i, t0 = 0.0, 0, time.perf_counter()
    with Runtime(policy) as rt:
        while time.perf_counter() - t0 < seconds:
            burst = [case(rng, i + k) for k in range(rng.randint(1, 8))]
            i += len(burst)
            handles = [(o, rt.submit(o)) for o in burst]
            dropped = {id(h) for _o, h in handles if rng.random() < CANCEL and h.cancel()}
            counts["cancelled"] += len(dropped)
            for o, h in handles:
                if id(h) in dropped:
                    continue
                try:
                    got = h.result(timeout=60)["actions"][0]
                except Exception:
                    counts["errors"] += 1
                    continue
                diff = float((got - reference(o)).abs().max())
                worst = max(worst, diff)
                counts["wrong"] += diff > TOL
                counts["finished"] += 1
        time.sleep(0.5)
        cache = rt.engines["vla"].cache
        graphs = policy.graphs
        return {**counts, "worst_abs_diff": worst, "bucket_fills": graphs.fills,
                "static_steps": graphs.runs, "kv_pages_in_use": cache.num_pages - cache.free_pages,
                "live_requests": rt.live["requests"], "buckets_holding": graphs.holding}


def run_vla(quick: bool, seconds: float) -> dict:
    import torch

    torch.set_num_threads(1)
    try:
        from tqdm import tqdm
        tqdm.monitor_interval = 0  # no monitor thread (the loaders' bars): it would count as leaked
    except ImportError:
        pass
    for name in ("pi0", "smolvla"):  # lazy thread pools (torch's, the tokenizer's) exist
        _family(name, 1.0, seed=99)   # before the count
    start = snapshot(os.getpid())
    t0 = time.perf_counter()
    families: dict[str, dict] = {}
    growth = []
    with Sampler(os.getpid(), 1.0, t0) as sampler:
        for k, name in enumerate(("pi0", "pi05", "smolvla")):
            a = time.perf_counter() - t0
            families[name] = _family(name, seconds / 3, seed=k)
            b = time.perf_counter() - t0
            print(f"   {name}: {families[name]}", flush=True)
            # each family loads its model and forms new shapes first: its second half only
            growth.append(sampler.rss_growth_mb_per_min(after=(a + b) / 2, before=b))
    time.sleep(0.5)  # the last runtime's threads finish exiting
    end = snapshot(os.getpid())
    elapsed = time.perf_counter() - t0
    total = {k: sum(f[k] for f in families.values()) for k in
             ("finished", "cancelled", "wrong", "errors", "kv_pages_in_use", "live_requests",
              "buckets_holding")}
    held = total["live_requests"] + total["buckets_holding"]
    return {
        "families": families,
        "figures": {
            "seconds": elapsed, "requests": total["finished"] + total["cancelled"],
            "requests_per_s": (total["finished"] + total["cancelled"]) / elapsed,
            "finished": total["finished"], "cancelled": total["cancelled"],
            "wrong_outputs": total["wrong"], "kv_pages_in_use_at_end": total["kv_pages_in_use"],
            "requests_or_items_held_at_end": held,
            "worst_abs_diff": max(f["worst_abs_diff"] for f in families.values()),
            "rss_start_mb": start["rss_mb"], "rss_end_mb": end["rss_mb"],
            "rss_growth_mb_per_min": max(growth),  # the worst family's second half
            "fds_start": start["fds"], "fds_end": end["fds"],
            "leaked_fds": end["fds"] - start["fds"],
            "threads_start": start["threads"], "threads_end": end["threads"],
            "leaked_threads": end["threads"] - start["threads"],
            "errors": total["errors"] + total["wrong"] + (1 if held or total["kv_pages_in_use"]
                                                          else 0),
        },
    }

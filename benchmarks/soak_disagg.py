"""The disaggregation soak section: a small random Llama with its prefill walk on worker 1 and
its decode walk on worker 2 (each request's K/V moving between them, placement/kv_moves.py)
under the placement section's chaos -- cancels at random points (many racing the walk change),
workers SIGKILLed at random times (restart auto) -- with every finished request's greedy
tokens checked against the same model in this process.

Allowed outcomes: the reference's tokens; a cancel; RequestFailed naming a killed worker, or
K/V that never arrived because their sender was killed, or that their sender could not send to
the receiver that was killed. After the chaos: both workers up, 50 clean requests, and on both
workers no K/V page, queued item or request held."""

from __future__ import annotations

import os
import random
import sys
import threading
from typing import Any, Callable

from mstar_rt import Runtime
from mstar_rt.engines import SamplingParams
from mstar_rt.placement import ModelSpec, NodeGroup, PlacedRuntime

from bench_common import ROOT, child_pythonpath
from soak_placement import TIMEOUT_S, WrongOutput, model_section, settle
from soak_proc import snapshot
from soak_runtime import _Canceller, meet_fate

TESTS = str(ROOT / "tests" / "python")  # the tiny Llama of the placement tests (sharp logits:
sys.path.insert(0, TESTS)                # greedy tokens never near a tie)
MODEL = ModelSpec("placement_models:tiny_llama", {"emit_logits": False, "num_pages": 96})
GROUPS = [NodeGroup(["prefill"], rank=1), NodeGroup(["decode"], rank=2)]
CLEAN_AFTER = 50
HELD = ("kv_pages_in_use", "live_requests", "queued_items", "kv_waiting")  # 0 at the end


class GreedyReference:
    """Greedy tokens of an LM in this process, one run per (prompt, max_tokens)."""

    def __init__(self, model: object) -> None:
        self.rt = Runtime(model)
        self.cache: dict[tuple, list] = {}
        self.lock = threading.Lock()

    def tokens(self, prompt: list[int], n: int) -> list:
        key = (tuple(prompt), n)
        with self.lock:
            got = self.cache.get(key)
        if got is None:
            got = self.rt.submit({"prompt": prompt, "params": _params(n)}).result(TIMEOUT_S)
            got = got["token"]
            with self.lock:
                self.cache[key] = got
        return got

    def check(self, prompt: list[int], n: int, out: dict) -> None:
        want = self.tokens(prompt, n)
        if out["token"] != want:
            raise WrongOutput(f"prompt {prompt}, {n} tokens: {out['token']}, expected {want}")


def greedy_one(ref: GreedyReference, killed: Callable[[str], bool], racing_s: float,
               request: Callable[[random.Random], tuple[list[int], int]]) -> Callable:
    """A chaos client's one request (soak_placement's _drive): a greedy request with a random
    fate (cancels up to ``racing_s`` after submit), its tokens checked if it finishes."""
    def one(rt: Any, rng: random.Random, canceller: _Canceller) -> str:
        prompt, n = request(rng)
        h = rt.submit({"prompt": prompt, "params": _params(n)})
        out = settle(h, meet_fate(h, rng, canceller, racing_s), killed)
        if isinstance(out, str):
            return out
        ref.check(prompt, n, out)
        return "finished"
    return one


def _params(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True)


def _request(rng: random.Random) -> tuple[list[int], int]:
    return [rng.randrange(128) for _ in range(rng.randint(1, 20))], rng.randint(1, 24)


def _killed(text: str) -> bool:
    """A failure a kill explains: the worker named, K/V whose sender died, or K/V a sender
    could not send to the worker that died."""
    return "worker process rank" in text or "its K/V never arrived" in text \
        or "its K/V cannot arrive" in text or "its K/V could not be sent to worker rank" in text


def run_disagg(quick: bool, seconds: float) -> dict:
    os.environ["PYTHONPATH"] = child_pythonpath(TESTS)
    ref = GreedyReference(MODEL.build(MODEL.parent_kwargs))
    from mstar_rt.distributed.group import open_store
    open_store(2, 5.0)  # libuv's process-wide pipe pair opens with the first store, never closes
    start = snapshot(os.getpid())
    rt = PlacedRuntime(MODEL, GROUPS, progress=False, restart="auto", max_restarts=1_000_000)
    one = greedy_one(ref, _killed, 0.02, _request)  # 20 ms: a prefill and a K/V move

    def clean(prompt: list[int], n: int) -> None:
        ref.check(prompt, n, rt.submit({"prompt": prompt, "params": _params(n)})
                  .result(timeout=TIMEOUT_S))

    rng = random.Random(9)
    cleans = [lambda r=_request(rng): clean(*r) for _ in range(CLEAN_AFTER)]
    return model_section(rt, "disagg", seconds, 2, one, cleans, HELD, start, ref.rt.close)

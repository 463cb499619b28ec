"""The omni soak section: a tiny random Qwen3-Omni split over two workers as a user would
split it -- the thinker (text and audio encoders, its LM) on worker 1, the talker, code
predictor and code2wav on worker 2 -- so every request's thinker stream crosses worker to
worker into the talker's loop window by window (placement/stream_in.py), under the placement
section's chaos: cancels at random points and workers SIGKILLed at random times (restart
auto). Every finished request's tokens and audio chunks are checked against the same model in
this process: the same tokens, the same chunks (count and length; samples within 1e-4).

Allowed outcomes: the reference's outputs; a cancel; RequestFailed naming a killed worker.
After the chaos: both workers up, CLEAN_AFTER clean requests, and on both workers no K/V page,
queued item, request or segment run held."""

from __future__ import annotations

import os
import random
import sys
import tempfile
import threading

import numpy as np

from mstar_rt import Runtime
from mstar_rt.placement import ModelSpec, NodeGroup, PlacedRuntime

from bench_common import ROOT, child_pythonpath
from soak_placement import TIMEOUT_S, WrongOutput, model_section, settle
from soak_proc import snapshot
from soak_runtime import _Canceller, meet_fate

TESTS = str(ROOT / "tests" / "python")  # the tiny Qwen3-Omni of the omni tests
sys.path.insert(0, TESTS)
CLEAN_AFTER = 30
HELD = ("kv_pages_in_use", "live_requests", "queued_items", "segment_runs")  # 0 at the end
THINKER = ("text_", "thinker_", "audio_encoder")  # node name prefixes placed on worker 1


class _Reference:
    """Outputs of the same model in this process, one run per request."""

    def __init__(self, model: object) -> None:
        self.rt = Runtime(model)
        self.cache: dict[tuple, dict] = {}
        self.lock = threading.Lock()

    def outputs(self, req: dict) -> dict:
        key = _key(req)
        with self.lock:
            got = self.cache.get(key)
        if got is None:
            got = self.rt.submit(req).result(TIMEOUT_S)
            with self.lock:
                self.cache[key] = got
        return got


def _key(req: dict) -> tuple:
    return (tuple(req["prompt"]), req["thinker_sampling"]["max_tokens"],
            req["talker_sampling"]["max_tokens"], req["return_audio"])


def _request(rng: random.Random) -> dict:
    import omni_tiny as ot

    words = [rng.randrange(1, 60) for _ in range(rng.randint(1, 5))]
    return {"prompt": ot.chat_prompt(words), "speaker": "ethan", "audio_features": [],
            "return_audio": rng.random() < 0.9,
            "thinker_sampling": {"max_tokens": rng.randint(1, 12)},
            "talker_sampling": {"temperature": 0.0, "max_tokens": rng.randint(4, 40)}}


def _differs(out: dict, want: dict) -> str:
    """What differs between two requests' outputs ('' when nothing does)."""
    if out.get("token") != want.get("token"):
        return f"tokens {out.get('token')}, expected {want.get('token')}"
    got, ref = out.get("audio", []), want.get("audio", [])
    if [len(a) for a in got] != [len(a) for a in ref]:
        return f"audio chunks of {[len(a) for a in got]} samples, expected {[len(a) for a in ref]}"
    worst = max((float(np.abs(a - b).max()) for a, b in zip(got, ref) if len(a)), default=0.0)
    return f"audio differs by {worst:.2e}" if worst > 1e-4 else ""


def _killed(text: str) -> bool:
    return "worker process rank" in text


def run_omni(quick: bool, seconds: float) -> dict:
    from omni_support import tiny_qwen3_omni

    os.environ["PYTHONPATH"] = child_pythonpath(TESTS)
    directory = tempfile.mkdtemp(prefix="mstar_soak_omni_")
    model = tiny_qwen3_omni(directory)
    ref = _Reference(model)
    nodes = [n.name for n in model.nodes]
    thinker = [n for n in nodes if n.startswith(THINKER)]
    groups = [NodeGroup(thinker, rank=1), NodeGroup([n for n in nodes if n not in thinker],
                                                    rank=2)]
    spec = ModelSpec("placement_models:tiny_omni", {"directory": directory})
    start = snapshot(os.getpid())
    rt = PlacedRuntime(spec, groups, progress=False, restart="auto", max_restarts=1_000_000)

    def one(rt: PlacedRuntime, rng: random.Random, canceller: _Canceller) -> str:
        req = _request(rng)
        h = rt.submit(req)
        out = settle(h, meet_fate(h, rng, canceller, 0.05), _killed)  # 50 ms: a few tokens
        if isinstance(out, str):
            return out
        check(req, out)
        return "finished"

    def check(req: dict, out: dict) -> None:
        wrong = _differs(out, ref.outputs(req))
        if wrong:
            raise WrongOutput(f"{_key(req)}: {wrong}")

    rng = random.Random(11)
    cleans = [lambda req=_request(rng): check(req, rt.submit(req).result(timeout=TIMEOUT_S))
              for _ in range(CLEAN_AFTER)]
    return model_section(rt, "omni", seconds, 3, one, cleans, HELD, start, ref.rt.close)

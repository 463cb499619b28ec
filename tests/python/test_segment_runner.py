"""The worker's SegmentRunner in this process, its replies recorded: a run's EMITs made by the
batch that ends it leave inside its ``done`` (one message where a walk's last node EMITs, and
the parent delivers them first); earlier EMITs leave as they are made, in order."""

from __future__ import annotations

import threading

import torch

from mstar_rt.model import RequestContext
from mstar_rt.placement.segment_runner import SegmentRunner
from mstar_rt.placement.segments import find_segments

import placement_segment_models as sm
from placement_support import T

FIRST_ID = 100


class Replies:
    def __init__(self) -> None:
        self.got: list[tuple[str, dict]] = []
        self.ended = threading.Event()

    def __call__(self, kind: str, **fields) -> None:
        self.got.append((kind, fields))
        if kind in ("done", "failed"):
            self.ended.set()


def run_once(steps: int) -> list[tuple[str, dict]]:
    model = sm.segmented()
    ranks = {n: 1 for n in sm.GROUP}
    ranks.update(pre=0, post=0)
    segments = find_segments(model, ranks, {1}).segments
    main = next(FIRST_ID + i for i, s in enumerate(segments) if s.walk == "main")
    g = torch.linspace(-1, 1, 4)
    contexts = {7: RequestContext(id=7, inputs={"x": g, "n": steps, "pause": 0.0,
                                                "fail": False, "again": False})}
    replies = Replies()
    runner = SegmentRunner(model, segments, FIRST_ID, 1, contexts.get, replies)
    try:
        assert runner.submit(main, [(3, 7, {"h0": g, "fail": False, "n": steps,
                                           "pause": 0.0})]) == []
        assert replies.ended.wait(T)
    finally:
        runner.close()
    return replies.got


def test_a_run_whose_last_batch_emits_ends_in_one_reply():
    got = run_once(1)
    assert [k for k, _ in got] == ["done"]
    done = got[0][1]
    assert done["items"] == [3] and len(done["emits"]) == 1
    request, name, value = done["emits"][0]
    assert (request, name) == (7, "tok") and isinstance(value, int)
    assert set(done["outputs"][0]) == {"g"}


def test_earlier_emits_leave_as_made_and_the_last_rides_with_the_end():
    got = run_once(4)
    kinds = [k for k, _ in got]
    assert kinds[-1] == "done" and set(kinds[:-1]) <= {"emit"}
    tokens = [e for k, f in got if k == "emit" for e in f["emits"]]
    tokens += got[-1][1]["emits"]
    assert [(r, n) for r, n, _ in tokens] == [(7, "tok")] * 4
    assert len(got[-1][1]["emits"]) == 1  # the step that stopped the loop

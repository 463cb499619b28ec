"""Stream conformance under any timing (issue 16, item 1): for every chunk policy with random
parameters, every stream length from 0 to several chunks, and random delays in the producer and
the consumer (so the consumer runs before, during and after the producer's last iterations), a
stream consumer sees exactly the windows of the policy's table (docs/chunk_policies.md), never an
empty one, and -- if it asks (end_stream) -- hears the end exactly once, last. In the Python
Runtime and through a placement worker; tests/cpp/test_stream_conformance.cpp does the same for
the C++ runtime API."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mstar_rt import Runtime
from mstar_rt.placement import NodeGroup, PlacedRuntime

from stream_models import ITEM0, StreamModel
from walk_models import ZERO_LIVE, settled

T = 30.0
DELAYS = st.sampled_from([0.0, 0.0, 0.0, 0.0002, 0.001, 0.003])

# (name, arguments, first sizes, steady size, context) -- the table's parameters
POLICY = st.one_of(
    st.integers(1, 5).map(lambda k: ("Fixed", (k,), (), k, 0)),
    st.tuples(st.integers(1, 6), st.integers(1, 6)).filter(lambda t: t[1] <= t[0]).map(
        lambda t: ("SlidingWindow", t, (t[0],), t[1], t[0] - t[1])),
    st.tuples(st.integers(0, 4), st.integers(1, 5)).map(
        lambda t: ("LeftContext", t, (), t[1], t[0])),
    st.tuples(st.lists(st.integers(1, 4), max_size=3), st.integers(1, 5), st.integers(0, 3)).map(
        lambda t: ("Ramp", (tuple(t[0]), t[1], t[2]), tuple(t[0]), t[1], t[2])),
)


def table(first: tuple, steady: int, context: int, n: int) -> list[tuple[int, int, int]]:
    """The policy's windows over n items, (begin, new_begin, end): fresh sizes first..., then
    steady; up to `context` items before each; the tail flushed short; none past the end."""
    windows, new_begin = [], 0
    while new_begin < n:
        size = first[len(windows)] if len(windows) < len(first) else steady
        windows.append((max(0, new_begin - context), new_begin, min(new_begin + size, n)))
        new_begin += size
    return windows


@st.composite
def requests(draw, max_chunks: int = 4):
    """1-3 concurrent requests, each: n items (0 .. several chunks), producer and consumer
    delays."""
    out = []
    for _ in range(draw(st.integers(1, 3))):
        n = draw(st.integers(0, 3 + 4 * max_chunks))
        out.append(dict(n=n, pd=draw(st.lists(DELAYS, max_size=n + 1)),
                        cd=draw(st.lists(DELAYS, max_size=n + 1))))
    return out


def check(got: list, want: list, n: int, end_aware: bool, sequential: bool) -> None:
    windows = [w for w in got if w[0] == "window"]
    ends = [w for w in got if w[0] == "end"]
    assert [w[1:4] for w in windows] == want, got
    for _, begin, new_begin, end, last, items in windows:
        assert begin <= new_begin < end  # never an empty window
        assert items == [ITEM0 + p for p in range(begin, end)]
    assert not any(w[4] for w in windows[:-1]), got  # only the final window may say last
    if sequential and windows:  # cut after the end of stream: the final window knows it
        assert windows[-1][4], got
    if end_aware:
        told = len(ends) + (1 if windows and windows[-1][4] else 0)
        assert told == 1 and got[-1] in ends + windows[-1:], got  # exactly once, and last
    else:
        assert ends == [], got


def run_case(rt, walk: str, table_args: tuple, reqs: list, end_aware: bool, sequential: bool):
    handles = [rt.submit(dict(walk=walk, **r)) for r in reqs]
    for h, r in zip(handles, reqs):
        got = h.result(timeout=T).get("win", [])
        check(got, table(*table_args, r["n"]), r["n"], end_aware, sequential)


SETTINGS = dict(deadline=None, database=None, print_blob=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.function_scoped_fixture])


@settings(max_examples=60, **SETTINGS)
@given(policy=POLICY, reqs=requests(), end_aware=st.booleans(),
       placement=st.sampled_from(["parallel", "parallel", "sequential"]))
def test_windows_are_the_policys_under_any_timing_in_the_runtime(policy, reqs, end_aware,
                                                                 placement):
    kind, args, first, steady, context = policy
    with Runtime(StreamModel({"w": (kind, args, placement)}, end_aware)) as rt:
        run_case(rt, "w", (first, steady, context), reqs, end_aware, placement == "sequential")
        assert settled(rt) == ZERO_LIVE


# Through a placement worker: the consumers run in another process, one walk per policy.
PLACED = {"fixed3": ("Fixed", [3], (), 3, 0),
          "sliding42": ("SlidingWindow", [4, 2], (4,), 2, 2),
          "left23": ("LeftContext", [2, 3], (), 3, 2),
          "ramp": ("Ramp", [[1, 2], 4, 1], (1, 2), 4, 1)}


@pytest.fixture(scope="module")
def placed():
    walks = {f"{name}_{where}": [kind, args, where]
             for name, (kind, args, *_rest) in PLACED.items() for where in ("parallel", "sequential")}
    consumers = [f"consumer_{w}" for w in walks]
    rt = PlacedRuntime("stream_models:conformance", [NodeGroup(consumers, rank=1)],
                       model_kwargs={"walks": walks}, progress=False)
    yield rt
    rt.close()


@settings(max_examples=30, **SETTINGS)
@given(name=st.sampled_from(list(PLACED)), reqs=requests(max_chunks=3),
       where=st.sampled_from(["parallel", "sequential"]))
def test_windows_are_the_policys_under_any_timing_through_a_placement_worker(placed, name, reqs,
                                                                            where):
    _, _, first, steady, context = PLACED[name]
    run_case(placed, f"{name}_{where}", (first, steady, context), reqs, True, where == "sequential")

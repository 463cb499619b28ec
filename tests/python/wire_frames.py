"""Random ZeroMQ frames for the placement worker protocol fuzz tests (test_fuzz_placement_wire*.py,
issue 16, item 2): hypothesis strategies for headers, msgpack payloads -- messages of every kind
with fields mostly what the kind needs, the codec's extension types with plausible and forged
contents (arena references included), truncated, flipped and spliced bytes, structures nested
deeper than any parser stack, containers claiming 2**32 - 1 elements -- and ``clear``, which tells
a reply that says what was wrong from one that came from the worker's catch-all."""

from __future__ import annotations

import itertools
import re

import msgpack
import torch
from hypothesis import HealthCheck
from hypothesis import strategies as st

from mstar_rt.placement.protocol import TO_PARENT, TO_WORKER, TO_WORKER_HEADER

import placement_models as pm

T = 30.0
STRANGER_CASES, PARENT_CASES = 400, 400  # examples asked of hypothesis per suite
SETTINGS = dict(derandomize=True, deadline=None, database=None, print_blob=False,
                suppress_health_check=list(HealthCheck))
PIPELINE_NODES = ["encoder", "embed", "backbone", "collect", "head"]
# A reply whose text starts with a Python exception's name came from the worker's catch-all for
# its own bugs, not from a check that says what was wrong.
RAW_EXCEPTION = re.compile(r"^[A-Z]\w*(Error|Exception|Exit|Interrupt)\b")

# ---- strategies ----------------------------------------------------------------------------------

Ids = itertools.count  # work item ids, unique in a run, so every reply names one case's items

INT64 = st.integers(-2**63, 2**64 - 1)  # every integer msgpack carries
SMALL = st.integers(-2, 8)
LEAVES = st.one_of(st.none(), st.booleans(), SMALL, INT64, st.floats(), st.text(max_size=8),
                   st.binary(max_size=8))
DTYPES = st.sampled_from(["float32", "bfloat16", "int64", "uint8", "bool", "complex128",
                          "object", "", "float32 ", "<f4", "torch.float32"])
SHAPE = st.one_of(st.lists(st.integers(0, 5), max_size=4), st.lists(INT64, max_size=3),
                  st.lists(st.just(1), min_size=60, max_size=80), LEAVES)
REGISTERED = ["mstar_rt.model:StreamChunk", "placement_models:Tag",
              "mstar_rt.engines.sampling:SamplingParams", "os:system", "builtins:eval", ""]


def _ext(code: int, data: object) -> msgpack.ExtType:
    return msgpack.ExtType(code, msgpack.packb(data, use_bin_type=True))


def exts(inner: st.SearchStrategy) -> st.SearchStrategy:
    """The codec's extension types with plausible and forged contents, and unknown codes."""
    tensor = st.tuples(st.sampled_from([0, 1, 2, -1]), DTYPES, SHAPE,
                       st.one_of(st.integers(0, 1 << 16), INT64),
                       st.one_of(st.integers(0, 256), INT64)).map(list)
    small = st.tuples(st.sampled_from([0, 1, 2, -1]), DTYPES, SHAPE,
                      st.one_of(st.binary(max_size=40), SMALL)).map(list)
    return st.one_of(
        st.one_of(tensor, inner).map(lambda h: _ext(1, h)),
        st.one_of(small, inner).map(lambda h: _ext(6, h)),
        inner.map(lambda v: _ext(2, v)),
        st.tuples(st.sampled_from(REGISTERED),
                  st.dictionaries(st.text(max_size=10), inner, max_size=4)).map(
            lambda t: _ext(3, list(t))),
        inner.map(lambda v: _ext(3, v)),
        st.tuples(DTYPES, st.binary(max_size=9)).map(lambda t: _ext(4, list(t))),
        st.tuples(st.integers(0, 127), st.binary(max_size=12)).map(lambda t: msgpack.ExtType(*t)),
    )


VALUES = st.recursive(st.one_of(LEAVES, exts(LEAVES)),
                      lambda c: st.one_of(st.lists(c, max_size=4),
                                          st.dictionaries(st.one_of(st.text(max_size=6), SMALL),
                                                          c, max_size=4),
                                          exts(c)),
                      max_leaves=12)


def maybe(strategy: st.SearchStrategy, odds: int = 5) -> st.SearchStrategy:
    """``strategy`` most of the time, any value otherwise."""
    return st.integers(0, odds).flatmap(lambda i: VALUES if i == 0 else strategy)


@st.composite
def items(draw, ids: Ids, rids: list[int]) -> list:
    """A batch's items: mostly well-formed [item, request, iteration, {input: value}, chunk]."""
    out = []
    for _ in range(draw(st.integers(0, 4))):
        inputs = draw(st.dictionaries(
            st.sampled_from(["x", "delay", "h", "feat", "tok", "steps", "pause", "nope"]),
            st.one_of(VALUES, st.integers(0, 3).map(lambda n: torch.ones(n, pm.DIM_IN) / (n + 1)),
                      st.integers(1, 2).map(lambda n: torch.ones(n, pm.DIM) / 3)),
            max_size=4))
        inputs.pop("delay", None)  # a node may sleep as long as its input says; keep it short
        if draw(st.booleans()):
            inputs["delay"] = draw(st.sampled_from([0.0, 0, None, -1.0, "s", False]))
        chunk = draw(st.one_of(st.none(), st.tuples(SMALL, SMALL, SMALL, st.booleans()).map(list),
                               st.lists(LEAVES, max_size=5), VALUES))
        item = [next(ids), draw(st.sampled_from(rids)),
                draw(st.one_of(st.integers(0, 3), INT64)), inputs, chunk]
        out.append(draw(maybe(st.just(item))) if draw(st.integers(0, 7)) == 0 else item)
    return out


@st.composite
def opens(draw, rids: list[int]) -> dict:
    out = {}
    for rid in draw(st.lists(st.sampled_from(rids), unique=True, max_size=3)):
        entry = {"inputs": draw(st.one_of(st.none(), st.dictionaries(st.text(max_size=5), VALUES,
                                                                     max_size=3))),
                 "state": draw(st.dictionaries(st.text(max_size=5), LEAVES, max_size=3)),
                 "order": draw(st.one_of(st.tuples(INT64, INT64).map(list),
                                         st.tuples(st.integers(0, 10**12), SMALL).map(list),
                                         VALUES))}
        for key in draw(st.lists(st.sampled_from(list(entry)), unique=True, max_size=2)):
            del entry[key]
        out[rid] = draw(maybe(st.just(entry), odds=8))
    return draw(maybe(st.just(out), odds=8))


@st.composite
def messages(draw, ids: Ids, rids: list[int]) -> dict:
    """A msgpack map: a version, a kind and fields that are mostly what the kind needs."""
    msg: dict = {}
    if draw(st.integers(0, 9)):
        msg["v"] = 1 if draw(st.integers(0, 7)) else draw(VALUES)
    kind = draw(st.one_of(st.sampled_from(["batch", "batch", "release", "stats"]),
                          st.sampled_from([*TO_WORKER, *TO_PARENT, "explode", ""]), VALUES))
    msg["kind"] = kind
    fields = {"items": lambda: draw(items(ids, rids)),
              "node": lambda: draw(maybe(st.integers(-1, len(PIPELINE_NODES)))),
              "walk": lambda: draw(maybe(st.integers(-1, 2))),
              "open": lambda: draw(opens(rids)),
              "requests": lambda: draw(maybe(st.lists(st.sampled_from(rids), max_size=3))),
              "token": lambda: draw(maybe(INT64)),
              "gen": lambda: draw(VALUES)}
    wanted = {"batch": ["items", "node", "walk", "open"], "release": ["requests"],
              "stats": ["token"]}.get(kind if isinstance(kind, str) else "", [])
    for name in wanted:
        if draw(st.integers(0, 11)):
            msg[name] = fields[name]()
    for name in draw(st.lists(st.sampled_from(list(fields)), unique=True, max_size=2)):
        msg[name] = fields[name]()
    for key, value in draw(st.dictionaries(st.one_of(st.text(max_size=4), SMALL), VALUES,
                                           max_size=2)).items():
        msg.setdefault(key, value)
    return msg


def mutate(data: bytes, how: tuple) -> bytes:
    """Truncates ``data``, flips bytes in it or splices bytes into it."""
    kind, at, arg = how
    at = at % (len(data) + 1)
    if kind == "cut":
        return data[:at]
    if kind == "flip":
        if not data:
            return bytes([arg])
        at = min(at, len(data) - 1)
        return data[:at] + bytes([data[at] ^ (arg or 1)]) + data[at + 1:]
    return data[:at] + bytes([arg]) * (1 + arg % 7) + data[at:]


MUTATIONS = st.tuples(st.sampled_from(["cut", "flip", "splice"]), st.integers(0, 1 << 16),
                      st.integers(0, 255))


def nested(depth: int, marker: int) -> bytes:
    """``depth`` nested one-element arrays (or maps) around nil: deeper than any parser stack."""
    return (b"\x91" if marker % 2 else b"\x81\xa1k") * depth + b"\xc0"


def huge_container(tag: int) -> bytes:
    """A header that claims 2**32 - 1 elements (or bytes), with almost nothing behind it."""
    return bytes([tag]) + b"\xff\xff\xff\xff" + b"\x00" * 8


@st.composite
def payloads(draw, ids: Ids, rids: list[int]) -> bytes:
    choice = draw(st.integers(0, 9))
    if choice == 0:
        return draw(st.binary(max_size=64))
    if choice == 1:
        return draw(st.one_of(
            st.builds(nested, st.sampled_from([10, 500, 5000, 200_000]), st.integers(0, 1)),
            st.sampled_from([0xdc, 0xdd, 0xde, 0xdf, 0xc6, 0xdb, 0xc9]).map(huge_container)))
    try:
        packed = msgpack.packb(draw(messages(ids, rids)), use_bin_type=True)
    except (TypeError, ValueError, OverflowError):
        packed = b"\xc1"
    if choice == 2:
        packed = mutate(packed, draw(MUTATIONS))
    return packed


@st.composite
def frames(draw, gen: int, ids: Ids, rids: list[int]) -> list[bytes]:
    """What a DEALER sends: mostly [12-byte header, payload], sometimes other frame counts and
    header sizes; the header's generation is mostly the worker's."""
    choice = draw(st.integers(0, 11))
    if choice == 0:
        return draw(st.lists(st.binary(max_size=16), min_size=1, max_size=4))
    if choice == 1:
        header = draw(st.binary(max_size=20))
    else:
        g = gen if draw(st.integers(0, 5)) else draw(st.integers(0, 2**32 - 1))
        span = draw(st.one_of(st.just(0), st.integers(0, 2**64 - 1)))
        header = TO_WORKER_HEADER.pack(g, span)
    out = [header, draw(payloads(ids, rids))]
    if choice == 2:
        out.append(draw(st.binary(max_size=8)))
    return out


def clear(text: object) -> bool:
    return isinstance(text, str) and len(text) > 10 and not RAW_EXCEPTION.match(
        text.split("rejected a message: ", 1)[-1])

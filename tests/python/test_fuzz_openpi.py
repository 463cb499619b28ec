"""Fuzzing the openpi policy websocket (issue 16, item 2): generated frames -- random bytes,
truncated messages, wrong types, arrays of wrong dtypes and shapes, shapes far past any buffer,
deep nesting, text frames, valid observations with missing or extra keys -- each get one clear
``error: ...`` text frame (or, when valid, the policy's actions) on a connection that stays open
for the next observation, as serve/openpi.py promises. A frame over the server's ws_max_size
closes that one connection with 1009 and the server accepts the next; an image whose header
claims more pixels than the policy takes is refused before it is decoded. No case is counted as
a server failure, and afterwards a valid observation still gets its actions."""

from __future__ import annotations

import contextlib
import struct
import time
import zlib
from pathlib import Path
from typing import Any, Iterator

import msgpack
import numpy as np
import pytest
import websockets.exceptions
import websockets.sync.client
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from openpi_client import msgpack_numpy

from mstar_rt.serve.config import build_model, load_config
from mstar_rt.serve.config import PolicySpec
from mstar_rt.serve.openpi import MAX_IMAGE_PIXELS, ObservationError, check_input, decode_image
from test_serve_support import serving, settled

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = 500  # generated frames per run (derandomized: the same frames in every run)
RECV_S = 20.0  # a reply slower than this is a hang
FUZZ = settings(max_examples=EXAMPLES, derandomize=True, database=None, deadline=None,
                suppress_health_check=list(HealthCheck))

GOOD = {"observation/state": np.linspace(-1, 1, 8, dtype=np.float32)}
STATE = np.zeros(8, np.float32)
IMAGE = np.zeros((64, 64, 3), np.uint8)


@pytest.fixture(scope="module")
def robot():
    """examples/robot's chunk policy (observation/state [8] float32 -> actions [20, 2])."""
    config = load_config(ROOT / "examples" / "serve" / "robot_policy.yaml")
    with serving(build_model(config), name=config.model.name, policy=config.policy,
                 max_concurrent_requests=8) as s:
        yield s


@pytest.fixture(scope="module")
def vision():
    """examples/serve/vision_policy.py: observation/image [64, 64, 3] uint8 (raw, or JPEG/PNG
    bytes) + observation/state [8] -> actions [16, 7]."""
    config = load_config(ROOT / "examples" / "serve" / "vision_policy.yaml")
    with serving(build_model(config), name=config.model.name, policy=config.policy) as s:
        yield s


@contextlib.contextmanager
def _connect(s) -> Iterator[websockets.sync.client.ClientConnection]:
    with websockets.sync.client.connect(f"{s.ws_url}/", open_timeout=RECV_S) as ws:
        assert msgpack_numpy.unpackb(ws.recv(RECV_S))["model"]  # the metadata comes first
        yield ws


def _reply(ws, frame: Any) -> Any:
    ws.send(frame)
    return ws.recv(RECV_S)


def _actions(ws, obs: dict = GOOD) -> np.ndarray:
    reply = _reply(ws, _pack(obs))
    assert isinstance(reply, bytes), reply
    return msgpack_numpy.unpackb(reply)["actions"]


def _error(ws, frame: Any) -> str:
    reply = _reply(ws, frame)
    assert isinstance(reply, str) and reply.startswith("error: "), reply
    return reply


# ---- packing anything, as a client might -------------------------------------------------------

def _ndarray(dtype: Any, shape: Any, data: Any) -> dict:
    return {b"__ndarray__": True, b"data": data, b"dtype": dtype, b"shape": shape}


def _npgeneric(dtype: Any, data: Any) -> dict:
    return {b"__npgeneric__": True, b"data": data, b"dtype": dtype}


def _as_wire(obj: Any) -> Any:
    """Arrays as openpi_client packs them, of any dtype (it refuses some; a client may not)."""
    if isinstance(obj, np.ndarray):
        return _ndarray(obj.dtype.str, list(obj.shape), obj.tobytes())
    if isinstance(obj, np.generic):
        return _npgeneric(obj.dtype.str, obj.item())
    raise TypeError(type(obj))


def _pack(obs: Any) -> bytes:
    return msgpack.packb(obs, default=_as_wire)


# ---- generated frames --------------------------------------------------------------------------
# Each strategy draws (kind, what the server must answer, frame); the answer is "error" (an
# error text frame), "actions" (the policy's actions), or "either" (a frame that may be valid).

_ints = st.integers(-2**63, 2**64 - 1)  # what msgpack carries
_scalars = (st.none() | st.booleans() | _ints | st.floats() | st.text(max_size=16)
            | st.binary(max_size=32))
_values = st.recursive(_scalars, lambda kids: st.lists(kids, max_size=4) | st.dictionaries(
    st.text(max_size=8), kids, max_size=4), max_leaves=24)
_dtypes = (st.sampled_from(["<f4", ">f4", "<f8", "<f2", "|u1", "|i1", "|b1", "<i8", ">u8", "<c8",
                            "<c16", "|V8", "|O", "<U4", "|S4", "|S0", "<M8[s]", "<m8[ns]", "f3",
                            "", "float32", "object", "void", "(2,)f4", "<f4,<i4"])
           | st.text(max_size=6) | _ints | st.none() | st.lists(st.text(max_size=4), max_size=2))
_shapes = (st.lists(st.integers(-2, 16), max_size=3) | st.lists(st.integers(0, 2**64 - 1),
                                                                max_size=3)
           | st.sampled_from([[8], [2, 4], [2**31, 2**31], [2**62, 2**62], [-8], [0] * 65, []])
           | _values)
# arrays as the wire carries them, with any dtype, shape and data
_wire_arrays = (st.builds(_ndarray, _dtypes, _shapes, st.binary(max_size=256) | _values)
                | st.builds(_npgeneric, _dtypes, _scalars | _values))
# real arrays of many dtypes, most of a shape the policy does not take
_real_arrays = hnp.arrays(st.sampled_from(["f4", "f8", "f2", "u1", "i8", "?", "c8", "U3", "S3"]),
                          hnp.array_shapes(min_dims=0, max_dims=3, max_side=9))
# big ones: far past the policy's [8] (4 MB at most, so a case stays fast)
_big_arrays = st.integers(9, 2**20).map(lambda n: np.zeros(n, np.float32))
# keys that cannot name the state, directly or nested ("observation" -> "state")
_extra = st.dictionaries(st.text(max_size=12).filter(lambda k: not k.startswith("observation")),
                         _values | _real_arrays, max_size=3)


@st.composite
def _wrong_state(draw):
    state = draw(_values | _wire_arrays | _real_arrays | _big_arrays)
    return "wrong state", "either", _pack({**draw(_extra), "observation/state": state})


@st.composite
def _keys(draw):
    """The state missing, or a valid one with extra keys."""
    if draw(st.booleans()):
        return "missing state", "error", _pack(draw(_extra))
    return "extra keys", "actions", _pack({**draw(_extra), **GOOD})


@st.composite
def _truncated(draw):
    frame = _pack(draw(st.sampled_from([GOOD, {**GOOD, "prompt": "reach"}])))
    return "truncated", "error", frame[:draw(st.integers(0, len(frame) - 1))]


@st.composite
def _deep(draw):
    """Arrays or maps nested past what msgpack's unpacker (and numpy) take."""
    depth = draw(st.integers(1, 5000))
    if draw(st.booleans()):
        inner = b"\x91" * depth + b"\xc0"  # [[[...[nil]...]]]
    else:
        inner = b"\x81\xa1k" * depth + b"\xc0"  # {"k": {"k": ... nil}}
    if draw(st.booleans()):
        inner = b"\x81" + msgpack.packb("observation/state") + inner
    return "deep", "error", inner


FRAMES = st.one_of(
    _wrong_state(), _wrong_state(), _keys(), _truncated(), _deep(),
    _values.map(lambda v: ("other values", "error", _pack(v))),  # no key names the state
    st.binary(max_size=512).map(lambda b: ("random bytes", "error", b)),
    st.text(max_size=64).map(lambda t: ("text frame", "error", t)),
)


def test_every_generated_frame_gets_an_error_frame_or_actions_and_the_connection_lives(robot):
    tried: dict[str, int] = {}
    started = time.monotonic()
    with _connect(robot) as ws:
        @FUZZ
        @given(FRAMES)
        def fuzz(case: tuple) -> None:
            kind, want, frame = case
            tried[kind] = tried.get(kind, 0) + 1
            reply = _reply(ws, frame)
            if isinstance(reply, str):
                assert want != "actions", reply
                assert reply.startswith("error: ") and len(reply) > len("error: ") + 10, reply
            else:
                assert want != "error", frame[:200]
                assert msgpack_numpy.unpackb(reply)["actions"].shape == (20, 2)
            assert _actions(ws).shape == (20, 2)  # the same connection serves the next one

        fuzz()
    total = sum(tried.values())
    print(f"\nopenpi fuzz: {total} frames in {time.monotonic() - started:.1f} s: {tried}")
    assert total >= EXAMPLES * 0.9 and len(tried) == 8 and min(tried.values()) >= 5, tried
    with _connect(robot) as ws:
        assert _actions(ws).shape == (20, 2)  # a new connection too
    requests = robot.state.metrics.requests
    assert requests.value("policy", "failed") == 0  # every bad frame was the client's fault
    assert requests.value("policy", "bad_request") >= total * 0.5
    assert settled(robot)["requests"] == 0


# ---- past the server's limits ------------------------------------------------------------------

def test_a_frame_over_ws_max_size_closes_that_connection_with_1009_and_the_server_goes_on(robot):
    limit = robot.server._server.config.ws_max_size
    with _connect(robot) as ws:
        ws.send(b"\x00" * (limit + 1))
        with pytest.raises(websockets.exceptions.ConnectionClosed) as e:
            ws.recv(RECV_S)
        assert e.value.rcvd is not None and e.value.rcvd.code == 1009  # message too big
    with _connect(robot) as ws:
        assert _actions(ws).shape == (20, 2)
        # just under the limit: read, refused by its shape, the connection open
        big = _pack({"observation/state": np.zeros((limit - 1024) // 4, np.float32)})
        assert len(big) < limit
        assert "has shape" in _error(ws, big)
        assert _actions(ws).shape == (20, 2)


def _png(width: int, height: int) -> bytes:
    """A black grayscale PNG: a few hundred KB that decode to width * height * 3 bytes."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return (struct.pack(">I", len(data)) + kind + data
                + struct.pack(">I", zlib.crc32(kind + data)))

    z = zlib.compressobj(9)
    row = b"\x00" * (width + 1)
    idat = b"".join(z.compress(row) for _ in range(height)) + z.flush()
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 0, 0,
                                                              0, 0))
            + chunk(b"IDAT", idat) + chunk(b"IEND", b""))


def test_an_image_claiming_more_pixels_than_the_policy_takes_is_refused_before_decoding(vision):
    bomb = _png(6000, 6000)  # 100 MB once decoded; before the check every such frame cost that
    assert len(bomb) < 100_000
    with _connect(vision) as ws:
        error = _error(ws, _pack({"observation/image": bomb, "observation/state": STATE}))
        assert "a 6000 x 6000 image is larger than the policy takes (64 x 64)" in error
        assert _actions(ws, {"observation/image": IMAGE, "observation/state": STATE}).shape \
            == (16, 7)
    # a policy that declares no image size still has a ceiling
    side = int(MAX_IMAGE_PIXELS ** 0.5) + 1
    with pytest.raises(ObservationError, match=f"a {side} x {side} image is larger"):
        decode_image(_png(side, side), "observation/image")


@pytest.mark.parametrize("image, needle", [
    (b"", "0 bytes that OpenCV cannot decode"),
    (b"\xff\xd8\xff\xe0" + b"\x00" * 64, "OpenCV cannot decode"),
    (b"\x89PNG\r\n\x1a\n" + b"\x00" * 64, "OpenCV cannot decode"),
    (b"GIF89a" + b"\x00" * 64, "OpenCV cannot decode"),
    (np.zeros(10, np.uint8), "10 bytes that OpenCV cannot decode"),
    (np.zeros((64, 64), np.float32), "has shape (64, 64)"),
    ([[0, 1]], "an image must be an array or encoded bytes"),
    ("a string", "an image must be an array or encoded bytes"),
    (7, "an image must be an array or encoded bytes"),
], ids=["empty", "jpeg-header-only", "png-header-only", "gif", "short-uint8", "gray-float",
        "list", "text", "int"])
def test_undecodable_images_get_an_error_frame_and_the_next_image_is_served(vision, image, needle):
    with _connect(vision) as ws:
        error = _error(ws, _pack({"observation/image": image, "observation/state": STATE}))
        assert error.startswith("error: observation 'observation/image'") and needle in error, \
            error
        assert _actions(ws, {"observation/image": IMAGE, "observation/state": STATE}).shape \
            == (16, 7)
    assert vision.state.metrics.requests.value("policy", "failed") == 0


def test_random_image_bytes_get_an_error_frame_on_one_connection(vision):
    tried = 0
    with _connect(vision) as ws:
        @settings(FUZZ, max_examples=100)
        @given(st.binary(min_size=1, max_size=2048)
               | st.binary(max_size=512).map(lambda b: b"\xff\xd8\xff" + b)
               | st.binary(max_size=512).map(lambda b: b"\x89PNG\r\n\x1a\n" + b))
        def fuzz(data: bytes) -> None:
            nonlocal tried
            tried += 1
            _error(ws, _pack({"observation/image": data, "observation/state": STATE}))

        fuzz()
    print(f"\nopenpi image fuzz: {tried} images")
    assert tried >= 90


@pytest.mark.parametrize("name, value, needle", [
    ("gripper", [300], "cannot be read as uint8"),  # numpy's OverflowError: was a server failure
    ("state", [1e300] * 8, "cannot be read as float32"),  # was inf, fed to the policy
    ("state", np.ones(8, np.complex64), "cannot be read as float32"),  # was its real part
    ("state", [[0.0] * 8], "has shape (1, 8), but the policy takes (8,)"),
])
def test_a_value_outside_its_declared_dtype_or_shape_is_the_clients_error(name, value, needle):
    spec = PolicySpec(shapes={"state": [8]}, dtypes={"state": "float32", "gripper": "uint8"})
    with pytest.raises(ObservationError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        check_input(spec, name, value, f"observation {name!r}")

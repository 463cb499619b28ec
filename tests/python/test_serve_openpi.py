"""The openpi policy websocket: the real openpi_client WebsocketClientPolicy gets correctly shaped
actions (the robot demo's policy; a camera policy with raw and JPEG images); concurrent clients
are batched and never wait on each other's trouble; malformed messages get an error frame and
the connection keeps working; the API key is checked on the handshake; a placed policy whose
worker is killed fails only the observations that worker held. Also the benchmark's --quick
smoke run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import uuid
from pathlib import Path

import cv2
import httpx
import msgpack
import numpy as np
import pytest
import websockets.exceptions
import yaml
from openpi_client import msgpack_numpy
from openpi_client.websocket_client_policy import WebsocketClientPolicy

from mstar_rt.serve.config import build_model, load_config
from test_serve_support import serving, settled, wait_until

ROOT = Path(__file__).resolve().parents[2]
# openpi_client connects without a context manager, which websockets >= 14 warns about
pytestmark = pytest.mark.filterwarnings("ignore:connect\\(\\) must be used:DeprecationWarning")
KEY = "policy-key"


@pytest.fixture(scope="module")
def robot():
    """examples/robot's chunk policy (obs [8] -> actions [20, 2]) as robot_policy.yaml serves it."""
    config = load_config(ROOT / "examples" / "serve" / "robot_policy.yaml")
    model = build_model(config)
    with serving(model, name=config.model.name, policy=config.policy, api_key=KEY,
                 max_concurrent_requests=8) as s:
        s.net, s.model = model.net, model
        yield s


@pytest.fixture(scope="module")
def vision():
    """examples/serve/vision_policy.py (image [64, 64, 3] + state [8] -> actions [16, 7])."""
    config = load_config(ROOT / "examples" / "serve" / "vision_policy.yaml")
    model = build_model(config)
    with serving(model, name=config.model.name, policy=config.policy) as s:
        s.net, s.model = model.net, model
        yield s


def _client(s, key=KEY) -> WebsocketClientPolicy:
    return WebsocketClientPolicy("127.0.0.1", s.port, api_key=key)


def _state(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(8).astype(np.float32)


def _image(seed: int) -> np.ndarray:
    # smooth, so JPEG keeps it close; uint8 RGB
    y, x = np.mgrid[0:64, 0:64]
    g = np.random.default_rng(seed)
    img = np.stack([(x * g.uniform(1, 3) + y * g.uniform(0, 2)) % 256 for _ in range(3)], -1)
    return img.astype(np.uint8)


# ---- the openpi client -------------------------------------------------------------------------

def test_openpi_client_gets_metadata_and_the_policys_actions(robot):
    client = _client(robot)
    try:
        meta = client.get_server_metadata()
        assert meta["model"] == "robot-chunk-policy" and meta["action_horizon"] == 20
        assert meta["observation"]["observation/state"]["shape"] == "(8,)"
        for seed in range(3):
            obs = {"observation/state": _state(seed), "prompt": "reach"}
            reply = client.infer(obs)
            assert reply["actions"].shape == (20, 2) and reply["actions"].dtype == np.float32
            np.testing.assert_allclose(reply["actions"], robot.net.act(obs["observation/state"]),
                                       rtol=1e-5, atol=1e-6)
            assert reply["server_timing"]["infer_ms"] > 0
        assert "prev_total_ms" in reply["server_timing"]
    finally:
        client._ws.close()
    assert settled(robot)["requests"] == 0


def test_camera_policy_takes_raw_and_jpeg_images_and_jpeg_decodes_to_the_same_actions(vision):
    client = WebsocketClientPolicy("127.0.0.1", vision.port)
    try:
        image, state = _image(0), _state(0)
        raw = client.infer({"observation/image": image, "observation/state": state})
        assert raw["actions"].shape == (16, 7)
        np.testing.assert_allclose(raw["actions"], vision.net.act(image, state), atol=1e-5)
        ok, jpeg = cv2.imencode(".jpg", cv2.cvtColor(image, cv2.COLOR_RGB2BGR))
        assert ok
        sent = client.infer({"observation/image": jpeg.tobytes(), "observation/state": state})
        decoded = cv2.cvtColor(cv2.imdecode(jpeg, cv2.IMREAD_COLOR), cv2.COLOR_BGR2RGB)
        np.testing.assert_allclose(sent["actions"], vision.net.act(decoded, state), atol=1e-5)
        # a JPEG packed as a uint8 array works too (some clients send np.frombuffer(jpeg))
        arr = client.infer({"observation/image": jpeg.reshape(-1), "observation/state": state})
        np.testing.assert_allclose(arr["actions"], sent["actions"], atol=1e-6)
    finally:
        client._ws.close()


def test_concurrent_clients_are_batched_by_the_runtime_and_all_get_their_own_actions(vision):
    sizes: list[int] = []
    node = vision.rt.model.submodules["denoise"]
    forward = node.forward

    def counting(batch):
        sizes.append(len(batch))
        return forward(batch)

    node.forward = counting
    clients = [WebsocketClientPolicy("127.0.0.1", vision.port) for _ in range(6)]
    results: dict[int, list] = {}
    go = threading.Barrier(len(clients))

    def run(k: int) -> None:
        go.wait()
        results[k] = [clients[k].infer({"observation/image": _image(k),
                                        "observation/state": _state(10 * k + i)})["actions"]
                      for i in range(3)]

    threads = [threading.Thread(target=run, args=(k,)) for k in range(len(clients))]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    finally:
        node.forward = forward
        for c in clients:
            c._ws.close()
    assert sorted(results) == list(range(6))
    for k, per in results.items():
        for i, actions in enumerate(per):
            np.testing.assert_allclose(actions, vision.net.act(_image(k), _state(10 * k + i)),
                                       atol=1e-5)
    assert max(sizes) > 1, sizes  # observations of different connections shared a forward
    assert settled(vision) == dict(requests=0, handles=0, stored=0, queued=0, inflight=0)


# ---- malformed input ---------------------------------------------------------------------------

@pytest.mark.parametrize("payload, needle", [
    (b"\xc1\x00garbage", "not msgpack"),
    (msgpack.packb([1, 2, 3]), "must be a dict"),
    (msgpack_numpy.packb({"observation/state": np.zeros(5, np.float32)}), "has shape (5,)"),
    (msgpack_numpy.packb({"observation/state": np.zeros((2, 8), np.float32)}),
     "has shape (2, 8)"),
    (msgpack_numpy.packb({"state": np.zeros(8, np.float32)}), "has no 'observation/state'"),
    (msgpack_numpy.packb({"observation/state": "eight floats"}), "cannot be read as float32"),
    (msgpack.packb({"observation/state": {b"__ndarray__": True, b"data": b"\x00" * 3,
                                          b"dtype": "<f4", b"shape": [8]}}), "needs 32 bytes"),
    ("a text frame", "binary msgpack frames"),
    # the policy answered NaN actions for them, which an openpi client executes
    (msgpack_numpy.packb({"observation/state": np.full(8, np.nan, np.float32)}),
     "holds NaN or infinite values"),
    (msgpack_numpy.packb({"observation/state": np.full(8, np.inf, np.float64)}),
     "holds NaN or infinite values"),
], ids=["garbage", "list", "short-state", "batched-state", "missing-key", "string-state",
        "truncated-array", "text-frame", "nan-state", "inf-state"])
def test_malformed_observation_gets_an_error_frame_and_the_connection_keeps_working(robot, payload,
                                                                                    needle):
    import websockets.sync.client

    with websockets.sync.client.connect(f"{robot.ws_url}/", additional_headers={
            "Authorization": f"Api-Key {KEY}"}) as ws:
        assert msgpack_numpy.unpackb(ws.recv())["model"] == "robot-chunk-policy"
        ws.send(payload)
        error = ws.recv()
        assert isinstance(error, str) and needle in error, error
        ws.send(msgpack_numpy.packb({"observation/state": _state(1)}))
        reply = msgpack_numpy.unpackb(ws.recv())
        assert reply["actions"].shape == (20, 2)


def test_openpi_client_raises_the_servers_error_and_its_next_call_succeeds(vision):
    client = WebsocketClientPolicy("127.0.0.1", vision.port)
    try:
        with pytest.raises(RuntimeError, match="OpenCV cannot decode"):
            client.infer({"observation/image": b"not a jpeg", "observation/state": _state(0)})
        with pytest.raises(RuntimeError, match=r"has shape \(32, 32, 3\)"):
            client.infer({"observation/image": np.zeros((32, 32, 3), np.uint8),
                          "observation/state": _state(0)})
        assert client.infer({"observation/image": _image(1),
                             "observation/state": _state(1)})["actions"].shape == (16, 7)
    finally:
        client._ws.close()


def test_observation_keys_stay_interned_after_their_message_is_freed():
    # msgpack interns map keys; one that left CPython's interned-string table with every message
    # made the table rebuild itself every ~10k messages (+1.9 MB the first time)
    from mstar_rt.serve.openpi import packb, unpackb

    key = "observation/" + uuid.uuid4().hex  # a fresh string, interned by no one yet
    obs = unpackb(packb({key: np.zeros(2, np.float32), "nested": {key: 1}}))
    interned = next(iter(obs))
    assert interned == key and interned is not key
    kept = id(interned)
    del obs, interned
    assert id(sys.intern(key)) == kept  # still the one the first message interned


def test_a_waiting_request_never_blocks_other_connections_or_health(robot):
    node = robot.rt.model.submodules["mlp"]
    forward = node.forward
    release = threading.Event()
    entered = threading.Event()

    def slow(batch):
        entered.set()
        release.wait(20)
        return forward(batch)

    node.forward = slow
    first = _client(robot)
    reply: list = []
    t = threading.Thread(target=lambda: reply.append(first.infer({"observation/state": _state(0)})))
    try:
        t.start()
        assert entered.wait(20)
        # the policy is stuck in a forward; the server still connects, answers, and rejects
        assert httpx.get(robot.url + "/healthz").text == "OK\n"
        other = _client(robot)
        with pytest.raises(RuntimeError, match="has shape"):
            other.infer({"observation/state": np.zeros(3, np.float32)})
        other._ws.close()
    finally:
        release.set()
        t.join(20)
        node.forward = forward
        first._ws.close()
    assert reply[0]["actions"].shape == (20, 2)


def test_a_client_that_leaves_while_its_observation_is_served_cancels_it(robot):
    node = robot.rt.model.submodules["mlp"]
    forward = node.forward
    release, entered = threading.Event(), threading.Event()

    def slow(batch):
        entered.set()
        release.wait(20)
        return forward(batch)

    def cancelled() -> float:
        return robot.state.metrics.requests.value("policy", "cancelled")

    before = cancelled()
    node.forward = slow
    client = _client(robot)

    def ask() -> None:
        with pytest.raises(websockets.exceptions.ConnectionClosed):
            client.infer({"observation/state": _state(0)})

    t = threading.Thread(target=ask, daemon=True)
    try:
        t.start()
        assert entered.wait(20)
        client._ws.close()  # gone while its forward still runs: cancelled now, not after it
        wait_until(lambda: cancelled() == before + 1, "the request cancelled")
    finally:
        release.set()
        node.forward = forward
        t.join(20)
    settled(robot)
    assert _client(robot).infer({"observation/state": _state(1)})["actions"].shape == (20, 2)


# ---- API key, health, limits -------------------------------------------------------------------

@pytest.mark.parametrize("key", [None, "wrong"])
def test_missing_or_wrong_api_key_is_refused_on_the_handshake(robot, key):
    with pytest.raises(websockets.exceptions.InvalidStatus, match="403"):
        WebsocketClientPolicy("127.0.0.1", robot.port, api_key=key)
    assert httpx.get(robot.url + "/healthz").status_code == 200  # health needs no key
    assert _client(robot).infer({"observation/state": _state(2)})["actions"].shape == (20, 2)


def test_healthz_is_503_with_the_reason_while_the_model_cannot_serve(robot, monkeypatch):
    monkeypatch.setattr(robot.model, "health", lambda: "a rank was lost; load it again")
    got = httpx.get(robot.url + "/healthz")
    assert got.status_code == 503 and got.text == "a rank was lost; load it again\n"
    monkeypatch.undo()
    assert httpx.get(robot.url + "/healthz").text == "OK\n"


def test_above_max_concurrent_requests_a_policy_call_gets_an_error_frame(robot):
    admission = robot.state.bridge.admission
    for _ in range(admission.limit):
        admission.enter()  # the server is full
    try:
        client = _client(robot)
        with pytest.raises(RuntimeError, match="max_concurrent_requests=8"):
            client.infer({"observation/state": _state(0)})
    finally:
        for _ in range(admission.limit):
            admission.leave()
    assert client.infer({"observation/state": _state(0)})["actions"].shape == (20, 2)
    client._ws.close()
    text = httpx.get(robot.url + "/metrics", headers={"x-api-key": KEY}).text
    assert 'mstar_requests_total{endpoint="policy",status="rejected"} 1' in text
    assert 'mstar_requests_total{endpoint="policy",status="ok"}' in text


# ---- multi-process placement behind the same server ----------------------------------------------

def test_policy_placed_across_two_processes_serves_the_same_actions(tmp_path):
    from mstar_rt.serve.config import build_runtime

    raw = yaml.safe_load((ROOT / "examples" / "serve" / "robot_policy.yaml").read_text())
    raw["node_groups"] = [{"nodes": ["mlp"], "rank": 1, "process": True, "device": "cpu"}]
    config = load_config(raw, base_dir=str(ROOT / "examples" / "serve"))
    model = build_model(config)
    runtime = build_runtime(config, model)
    assert type(runtime).__name__ == "PlacedRuntime"
    with serving(model, runtime=runtime, name="placed", policy=config.policy) as s:
        client = WebsocketClientPolicy("127.0.0.1", s.port)
        try:
            for seed in range(3):
                state = _state(seed)
                actions = client.infer({"observation/state": state})["actions"]
                np.testing.assert_allclose(actions, model.net.act(state), rtol=1e-5, atol=1e-6)
        finally:
            client._ws.close()
        assert settled(s)["requests"] == 0
        # restart: manual (the default): the operator is told what a server operator can do
        os.kill(runtime.workers[1]["pid"], signal.SIGKILL)
        wait_until(lambda: runtime.health() is not None, "the dead worker to show in health")
        health = httpx.get(s.url + "/health").json()
        assert "restart the server" in str(health) and "restart_worker" not in str(health), health


def test_a_placed_policy_whose_worker_is_killed_fails_only_the_observations_it_held(tmp_path):
    """The camera policy split over two worker processes (restart: auto), four robots sending
    without pause, and the expert's worker SIGKILLed mid-traffic: an observation either gets
    the right actions or an error frame naming the dead worker and the nodes it ran (never the
    internal stand-in's name), each connection keeps serving, and /health is ok again once
    the worker is back."""
    from mstar_rt.serve.config import build_runtime

    raw = yaml.safe_load((ROOT / "examples" / "serve" / "vision_policy.yaml").read_text())
    raw["node_groups"] = [{"nodes": ["encode"], "rank": 1, "process": True},
                          {"nodes": ["denoise", "finish"], "rank": 2, "process": True}]
    raw["placement"] = {"restart": "auto"}
    config = load_config(raw, base_dir=str(ROOT / "examples" / "serve"))
    model = build_model(config)
    obs = [{"observation/image": _image(k), "observation/state": _state(k)} for k in range(4)]
    want = [model.net.act(o["observation/image"], o["observation/state"]) for o in obs]
    with serving(model, runtime=build_runtime(config, model), name="placed",
                 policy=config.policy) as s:
        pid = s.rt.workers[2]["pid"]
        stop, sent, errors, wrong = threading.Event(), [0] * 4, [], []

        def robot(k: int) -> None:
            client = WebsocketClientPolicy("127.0.0.1", s.port)
            try:
                while not stop.is_set():
                    try:
                        actions = client.infer(obs[k])["actions"]
                    except RuntimeError as e:  # openpi_client raises on an error frame
                        errors.append(str(e))
                        continue
                    sent[k] += 1
                    if np.abs(actions - want[k]).max() > 1e-4:
                        wrong.append(k)
            finally:
                client._ws.close()

        robots = [threading.Thread(target=robot, args=(k,)) for k in range(4)]
        for t in robots:
            t.start()
        wait_until(lambda: min(sent) >= 5, "every robot to be served")
        os.kill(pid, signal.SIGKILL)
        wait_until(lambda: s.rt.workers[2]["state"] == "up" and s.rt.workers[2]["pid"] != pid,
                   "the worker to be restarted")
        after = list(sent)
        wait_until(lambda: all(n >= a + 5 for n, a in zip(sent, after)),
                   "every robot to be served again on its connection")
        stop.set()
        for t in robots:
            t.join(30)
        assert not wrong
        for e in errors:
            assert "worker process rank 2" in e and "killed by signal 9" in e, e
            assert "segment:" not in e and "'denoise'" in e, e
        assert httpx.get(s.url + "/health").status_code == 200
        assert settled(s)["requests"] == 0


# ---- the benchmark, as a smoke test ------------------------------------------------------------

def test_serve_benchmark_quick_run_writes_its_result_and_plot(tmp_path):
    out = tmp_path / "serve.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "serve.py"), "--quick",
                           "--out", str(out)], capture_output=True, text=True, timeout=240,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["name"] == "serve" and result["quick"] is True
    assert result["ratios"]["rps_16clients_vs_blocking"] > 0
    for side in ("ours", "blocking"):
        for c in (1, 4, 16):
            assert result["figures"][f"{side}_rps_{c}clients"] > 0
    assert result["figures"]["actions_max_abs_diff"] <= 1e-4
    assert out.with_suffix(".png").stat().st_size > 0
    assert "rps_16clients_vs_blocking" in proc.stdout

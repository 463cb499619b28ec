"""The server's limits against clients that misbehave or are merely unlucky, found by an audit of
the serving layer: a stalled reader, a huge body, a client that pipelines then leaves, made-up
paths, non-finite outputs, keys sent twice, and errors in the documented shape."""

from __future__ import annotations

import json
import socket
import threading
from pathlib import Path

import httpx
import numpy as np
import pytest
import websockets.sync.client
from openpi_client import msgpack_numpy

from mstar_rt.serve.config import build_model, load_config
from mstar_rt.serve.requests_in import MAX_BODY_BYTES
from test_serve_support import Counter, serving, wait_until

ROOT = Path(__file__).resolve().parents[2]


def test_a_client_that_stops_reading_gives_its_slot_back_after_request_timeout_s():
    from mstar_rt.serve.speech_models import SentenceTTS

    text = ("This sentence goes on and on, " * 136)[:4090]
    with serving(SentenceTTS("espeak", voices=["en-us"]), name="espeak",
                 max_concurrent_requests=1, request_timeout_s=2) as s:
        body = json.dumps({"input": text, "response_format": "pcm"}).encode()
        k = socket.socket()
        k.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        try:
            k.connect(("127.0.0.1", s.port))
            k.sendall(b"POST /v1/audio/speech HTTP/1.1\r\nHost: x\r\nContent-Type: "
                      b"application/json\r\n" + f"Content-Length: {len(body)}\r\n\r\n".encode()
                      + body)
            assert k.recv(200).startswith(b"HTTP/1.1 200")  # then it reads nothing more
            # it held the only slot for good: every other client got 429
            wait_until(lambda: s.state.bridge.admission.in_flight == 0, "the slot back", 20)
            assert httpx.post(s.url + "/v1/audio/speech", json={"input": "Hi."},
                              timeout=30).status_code == 200
        finally:
            k.close()


def test_a_body_past_the_cap_is_refused_before_it_is_read_and_parsing_is_off_the_loop():
    with serving(Counter(), name="counter") as s:
        big = b'{"inputs": {"n": [' + b"1," * (MAX_BODY_BYTES // 2) + b'1]}}'
        r = httpx.post(s.url + "/generate", content=big, timeout=60)
        assert r.status_code == 413, r.text
        assert "larger than 64 MiB" in r.json()["error"]["message"]
        r = httpx.post(s.url + "/generate", content=b"[1, 2]")
        assert r.status_code == 400 and "must be a JSON object" in r.text


def test_a_client_that_pipelines_its_next_observation_and_leaves_is_cancelled_at_once():
    config = load_config(ROOT / "examples/serve/robot_policy.yaml")
    with serving(build_model(config), name=config.model.name, policy=config.policy) as s:
        node = s.rt.model.submodules["mlp"]
        forward, entered, release = node.forward, threading.Event(), threading.Event()

        def slow(batch):
            entered.set()
            release.wait(30)
            return forward(batch)

        node.forward = slow
        obs = msgpack_numpy.packb({"observation/state": np.zeros(8, np.float32)})
        try:
            with websockets.sync.client.connect(s.ws_url + "/") as ws:
                ws.recv()
                ws.send(obs)
                ws.send(obs)  # its next one, sent early: it held the only receive
                assert entered.wait(10)
            wait_until(lambda: s.state.metrics.requests.value("policy", "cancelled") == 1
                       and s.state.bridge.admission.in_flight == 0, "the cancel", 5)
        finally:
            release.set()


def test_non_finite_outputs_end_the_ndjson_stream_with_an_error_line_not_bare_nan():
    config = load_config(ROOT / "examples/serve/vision_policy.yaml")
    with serving(build_model(config), name=config.model.name, policy=config.policy) as s:
        img = [[[0, 0, 0]] * 64] * 64
        r = httpx.post(s.url + "/generate", json={"inputs": {"image": img, "state": [3e38] * 8},
                                                  "arrays": "list"}, timeout=60)
        lines = [json.loads(x, parse_constant=pytest.fail) for x in r.text.splitlines()]
        assert "NaN or infinite values, which JSON cannot carry" in lines[-1]["error"]["message"]


def test_metrics_labels_errors_and_keys():
    with serving(Counter(), name="counter", api_key="sésame") as s:
        key = {"Authorization": "Bearer sésame".encode()}  # UTF-8 bytes, as curl sends them
        for path in ("/a", "/b", "/c"):  # one series per made-up path grew /metrics
            assert httpx.get(s.url + path).status_code == 401
        metrics = httpx.get(s.url + "/metrics", headers=key).text
        assert 'endpoint="other",status="unauthorized"} 3.0' in metrics
        assert 'endpoint="/a"' not in metrics
        for extra in ({"x-api-key": ""}, {"x-api-key": "stale"}):  # any one may carry it
            assert httpx.get(s.url + "/v1/models", headers={**key, **extra}).status_code == 200
        r = httpx.post(s.url + "/v1/embeddings", headers=key)
        assert r.status_code == 404 and r.json()["error"]["type"] == "not_found"
        r = httpx.get(s.url + "/generate", headers=key)
        assert r.status_code == 405 and "Method Not Allowed" in r.json()["error"]["message"]
        assert httpx.head(s.url + "/health").status_code == 200  # a load balancer's probe
        r = httpx.post(s.url + "/generate", headers=key, json={"inputs": {"n": 3},
                                                               "deadline_s": 1e-9,
                                                               "fail_late": True})
        assert r.status_code == 503 and r.json()["error"]["code"] == "deadline_refused"
        counted = [x for x in httpx.get(s.url + "/metrics", headers=key).text.splitlines()
                   if x.startswith('mstar_requests_total{endpoint="/generate"')]
        assert counted == ['mstar_requests_total{endpoint="/generate",status="deadline"} 1.0']

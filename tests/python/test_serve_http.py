"""HTTP serving: the official openai client streams speech (PCM and WAV) from
/v1/audio/speech, /generate streams NDJSON, /metrics speaks Prometheus, bad input on every
endpoint gets a clear error while the server keeps serving, the concurrency limit answers 429,
and a client that leaves mid-stream cancels its request and frees its KV pages."""

from __future__ import annotations

import json
import socket
import threading
import time
from typing import Any

import httpx
import numpy as np
import openai
import pytest

from mstar_rt import EMIT, DynamicLoop, GraphEdge, GraphNode, Model, NodeSubmodule
from mstar_rt.serve import MstarClient, ServeError, SpeechSpec
from mstar_rt.serve.speech_models import SentenceTTS
from test_serve_support import Counter, serving, settled, wait_until

KEY = "test-key"
TEXT = "Hello there. This is a streaming test."


@pytest.fixture(scope="module")
def speech():
    with serving(SentenceTTS("espeak", voices=["en-us", "en-gb"]), name="espeak",
                 api_key=KEY) as s:
        yield s


@pytest.fixture(scope="module")
def counter():
    model = Counter()
    with serving(model, name="counter", max_concurrent_requests=2) as s:
        s.model = model
        yield s


def _openai(s) -> openai.OpenAI:
    return openai.OpenAI(base_url=s.url + "/v1", api_key=KEY, max_retries=0)


def _speak(s, fmt: str, voice: str = "en-us") -> tuple[bytes, int]:
    with _openai(s).audio.speech.with_streaming_response.create(
            model="espeak", voice=voice, input=TEXT, response_format=fmt) as resp:
        rate = int(resp.headers["x-sample-rate"])
        return b"".join(resp.iter_bytes()), rate


# ---- speech ------------------------------------------------------------------------------------

def test_openai_client_streams_pcm_speech_that_is_audible_and_as_long_as_the_text(speech):
    pcm, rate = _speak(speech, "pcm")
    assert rate == 24000 and len(pcm) % 2 == 0
    audio = np.frombuffer(pcm, "<i2").astype(np.float32) / 32768
    seconds = len(audio) / rate
    assert 1.0 < seconds < 10.0, seconds  # two short sentences
    assert np.sqrt(np.mean(audio ** 2)) > 0.01  # speech, not silence


def test_wav_is_a_streaming_header_followed_by_exactly_the_pcm_stream(speech):
    wav, rate = _speak(speech, "wav")
    pcm, _ = _speak(speech, "pcm")  # espeak-ng is deterministic
    head = wav[:44]
    assert head[:4] == b"RIFF" and head[8:16] == b"WAVEfmt "
    assert int.from_bytes(head[4:8], "little") == 0xFFFFFFFF  # size unknown: streaming
    assert int.from_bytes(head[20:22], "little") == 1  # PCM
    assert int.from_bytes(head[22:24], "little") == 1  # mono
    assert int.from_bytes(head[24:28], "little") == rate == 24000
    assert int.from_bytes(head[34:36], "little") == 16
    assert head[36:40] == b"data" and int.from_bytes(head[40:44], "little") == 0xFFFFFFFF
    assert wav[44:] == pcm


def test_python_client_streams_speech_and_lists_the_model_with_its_voices(speech):
    with MstarClient(speech.url, api_key=KEY) as c:
        assert c.health()["status"] == "ok"
        (model,) = c.models()
        assert model["id"] == "espeak" and model["voices"] == ["en-us", "en-gb"]
        assert "speech" in model["capabilities"]
        chunks = list(c.speech("One sentence. And another one.", voice="en-gb"))
        assert c.sample_rate == 24000 and sum(map(len, chunks)) > 24000


@pytest.mark.parametrize("body, status, needle", [
    ({"model": "espeak", "voice": "alloy", "input": "hi"}, 400, "unknown voice 'alloy'"),
    ({"model": "tts-1", "voice": "en-us", "input": "hi"}, 404, "model 'tts-1' is not served"),
    ({"model": "espeak", "voice": "en-us", "input": 5}, 400, "'input' must be a non-empty"),
    ({"model": "espeak", "voice": "en-us", "input": "  "}, 400, "'input' must be a non-empty"),
    ({"model": "espeak", "voice": 3, "input": "hi"}, 400, "'voice' must be a string"),
    ({"model": "espeak", "voice": "en-us", "input": "hi", "response_format": "mp3"}, 400,
     "response_format 'mp3' is not served"),
    ({"model": "espeak", "voice": "en-us", "input": "hi", "speed": 2.0}, 400, "speed"),
    ({"model": "espeak", "input": "hi", "volume": 1}, 400, "unknown field 'volume'"),
    ({"model": "espeak", "input": "Hi. " * 1025}, 400, "'input' holds 4100 characters; at most 4096"),
    ([1, 2], 400, "must be a JSON object"),
])
def test_bad_speech_requests_get_a_clear_error_and_the_server_keeps_serving(speech, body, status,
                                                                            needle):
    r = httpx.post(speech.url + "/v1/audio/speech", json=body,
                   headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == status, r.text
    assert needle in r.json()["error"]["message"]
    pcm, _ = _speak(speech, "pcm")
    assert len(pcm) > 0


def test_a_long_reply_does_not_hold_a_short_one_back(speech):
    """Requests speak a piece each per iteration, side by side: a short reply sent while a long
    one streams ends before the long one does (before: it began only after the long one)."""
    long_text = ("This sentence has no end and goes on, " * 100).strip()  # 3899 chars, no stop
    first: dict[str, float] = {}
    end: dict[str, float] = {}

    def speak(name: str, text: str) -> None:
        with _openai(speech).audio.speech.with_streaming_response.create(
                model="espeak", voice="en-us", input=text, response_format="pcm") as resp:
            for chunk in resp.iter_bytes():
                first.setdefault(name, time.monotonic())
        end[name] = time.monotonic()

    long_thread = threading.Thread(target=speak, args=("long", long_text))
    long_thread.start()
    wait_until(lambda: "long" in first, "the long reply's first audio", timeout=30)
    speak("short", "Hi.")
    long_thread.join(60)
    assert not long_thread.is_alive() and "long" in end
    assert end["short"] < end["long"], (first, end)


def test_openai_client_sees_bad_requests_as_its_own_errors(speech):
    client = _openai(speech)
    with pytest.raises(openai.BadRequestError, match="unknown voice"):
        client.audio.speech.create(model="espeak", voice="alloy", input="hi")
    with pytest.raises(openai.NotFoundError, match="not served here"):
        client.audio.speech.create(model="tts-1", voice="en-us", input="hi")


def test_invalid_json_body_is_a_400_that_says_so(speech):
    r = httpx.post(speech.url + "/v1/audio/speech", content=b"{not json",
                   headers={"Authorization": f"Bearer {KEY}", "content-type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer nope"}, {"x-api-key": "nope"},
                                     {"Authorization": "Basic abc"}])
def test_missing_or_wrong_api_key_is_401_on_every_endpoint_but_health(speech, headers):
    for method, path in (("GET", "/v1/models"), ("GET", "/metrics"),
                         ("POST", "/v1/audio/speech"), ("POST", "/generate")):
        r = httpx.request(method, speech.url + path, headers=headers, json={})
        assert r.status_code == 401, (path, r.text)
        assert "API key" in r.json()["error"]["message"]
    assert httpx.get(speech.url + "/health").status_code == 200
    for good in ({"Authorization": f"Bearer {KEY}"}, {"x-api-key": KEY}):
        assert httpx.get(speech.url + "/v1/models", headers=good).status_code == 200


def test_speech_failing_mid_stream_breaks_the_stream_visibly_and_frees_everything(monkeypatch):
    """Raw audio has no error frame: a request that fails after its first audio must end its
    HTTP stream broken (no terminating chunk), so a client cannot take a truncated answer for a
    whole one; the server counts it failed and holds nothing."""
    model = SentenceTTS("espeak", voices=["en-us"])
    node = model.submodules["speak"]
    speak = node.forward

    def forward(batch):  # the second sentence of a text naming "boom" fails
        for sentences, i, _tts in batch:
            if i == 1 and "boom" in sentences[0]:
                raise RuntimeError("the voice failed on purpose")
        return speak(batch)

    monkeypatch.setattr(node, "forward", forward)
    with serving(model, name="espeak") as s:
        for fmt in ("pcm", "wav"):
            got = bytearray()
            with pytest.raises(httpx.RemoteProtocolError):
                with httpx.stream("POST", s.url + "/v1/audio/speech", timeout=30,
                                  json={"model": "espeak", "input": "A boom. Then more.",
                                        "response_format": fmt}) as r:
                    assert r.status_code == 200
                    for chunk in r.iter_bytes():
                        got += chunk
            assert len(got) > 2400, f"{fmt}: the first sentence's audio never came"
        with pytest.raises(ServeError, match="the speech stream broke off"):
            list(MstarClient(s.url).speech("A boom. Then more.", response_format="pcm"))
        assert len(b"".join(MstarClient(s.url).speech("Fine. All of it."))) > 4800
        assert settled(s)["requests"] == 0
        text = httpx.get(s.url + "/metrics").text
        assert 'mstar_requests_total{endpoint="/v1/audio/speech",status="failed"} 3' in text


def test_metrics_count_speech_requests_time_to_first_audio_and_real_time_factor(speech):
    _speak(speech, "pcm")
    with MstarClient(speech.url, api_key=KEY) as c:
        text = c.metrics()
    lines = dict(line.rsplit(" ", 1) for line in text.splitlines() if not line.startswith("#"))
    assert float(lines['mstar_requests_total{endpoint="/v1/audio/speech",status="ok"}']) >= 1
    assert float(lines["mstar_time_to_first_audio_seconds_count"]) >= 1
    assert float(lines["mstar_speech_real_time_factor_count"]) >= 1
    assert 'mstar_request_duration_seconds_bucket{endpoint="/v1/audio/speech",le="+Inf"}' in lines
    assert float(lines["mstar_live_requests"]) == 0


# ---- generate ----------------------------------------------------------------------------------

def test_health_is_503_with_the_reason_while_the_model_cannot_serve(counter, monkeypatch):
    """Model.health (a tensor-parallel rank or a placed worker lost for good) reaches /health,
    so a load balancer or orchestrator can replace the server; it needs no key."""
    ok = httpx.get(counter.url + "/health")
    assert ok.status_code == 200 and ok.json()["status"] == "ok" and "reason" not in ok.json()
    monkeypatch.setattr(counter.model, "health", lambda: "rank 1 was lost; load it again")
    sick = httpx.get(counter.url + "/health")
    assert sick.status_code == 503
    assert sick.json() | {"admitted": 0} == {"status": "unavailable", "model": "counter",
                                              "admitted": 0, "max_concurrent_requests": 2,
                                              "reason": "rank 1 was lost; load it again"}
    monkeypatch.undo()
    assert httpx.get(counter.url + "/health").status_code == 200


def test_generate_streams_one_ndjson_line_per_output_with_arrays_as_base64(counter):
    with MstarClient(counter.url) as c:
        out = list(c.generate({"n": 3}))
    assert [name for name, _ in out] == ["step", "vec"] * 3
    vecs = [v for name, v in out if name == "vec"]
    for i, v in enumerate(vecs):
        assert v.dtype == np.float32 and v.tolist() == list(range(i + 1))
    r = httpx.post(counter.url + "/generate", json={"inputs": {"n": 2}, "arrays": "list"})
    lines = [json.loads(x) for x in r.text.splitlines()]
    assert lines[1] == {"output": "vec", "index": 0, "value": [0.0], "dtype": "float32",
                        "shape": [1]}
    assert lines[-1] == {"done": True, "counts": {"step": 2, "vec": 2}}
    assert settled(counter) == dict(requests=0, handles=0, stored=0, queued=0, inflight=0)


def test_generate_decodes_array_inputs_and_rejects_bad_ones(counter):
    r = httpx.post(counter.url + "/generate", json={"inputs": {"n": {"dtype": "int64", "shape": [],
                                                                     "data": "AAAA"}}})
    assert r.status_code == 400 and "needs 8" in r.json()["error"]["message"]
    r = httpx.post(counter.url + "/generate", json={"inputs": {"n": {"dtype": "object",
                                                                     "shape": [], "data": ""}}})
    assert r.status_code == 400 and "dtype" in r.json()["error"]["message"]


@pytest.mark.parametrize("body, needle", [
    ({"inputs": {"n": "three"}}, "'n' must be an integer"),
    ({"inputs": {"m": 1}}, "not declared by the model"),
    ({"inputs": [1]}, "'inputs' must be an object"),
    ({"inputs": {"n": 1}, "priority": "high"}, "'priority' must be an integer"),
    ({"inputs": {"n": 1}, "deadline_s": -1}, "'deadline_s' must be a positive"),
    ({"inputs": {"n": 1}, "arrays": "hex"}, "'arrays' must be"),
    ({"input": {"n": 1}}, "unknown field 'input'"),
])
def test_bad_generate_requests_get_a_clear_400(counter, body, needle):
    r = httpx.post(counter.url + "/generate", json=body)
    assert r.status_code == 400, r.text
    assert needle in r.json()["error"]["message"]
    assert [n for n, _ in MstarClient(counter.url).generate({"n": 1})] == ["step", "vec"]


def test_a_request_failing_mid_stream_ends_with_an_error_line_and_frees_everything(counter):
    r = httpx.post(counter.url + "/generate", json={"inputs": {"n": 5, "fail_at": 2}})
    lines = [json.loads(x) for x in r.text.splitlines()]
    assert [x.get("output") for x in lines[:4]] == ["step", "vec", "step", "vec"]
    assert lines[-1]["error"]["type"] == "RequestFailed"
    assert "step 2 failed on purpose" in lines[-1]["error"]["message"]
    with pytest.raises(ServeError, match="failed on purpose"):
        list(MstarClient(counter.url).generate({"n": 5, "fail_at": 2}))
    # failing before the first output is a plain HTTP error
    r = httpx.post(counter.url + "/generate", json={"inputs": {"n": 5, "fail_at": 0}})
    assert r.status_code == 500 and "failed on purpose" in r.json()["error"]["message"]
    assert settled(counter)["requests"] == 0


def test_above_max_concurrent_requests_the_server_answers_429_then_recovers(counter):
    node = counter.model.node
    node.release.clear()
    node.holding = 0
    results: list = []

    def held() -> None:
        results.append(list(MstarClient(counter.url).generate({"n": 1, "hold": True})))

    threads = [threading.Thread(target=held) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        wait_until(lambda: counter.state.bridge.admission.in_flight == 2, "two admitted requests")
        r = httpx.post(counter.url + "/generate", json={"inputs": {"n": 1}})
        assert r.status_code == 429
        assert "max_concurrent_requests=2" in r.json()["error"]["message"]
        assert r.headers["retry-after"] == "1"
        assert httpx.get(counter.url + "/health").json()["admitted"] == 2
    finally:
        node.release.set()
        for t in threads:
            t.join(20)
    assert len(results) == 2 and all(len(r) == 2 for r in results)
    settled(counter)
    text = httpx.get(counter.url + "/metrics").text
    assert 'mstar_requests_total{endpoint="/generate",status="rejected"} 1' in text


def test_a_client_leaving_before_the_first_output_cancels_the_request_at_once(counter):
    node = counter.model.node
    node.release.clear()
    node.holding = 0
    body = json.dumps({"inputs": {"n": 50, "hold": True}}).encode()
    sock = socket.create_connection(("127.0.0.1", counter.port), timeout=20)
    try:
        sock.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        wait_until(lambda: node.holding == 1, "the request to reach its node")
    finally:
        sock.close()
    try:
        # cancelled while its node still runs: the disconnect did it, not the request's end
        wait_until(lambda: counter.state.metrics.requests.value("/generate", "cancelled") == 1
                   and counter.state.bridge.admission.in_flight == 0, "the request to be cancelled")
        assert node.holding == 1 and not node.release.is_set()
    finally:
        node.release.set()
    # the node's batch comes back and is dropped: nothing of the request is left
    assert settled(counter) == dict(requests=0, handles=0, stored=0, queued=0, inflight=0)


def test_a_request_past_request_timeout_s_is_cancelled_with_a_504():
    model = Counter()
    with serving(model, name="counter", request_timeout_s=0.3) as s:
        try:
            r = httpx.post(s.url + "/generate", json={"inputs": {"n": 1, "hold": True}})
            assert r.status_code == 504
            assert "request_timeout_s=0.3" in r.json()["error"]["message"]
            assert s.state.metrics.requests.value("/generate", "timeout") == 1
        finally:
            model.node.release.set()
        assert settled(s)["requests"] == 0


# ---- KV cache: metrics and disconnects ---------------------------------------------------------

@pytest.fixture(scope="module")
def orpheus():
    from mstar_rt.engines import KVCacheEngine
    from mstar_rt.models.orpheus import OrpheusTTS

    model = OrpheusTTS.tiny(constrain_codes=True,
                            engine=KVCacheEngine(page_size=16, num_pages=128))
    params = {"max_tokens": 2000, "seed": 0, "ignore_eos": True}
    with serving(model, name="orpheus-tiny",
                 speech=SpeechSpec(inputs={"params": params})) as s:
        yield s


def _pages_in_use(s) -> int:
    cache = s.rt.engines["lm"].cache
    return cache.num_pages - cache.free_pages


def test_client_disconnecting_mid_stream_cancels_the_request_and_frees_its_kv_pages(orpheus):
    got = 0
    pages_while_streaming = 0
    with httpx.stream("POST", orpheus.url + "/v1/audio/speech", timeout=60,
                      json={"input": "hi", "voice": "tara", "response_format": "pcm"}) as r:
        assert r.status_code == 200
        for chunk in r.iter_bytes():
            got += len(chunk)
            pages_while_streaming = max(pages_while_streaming, _pages_in_use(orpheus))
            if got >= 8192:
                break  # leaves with ~2000 tokens still to speak
    assert pages_while_streaming > 0
    assert settled(orpheus)["requests"] == 0
    wait_until(lambda: _pages_in_use(orpheus) == 0, "the KV pages to be freed")
    text = httpx.get(orpheus.url + "/metrics").text
    assert 'mstar_requests_total{endpoint="/v1/audio/speech",status="cancelled"} 1' in text
    assert 'mstar_kv_pages_in_use{engine="lm"} 0' in text
    assert 'mstar_kv_pages_total{engine="lm"} 128' in text


def test_openai_client_streams_wav_from_the_orpheus_walk_and_leaving_frees_its_pages(orpheus):
    client = openai.OpenAI(base_url=orpheus.url + "/v1", api_key="unused", max_retries=0)
    with client.audio.speech.with_streaming_response.create(
            model="orpheus-tiny", voice="tara", input="hi", response_format="wav") as resp:
        it = resp.iter_bytes()
        head = next(it)
        assert head[:4] == b"RIFF"
        total = len(head)
        for chunk in it:
            total += len(chunk)
            if total > 44 + 4096:
                break
    assert settled(orpheus)["requests"] == 0
    wait_until(lambda: _pages_in_use(orpheus) == 0, "the KV pages to be freed")


# ---- a checkpoint directory, served as a causal LM ---------------------------------------------

def test_a_checkpoint_dir_is_served_as_a_causal_lm_that_streams_tokens(tmp_path):
    import torch
    from safetensors.torch import save_file

    from mstar_rt.models.llama import LlamaConfig, LlamaForCausalLM
    from mstar_rt.serve.config import build_model, build_runtime, load_config

    hf = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
              num_attention_heads=2, num_key_value_heads=1, head_dim=16, hidden_act="silu",
              max_position_embeddings=128)
    (tmp_path / "tiny-llama").mkdir()
    (tmp_path / "tiny-llama" / "config.json").write_text(json.dumps(hf))
    torch.manual_seed(0)
    lm = LlamaForCausalLM(LlamaConfig.from_hf(hf))
    save_file({k: v.contiguous() for k, v in lm.state_dict().items()},
              str(tmp_path / "tiny-llama" / "model.safetensors"))
    config = load_config({"model": {"checkpoint": "tiny-llama", "args": {"progress": False}},
                          "kv_cache": {"page_size": 4, "num_pages": 16}}, base_dir=str(tmp_path))
    model = build_model(config)
    runtime = build_runtime(config, model)
    assert runtime.engines["lm"].cache.num_pages == 16
    with serving(model, runtime=runtime, name=config.model.name) as s:
        with MstarClient(s.url) as c:
            assert c.models()[0]["id"] == "tiny-llama"
            params = {"max_tokens": 5, "ignore_eos": True, "temperature": 0.0}
            tokens = [int(v) for n, v in c.generate({"prompt": [1, 2, 3], "params": params})
                      if n == "token"]
            again = [int(v) for n, v in c.generate({"prompt": [1, 2, 3], "params": params})
                     if n == "token"]
        assert len(tokens) == 5 and tokens == again and all(0 <= t < 64 for t in tokens)
        settled(s)
        cache = s.rt.engines["lm"].cache
        assert cache.free_pages == cache.num_pages


class _SlowSteps(Model):
    """``n`` steps of 50 ms, each EMITted: a stream that is still going when the server stops."""

    inputs = ("n",)

    class _Step(NodeSubmodule):
        def prepare_inputs(self, ctx: Any, inputs: dict) -> Any:
            return ctx.iteration, inputs["n"]

        def forward(self, batch: list) -> list:
            time.sleep(0.05)
            return [{"step": i} for i, _n in batch]

        def check_stop(self, batch: list, outputs: list) -> list:
            return [("steps",) if i + 1 >= n else () for i, n in batch]

    def __init__(self) -> None:
        self.nodes = [GraphNode("step", ["n"], [GraphEdge(EMIT, "step")])]
        self.walks = {"steps": DynamicLoop("step", 10_000, "steps")}
        self.submodules = {"step": self._Step()}


def test_a_stream_cut_by_the_shutdown_grace_ends_without_a_traceback(capfd):
    """uvicorn cancels what still streams when its 3 s grace ends: the stream is cut (the
    client sees no clean end) and the request cancelled, but that is no application error."""
    with serving(_SlowSteps(), name="slow") as s:
        lines: list[str] = []
        ended: list[BaseException] = []

        def read() -> None:
            try:
                with httpx.stream("POST", s.url + "/generate", json={"inputs": {"n": 10_000}},
                                  timeout=30) as r:
                    for line in r.iter_lines():
                        lines.append(line)
            except BaseException as e:  # the cut
                ended.append(e)

        reader = threading.Thread(target=read)
        reader.start()
        wait_until(lambda: len(lines) >= 2, "the stream to flow")
        start = time.monotonic()
        s.server.stop(timeout=15)
        took = time.monotonic() - start
        reader.join(15)
        assert not reader.is_alive() and ended, "the client saw a clean end of a cut stream"
        assert took < 5, took
        assert settled(s)["requests"] == 0  # the cut request was cancelled
    err = capfd.readouterr().err
    assert "Exception in ASGI application" not in err and "CancelledError" not in err, err

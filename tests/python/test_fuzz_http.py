"""Fuzzing the HTTP API through its OpenAPI document (issue 16, item 2): schemathesis generates
requests for every operation the app documents -- bodies that fit the published schemas and
bodies that break them -- against a live server, for a speech deployment (espeak, behind an API
key) and a policy deployment (array inputs on /generate). Every response must be no 5xx, of a
documented status, content type and schema, and after each operation's run a good request still
succeeds and the runtime holds nothing. Also the hostile bodies schemathesis does not make
(nesting past the JSON parser, integers past Python's digit limit, NaN)."""

from __future__ import annotations

import faulthandler
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (content_type_conformance, negative_data_rejection,
                                               response_headers_conformance,
                                               response_schema_conformance,
                                               status_code_conformance)

from mstar_rt.serve import MstarClient
from mstar_rt.serve.config import build_model, load_config
from mstar_rt.serve.speech_models import SentenceTTS
from test_serve_support import serving, settled

ROOT = Path(__file__).resolve().parents[2]
KEY = "fuzz-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
EXAMPLES = 25  # per operation and mode (schema-valid bodies, schema-breaking bodies)
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance,
          response_schema_conformance, response_headers_conformance, negative_data_rejection]
# Phases without shrinking: a failing call is shown as it failed, not after minutes of calls.
PHASES = (Phase.explicit, Phase.reuse, Phase.generate)
# Generous: a status or schema check, not a latency one (a loaded CI host once held one 0.4 s
# chat answer past 30 s, not seen in 3,000 calls here); a server that hangs still fails.
CALL_TIMEOUT_S = 120
OPERATIONS = {("GET", "/health"), ("GET", "/healthz"), ("GET", "/v1/models"),
              ("GET", "/metrics"), ("POST", "/v1/audio/speech"), ("POST", "/generate")}


@pytest.fixture(scope="module")
def speech():
    with serving(SentenceTTS("espeak", voices=["en-us", "en-gb"]), name="espeak",
                 api_key=KEY) as s:
        s.headers = AUTH
        yield s


@pytest.fixture(scope="module")
def policy():
    config = load_config(ROOT / "examples" / "serve" / "robot_policy.yaml")
    with serving(build_model(config), name=config.model.name, policy=config.policy) as s:
        s.headers = {}
        yield s


def call(case):
    """``case.call_and_validate`` with CHECKS; on a timeout the threads of this process -- the
    server's among them -- are dumped first, to show where it stood."""
    try:
        return case.call_and_validate(timeout=CALL_TIMEOUT_S, checks=CHECKS)
    except requests.exceptions.Timeout:
        faulthandler.dump_traceback(all_threads=True)
        raise


def _good_request_succeeds(s) -> None:
    with MstarClient(s.url, api_key=KEY if s.headers else None) as c:
        assert c.health()["status"] == "ok"
        if s.headers:
            assert sum(map(len, c.speech("Still here."))) > 0
        else:
            assert [n for n, _ in c.generate({"obs": [0.0] * 8})] == ["actions"]
    assert settled(s)["requests"] == 0


@pytest.mark.parametrize("deployment", ["speech", "policy"])
def test_every_documented_operation_survives_generated_requests(deployment, request):
    s = request.getfixturevalue(deployment)
    doc = httpx.get(s.url + "/openapi.json", headers=s.headers).json()
    schema = schemathesis.openapi.from_dict(doc)
    schema.config.update(base_url=s.url, headers=s.headers)
    operations = {(op.method.upper(), op.path): op
                  for op in (r.ok() for r in schema.get_all_operations())}
    assert set(operations) == OPERATIONS
    tried: dict[str, Counter] = {}  # statuses answered, per operation and mode
    started = time.monotonic()
    for (method, path), op in sorted(operations.items()):
        # a GET without parameters has nothing to break: only its one request
        modes = [GenerationMode.POSITIVE] + ([GenerationMode.NEGATIVE] if len(op.body) else [])
        for mode in modes:
            label = f"{method} {path} {mode.value}"
            tried[label] = Counter()

            @settings(max_examples=EXAMPLES, derandomize=True, database=None, deadline=None,
                      suppress_health_check=list(HealthCheck), phases=PHASES)
            @given(op.as_strategy(generation_mode=mode))
            def fuzz(case) -> None:
                response = call(case)
                tried[label][response.status_code] += 1

            fuzz()
        _good_request_succeeds(s)
    total = sum(map(Counter.total, tried.values()))
    print(f"\nhttp fuzz ({deployment}): {total} requests in {time.monotonic() - started:.1f} s")
    for label, statuses in tried.items():
        print(f"  {label}: {statuses.total()} {dict(sorted(statuses.items()))}")
    assert all(statuses.total() >= 1 for statuses in tried.values()), tried
    assert total >= 100, tried
    # valid bodies reach the model: speech speaks, the policy acts
    served = "/v1/audio/speech" if deployment == "speech" else "/generate"
    assert tried[f"POST {served} positive"][200] >= 5, tried


# ---- bodies schemathesis does not make ---------------------------------------------------------

@pytest.mark.parametrize("raw, needle", [
    (b"[" * 100_000 + b"]" * 100_000, "too deeply"),
    (b'{"inputs": {"obs": ' + b"9" * 5000 + b"}}", "not valid JSON"),
    (b'{"inputs": {"obs": [0,0,0,0,0,0,0,0]}, "deadline_s": NaN}', "'deadline_s' must be"),
    (b'{"inputs": {"obs": [0,0,0,0,0,0,0,0]}, "deadline_s": Infinity}', "'deadline_s' must be"),
    (b'{"inputs": {"obs": [0,0,0,0,0,0,0,0]}, "deadline_s": 1e300}', "'deadline_s' must be"),
    (b'{"inputs": {"obs": [0,0,0,0,0,0,0,0]}, "priority": 2147483648}', "'priority' must be"),
    (b'{"inputs": {"obs": {"dtype": ["float32"], "shape": [8], "data": ""}}}', "obs.dtype"),
    (b"\xff\xfe", "not valid JSON"),
], ids=["deep-nesting", "huge-integer", "nan-deadline", "inf-deadline", "far-deadline",
        "int32-priority", "list-dtype", "not-utf8"])
def test_hostile_bodies_get_a_400_that_says_what_to_fix(policy, raw, needle):
    r = httpx.post(policy.url + "/generate", content=raw,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text[:300]
    assert needle in r.json()["error"]["message"], r.text[:300]
    _good_request_succeeds(policy)


@pytest.mark.parametrize("text", ["-f{secret}", "--help", "- a bullet point", "nul\x00byte", "-"],
                         ids=["file-option", "help-option", "bullet", "nul", "dash"])
def test_speech_text_is_spoken_never_taken_as_an_espeak_option(speech, tmp_path, text):
    """Found while fuzzing the speech endpoint: the sentence was an espeak-ng argument, so
    "-f<file>" spoke a file of the server's, and a leading "-" or a NUL failed with a 500."""
    secret = tmp_path / "secret.txt"
    secret.write_text("a server file that no client may hear. " * 40)  # about two minutes
    r = httpx.post(speech.url + "/v1/audio/speech", headers=AUTH, timeout=60,
                   json={"input": text.format(secret=secret), "response_format": "pcm"})
    assert r.status_code == 200, r.text[:300]
    seconds = len(r.content) / 2 / int(r.headers["x-sample-rate"])
    assert 0 < seconds < 15, seconds  # the text itself, not the file it names
    _good_request_succeeds(speech)


def test_a_lone_surrogate_in_generate_text_is_spoken_not_a_500(speech):
    """JSON may carry a lone surrogate, which no UTF-8 encoder takes; /generate passes the text
    through to the model (espeak now gets it with a replacement character)."""
    r = httpx.post(speech.url + "/generate", content=b'{"inputs": {"text": "\\ud800 hi"}}',
                   headers={**AUTH, "content-type": "application/json"}, timeout=60)
    assert r.status_code == 200, r.text[:300]
    assert r.text.splitlines()[-1] == '{"done": true, "counts": {"audio": 1}}'
    r = httpx.post(speech.url + "/v1/audio/speech", content=b'{"input": "\\ud800 hi"}',
                   headers={**AUTH, "content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input", r.text[:300]

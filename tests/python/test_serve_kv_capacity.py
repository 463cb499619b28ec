"""A request whose prompt plus requested tokens the KV cache can never hold (fewer pages than it
needs, whether the model's longest sequence or only this request's is too long) fails alone at
the engine's admission with RequestTooLarge, naming the numbers and what to change; every front
end answers it as the client's error (HTTP 400, an openpi error frame), never a 500, and nothing
it touched stays held: no KV page, no request slot."""

from __future__ import annotations

import threading
from typing import Any

import httpx
import numpy as np
import openai
import pytest
import torch
import websockets.sync.client
from openpi_client import msgpack_numpy

from kv_models import tiny_llama
from mstar_rt import RequestFailed, RequestTooLarge, Runtime
from mstar_rt.engines import KVCacheEngine, KVLayout, OutOfPages, PagedKVCache, SequenceTooLarge
from mstar_rt.engines.sampling import SamplingParams
from mstar_rt.models.causal_lm import CausalLM
from mstar_rt.serve.config import PolicySpec, SpeechSpec
from test_serve_support import WAIT_S, serving, settled, wait_until

T = 60.0


class _Gate:
    """A logits processor that holds the first request it samples for until :attr:`release`
    is set, and records, at each later sample, whether ``other`` (a callable) said it ended."""

    def __init__(self) -> None:
        self.entered, self.release = threading.Event(), threading.Event()
        self.other: Any = lambda: False
        self.saw_other_end = False

    def __call__(self, state: dict, logits: torch.Tensor) -> torch.Tensor:
        if not self.entered.is_set():
            self.entered.set()
            assert self.release.wait(WAIT_S), "the test never released the held request"
        elif self.other():
            self.saw_other_end = True
        return logits


def _lm(gate: Any = None, num_pages: int = 8, max_seq_len: int = 256) -> CausalLM:
    return CausalLM(tiny_llama(), max_seq_len=max_seq_len, logits_processor=gate,
                    engine=KVCacheEngine(page_size=4, num_pages=num_pages))


def _all_free(rt: Any) -> bool:
    cache = rt.engines["lm"].cache
    return (cache.free_pages == cache.num_pages and cache.live_sequences == 0
            and not any(rt.live.values()))


# ---- the engine ----------------------------------------------------------------------------------

def test_the_cache_refuses_a_sequence_it_can_never_hold_with_the_numbers_and_takes_nothing():
    cache = PagedKVCache(KVLayout(1, 1, 4), page_size=4, num_pages=8)
    with pytest.raises(SequenceTooLarge) as got:
        cache.admit(0, "main", 3, reserve=43)
    e = got.value
    assert isinstance(e, OutOfPages)
    assert (e.tokens, e.pages, e.page_size, e.num_pages) == (43, 11, 4, 8)
    assert "a sequence of 43 tokens needs 11 pages of 4 tokens but the KV cache has 8" in str(e)
    assert cache.free_pages == 8 and cache.live_sequences == 0
    assert cache.admit(0, "main", 3, reserve=32) is not None  # all 8 pages: it fits


def test_a_request_past_the_kv_cache_fails_alone_at_admission_while_another_keeps_going():
    gate = _Gate()
    with Runtime(_lm(gate)) as rt:
        held = rt.submit({"prompt": [1, 2, 3],
                          "params": SamplingParams(max_tokens=12, ignore_eos=True)})
        assert gate.entered.wait(WAIT_S)  # it holds pages and is mid-request
        big = rt.submit({"prompt": [4, 5, 6, 7, 8],
                         "params": SamplingParams(max_tokens=40, ignore_eos=True)})
        gate.other = lambda: big.done
        gate.release.set()
        with pytest.raises(RequestTooLarge) as got:
            big.result(timeout=T)
        e = got.value
        assert isinstance(e, RequestFailed) and isinstance(e, ValueError)
        assert e.reason == ("a prompt of 5 tokens + max_tokens 40 needs 12 pages of 4 tokens but "
                            "the KV cache has 8; raise num_pages to 12 or more (kv_cache.num_pages "
                            "in a serving config) or page_size, or lower max_tokens or shorten "
                            "the prompt")
        assert str(e).startswith("node 'prefill' in walk 'prefill' failed: RequestTooLarge: ")
        assert len(held.result(timeout=T)["token"]) == 12
        assert gate.saw_other_end  # it sampled on after the big one had failed
        wait_until(lambda: _all_free(rt), "every page and request to be released")


def test_the_models_longest_sequence_past_the_cache_names_max_seq_len_and_fits_below_it():
    with Runtime(_lm(num_pages=8, max_seq_len=64)) as rt:
        # 3 + 100 tokens, capped at the model's 64: 16 pages of the cache's 8
        h = rt.submit({"prompt": [1, 2, 3], "params": SamplingParams(max_tokens=100)})
        with pytest.raises(RequestTooLarge, match=r"a prompt of 3 tokens \+ max_tokens 100 "
                                                  r"\(capped at max_seq_len 64\) needs 16 pages"):
            h.result(timeout=T)
        ok = rt.submit({"prompt": [1, 2, 3],
                        "params": SamplingParams(max_tokens=29, ignore_eos=True)})
        assert len(ok.result(timeout=T)["token"]) == 29  # 32 tokens: all 8 pages
        wait_until(lambda: _all_free(rt), "every page and request to be released")


# ---- the HTTP front end --------------------------------------------------------------------------

def test_generate_past_the_kv_cache_is_a_400_naming_the_numbers_and_others_stream_on():
    gate = _Gate()
    with serving(_lm(gate), name="tiny") as s:
        got: dict[str, httpx.Response] = {}

        def post(key: str, prompt: list, max_tokens: int) -> None:
            got[key] = httpx.post(s.url + "/generate", timeout=T, json={"inputs": {
                "prompt": prompt, "params": {"max_tokens": max_tokens, "ignore_eos": True}}})

        a = threading.Thread(target=post, args=("held", [1, 2, 3], 12))
        a.start()
        assert gate.entered.wait(WAIT_S)  # in flight, holding its pages and a slot
        b = threading.Thread(target=post, args=("big", [4, 5, 6, 7, 8], 40))
        b.start()
        try:
            wait_until(lambda: s.rt.live["requests"] == 2, "the big request to be submitted")
        finally:
            gate.release.set()
            a.join(T)
            b.join(T)
        r = got["big"]
        assert r.status_code == 400, r.text
        assert r.json() == {"error": {
            "message": "a prompt of 5 tokens + max_tokens 40 needs 12 pages of 4 tokens but the "
                       "KV cache has 8; raise num_pages to 12 or more (kv_cache.num_pages in a "
                       "serving config) or page_size, or lower max_tokens or shorten the prompt",
            "type": "invalid_request_error", "param": None, "code": "kv_cache_too_small"}}
        held = got["held"]
        assert held.status_code == 200, held.text
        assert held.text.count('"output": "token"') == 12 and '"done": true' in held.text
        settled(s)
        wait_until(lambda: _all_free(s.rt), "every page to be released")
        metrics = s.state.metrics.requests
        assert metrics.value("/generate", "bad_request") == 1
        assert metrics.value("/generate", "failed") == 0
        assert metrics.value("/generate", "ok") == 1


def test_speech_past_the_kv_cache_is_a_400_the_openai_client_raises_as_a_bad_request():
    from mstar_rt.models.orpheus import OrpheusTTS

    model = OrpheusTTS.tiny(constrain_codes=True, engine=KVCacheEngine(page_size=16, num_pages=8))
    params = {"max_tokens": 2000, "seed": 0, "ignore_eos": True}
    with serving(model, name="orpheus-tiny", speech=SpeechSpec(inputs={"params": params})) as s:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.BadRequestError) as got:
            client.audio.speech.create(model="orpheus-tiny", voice="tara", input="hi",
                                       response_format="pcm")
        assert got.value.code == "kv_cache_too_small"
        assert "+ max_tokens 2000 needs" in got.value.message
        assert "but the KV cache has 8; raise num_pages to" in got.value.message
        settled(s)
        wait_until(lambda: _all_free(s.rt), "every page to be released")


def test_an_openpi_observation_past_the_kv_cache_gets_an_error_frame_and_frees_everything():
    spec = PolicySpec(observation={"prompt": "prompt"}, shapes={"prompt": (None,)},
                      dtypes={"prompt": "int64"}, actions="token")
    with serving(_lm(num_pages=2), name="tiny-policy", policy=spec) as s:
        with websockets.sync.client.connect(s.ws_url + "/") as ws:
            ws.recv()  # the metadata
            # 3 + SamplingParams' 16 max_tokens: 5 pages of the cache's 2
            for _ in range(2):  # the connection outlives the error
                ws.send(msgpack_numpy.packb({"prompt": np.array([1, 2, 3])}))
                frame = ws.recv(timeout=T)
                assert isinstance(frame, str), frame
                assert frame.startswith("error: a prompt of 3 tokens + max_tokens 16 needs 5 "
                                        "pages of 4 tokens but the KV cache has 2; raise "
                                        "num_pages to 5 or more"), frame
        settled(s)
        wait_until(lambda: _all_free(s.rt), "every page to be released")
        assert s.state.metrics.requests.value("policy", "bad_request") == 2
        assert s.state.metrics.requests.value("policy", "failed") == 0


@pytest.mark.parametrize("message, too_large", [
    ("RequestTooLarge: a prompt of 9 tokens needs 3 pages", True),
    ("node 'prefill' in walk 'prefill' failed: RequestTooLarge: needs 3 pages", True),
    ("decode of request 4 in process 77 failed: node 'decode' in walk 'decode' failed: "
     "RequestTooLarge: needs 3 pages", True),
    # a node's own error quoting a client's text, or another failure's: the model's failure
    ("node 'tts' in walk 'main' failed: ValueError: cannot say 'RequestTooLarge: x'", False),
    ("node 'a' in walk 'main' failed: KeyError: b failed: RequestTooLarge: x", False),
])
def test_only_an_engines_own_tag_makes_a_failure_the_clients(message, too_large):
    from mstar_rt.request_errors import request_failure
    err = request_failure(message)
    assert isinstance(err, RequestTooLarge) is too_large and isinstance(err, RequestFailed)

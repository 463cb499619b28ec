"""/v1/chat/completions on an omni chat model, through the official openai client: text and
input_audio in; text, or text and audio (WAV / pcm16), out; streamed as OpenAI streams audio
(transcript and data deltas) or whole; OpenAI's multi-turn audio ids; clear 400s naming the
field; a client that leaves cancels its request; /v1/audio/speech through the same model.

The model comes from the ``omni_model`` fixture: FakeOmni (tests/python/omni_support.py) until
the real tiny Qwen3-Omni is wired; checks of FakeOmni's exact answers and recorded inputs are
skipped for any other model (see ``fake``)."""

from __future__ import annotations

import base64
import io
import json
import socket
import threading
import time
import wave

import httpx
import numpy as np
import openai
import pytest

from mstar_rt.models.qwen3_omni.chat import OmniChat
from omni_support import SAMPLES_PER_TOKEN, FakeOmni, tiny_qwen3_omni
from test_serve_support import Counter, serving, settled, wait_until

MODEL = "qwen3-omni-tiny"


@pytest.fixture(scope="module", params=["qwen3-omni-tiny", "fake"])
def omni_model(request, tmp_path_factory):
    """The model served: the real tiny random Qwen3-Omni (omni_support.tiny_qwen3_omni), and
    FakeOmni, a scripted model whose answers are known exactly, so the tests can also check
    the wire format to the byte and what the server passed to the model (the tests that read
    its recorded inputs run on it alone)."""
    if request.param == "qwen3-omni-tiny":
        return tiny_qwen3_omni(str(tmp_path_factory.mktemp("qwen3-omni-tiny")))
    return FakeOmni(step_s=0.001)


@pytest.fixture(scope="module")
def omni(omni_model):
    with serving(omni_model, name=MODEL) as s:
        s.model = omni_model
        yield s


@pytest.fixture(scope="module")
def scripted():
    """A server of FakeOmni alone, for the tests that read what the server passed to the
    model or need it to hold an answer back."""
    model = FakeOmni(step_s=0.001)
    with serving(model, name=MODEL) as s:
        s.model = model
        yield s


def fake(s) -> bool:
    return isinstance(s.model, FakeOmni)


def _client(s) -> openai.OpenAI:
    return openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0)


def _wav(seconds: float, rate: int = 16000) -> str:
    t = np.arange(int(seconds * rate)) / rate
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes((0.3 * np.sin(2 * np.pi * 220 * t) * 32767).astype("<i2").tobytes())
    return base64.b64encode(buf.getvalue()).decode()


def _pcm16(seconds: float) -> str:
    t = np.arange(int(seconds * 24000)) / 24000
    return base64.b64encode((0.3 * np.sin(2 * np.pi * 220 * t) * 32767)
                            .astype("<i2").tobytes()).decode()


def _audio_part(data: str, fmt: str = "wav") -> dict:
    return {"type": "input_audio", "input_audio": {"data": data, "format": fmt}}


def _wav_samples(data: bytes) -> np.ndarray:
    with wave.open(io.BytesIO(data)) as w:
        assert (w.getnchannels(), w.getsampwidth(), w.getframerate()) == (1, 2, 24000)
        return np.frombuffer(w.readframes(w.getnframes()), "<i2")


def _fields(x) -> dict:
    """A delta's ``audio`` as a dict of the fields sent (a model in newer openai clients)."""
    if x is None or isinstance(x, dict):
        return x or {}
    return x.model_dump(exclude_none=True)


def _hello(s, **body):
    """A short whole answer to HELLO."""
    return _client(s).chat.completions.create(model=MODEL, messages=HELLO, max_tokens=SHORT,
                                              **body)


def _chunks(s, **body) -> list:
    body.setdefault("max_tokens", SHORT)
    return list(_client(s).chat.completions.create(model=MODEL, stream=True, **body))


HELLO = [{"role": "user", "content": "Hello there"}]
SEED = 0  # the talker's sampling, where a test needs its audio to be the same every run
SHORT = 16  # max_tokens: FakeOmni answers HELLO in 12; a random model rarely stops by itself


# ---- whole answers -----------------------------------------------------------------------------

def test_text_in_text_out_is_a_chat_completion_with_content_and_usage(omni):
    r = _client(omni).chat.completions.create(model=MODEL, messages=HELLO, max_tokens=SHORT)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-") and r.model == MODEL
    (choice,) = r.choices
    assert choice.message.role == "assistant" and choice.message.audio is None
    assert isinstance(choice.message.content, str) and choice.finish_reason in ("stop", "length")
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.usage.completion_tokens >= 1
    if fake(omni):
        assert choice.message.content == "Hello there" and choice.finish_reason == "stop"
        prompt = omni.model.seen[-1]["prompt"]
        assert r.usage.prompt_tokens == len(prompt)
        assert r.usage.completion_tokens == len("Hello there") + 1  # and <|im_end|>
    settled(omni)


def test_audio_out_as_wav_has_the_transcript_and_a_whole_wav_of_the_answer(omni):
    r = _client(omni).chat.completions.create(
        model=MODEL, messages=HELLO, max_tokens=SHORT, modalities=["text", "audio"],
        audio={"voice": "chelsie", "format": "wav"})
    msg = r.choices[0].message
    assert msg.content is None and msg.audio.id.startswith("audio_")
    assert msg.audio.expires_at > time.time()
    wav = base64.b64decode(msg.audio.data)
    assert wav[:4] == b"RIFF" and int.from_bytes(wav[4:8], "little") == len(wav) - 8
    assert int.from_bytes(wav[40:44], "little") == len(wav) - 44  # sizes known: not streaming
    samples = _wav_samples(wav)
    assert len(samples) > 0
    if fake(omni):
        assert msg.audio.transcript == "Hello there"
        assert len(samples) == SAMPLES_PER_TOKEN * len("Hello there")
        assert abs(np.abs(samples).max() / 32767 - 0.2) < 0.01  # chelsie's amplitude
        assert omni.model.seen[-1]["speaker"] == "chelsie"
        assert omni.model.seen[-1]["return_audio"] is True


def test_pcm16_audio_is_the_wav_without_its_header(omni):
    client = _client(omni)
    voice = omni.model.speakers[0]
    kw = dict(model=MODEL, messages=HELLO, modalities=["text", "audio"], max_tokens=SHORT)
    wav = client.chat.completions.create(audio={"voice": voice, "format": "wav"}, **kw)
    pcm = client.chat.completions.create(audio={"voice": voice, "format": "pcm16"}, **kw)
    data = base64.b64decode(pcm.choices[0].message.audio.data)
    assert len(data) % 2 == 0
    if fake(omni):  # deterministic
        assert data == base64.b64decode(wav.choices[0].message.audio.data)[44:]


def test_input_audio_wav_and_pcm16_reach_the_model_as_mel_features(omni):
    content = [{"type": "text", "text": "What is this?"}, _audio_part(_wav(1.0)),
               _audio_part(_pcm16(0.5), "pcm16")]
    r = _client(omni).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": content}], max_tokens=64)
    assert r.usage.prompt_tokens_details.audio_tokens == 13 + 7  # 100 and 50 mel frames
    if fake(omni):
        assert r.choices[0].message.content == "[100][50]What is this?"
        feats = omni.model.seen[-1]["audio_features"]
        assert [f.shape for f in feats] == [(128, 100), (128, 50)]
        assert all(f.dtype == np.float32 for f in feats)


def test_max_tokens_cuts_the_answer_with_finish_reason_length(omni):
    r = _client(omni).chat.completions.create(model=MODEL, messages=HELLO, max_tokens=3)
    assert r.usage.completion_tokens <= 3
    if fake(omni):
        assert r.choices[0].message.content == "Hel" and r.choices[0].finish_reason == "length"
    r = _client(omni).chat.completions.create(model=MODEL, messages=HELLO,
                                              max_completion_tokens=4)
    assert r.usage.completion_tokens <= 4


def test_sampling_fields_map_to_thinker_sampling_and_text_only_asks_no_audio(scripted):
    omni = scripted
    client = _client(omni)
    client.chat.completions.create(model=MODEL, messages=HELLO, temperature=0.7, top_p=0.9,
                                   max_tokens=20)
    seen = omni.model.seen[-1]
    assert seen["thinker_sampling"] == {"temperature": 0.7, "top_p": 0.9}
    assert seen["max_tokens"] == 20 and seen["return_audio"] is False
    assert seen["speaker"] is None and seen["talker_sampling"] is None
    client.chat.completions.create(model=MODEL, messages=HELLO, temperature=0)
    assert omni.model.seen[-1]["thinker_sampling"] is None  # greedy
    client.chat.completions.create(model=MODEL, messages=HELLO, extra_body={"top_k": 5})
    assert omni.model.seen[-1]["thinker_sampling"] == {"temperature": 1.0, "top_k": 5}
    client.chat.completions.create(model=MODEL, messages=HELLO, modalities=["text", "audio"],
                                   audio={"voice": "Ethan", "format": "wav"})  # case aside
    assert omni.model.seen[-1]["speaker"] == "ethan"


def test_multi_turn_with_an_earlier_answers_audio_id_uses_its_transcript(omni):
    client = _client(omni)
    first = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=SHORT,
                                           modalities=["text", "audio"],
                                           audio={"voice": omni.model.speakers[0],
                                                  "format": "wav"})
    audio_id = first.choices[0].message.audio.id
    messages = [{"role": "developer", "content": "Be brief."}, *HELLO,
                {"role": "assistant", "audio": {"id": audio_id}},
                {"role": "user", "content": "Again"}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=SHORT)
    if fake(omni):
        assert r.choices[0].message.content == "Again"
        text = omni.model.tokenizer.decode(omni.model.seen[-1]["prompt"])  # specials dropped
        assert text == ("system\nBe brief.\nuser\nHello there\nassistant\nHello there\n"
                        "user\nAgain\nassistant\n")
    # the message object the SDK returned can be sent back as it is
    back = first.choices[0].message.model_dump(exclude_none=True)
    r = client.chat.completions.create(model=MODEL, messages=[*HELLO, back,
                                                              {"role": "user", "content": "Ok"}])
    assert r.choices[0].message.content is not None
    with pytest.raises(openai.BadRequestError, match="no answer of this server has audio"):
        client.chat.completions.create(model=MODEL, messages=[
            *HELLO, {"role": "assistant", "audio": {"id": "audio_nope"}}])


# ---- streams -----------------------------------------------------------------------------------

def test_text_stream_is_role_then_content_deltas_then_finish_reason(omni):
    chunks = _chunks(omni, messages=HELLO, stream_options={"include_usage": True})
    assert len({c.id for c in chunks}) == 1 and all(c.object == "chat.completion.chunk"
                                                     for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    *body, finish, usage = chunks
    assert finish.choices[0].delta.content is None and finish.choices[0].finish_reason
    assert usage.choices == [] and usage.usage.completion_tokens >= 1
    text = "".join(c.choices[0].delta.content or "" for c in body)
    assert all(c.choices[0].delta.audio is None for c in chunks if c.choices)
    if fake(omni):
        assert text == "Hello there" and len(body) == 1 + len("Hello there")  # token by token
        assert usage.usage.prompt_tokens == len(omni.model.seen[-1]["prompt"])


def test_audio_stream_sends_transcript_and_pcm16_deltas_as_openai_does(omni):
    # seeded: the tiny random talker would otherwise now and then end before its audio
    chunks = _chunks(omni, messages=HELLO, modalities=["text", "audio"], seed=SEED,
                     audio={"voice": omni.model.speakers[1], "format": "pcm16"})
    deltas = [c.choices[0].delta for c in chunks]
    assert deltas[0].role == "assistant" and deltas[0].content is None
    audio = [_fields(d.audio) for d in deltas if d.audio is not None]
    assert audio[0]["id"].startswith("audio_")
    assert all("id" not in a for a in audio[1:-1])
    assert audio[-1] == {"expires_at": audio[-1]["expires_at"]} and audio[-1]["expires_at"] > 0
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    assert all(d.content is None for d in deltas)  # the text is the transcript
    transcript = "".join(a.get("transcript", "") for a in audio)
    pcm = b"".join(base64.b64decode(a["data"]) for a in audio if "data" in a)
    assert len(pcm) > 0 and len(pcm) % 2 == 0
    data_deltas = [a for a in audio if "data" in a]
    assert len(data_deltas) > 1  # audio streams as it is made, not once at the end
    if fake(omni):
        assert transcript == "Hello there"
        assert len(pcm) == 2 * SAMPLES_PER_TOKEN * len("Hello there")
        whole = _client(omni).chat.completions.create(
            model=MODEL, messages=HELLO, max_tokens=SHORT, modalities=["text", "audio"],
            audio={"voice": omni.model.speakers[1], "format": "pcm16"})
        assert base64.b64decode(whole.choices[0].message.audio.data) == pcm
    settled(omni)


def test_raw_stream_is_server_sent_events_ending_with_done(omni):
    with httpx.stream("POST", omni.url + "/v1/chat/completions", timeout=30,
                      json={"model": MODEL, "messages": HELLO, "stream": True,
                            "max_tokens": SHORT}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    last = json.loads(events[-2][6:])
    assert last["choices"][0]["delta"] == {} and last["choices"][0]["finish_reason"]


def test_concurrent_streams_each_get_their_own_answer(omni):
    results: dict[int, str] = {}

    def ask(i: int) -> None:
        chunks = _chunks(omni, messages=[{"role": "user", "content": f"question {i}"}],
                         modalities=["text", "audio"], audio={"voice": omni.model.speakers[0],
                                                              "format": "pcm16"})
        results[i] = "".join(_fields(c.choices[0].delta.audio).get("transcript", "")
                             for c in chunks if c.choices)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sorted(results) == [0, 1, 2, 3]
    if fake(omni):
        assert all(results[i] == f"question {i}" for i in range(4))
    settled(omni)


# ---- errors ------------------------------------------------------------------------------------

AUDIO_ON = {"modalities": ["text", "audio"]}


@pytest.mark.parametrize("body, param, needle", [
    ({}, "messages", "must be a non-empty list"),
    ({"messages": []}, "messages", "must be a non-empty list"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].role", "tools are not"),
    ({"messages": [{"role": "user"}]}, "messages[0].content", "is missing"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages[0].content[0].type", "'image_url' parts are not served"),
    ({"messages": [{"role": "user", "content": [_audio_part("AAAA", "mp3")]}]},
     "messages[0].content[0].input_audio.format", "no MP3 decoder"),
    ({"messages": [{"role": "user", "content": ["hi"]}]}, "messages[0].content[0]",
     "must be an object"),
    ({"messages": [{"role": "user", "content": [_audio_part("!!notbase64")]}]},
     "messages[0].content[0].input_audio.data", "not valid base64"),
    ({"messages": [{"role": "user", "content": [_audio_part("AAAAAAAA")]}]},
     "messages[0].content[0].input_audio.data", "not a WAV file"),
    ({"messages": [{"role": "user", "content": [_audio_part("AAAAAA==", "pcm16")]}]},
     "messages[0].content[0].input_audio.data", "send at least 10 ms"),
    ({"messages": [{"role": "user", "content": "a<|im_end|>b"}]}, "messages[0].content",
     "chat control tokens"),
    ({"messages": HELLO, **AUDIO_ON, "audio": {"voice": "ethan", "format": "mp3"}},
     "audio.format", "audio format 'mp3' is not served"),
    ({"messages": HELLO, **AUDIO_ON, "stream": True, "audio": {"voice": "ethan",
                                                               "format": "wav"}},
     "audio.format", "streamed audio is sent as pcm16"),
    ({"messages": HELLO, **AUDIO_ON, "audio": {"voice": "alloy", "format": "wav"}},
     "audio.voice", "unknown voice 'alloy'"),
    ({"messages": HELLO, "modalities": ["video"]}, "modalities", "'modalities' must be"),
    ({"messages": HELLO, "n": 2}, "n", "'n' is not served"),
    ({"messages": HELLO, "tools": [{"type": "function"}]}, "tools", "'tools' is not served"),
    ({"messages": HELLO, "temperature": 3}, "temperature", "'temperature' must be"),
    ({"messages": HELLO, "max_tokens": 0}, "max_tokens", "must be an integer in 1.."),
    ({"messages": HELLO, "max_tokens": 5, "max_completion_tokens": 6},
     "max_completion_tokens", "give one of them"),
    ({"messages": HELLO, "stream": "yes"}, "stream", "'stream' must be true or false"),
    ({"messages": HELLO, "volume": 1}, "volume", "unknown field 'volume'"),
])
def test_bad_chat_requests_get_a_400_naming_the_field_and_the_server_keeps_serving(
        omni, body, param, needle):
    r = httpx.post(omni.url + "/v1/chat/completions", json={"model": MODEL, **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert needle in error["message"] and error["param"] == param, error
    assert _hello(omni).choices


def test_a_prompt_past_the_thinkers_sequence_limit_is_a_400_not_a_model_failure(omni):
    if fake(omni):
        pytest.skip("the scripted model has no sequence limit")
    limit = omni.model.thinker.max_seq_len
    long_text = "hello world " * (limit // 2)  # two or more tokens a repeat
    r = httpx.post(omni.url + "/v1/chat/completions",
                   json={"model": MODEL, "messages": [{"role": "user", "content": long_text}]})
    assert r.status_code == 400, r.text
    assert "tokens; give 1 .. " in r.json()["error"]["message"]
    r = httpx.post(omni.url + "/v1/audio/speech",
                   json={"model": MODEL, "input": long_text[:4096], "voice": None})
    assert r.status_code == 400 and "tokens; give 1 .. " in r.text, r.text
    assert _hello(omni).choices


def test_openai_client_sees_chat_errors_as_its_own_exceptions(omni):
    client = _client(omni)
    with pytest.raises(openai.BadRequestError, match="unknown voice"):
        client.chat.completions.create(model=MODEL, messages=HELLO, modalities=["text", "audio"],
                                       audio={"voice": "alloy", "format": "wav"})
    with pytest.raises(openai.NotFoundError, match="'gpt-4o' is not served here"):
        client.chat.completions.create(model="gpt-4o", messages=HELLO, max_tokens=SHORT)
    with pytest.raises(openai.BadRequestError, match="stream"):
        client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=SHORT, stream=True,
                                       modalities=["text", "audio"],
                                       audio={"voice": "ethan", "format": "wav"})


def test_a_model_that_is_not_an_omni_chat_model_answers_404():
    with serving(Counter(), name="counter") as s:
        r = httpx.post(s.url + "/v1/chat/completions", json={"messages": HELLO})
        assert r.status_code == 404 and r.json()["error"]["code"] == "not_chat_model"
        assert "chat" not in httpx.get(s.url + "/v1/models").json()["data"][0]["capabilities"]


def test_the_model_list_names_the_chat_capability_and_the_speakers(omni):
    (info,) = _client(omni).models.list().data
    assert info.id == MODEL
    assert {"chat", "speech"} <= set(info.capabilities)
    assert info.voices == list(omni.model.speakers)


def test_a_failure_mid_stream_is_an_error_event_the_openai_client_raises():
    with serving(FakeOmni(fail_at=3), name=MODEL) as s:
        client = _client(s)
        got = []
        with pytest.raises(openai.APIError, match="failed on purpose"):
            for chunk in client.chat.completions.create(model=MODEL, messages=HELLO,
                                                        stream=True):
                got.append(chunk.choices[0].delta.content or "")
        assert "".join(got) == "Hel"  # what came before the failure
        with pytest.raises(openai.InternalServerError, match="failed on purpose"):
            client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=SHORT)
        metrics = s.state.metrics.requests
        assert metrics.value("/v1/chat/completions", "failed") == 2
        assert settled(s)["requests"] == 0


def test_a_whole_answer_past_request_timeout_s_is_cancelled_with_a_504():
    model = FakeOmni()
    model.hold = True
    with serving(model, name=MODEL, request_timeout_s=0.3) as s:
        try:
            r = httpx.post(s.url + "/v1/chat/completions", json={"messages": HELLO},
                           timeout=30)
            assert r.status_code == 504, r.text
            assert "request_timeout_s=0.3" in r.json()["error"]["message"]
        finally:
            model.release.set()
        assert s.state.metrics.requests.value("/v1/chat/completions", "timeout") == 1
        assert settled(s)["requests"] == 0


# ---- disconnects -------------------------------------------------------------------------------

def _cancelled(s) -> float:
    return s.state.metrics.requests.value("/v1/chat/completions", "cancelled")


def _ended_ok(s) -> float:
    return s.state.metrics.requests.value("/v1/chat/completions", "ok")


def test_a_client_leaving_mid_stream_cancels_the_request(omni):
    m = omni.model
    body = {"model": MODEL, "stream": True, "max_tokens": 4000, **AUDIO_ON,
            "audio": {"voice": omni.model.speakers[0], "format": "pcm16"},
            "messages": [{"role": "user", "content": "long answer " * 300}]}
    # The real random model samples how long it speaks (1 to 8 audio events of ~490 text
    # events here): its first audio can be its last, and the answer may then end before the
    # server sees the client leave. Such a try proves nothing, so it is made again.
    for _ in range(4):
        before, done = _cancelled(omni), _ended_ok(omni)
        try:
            with httpx.stream("POST", omni.url + "/v1/chat/completions", json=body,
                              timeout=30) as r:
                assert r.status_code == 200
                lines = r.iter_lines()  # kept: dropping a half-read iterator closes it
                for line in lines:
                    if '"data"' in line:
                        break  # audio is flowing
                if fake(omni):  # hold the model mid-answer, so only the disconnect can end it
                    m.release.clear()
                    m.holding = 0
                    m.hold = True
                    wait_until(lambda: m.holding >= 1, "the model to be held")
            wait_until(lambda: (_cancelled(omni) == before + 1 or _ended_ok(omni) == done + 1)
                       and omni.state.bridge.admission.in_flight == 0,
                       "the request to be cancelled (or to end on its own)")
        finally:
            if fake(omni):
                m.hold = False
                m.release.set()
        if _cancelled(omni) == before + 1:
            break
        assert not fake(omni), "the held answer ended on its own"
    else:
        raise AssertionError("four answers all ended before the server saw the client leave")
    assert settled(omni)["requests"] == 0


def test_a_full_server_answers_429_before_decoding_the_audio(monkeypatch):
    """The admission comes first: a refused request spends nothing on its audio (before,
    every refused request decoded its WAV and computed mel features on the server's pool)."""
    model = FakeOmni(step_s=0.001)
    with serving(model, name=MODEL, max_concurrent_requests=1) as s:
        built = []
        real = OmniChat.prompt
        monkeypatch.setattr(OmniChat, "prompt", lambda self, m: built.append(1) or real(self, m))
        model.release.clear()
        model.holding = 0
        model.hold = True
        first = threading.Thread(target=httpx.post, args=(s.url + "/v1/chat/completions",),
                                 kwargs={"json": {"model": MODEL, "messages": HELLO},
                                         "timeout": 30})
        first.start()
        try:
            wait_until(lambda: model.holding >= 1, "the first request to reach the model")
            audio = [{"role": "user", "content": [_audio_part(_wav(1.0))]}]
            r = httpx.post(s.url + "/v1/chat/completions",
                           json={"model": MODEL, "messages": audio}, timeout=30)
            assert r.status_code == 429, r.text
            assert built == [1], "the refused request's audio was decoded"
        finally:
            model.hold = False
            model.release.set()
            first.join(30)
        assert s.state.bridge.admission.in_flight == 0
        assert httpx.post(s.url + "/v1/chat/completions", json={"model": MODEL, "messages": audio},
                          timeout=30).status_code == 200


def test_a_client_leaving_before_a_whole_answer_cancels_the_request(scripted):
    omni = scripted  # FakeOmni holds the answer back, so it cannot finish first
    m = omni.model
    before = _cancelled(omni)
    m.release.clear()
    m.holding = 0
    m.hold = True
    body = json.dumps({"model": MODEL, "messages": HELLO}).encode()
    sock = socket.create_connection(("127.0.0.1", omni.port), timeout=20)
    try:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                     b"Content-Type: application/json\r\n"
                     + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        wait_until(lambda: m.holding >= 1, "the request to reach the model")
    finally:
        sock.close()
    try:
        wait_until(lambda: _cancelled(omni) == before + 1
                   and omni.state.bridge.admission.in_flight == 0, "the request to be cancelled")
        assert not m.release.is_set()  # the disconnect ended it, not the answer
    finally:
        m.hold = False
        m.release.set()
    assert settled(omni)["requests"] == 0


# ---- /v1/audio/speech through the omni model ---------------------------------------------------

def test_speech_endpoint_reads_the_text_aloud_through_the_omni_model(omni):
    client = _client(omni)
    for _ in range(4):  # the random model samples its speech: it may end before a frame
        with client.audio.speech.with_streaming_response.create(
                model=MODEL, voice=omni.model.speakers[1], input="Read me",
                response_format="pcm") as resp:
            assert int(resp.headers["x-sample-rate"]) == 24000
            pcm = b"".join(resp.iter_bytes())
        if pcm:
            break
    assert len(pcm) > 0 and len(pcm) % 2 == 0
    if fake(omni):
        assert len(pcm) == 2 * SAMPLES_PER_TOKEN * len("Read me")
        seen = omni.model.seen[-1]
        assert seen["speaker"] == omni.model.speakers[1] and seen["return_audio"] is True
        prompt = omni.model.tokenizer.decode(seen["prompt"])
        assert "aloud" in prompt and prompt.endswith("\nuser\nRead me\nassistant\n")
    with pytest.raises(openai.BadRequestError, match="unknown voice"):
        client.audio.speech.create(model=MODEL, voice="alloy", input="hi")


# ---- fuzzing the published schema --------------------------------------------------------------

def test_chat_and_speech_survive_requests_generated_from_the_published_schema(omni):
    """schemathesis, as test_fuzz_http does for the other deployments: bodies that fit the
    published chat and speech schemas and bodies that break them get no 5xx, only documented
    statuses, and a 4xx for every body that breaks the schema."""
    import schemathesis
    from hypothesis import HealthCheck, given, settings
    from schemathesis import GenerationMode

    from test_fuzz_http import EXAMPLES, PHASES, call

    doc = httpx.get(omni.url + "/openapi.json").json()
    schema = schemathesis.openapi.from_dict(doc)
    schema.config.update(base_url=omni.url)
    ops = {(op.method.upper(), op.path): op for op in (r.ok() for r in schema.get_all_operations())}
    assert ("POST", "/v1/chat/completions") in ops
    statuses: dict[str, dict[int, int]] = {}
    examples = EXAMPLES if fake(omni) else 8  # a random model rarely stops before max_tokens
    for path in ("/v1/chat/completions", "/v1/audio/speech"):
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            seen = statuses.setdefault(f"{path} {mode.value}", {})

            @settings(max_examples=examples, derandomize=True, database=None, deadline=None,
                      suppress_health_check=list(HealthCheck), phases=PHASES)
            @given(ops[("POST", path)].as_strategy(generation_mode=mode))
            def fuzz(case) -> None:
                response = call(case)
                seen[response.status_code] = seen.get(response.status_code, 0) + 1

            fuzz()
    print("\nchat fuzz:", statuses)
    assert statuses["/v1/chat/completions positive"].get(200, 0) >= 1, statuses
    assert _hello(omni).choices
    assert settled(omni)["requests"] == 0

"""OrpheusTTS end to end through the Runtime with a tiny random LM and a reduced-width SNAC of
the real 24 kHz receptive field: streamed audio equals one-shot decoding of the generated tokens
(concurrent requests; Orpheus' own SlidingWindow(28, 7), the default, and other policies, the
SNAC node carrying the context short windows lack; first audio after 28 tokens, then a frame per
7), end of speech and max_tokens stop it, constrained codes make only valid frames, seeded
sampling does not depend on the batch, cancel frees everything, and the LM's non-sampling
prefill equals a plain prefill."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

import mstar_rt
from mstar_rt import Fixed, LeftContext, RequestCancelled, SlidingWindow
from mstar_rt.engines import KVCacheEngine, SamplingParams
from mstar_rt.models.causal_lm import CausalLM
from mstar_rt.models.orpheus import OrpheusTokens, OrpheusTTS, TextEncoder, tiny_lm, tiny_snac
from mstar_rt.models.snac_stream import decode_one_shot

from walk_models import ZERO_LIVE, close_within, drain, settled, wait_until

T = 60.0  # the longest any single wait may take
TOL = 1e-5
SPF = 2048  # samples per frame


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conftest.py


@pytest.fixture(scope="module")
def tts() -> OrpheusTTS:
    return OrpheusTTS.tiny(0, constrain_codes=True)


def run(model: OrpheusTTS, requests: list[dict]) -> list[dict]:
    """Serves ``requests`` concurrently; returns their results, each with its handle's state."""
    rt = mstar_rt.Runtime(model)
    try:
        handles = [rt.submit(r) for r in requests]
        out = []
        for h in handles:
            res = dict(h.result(timeout=T))
            res["state"] = h.context.state
            out.append(res)
        assert settled(rt) == ZERO_LIVE
        cache = rt.engines["lm"].cache
        assert wait_until(lambda: cache.free_pages == cache.num_pages)
    finally:
        close_within(rt)
    return out


def audio_of(result: dict) -> np.ndarray:
    chunks = result.get("audio", [])
    return np.concatenate(chunks) if chunks else np.zeros(0, np.float32)


def assert_exact(model: OrpheusTTS, result: dict) -> np.ndarray:
    ref = decode_one_shot(model.decoder, model.layout, result["token"])
    audio = audio_of(result)
    assert audio.dtype == np.float32
    assert len(audio) == len(ref), f"{len(audio)} samples streamed, one-shot gives {len(ref)}"
    assert len(ref) > 0 and np.abs(ref).max() > 1e-3  # real audio, not silence
    err = float(np.abs(audio - ref).max())
    assert err < TOL, f"streamed audio differs from one-shot decoding by {err}"
    return audio


# ---- exactness ----------------------------------------------------------------------------------

@pytest.mark.parametrize("policy, carry", [(None, True), (Fixed(7), True),
                                           (SlidingWindow(49, 7), False),
                                           (LeftContext(42, 7), False)],
                         ids=["default", "fixed7", "sliding49-windows-only", "exact-windows-only"])
def test_streamed_audio_equals_one_shot_for_concurrent_requests(policy, carry):
    model = OrpheusTTS.tiny(0, constrain_codes=True, policy=policy, carry_context=carry)
    assert policy is not None or str(model.policy) == "SlidingWindow(28, 7)"
    # lengths ending mid-frame, on a frame boundary, and shorter than the first window
    lengths = (60, 63, 91, 20)
    results = run(model, [{"text": f"request {i}", "params": SamplingParams(
        max_tokens=n, temperature=1.0, seed=i, ignore_eos=True)} for i, n in enumerate(lengths)])
    for n, r in zip(lengths, results):
        assert len(r["token"]) == n
        frames = n // 7
        if frames == 0:
            assert len(audio_of(r)) == 0
            continue
        audio = assert_exact(model, r)
        assert len(audio) == frames * SPF
        s = r["state"]
        assert (s["frames_emitted"], s["invalid_frames"], s["incomplete_frames"]) == (
            frames, 0, int(n % 7 != 0))
        assert s["short_context_frames"] == 0


def recording(model: OrpheusTTS) -> tuple[list[int], list[int]]:
    """Instruments the SNAC node: per window it decodes, in order (one request at a time), the
    window's end (tokens streamed so far) and the frames of audio it gave; an end-of-stream
    flush (end_stream) counts as a window ending where the last one did."""
    codec, ends, frames = model.codec, [], []
    prepare, forward = codec.prepare_inputs, codec.forward

    def record_prepare(ctx, inputs):
        ends.append(inputs["token"].end)
        return prepare(ctx, inputs)

    def record_forward(batch):
        out = forward(batch)
        frames.extend(len(o["audio"]) // SPF for o in out)
        return out

    def record_end(ctx):  # the stream ended where the last window did: the flush
        ends.append(ends[-1] if ends else 0)
        out = end_stream(ctx)
        frames.append(len(out["audio"]) // SPF)
        return out

    end_stream = codec.end_stream
    codec.prepare_inputs, codec.forward, codec.end_stream = record_prepare, record_forward, record_end
    return ends, frames


def test_audio_streams_before_the_lm_is_done():
    model = OrpheusTTS.tiny(0, constrain_codes=True)  # Orpheus' SlidingWindow(28, 7)
    ends, frames = recording(model)
    with mstar_rt.Runtime(model) as rt:
        h = rt.submit({"text": "streaming", "params": SamplingParams(
            max_tokens=140, temperature=1.0, seed=3, ignore_eos=True)})
        events, error = drain(h, timeout=T)
    assert error is None
    names = [n for n, v in events if n == "token" or (n == "audio" and len(v))]
    assert "token" in names[names.index("audio"):]  # audio came while the LM was talking
    assert names.index("audio") >= 28  # frame 0 needs frames 1..3 after it
    assert_exact(model, {"token": [v for n, v in events if n == "token"],
                         "audio": [v for n, v in events if n == "audio"]})
    # First audio once 28 tokens are in -- the first window -- then a frame per window of 7 new
    # tokens; the last window (or end_stream after it) flushes the frames still owed.
    assert ends[0] == 28 and frames[0] == 1, (ends, frames)
    assert all(f == 1 and e - before == 7
               for before, e, f in zip(ends[:-2], ends[1:-1], frames[1:-1])), (ends, frames)
    assert ends[-1] == 140 and sum(frames) == 20 and frames[-1] >= 3, (ends, frames)


# ---- stopping -----------------------------------------------------------------------------------

def forced_end(model: OrpheusTTS, at: int, constrain: bool = True):
    """A logits processor that makes ``end_of_speech`` certain at stream position ``at`` and
    impossible before."""
    inner, end = model.lm.constrain, model.tokens.end_of_speech

    def processor(state: dict, logits: torch.Tensor) -> torch.Tensor:
        out = torch.full_like(logits, float("-inf"))
        if state["generated"] == at:
            out[end] = 0.0
            return out
        out = inner(state, logits) if constrain else logits.clone()
        out[end] = float("-inf")
        return out

    return processor


@pytest.mark.parametrize("at", [35, 38], ids=["frame_boundary", "mid_frame"])
def test_end_of_speech_stops_the_loop_and_flushes_the_audio(at):
    model = OrpheusTTS.tiny(0, constrain_codes=True)
    model.lm.logits_processor = forced_end(model, at)
    params = SamplingParams(max_tokens=500, temperature=1.0, seed=5)
    r, = run(model, [{"text": "stop", "params": params}])
    assert len(r["token"]) == at + 1 and r["token"][-1] == model.tokens.end_of_speech
    audio = assert_exact(model, r)
    assert len(audio) == (at // 7) * SPF
    assert r["state"]["incomplete_frames"] == int(at % 7 != 0)


def test_constrained_codes_make_only_valid_frames():
    free = OrpheusTTS.tiny(0, constrain_codes=False)
    bound = OrpheusTTS.tiny(0, constrain_codes=True)
    params = SamplingParams(max_tokens=140, temperature=1.5, seed=11, ignore_eos=True)
    req = {"text": "valid codes", "params": params}
    r_free, = run(free, [req])
    r_bound, = run(bound, [req])
    layout = bound.layout
    assert all(layout.code_of(t, p) is not None for p, t in enumerate(r_bound["token"]))
    assert r_bound["state"]["invalid_frames"] == 0
    assert r_bound["state"]["frames_emitted"] == 20
    assert_exact(bound, r_bound)
    # the random LM left alone mostly spells no valid frame: the counter sees the drops
    assert r_free["state"]["invalid_frames"] > 0
    assert r_free["state"]["invalid_frames"] + r_free["state"]["frames_emitted"] == 20


# ---- batching and cancel ------------------------------------------------------------------------

def test_seeded_request_sounds_the_same_alone_and_batched(tts):
    target = {"text": "same voice", "params": SamplingParams(
        max_tokens=84, temperature=0.9, top_p=0.9, repetition_penalty=1.2, seed=42)}
    others = [{"text": f"noise {i}", "params": SamplingParams(
        max_tokens=70 + 7 * i, temperature=1.2, seed=100 + i, ignore_eos=True)}
        for i in range(4)]
    alone, = run(tts, [target])
    batched = run(tts, others[:2] + [target] + others[2:])[2]
    assert batched["token"] == alone["token"]
    a, b = audio_of(alone), audio_of(batched)
    assert len(a) == len(b) > 0
    assert float(np.abs(a - b).max()) < TOL
    assert tts.codec.decode_batch_sizes.keys() - {1}, "no SNAC call decoded several windows"


def test_cancel_mid_speech_frees_pages_and_leaves_nothing_live(tts):
    rt = mstar_rt.Runtime(tts)
    try:
        cache = rt.engines["lm"].cache
        long = rt.submit({"text": "a long story", "params": SamplingParams(
            max_tokens=3000, temperature=1.0, seed=1, ignore_eos=True)})
        short = rt.submit({"text": "short", "params": SamplingParams(
            max_tokens=42, temperature=1.0, seed=2, ignore_eos=True)})
        assert wait_until(lambda: long.context.state.get("frames_emitted", 0) > 0, T)
        assert cache.free_pages < cache.num_pages
        assert long.cancel()
        with pytest.raises(RequestCancelled):
            long.result(timeout=T)
        assert len(short.result(timeout=T)["audio"]) > 0
        assert settled(rt, T) == ZERO_LIVE
        assert wait_until(lambda: cache.free_pages == cache.num_pages and cache.live_sequences == 0)
    finally:
        close_within(rt)


# ---- the LM's non-sampling prefill --------------------------------------------------------------

def test_prefill_without_sampling_equals_a_plain_prefill():
    """The first decode step after a non-sampling prefill of prompt[:-1] sees what a plain
    prefill of the whole prompt sees: equal logits, hence equal tokens -- through CausalLM,
    through its static (CUDA-graph) decode path, and through OrpheusTTS."""
    tokens = OrpheusTokens.tiny()
    module = tiny_lm(tokens, seed=3)
    tts = OrpheusTTS(module, tiny_snac(3), tokens, emit_logits=True)
    texts = ("hi", "a longer sentence here", "x y")
    prompts = [tts.prompt_ids({"text": t}) for t in texts] + [[5, 9]]  # [5, 9]: 1-token prefill
    greedy = SamplingParams(max_tokens=12, ignore_eos=True)

    def serve(**kw) -> list[dict]:
        lm = CausalLM(module, emit_logits=True, engine=KVCacheEngine(page_size=4), **kw)
        with mstar_rt.Runtime(lm) as rt:
            if not kw.get("prefill_samples", True):
                with pytest.raises(ValueError, match="at least two token ids"):
                    rt.submit({"prompt": [5]})
            return [h.result(timeout=T) for h in [rt.submit({"prompt": p, "params": greedy})
                                                 for p in prompts]]

    ref = serve()
    variants = [serve(prefill_samples=False), serve(prefill_samples=False, cuda_graphs=True),
                run(tts, [{"text": t, "params": greedy} for t in texts])]
    for got in variants:
        for r, g in zip(ref, got):
            assert g["token"] == r["token"]
            assert len(g["logits"]) == len(r["logits"]) == 12
            for a, b in zip(r["logits"], g["logits"]):
                assert float((a - b).abs().max()) < TOL


# ---- prompts, checkpoints and errors ------------------------------------------------------------

def test_prompt_format_and_input_errors(tts):
    t = tts.tokens
    hi = [ord("h"), ord("i")]
    assert tts.prompt_ids({"text": "hi"}) == [t.start_of_human, t.bos, *hi, t.eot,
                                              t.end_of_human, t.start_of_ai, t.start_of_speech]
    assert tts.prompt_ids({"prompt": hi, "voice": "v"}) == tts.prompt_ids({"text": "hi",
                                                                             "voice": "v"})
    real = OrpheusTokens()
    assert real.prompt([9]) == [128259, 128000, 9, 128009, 128260, 128261, 128257]
    assert real.layout.audio_base == 128266 and real.layout.end_token == 128258
    with mstar_rt.Runtime(tts) as rt:
        with pytest.raises(ValueError, match="either 'text'"):
            rt.submit({"text": "a", "prompt": [1]})
        with pytest.raises(ValueError, match="either 'text'"):
            rt.submit({})
        # cast before: [1.5, 2.7] was spoken as [1, 2], a voice 123 as the text "123: "
        with pytest.raises(TypeError, match="prompt token ids must be integers, got float"):
            rt.submit({"prompt": [1.5, 2.7]})
        with pytest.raises(TypeError, match="'voice' must be a string"):
            rt.submit({"text": "hi", "voice": 123})
    assert str(OrpheusTTS.tiny(0, policy=SlidingWindow(28, 7)).policy) == "SlidingWindow(28, 7)"
    with pytest.raises(ValueError, match="SlidingWindow\\(49, 7\\)"):  # too short for windows alone
        OrpheusTTS.tiny(0, policy=SlidingWindow(28, 7), carry_context=False)
    with pytest.raises(ValueError, match="vocabulary"):
        OrpheusTTS(tiny_lm(OrpheusTokens.tiny(), vocab_size=600), tiny_snac(), OrpheusTokens.tiny())


def test_from_pretrained_reads_lm_snac_and_tokenizer(tmp_path):
    transformers = pytest.importorskip("transformers")
    tokenizers = pytest.importorskip("tokenizers")
    safetensors = pytest.importorskip("safetensors.torch")
    from mstar_rt.models.snac import SnacConfig, SnacDecoder

    tokens = OrpheusTokens.tiny()
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=tokens.min_vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512,
        initializer_range=0.1, tie_word_embeddings=False, bos_token_id=None, eos_token_id=None,
        pad_token_id=None))
    lm_dir, snac_dir = tmp_path / "lm", tmp_path / "snac"
    hf.save_pretrained(lm_dir)
    words = {"[UNK]": 0, "hello": 40, "world": 41}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(words, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.save(str(lm_dir / "tokenizer.json"))
    config = SnacConfig(decoder_dim=32, latent_dim=32, codebook_size=64)
    snac_dir.mkdir()
    (snac_dir / "config.json").write_text(json.dumps(config.to_dict()))
    safetensors.save_file(SnacDecoder(config).state_dict(), str(snac_dir / "model.safetensors"))

    model = OrpheusTTS.from_pretrained(lm_dir, snac_dir, tokens=tokens, progress=False,
                                       constrain_codes=True)
    assert model.prompt_ids({"text": "hello world"})[2:4] == [40, 41]
    assert TextEncoder(lm_dir / "tokenizer.json")("world hello") == [41, 40]
    r, = run(model, [{"text": "hello world", "params": SamplingParams(
        max_tokens=35, temperature=1.0, seed=0, ignore_eos=True)}])
    assert len(assert_exact(model, r)) == 5 * SPF
    # a broken tokenizer.json fails the load, naming it (it failed every text request)
    (lm_dir / "tokenizer.json").write_text("{bad")
    with pytest.raises(ValueError, match=r"tokenizer.json is not a readable tokenizer"):
        OrpheusTTS.from_pretrained(lm_dir, snac_dir, tokens=tokens, progress=False)
    os.remove(lm_dir / "tokenizer.json")
    bare = OrpheusTTS.from_pretrained(lm_dir, snac_dir, tokens=tokens, progress=False)
    with pytest.raises(ValueError, match="no tokenizer"):
        bare.prompt_ids({"text": "hello"})
    assert bare.prompt_ids({"prompt": [40]})[2] == 40

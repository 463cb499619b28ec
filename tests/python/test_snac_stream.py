"""Conformance of streamed speech decoding: audio tokens streamed one per LM step through the
Runtime into SnacStreamNode add up to one decode of the whole sequence, sample for sample --
first and last frames included -- under Orpheus' SlidingWindow(28, 7), an exact LeftContext and a
wide SlidingWindow, whether the decoder keeps up or lags; concurrent requests share decoder calls;
invalid frames are dropped without shifting the frame alignment. The guard against the
chunk-boundary bug. Any policy with carried context: test_snac_stream_context.py; policies
without it and a causal decoder: test_snac_stream_policies.py."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from mstar_rt import Fixed, LeftContext, SlidingWindow  # noqa: E402
from mstar_rt.models.snac import PositionalNoise  # noqa: E402
from mstar_rt.models.snac_stream import (AudioTokenLayout, SnacStreamNode,  # noqa: E402
                                         decode_one_shot)

from snac_streams import (LAYOUT, ORPHEUS, SMALL, SPF, TOL, T, Recorder, Speech,  # noqa: E402
                          assert_first_audio_after_4_frames, audio_tokens, counters, direct,
                          random_codes, random_snac, served, tokens_of, window_ends)
from walk_models import ZERO_LIVE, settled, wait_until  # noqa: E402


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conftest.py


@pytest.fixture(scope="module")
def snac():
    return random_snac(SMALL)


# ---- streamed == one shot ---------------------------------------------------------------------

# tokens: shorter than the first window (flushed whole), frame boundary, mid-frame, long
LENGTHS = [3, 7, 15, 21, 69, 70, 73, 33 * 7 + 4]


POLICIES = {"orpheus": ORPHEUS, "exact": LeftContext(42, 7), "sliding49": SlidingWindow(49, 7)}


@pytest.mark.parametrize("mode", ["paced", "ahead"])
@pytest.mark.parametrize("policy", list(POLICIES))
def test_streamed_audio_equals_one_shot_decoding(serve, snac, policy, mode):
    assert snac.receptive_field_frames() == (3, 3)
    assert str(SnacStreamNode.exact_policy(snac, LAYOUT)) == "LeftContext(42, 7)"
    chunking = POLICIES[policy]
    rt = serve(Speech(Recorder(snac, LAYOUT), chunking))
    for i, n in enumerate(LENGTHS):
        tokens = audio_tokens(n, seed=i)
        chunks, state, windows = served(rt, tokens, mode)
        audio, want = np.concatenate(chunks), decode_one_shot(snac, LAYOUT, tokens)
        assert len(want) == n // 7 * SPF
        assert audio.shape == want.shape, (n, audio.shape, want.shape)
        assert np.abs(audio - want).max(initial=0) < TOL, (n, np.abs(audio - want).max())
        if n >= 7:  # the first and the last frame are there, not just "most of it"
            assert np.allclose(audio[:SPF], want[:SPF], atol=TOL, rtol=0)
            assert np.allclose(audio[-SPF:], want[-SPF:], atol=TOL, rtol=0)
        assert counters(state) == dict(frames_emitted=n // 7, invalid_frames=0,
                                       incomplete_frames=int(n % 7 != 0), short_context_frames=0)
        # Both ways a stream can end were taken: a window boundary followed by end_stream (an
        # empty span in the record), or a last window that is full (or flushed short). Held ("ahead"), the
        # decoder has still taken the first window before the end of stream was known.
        ends = window_ends(chunking, n)
        expect_empty = n in ends and (mode == "paced" or n == min(ends))
        assert windows[-1][3] and (windows[-1][0] == windows[-1][2]) == expect_empty, windows
        if policy != "sliding49" and n >= 35 and mode == "paced":
            assert_first_audio_after_4_frames(chunks, windows)
    assert settled(rt) == ZERO_LIVE


def test_concurrent_requests_share_decoder_calls(serve, snac):
    node = Recorder(snac, LAYOUT, max_batch=4)
    model = Speech(node, SnacStreamNode.exact_policy(snac, LAYOUT))
    rt = serve(model)
    node.go.clear()
    tokens = [audio_tokens(20 * 7, seed=10 + i) for i in range(4)]
    handles = [rt.submit({"tokens": t}) for t in tokens]
    # Let every LM loop finish first: then windows of all four wait for the decoder together.
    assert wait_until(lambda: model.submodules["lm"].finished == 4, timeout=T)
    node.go.set()
    for h, t in zip(handles, tokens):
        audio = np.concatenate(h.result(timeout=T)["audio"])
        want = decode_one_shot(snac, LAYOUT, t)
        assert audio.shape == want.shape and np.abs(audio - want).max() < TOL
    assert max(node.decode_batch_sizes) == 4, node.decode_batch_sizes
    assert settled(rt) == ZERO_LIVE


# ---- invalid tokens -----------------------------------------------------------------------------

def test_invalid_tokens_drop_whole_frames_and_keep_the_alignment(serve, snac):
    frames, left, right = 30, 3, 3
    codes = random_codes(frames, seed=42)
    tokens = tokens_of(codes)
    dropped = {5: (3, LAYOUT.token_of(7, 4)),  # a code of the next slot
               6: (0, 128000),  # a text token
               20: (6, LAYOUT.audio_base + 7 * 64)}  # past the last slot's range
    for f, (slot, bad) in dropped.items():
        tokens[7 * f + slot] = bad
    # a partial frame, the end of speech, then tokens that must be ignored (valid or not)
    tail = tokens_of(random_codes(1, seed=43), start=len(tokens))[:3]
    junk = tokens_of(random_codes(2, seed=44), start=len(tokens) + 4) + [5, 128000]
    tokens += tail + [LAYOUT.end_token] + junk

    kept = [f for f in range(frames) if f not in dropped]
    want = decode_one_shot(snac, LAYOUT, tokens)
    level = [torch.from_numpy(codes[kept][:, list(s)].reshape(1, -1)) for s in LAYOUT.level_slots]
    independent = snac.decode(level, noise=False)[0, 0].numpy()
    assert want.shape == independent.shape == (len(kept) * SPF,)
    assert np.abs(want - independent).max() < TOL  # one-shot = the valid frames, realigned

    rt = serve(Speech(Recorder(snac, LAYOUT), SnacStreamNode.exact_policy(snac, LAYOUT)))
    chunks, state, _ = served(rt, tokens)
    audio = np.concatenate(chunks)
    assert audio.shape == want.shape
    near_gap = [any(g in dropped for g in range(f - left, f + right + 1)) for f in kept]
    errors = [np.abs(audio[j * SPF:(j + 1) * SPF] - want[j * SPF:(j + 1) * SPF]).max()
              for j in range(len(kept))]
    exact = [e for e, near in zip(errors, near_gap) if not near]
    assert len(exact) == 15 and max(exact) < TOL  # the guarantee
    assert max(e for e, near in zip(errors, near_gap) if near) > TOL  # the documented limit
    assert counters(state) == dict(frames_emitted=len(kept), invalid_frames=3,
                                   incomplete_frames=1, short_context_frames=sum(near_gap))
    assert settled(rt) == ZERO_LIVE


def test_positional_noise_streams_exactly_across_a_dropped_frame(snac):
    """Noise drawn by absolute (valid-frame) position, not by window, keeps streaming exact."""
    noise = PositionalNoise(seed=3)
    tokens = tokens_of(random_codes(24, seed=5))
    tokens[7 * 12 + 2] = 5  # drops frame 12: later windows start at shifted valid-frame offsets
    want = decode_one_shot(snac, LAYOUT, tokens, noise=noise)
    assert np.abs(want - decode_one_shot(snac, LAYOUT, tokens)).max() > 1e-4  # noise matters
    node = SnacStreamNode(snac, LAYOUT, noise=noise)
    for policy in (SnacStreamNode.exact_policy(snac, LAYOUT), ORPHEUS, Fixed(7)):
        audio = np.concatenate(direct(node, tokens, policy)[0])
        assert audio.shape == want.shape == (23 * SPF,)
        for j, f in enumerate(f for f in range(24) if f != 12):
            if abs(f - 12) > 3:
                assert np.abs(audio[j * SPF:(j + 1) * SPF]
                              - want[j * SPF:(j + 1) * SPF]).max() < TOL, (policy, f)


def test_token_layout():
    lay = AudioTokenLayout()  # Orpheus
    assert lay.frame_size == 7 and lay.level_slots == ((0,), (1, 4), (2, 3, 5, 6))
    assert lay.token_of(0, 0) == 128266 and lay.token_of(4095, 13) == 128266 + 6 * 4096 + 4095
    for p in range(14):
        for code in (0, 1, 4095):
            assert lay.code_of(lay.token_of(code, p), p) == code
            assert lay.code_of(lay.token_of(code, p), p + 1) is None  # wrong slot
    assert lay.code_of(lay.end_token, 0) is None and lay.code_of(128265, 0) is None
    parsed = lay.frames([lay.token_of(1, p) for p in range(3, 24)], start_position=3)
    assert (parsed.first, len(parsed)) == (1, 2)  # positions 3..6 are a partial frame
    assert lay.frames([lay.token_of(1, p) for p in range(9)] + [lay.end_token]).stop == 1
    with pytest.raises(ValueError, match="end_token"):
        AudioTokenLayout(end_token=128266 + 5)

"""Streamed speech decoding with carried context: SnacStreamNode keeps the context short windows
lack, so every chunk policy -- Orpheus' SlidingWindow(28, 7), Fixed(7), Ramp, ... -- streams
exactly what one decode of the whole sequence gives, at every stream length and window
alignment, across invalid frames and end tokens, at full SNAC width too. What it keeps is
bounded, and committed only when a decode succeeds: a failed decode (alone or in a batch) is
retried from the same context."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from mstar_rt import Fixed, LeftContext, Ramp, SlidingWindow, StreamChunk  # noqa: E402
from mstar_rt.model import RequestContext, WorkContext  # noqa: E402
from mstar_rt.models.snac import SnacConfig, SnacDecoder  # noqa: E402
from mstar_rt.models.snac_stream import _CURSOR, SnacStreamNode, decode_one_shot  # noqa: E402

from snac_streams import (LAYOUT, ORPHEUS, SMALL, SPF, TOL, T, Recorder, Speech,  # noqa: E402
                          assert_first_audio_after_4_frames, audio_tokens, counters, direct,
                          random_codes, random_snac, served, tokens_of)
from walk_models import ZERO_LIVE, settled, wait_until  # noqa: E402


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conftest.py


@pytest.fixture(scope="module")
def snac():
    return random_snac(SMALL)


@pytest.fixture(scope="module")
def full():
    """The 24 kHz SNAC decoder at full width (random weights)."""
    return random_snac(SnacConfig(codebook_size=64))


# ---- carried context: any policy is exact -------------------------------------------------------

CARRY_POLICIES = [ORPHEUS, Fixed(7), SlidingWindow(14, 7), LeftContext(7, 7),
                  Ramp([3, 11], 7, context=5)]


def frame_errors(audio: np.ndarray, want: np.ndarray) -> list[float]:
    return [float(np.abs(audio[j * SPF:(j + 1) * SPF] - want[j * SPF:(j + 1) * SPF]).max())
            for j in range(len(want) // SPF)]


def assert_streams_exactly(node: SnacStreamNode, tokens, policy) -> None:
    """Both pacings of ``tokens`` through ``node``: every valid frame whose context (3 frames each
    side, by position) holds no dropped frame equals one-shot decoding, first and last included;
    the counters add up, and only frames near a gap may be short of context."""
    want = decode_one_shot(node.decoder, LAYOUT, tokens)
    parsed = LAYOUT.frames(tokens)
    kept = np.flatnonzero(parsed.valid)
    dropped = set(np.flatnonzero(~parsed.valid).tolist())
    near = [any(g in dropped for g in range(f - 3, f + 4)) for f in kept]
    end = LAYOUT.end_position(tokens)
    stop = len(tokens) if end is None else end
    for paced in (True, False):
        chunks, state = direct(node, tokens, policy, paced)
        audio = np.concatenate(chunks)
        assert audio.shape == want.shape, (policy, len(tokens), paced)
        errors = frame_errors(audio, want)
        assert max((e for e, n in zip(errors, near) if not n), default=0) < TOL, (
            policy, len(tokens), paced, errors)
        got = counters(state)
        assert got["short_context_frames"] <= sum(near), (policy, len(tokens), paced, got)
        assert got == dict(frames_emitted=len(kept), invalid_frames=len(dropped),
                           incomplete_frames=int(stop % 7 != 0),
                           short_context_frames=got["short_context_frames"])
        assert state[_CURSOR].chunk is None  # nothing is kept once the stream is flushed


@pytest.mark.parametrize("policy", CARRY_POLICIES, ids=str)
def test_carried_context_makes_every_policy_exact(snac, policy):
    """Every stream length residue against every window alignment (12 frames cover windows of up
    to 4 frames at strides of 7), and two long streams."""
    SnacStreamNode.check_policy(snac, policy, LAYOUT)  # carrying context: any policy passes
    node = SnacStreamNode(snac, LAYOUT)
    for n in [*range(1, 85), 33 * 7 + 4, 301]:
        assert_streams_exactly(node, audio_tokens(n, seed=n), policy)


@pytest.mark.parametrize("policy", CARRY_POLICIES, ids=str)
def test_carried_context_with_invalid_frames_and_end_tokens(snac, policy):
    node = SnacStreamNode(snac, LAYOUT)
    base = tokens_of(random_codes(16, seed=21))
    junk = tokens_of(random_codes(2, seed=22)) + [5, 128000]
    # The end of speech at every position of the first 6 frames: inside the first window, at a
    # window's end, just after it, mid-frame; and what follows it is ignored.
    for p in range(44):
        assert_streams_exactly(node, base[:p] + [LAYOUT.end_token] + junk, policy)
    for gaps in ((0,), (7,), (15,), (0, 7, 8, 15), (3, 14)):  # edges, middle, adjacent
        tokens = list(base)
        for f in gaps:
            tokens[7 * f + f % 7] = 128000  # a text token: the frame is dropped
        assert_streams_exactly(node, tokens, policy)
        assert_streams_exactly(node, tokens + base[:3], policy)  # and a partial frame
        assert_streams_exactly(node, tokens[:7 * 11 + 2] + [LAYOUT.end_token], policy)


def test_full_size_snac_streams_exactly_under_orpheus_window(serve, full):
    assert full.receptive_field_frames() == (3, 3)
    rt = serve(Speech(Recorder(full, LAYOUT), ORPHEUS))
    for i, n in enumerate([20, 70, 76]):
        tokens = audio_tokens(n, seed=200 + i)
        chunks, state, windows = served(rt, tokens, "paced")
        audio, want = np.concatenate(chunks), decode_one_shot(full, LAYOUT, tokens)
        assert audio.shape == want.shape == (n // 7 * SPF,)
        assert np.abs(audio - want).max() < TOL, (n, np.abs(audio - want).max())
        assert np.allclose(audio[:SPF], want[:SPF], atol=TOL, rtol=0)
        assert np.allclose(audio[-SPF:], want[-SPF:], atol=TOL, rtol=0)
        assert counters(state) == dict(frames_emitted=n // 7, invalid_frames=0,
                                       incomplete_frames=int(n % 7 != 0), short_context_frames=0)
        if n >= 35:
            assert_first_audio_after_4_frames(chunks, windows)
    assert settled(rt) == ZERO_LIVE


class Silent:
    """A decoder of the 24 kHz SNAC's receptive field that makes no sound: for bookkeeping."""

    samples_per_frame = 4

    def receptive_field_frames(self) -> tuple[int, int]:
        return 3, 3

    def decode(self, codes):
        return torch.zeros(codes[0].shape[0], 1, codes[0].shape[1] * self.samples_per_frame)


@pytest.mark.parametrize("policy", [ORPHEUS, Fixed(1), Fixed(7), LeftContext(42, 7),
                                    SlidingWindow(100, 3)], ids=str)
def test_carried_context_is_bounded(policy):
    """The node keeps at most the last 3 + 3 frames and a partial one, however long the stream
    and whatever the window size; nothing once the stream is flushed."""
    held = []

    def watch(state) -> None:
        window = state[_CURSOR].chunk
        held.append(0 if window is None else len(window.items))

    node = SnacStreamNode(Silent(), LAYOUT)
    _, state = direct(node, audio_tokens(1000, seed=1), policy, watch=watch)
    assert 6 * 7 <= max(held) <= (3 + 3 + 1) * 7, max(held)
    assert held[-1] == 0 and state["frames_emitted"] == 1000 // 7


class Flaky:
    """The decoder, failing once -- as an out-of-memory error would -- at its ``fail_at``-th call
    of at least ``rows`` rows."""

    def __init__(self, inner: SnacDecoder, fail_at: int, rows: int = 1) -> None:
        self.inner, self.fail_at, self.rows = inner, fail_at, rows
        self.calls, self.failed = 0, False
        self.samples_per_frame = inner.config.samples_per_coarse_frame

    def receptive_field_frames(self) -> tuple[int, int]:
        return self.inner.receptive_field_frames()

    def decode(self, codes):
        self.calls += codes[0].shape[0] >= self.rows
        if self.calls == self.fail_at and not self.failed:
            self.failed = True
            raise RuntimeError("the decoder failed")
        return self.inner.decode(codes, noise=False)


def test_a_failed_decode_commits_no_context(snac):
    """Fixed(7) windows hold no context: what the node kept must survive a failed decode, and
    the retried window must decode from the same cursor."""
    node = SnacStreamNode(Flaky(snac, fail_at=3), LAYOUT)
    tokens = audio_tokens(80, seed=8)
    ctx = WorkContext(RequestContext(1, {}), 0)
    spans = [(b, min(b + 7, 80), b + 7 >= 80) for b in range(0, 80, 7)]
    chunks, failures = [], 0
    for b, e, last in spans:
        window = {"token": StreamChunk(tokens[b:e], b, b, e, last)}
        before = dict(ctx.request.state)
        try:
            chunks.append(node.forward([node.prepare_inputs(ctx, window)])[0]["audio"])
        except RuntimeError:
            failures += 1
            assert ctx.request.state == before and ctx.request.state[_CURSOR] is before[_CURSOR]
            chunks.append(node.forward([node.prepare_inputs(ctx, window)])[0]["audio"])
    assert failures == 1 and node.decoder.failed
    audio, want = np.concatenate(chunks), decode_one_shot(snac, LAYOUT, tokens)
    assert audio.shape == want.shape and np.abs(audio - want).max() < TOL
    assert counters(ctx.request.state)["short_context_frames"] == 0


def test_a_failed_batch_is_retried_from_the_same_context(serve, snac):
    """Through the Runtime: a decoder call holding two requests' windows fails; the engine
    retries each alone, and both streams stay exact."""
    node = Recorder(Flaky(snac, fail_at=1, rows=2), LAYOUT, max_batch=2)
    model = Speech(node, Fixed(7))
    rt = serve(model)
    node.go.clear()
    tokens = [audio_tokens(12 * 7 + 3, seed=30 + i) for i in range(2)]
    handles = [rt.submit({"tokens": t}) for t in tokens]
    assert wait_until(lambda: model.submodules["lm"].finished == 2, timeout=T)
    node.go.set()
    for h, t in zip(handles, tokens):
        audio = np.concatenate(h.result(timeout=T)["audio"])
        want = decode_one_shot(snac, LAYOUT, t)
        assert audio.shape == want.shape and np.abs(audio - want).max() < TOL
        assert counters(h.context.state)["short_context_frames"] == 0
    assert node.decoder.failed and 1 in node.decode_batch_sizes
    assert settled(rt) == ZERO_LIVE

"""Streamed speech decoding without carried context: chunk policies too small to be exact are
refused, naming the smallest window that is, and the refusal agrees with streaming (every
accepted policy streams exactly, every refused one does not); Orpheus' own window is inexact for
the full SNAC's receptive field without carried context. A causal decoder streams exactly under
LeftContext, with no lookahead delay."""

import itertools

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import mstar_rt  # noqa: E402
from mstar_rt import LeftContext, SlidingWindow  # noqa: E402
from mstar_rt.models.snac import SnacConfig  # noqa: E402
from mstar_rt.models.snac_stream import SnacStreamNode, decode_one_shot  # noqa: E402

from snac_streams import (LAYOUT, ORPHEUS, SMALL, SPF, TOL, Recorder, Speech,  # noqa: E402
                          audio_tokens, causal_decoder, counters, direct, direct_decode,
                          random_codes, random_snac, served, tokens_of)
from walk_models import ZERO_LIVE, settled  # noqa: E402


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conftest.py


@pytest.fixture(scope="module")
def snac():
    return random_snac(SMALL)


@pytest.fixture(scope="module")
def full():
    """The 24 kHz SNAC decoder at full width (random weights)."""
    return random_snac(SnacConfig(codebook_size=64))


@pytest.fixture(scope="module")
def causal():
    return causal_decoder()


# ---- without carried context: policies too small ----------------------------------------------

def test_check_policy_names_the_minimum_window(snac):
    for ok in (SnacStreamNode.exact_policy(snac, LAYOUT), SlidingWindow(49, 7),
               SlidingWindow(56, 14), LeftContext(42, 14), mstar_rt.Ramp([7, 14], 7, context=42)):
        SnacStreamNode.check_policy(snac, ok, LAYOUT, carry_context=False)
    with pytest.raises(ValueError, match=r"SlidingWindow\(28, 7\).*at least 49 tokens \(7 "
                                         r"frames\).*LeftContext\(42, 7\)"):
        SnacStreamNode.check_policy(snac, SlidingWindow(28, 7), LAYOUT, carry_context=False)
    bad = (SlidingWindow(48, 7), SlidingWindow(49, 14), LeftContext(35, 7), mstar_rt.Fixed(7),
           SlidingWindow(50, 3), SlidingWindow(28, 7))
    for policy in bad:
        with pytest.raises(ValueError, match="49 tokens"):
            SnacStreamNode.check_policy(snac, policy, LAYOUT, carry_context=False)
        SnacStreamNode.check_policy(snac, policy, LAYOUT)  # the node carries what they lack


def test_check_policy_agrees_with_streaming(causal):
    """Without carried context, every accepted policy streams exactly at every length; every
    refused one does not at some length (it loses frames or decodes them with too little
    context). With it, all of them do."""
    node = SnacStreamNode(causal, LAYOUT, carry_context=False)
    carrying = SnacStreamNode(causal, LAYOUT)
    want = {}
    for policy in (LeftContext(14, 7), LeftContext(14, 21), SlidingWindow(21, 7),
                   SlidingWindow(35, 14), mstar_rt.Ramp([7], 14, context=14),
                   LeftContext(7, 7), SlidingWindow(14, 7), SlidingWindow(28, 14),
                   LeftContext(13, 7), mstar_rt.Fixed(7), LeftContext(14, 5)):
        try:
            SnacStreamNode.check_policy(causal, policy, LAYOUT, carry_context=False)
            accepted = True
        except ValueError:
            accepted = False
        exact_everywhere = True
        for n, paced in itertools.product(range(1, 50), (True, False)):
            tokens = audio_tokens(n, seed=n)
            if n not in want:
                want[n] = decode_one_shot(causal, LAYOUT, tokens)
            try:
                audio = np.concatenate(direct(node, tokens, policy, paced)[0])
            except ValueError:  # frames left the window undecoded
                exact_everywhere = False
                break
            if audio.shape != want[n].shape or np.abs(audio - want[n]).max(initial=0) > TOL:
                exact_everywhere = False
                break
        assert accepted == exact_everywhere, policy
        for n, paced in itertools.product(range(1, 50, 3), (True, False)):
            audio = np.concatenate(direct(carrying, audio_tokens(n, seed=n), policy, paced)[0])
            assert audio.shape == want[n].shape, (policy, n)
            assert np.abs(audio - want[n]).max(initial=0) < TOL, (policy, n)


def test_orpheus_window_is_not_exact_for_the_full_receptive_field(full):
    """Orpheus decodes each 4-frame window and keeps its second frame (samples 2048:4096): one
    frame of context before it, two after, where the 24 kHz SNAC needs three and three. The node
    without carried context is as inexact under that window (and says so); carrying context, it
    is exact."""
    assert full.receptive_field_frames() == (3, 3)
    frames = 8
    codes = random_codes(frames, seed=7)
    tokens = tokens_of(codes)
    want = decode_one_shot(full, LAYOUT, tokens)
    errors = []
    for i in range(frames - 3):
        window = np.concatenate(direct_decode(full, codes[i:i + 4]))
        errors.append(np.abs(window[SPF:2 * SPF] - want[(i + 1) * SPF:(i + 2) * SPF]).max())
    assert max(errors) > 1e-3, errors  # audible-scale seams at chunk boundaries
    node = SnacStreamNode(full, LAYOUT, carry_context=False)
    audio = np.concatenate(direct(node, tokens, SnacStreamNode.exact_policy(full, LAYOUT))[0])
    assert audio.shape == want.shape and np.abs(audio - want).max() < TOL
    sliding, state = direct(node, tokens, ORPHEUS)  # windows only, under Orpheus' policy
    assert np.abs(np.concatenate(sliding) - want).max() > 1e-3
    assert state["short_context_frames"] > 0  # and the node says so
    carried, state = direct(SnacStreamNode(full, LAYOUT), tokens, ORPHEUS)
    assert np.abs(np.concatenate(carried) - want).max() < TOL
    assert state["short_context_frames"] == 0


def test_frames_that_would_be_lost_fail_loudly(snac):
    node = SnacStreamNode(snac, LAYOUT, carry_context=False)
    with pytest.raises(ValueError, match="left the stream"):
        direct(node, audio_tokens(70, seed=1), mstar_rt.Fixed(7))


# ---- a causal decoder under LeftContext --------------------------------------------------------

def test_causal_decoder_receptive_field_is_exact(causal):
    left, right = causal.receptive_field_frames()
    assert (left, right) == (2, 0)
    f, frames = 8, 14
    codes = random_codes(frames, seed=3)
    base = direct_decode(causal, codes)[0][f * 64:(f + 1) * 64]
    changed = set()
    for g in range(frames):
        for slot in range(7):
            moved = codes.copy()
            moved[g, slot] = (moved[g, slot] + 1) % 64
            if not np.array_equal(direct_decode(causal, moved)[0][f * 64:(f + 1) * 64], base):
                changed.add(g)
    assert changed == set(range(f - left, f + 1))


def test_causal_decoder_streams_exactly_under_left_context(serve, causal):
    policy = LeftContext(14, 7)
    assert str(SnacStreamNode.exact_policy(causal, LAYOUT)) == "LeftContext(14, 7)"
    node = Recorder(causal, LAYOUT)
    rt = serve(Speech(node, policy))
    for i, (n, mode) in enumerate(itertools.product([5, 7, 30, 71, 140], ["paced", "ahead"])):
        tokens = audio_tokens(n, seed=100 + i)
        chunks, state, _ = served(rt, tokens, mode)
        audio, want = np.concatenate(chunks), decode_one_shot(causal, LAYOUT, tokens)
        assert audio.shape == want.shape == (n // 7 * 64,)
        assert np.abs(audio - want).max(initial=0) < TOL
        if mode == "paced":  # no lookahead delay: each frame as soon as its tokens are in
            assert [len(c) for c in chunks[:n // 7]] == [64] * (n // 7)
        assert counters(state)["short_context_frames"] == 0
    with pytest.raises(ValueError, match=r"at least 21 tokens.*LeftContext\(14, 7\)"):
        SnacStreamNode.check_policy(causal, LeftContext(7, 7), LAYOUT, carry_context=False)
    tokens = audio_tokens(140, seed=9)
    windows_only = SnacStreamNode(causal, LAYOUT, carry_context=False)
    short = np.concatenate(direct(windows_only, tokens, LeftContext(7, 7))[0])
    assert np.abs(short - decode_one_shot(causal, LAYOUT, tokens)).max() > 1e-3
    assert settled(rt) == ZERO_LIVE

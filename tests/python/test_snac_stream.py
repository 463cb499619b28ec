"""Conformance of streamed speech decoding: audio tokens streamed one per LM step through the
Runtime into SnacStreamNode add up to one decode of the whole sequence, sample for sample --
first and last frames included -- under the exact policies; invalid frames are dropped without
shifting the frame alignment; policies too small to be exact are refused (and shown to be
inexact); a causal decoder streams exactly under LeftContext. The guard against the
chunk-boundary bug."""

import itertools
import threading

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import mstar_rt  # noqa: E402
from mstar_rt import (EMIT, DynamicLoop, GraphEdge, GraphNode, LeftContext, Model,  # noqa: E402
                      NodeSubmodule, Parallel, SlidingWindow, StreamingGraphEdge, StreamWindow)
from mstar_rt.model import RequestContext, WorkContext  # noqa: E402
from mstar_rt.models.causal_codec import CausalConvDecoder  # noqa: E402
from mstar_rt.models.snac import PositionalNoise, SnacConfig, SnacDecoder  # noqa: E402
from mstar_rt.models.snac_stream import (AudioTokenLayout, SnacStreamNode,  # noqa: E402
                                         decode_one_shot)

from walk_models import ZERO_LIVE, settled, wait_until  # noqa: E402

TOL = 1e-5
T = 30.0  # seconds: the longest any single wait in this file may take
LAYOUT = AudioTokenLayout(codebook_size=64)  # Orpheus' token ids, a 64-code codebook
SPF = 2048  # samples per frame at 24 kHz
# Small widths, the 24 kHz model's rates and strides: the real (3, 3) receptive field.
SMALL = SnacConfig(latent_dim=16, decoder_dim=32, codebook_size=64, codebook_dim=8)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """These convolutions are tiny; on a busy 2-core machine extra threads only spin."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def random_snac(config: SnacConfig) -> SnacDecoder:
    torch.manual_seed(0)
    model = SnacDecoder(config).eval()
    with torch.no_grad():  # trained Snake alphas are not all 1: make them matter
        for name, p in model.named_parameters():
            if name.endswith("alpha"):
                p.uniform_(0.5, 2.0)
    return model.fold_weight_norm()


@pytest.fixture(scope="module")
def snac():
    return random_snac(SMALL)


@pytest.fixture(scope="module")
def causal():
    torch.manual_seed(0)
    return CausalConvDecoder(codebook_size=64).eval()


def random_codes(frames: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 64, (frames, LAYOUT.frame_size))


def tokens_of(codes: np.ndarray, start: int = 0) -> list[int]:
    return [LAYOUT.token_of(int(c), start + p) for p, c in enumerate(codes.reshape(-1))]


def audio_tokens(n: int, seed: int) -> list[int]:
    return tokens_of(random_codes(-(-n // 7), seed))[:n]


# ---- the model: a replaying "LM" streaming into the decoder node -------------------------------

class Replay(NodeSubmodule):
    """The speech LM stand-in: emits the request's tokens, one per DynamicLoop iteration.
    ``before_last(request_id, position)`` runs before the last token is emitted."""

    max_batch = 8

    def __init__(self) -> None:
        self.finished = 0
        self.before_last = None

    def prepare_inputs(self, ctx, inputs):
        return inputs["tokens"], ctx.iteration, ctx.request.id

    def forward(self, batch):
        for tokens, i, rid in batch:
            if i + 1 == len(tokens) and self.before_last is not None:
                self.before_last(rid, i)
        return [{"token": int(tokens[i])} for tokens, i, _ in batch]

    def check_stop(self, batch, outputs):
        stops = [("speak",) if i + 1 >= len(tokens) else () for tokens, i, _ in batch]
        self.finished += sum(1 for s in stops if s)
        return stops


class Recorder(SnacStreamNode):
    """The node under test, instrumented: it decodes only while ``go`` is set, and records every
    window it decoded as (request id, begin, new_begin, end, last)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.go = threading.Event()
        self.go.set()
        self.windows: list[tuple] = []

    def prepare_inputs(self, ctx, inputs):
        w = inputs["token"]
        return super().prepare_inputs(ctx, inputs), (ctx.request.id, w.begin, w.new_begin, w.end,
                                                     w.last)

    def forward(self, batch):
        if not self.go.wait(T):
            raise TimeoutError("the test never let the decoder run")
        out = super().forward([work for work, _ in batch])
        self.windows += [tag for _, tag in batch]
        return out

    def decoded_through(self, rid: int) -> int:
        return max((w[3] for w in self.windows if w[0] == rid), default=0)


class Speech(Model):
    inputs = ("tokens",)

    def __init__(self, codec: SnacStreamNode, policy) -> None:
        self.nodes = [GraphNode("lm", ["tokens"], [StreamingGraphEdge("codec", "token", policy)]),
                      GraphNode("codec", ["token"], [GraphEdge(EMIT, "audio")])]
        self.walks = {"speak": Parallel(DynamicLoop("lm", 1024, name="speak"), "codec")}
        self.submodules = {"lm": Replay(), "codec": codec}
        self.engines = {"lm": "lm", "codec": "codec"}


def window_ends(policy, limit: int) -> set[int]:
    ends, end = set(), 0
    while end <= limit:
        end += policy.new_size(len(ends))
        ends.add(end)
    return ends


def served(rt, tokens, mode="free"):
    """Streams ``tokens`` through the runtime; returns (chunks, request state). ``mode``:
    "paced" -- the decoder has finished every window before the last token comes, so a stream
    ending on a window boundary ends with the explicit empty last window; "ahead" -- the LM
    finishes before the decoder starts, so the last window is full and marked last."""
    model, codec = rt.model, rt.model.submodules["codec"]
    lm = model.submodules["lm"]
    lm.before_last = None
    if mode == "paced":
        def before_last(rid, i):
            need = max((e for e in window_ends(model.nodes[0].outputs[0].chunk_policy, i)
                        if e <= i), default=0)
            assert wait_until(lambda: codec.decoded_through(rid) >= need
                              and rt.live["inflight"] == 1, timeout=T)
        lm.before_last = before_last
    elif mode == "ahead":
        codec.go.clear()
    finished = lm.finished
    h = rt.submit({"tokens": list(tokens)})
    if mode == "ahead":
        assert wait_until(lambda: lm.finished > finished, timeout=T)
        codec.go.set()
    chunks = h.result(timeout=T)["audio"]
    for c in chunks:
        assert isinstance(c, np.ndarray) and c.dtype == np.float32 and c.ndim == 1
    return chunks, h.context.state, [w[1:] for w in codec.windows if w[0] == h.id]


def counters(state) -> dict:
    return {k: state.get(k, 0) for k in ("frames_emitted", "invalid_frames",
                                         "incomplete_frames", "short_context_frames")}


def direct(node: SnacStreamNode, tokens, policy, paced: bool = True):
    """The node driven without a runtime, over the windows the C++ chunk cursor makes. Paced:
    windows are taken as soon as they are ready (a stream ending on a window boundary then ends
    with an empty last window, as the runtime sends it); else only after the end of stream."""
    n = len(tokens)
    buf = mstar_rt.StreamBuffer(np.int64, 1 << (n + policy.max_window).bit_length(), policy)
    spans = []

    def drain():
        while True:
            try:
                c = buf.next_chunk(timeout=0)
            except TimeoutError:
                return
            if c is None:
                return
            spans.append((c.begin, c.new_begin, c.end, c.last))
            c.release()

    for p in range(n) if paced else ():
        buf.push(np.asarray(tokens[p:p + 1], dtype=np.int64))
        drain()
    if not paced:
        buf.push(np.asarray(tokens, dtype=np.int64))
    buf.close()
    drain()
    if not spans[-1][3]:
        spans.append((n, n, n, True))
    ctx = WorkContext(RequestContext(1, {}), 0)
    chunks = []
    for b, nb, e, last in spans:
        work = node.prepare_inputs(ctx, {"token": StreamWindow(list(tokens[b:e]), b, nb, e, last)})
        chunks.append(node.forward([work])[0]["audio"])
    return chunks, ctx.request.state


# ---- 1. streamed == one shot ------------------------------------------------------------------

# tokens: shorter than the first window (flushed whole), frame boundary, mid-frame, long
LENGTHS = [3, 7, 15, 21, 69, 70, 73, 33 * 7 + 4]


@pytest.mark.parametrize("mode", ["paced", "ahead"])
@pytest.mark.parametrize("policy", ["exact", "SlidingWindow(49,7)"])
def test_streamed_audio_equals_one_shot_decoding(serve, snac, policy, mode):
    assert snac.receptive_field_frames() == (3, 3)
    assert str(SnacStreamNode.exact_policy(snac, LAYOUT)) == "LeftContext(42, 7)"
    chunking = (SnacStreamNode.exact_policy(snac, LAYOUT) if policy == "exact"
                else SlidingWindow(49, 7))
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
        # Both ways a stream can end were taken: a window boundary followed by the explicit empty
        # last window, or a last window that is full (or flushed short). Held ("ahead"), the
        # decoder has still taken the first window before the end of stream was known.
        ends = window_ends(chunking, n)
        expect_empty = n in ends and (mode == "paced" or n == min(ends))
        assert windows[-1][3] and (windows[-1][0] == windows[-1][2]) == expect_empty, windows
        if policy == "exact" and n >= 28 and mode == "paced":  # a frame per 7 tokens after 4
            sizes = [len(c) // SPF for c in chunks]
            assert sizes[:3] == [0, 0, 0] and set(sizes[3:-1]) == {1}, sizes
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


# ---- 2. invalid tokens --------------------------------------------------------------------------

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
    audio = np.concatenate(direct(node, tokens, SnacStreamNode.exact_policy(snac, LAYOUT))[0])
    assert audio.shape == want.shape == (23 * SPF,)
    for j, f in enumerate(f for f in range(24) if f != 12):
        if abs(f - 12) > 3:
            assert np.abs(audio[j * SPF:(j + 1) * SPF] - want[j * SPF:(j + 1) * SPF]).max() < TOL


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


# ---- 3. policies too small ----------------------------------------------------------------------

def test_check_policy_names_the_minimum_window(snac):
    for ok in (SnacStreamNode.exact_policy(snac, LAYOUT), SlidingWindow(49, 7),
               SlidingWindow(56, 14), LeftContext(42, 14), mstar_rt.Ramp([7, 14], 7, context=42)):
        SnacStreamNode.check_policy(snac, ok, LAYOUT)
    with pytest.raises(ValueError, match=r"SlidingWindow\(28, 7\).*at least 49 tokens \(7 "
                                         r"frames\).*LeftContext\(42, 7\)"):
        SnacStreamNode.check_policy(snac, SlidingWindow(28, 7), LAYOUT)
    for bad in (SlidingWindow(48, 7), SlidingWindow(49, 14), LeftContext(35, 7),
                mstar_rt.Fixed(7), SlidingWindow(50, 3)):
        with pytest.raises(ValueError, match="49 tokens"):
            SnacStreamNode.check_policy(snac, bad, LAYOUT)


def test_check_policy_agrees_with_streaming(causal):
    """Every accepted policy streams exactly at every length; every refused one does not at some
    length (it loses frames or decodes them with too little context)."""
    node = SnacStreamNode(causal, LAYOUT)
    want = {}
    for policy in (LeftContext(14, 7), LeftContext(14, 21), SlidingWindow(21, 7),
                   SlidingWindow(35, 14), mstar_rt.Ramp([7], 14, context=14),
                   LeftContext(7, 7), SlidingWindow(14, 7), SlidingWindow(28, 14),
                   LeftContext(13, 7), mstar_rt.Fixed(7), LeftContext(14, 5)):
        try:
            SnacStreamNode.check_policy(causal, policy, LAYOUT)
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


def test_orpheus_window_is_not_exact_for_the_full_receptive_field():
    """Orpheus decodes each 4-frame window and keeps its second frame (samples 2048:4096): one
    frame of context before it, two after, where the 24 kHz SNAC needs three and three."""
    full = random_snac(SnacConfig(codebook_size=64))
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
    node = SnacStreamNode(full, LAYOUT)
    audio = np.concatenate(direct(node, tokens, SnacStreamNode.exact_policy(full, LAYOUT))[0])
    assert audio.shape == want.shape and np.abs(audio - want).max() < TOL
    sliding, state = direct(node, tokens, SlidingWindow(28, 7))  # ours under Orpheus' policy
    assert np.abs(np.concatenate(sliding) - want).max() > 1e-3
    assert state["short_context_frames"] > 0  # and the node says so


def direct_decode(decoder, codes: np.ndarray) -> list[np.ndarray]:
    """One decode of ``codes`` [frames, 7] by the decoder itself (no stream node)."""
    level = [torch.from_numpy(codes[:, list(s)].reshape(1, -1)) for s in LAYOUT.level_slots]
    kw = dict(noise=False) if isinstance(decoder, SnacDecoder) else {}
    return [decoder.decode(level, **kw)[0, 0].numpy()]


def test_frames_that_would_be_lost_fail_loudly(snac):
    node = SnacStreamNode(snac, LAYOUT)
    with pytest.raises(ValueError, match="left the stream"):
        direct(node, audio_tokens(70, seed=1), mstar_rt.Fixed(7))


# ---- 4. a causal decoder under LeftContext -----------------------------------------------------

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
        SnacStreamNode.check_policy(causal, LeftContext(7, 7), LAYOUT)
    tokens = audio_tokens(140, seed=9)
    short = np.concatenate(direct(node, tokens, LeftContext(7, 7))[0])
    assert np.abs(short - decode_one_shot(causal, LAYOUT, tokens)).max() > 1e-3
    assert settled(rt) == ZERO_LIVE

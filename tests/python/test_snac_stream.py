"""Conformance of streamed speech decoding: audio tokens streamed one per LM step through the
Runtime into SnacStreamNode add up to one decode of the whole sequence, sample for sample --
first and last frames included -- under every chunk policy, Orpheus' SlidingWindow(28, 7)
included, because the node carries the context short windows lack (bounded, committed only when
a decode succeeds); invalid frames are dropped without shifting the frame alignment. Without
carried context, policies too small to be exact are refused (and shown to be inexact); a causal
decoder streams exactly under LeftContext. The guard against the chunk-boundary bug."""

import itertools
import threading

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import mstar_rt  # noqa: E402
from mstar_rt import (EMIT, DynamicLoop, Fixed, GraphEdge, GraphNode, LeftContext,  # noqa: E402
                      Model, NodeSubmodule, Parallel, Ramp, SlidingWindow, StreamingGraphEdge,
                      StreamChunk)
from mstar_rt.model import RequestContext, WorkContext  # noqa: E402
from mstar_rt.models.causal_codec import CausalConvDecoder  # noqa: E402
from mstar_rt.models.snac import PositionalNoise, SnacConfig, SnacDecoder  # noqa: E402
from mstar_rt.models.snac_stream import (_CURSOR, AudioTokenLayout, SnacStreamNode,  # noqa: E402
                                         decode_one_shot)

from walk_models import ZERO_LIVE, settled, wait_until  # noqa: E402

TOL = 1e-5
T = 30.0  # seconds: the longest any single wait in this file may take
LAYOUT = AudioTokenLayout(codebook_size=64)  # Orpheus' token ids, a 64-code codebook
SPF = 2048  # samples per frame at 24 kHz
# Small widths, the 24 kHz model's rates and strides: the real (3, 3) receptive field.
SMALL = SnacConfig(latent_dim=16, decoder_dim=32, codebook_size=64, codebook_dim=8)
ORPHEUS = SlidingWindow(28, 7)  # what Orpheus streams with: 4 frames, a new one per window


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conftest.py


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
def full():
    """The 24 kHz SNAC decoder at full width (random weights)."""
    return random_snac(SnacConfig(codebook_size=64))


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

    def end_stream(self, ctx):
        # Recorded as an empty span where the stream ended, so a test sees which way it ended.
        end = self.decoded_through(ctx.request.id)
        out = super().end_stream(ctx)
        self.windows.append((ctx.request.id, end, end, end, True))
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
    ending on a window boundary ends with end_stream (recorded as an empty span); "ahead" -- the LM
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


def direct(node: SnacStreamNode, tokens, policy, paced: bool = True, watch=None):
    """The node driven without a runtime, over the windows the C++ chunk cursor makes. Paced:
    windows are taken as soon as they are ready (a stream ending on a window boundary then ends
    with end_stream, as the runtime calls it); else only after the end of stream.
    ``watch(state)`` runs after each window."""
    n = len(tokens)
    buf = mstar_rt.StreamBuffer(np.int64, 1 << (n + policy.max_chunk).bit_length(), policy)
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
    ctx = WorkContext(RequestContext(1, {}), 0)
    chunks = []
    for b, nb, e, last in spans:
        work = node.prepare_inputs(ctx, {"token": StreamChunk(list(tokens[b:e]), b, nb, e, last)})
        chunks.append(node.forward([work])[0]["audio"])
        if watch is not None:
            watch(ctx.request.state)
    if not spans or not spans[-1][3]:  # no window said last: the runtime calls end_stream
        chunks.append(node.end_stream(ctx)["audio"])
        if watch is not None:
            watch(ctx.request.state)
    return chunks, ctx.request.state


# ---- 1. streamed == one shot ------------------------------------------------------------------

# tokens: shorter than the first window (flushed whole), frame boundary, mid-frame, long
LENGTHS = [3, 7, 15, 21, 69, 70, 73, 33 * 7 + 4]


def assert_first_audio_after_4_frames(chunks, windows) -> None:
    """Frame 0 comes with the window that completes frame 3 (28 tokens: frames 1..3 are its
    right context), then a frame per window of 7 new tokens; the last window flushes the rest."""
    frames = [len(c) // SPF for c in chunks]
    first = next(i for i, f in enumerate(frames) if f)
    assert windows[first][2] == 28 and frames[first] == 1, (frames, windows)
    for (_, _, end, last), f, (_, _, before, _) in zip(windows[first + 1:], frames[first + 1:],
                                                      windows[first:]):
        assert last or (f, end - before) == (1, 7), (frames, windows)


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


# ---- 2. carried context: any policy is exact ----------------------------------------------------

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


# ---- 3. invalid tokens --------------------------------------------------------------------------

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


# ---- 4. without carried context: policies too small -------------------------------------------

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


def direct_decode(decoder, codes: np.ndarray) -> list[np.ndarray]:
    """One decode of ``codes`` [frames, 7] by the decoder itself (no stream node)."""
    level = [torch.from_numpy(codes[:, list(s)].reshape(1, -1)) for s in LAYOUT.level_slots]
    kw = dict(noise=False) if isinstance(decoder, SnacDecoder) else {}
    return [decoder.decode(level, **kw)[0, 0].numpy()]


def test_frames_that_would_be_lost_fail_loudly(snac):
    node = SnacStreamNode(snac, LAYOUT, carry_context=False)
    with pytest.raises(ValueError, match="left the stream"):
        direct(node, audio_tokens(70, seed=1), mstar_rt.Fixed(7))


# ---- 5. a causal decoder under LeftContext -----------------------------------------------------

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

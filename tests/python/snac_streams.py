"""Helpers for the streamed speech decoding tests (test_snac_stream*.py): random SNAC and causal
decoders, audio tokens of random codes, a model whose replaying "LM" streams tokens one per
DynamicLoop iteration into an instrumented SnacStreamNode (``Speech``, ``Recorder``), served
through a Runtime (``served``) or driven directly over the windows the C++ chunk cursor makes
(``direct``), and the checks those tests share."""

import threading

import numpy as np
import torch

import mstar_rt
from mstar_rt import (EMIT, DynamicLoop, GraphEdge, GraphNode, Model, NodeSubmodule, Parallel,
                      SlidingWindow, StreamingGraphEdge, StreamChunk)
from mstar_rt.model import RequestContext, WorkContext
from mstar_rt.models.causal_codec import CausalConvDecoder
from mstar_rt.models.snac import SnacConfig, SnacDecoder
from mstar_rt.models.snac_stream import AudioTokenLayout, SnacStreamNode

from walk_models import wait_until

TOL = 1e-5
T = 30.0  # seconds: the longest any single wait in these tests may take
LAYOUT = AudioTokenLayout(codebook_size=64)  # Orpheus' token ids, a 64-code codebook
SPF = 2048  # samples per frame at 24 kHz
# Small widths, the 24 kHz model's rates and strides: the real (3, 3) receptive field.
SMALL = SnacConfig(latent_dim=16, decoder_dim=32, codebook_size=64, codebook_dim=8)
ORPHEUS = SlidingWindow(28, 7)  # what Orpheus streams with: 4 frames, a new one per window


def random_snac(config: SnacConfig) -> SnacDecoder:
    torch.manual_seed(0)
    model = SnacDecoder(config).eval()
    with torch.no_grad():  # trained Snake alphas are not all 1: make them matter
        for name, p in model.named_parameters():
            if name.endswith("alpha"):
                p.uniform_(0.5, 2.0)
    return model.fold_weight_norm()


def causal_decoder() -> CausalConvDecoder:
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


def policy_spans(items: np.ndarray, policy, paced: bool = True) -> list[tuple]:
    """(begin, new_begin, end, last) of every window the C++ chunk cursor cuts from ``items``
    (int64, one item per row). Paced: each window taken as soon as it is ready, as the runtime
    does (a stream ending on a window boundary then has no window marked last); else all after
    the end of stream."""
    n = len(items)
    buf = mstar_rt.StreamBuffer(np.int64, 1 << (n + policy.max_chunk).bit_length(), policy,
                                item_shape=items.shape[1:])
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
        buf.push(items[p:p + 1])
        drain()
    if not paced and n:
        buf.push(items)
    buf.close()
    drain()
    return spans


def direct(node: SnacStreamNode, tokens, policy, paced: bool = True, watch=None):
    """The node driven without a runtime, over the windows the C++ chunk cursor makes. Paced:
    windows are taken as soon as they are ready (a stream ending on a window boundary then ends
    with end_stream, as the runtime calls it); else only after the end of stream.
    ``watch(state)`` runs after each window."""
    spans = policy_spans(np.asarray(tokens, dtype=np.int64), policy, paced)
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


def assert_first_audio_after_4_frames(chunks, windows) -> None:
    """Frame 0 comes with the window that completes frame 3 (28 tokens: frames 1..3 are its
    right context), then a frame per window of 7 new tokens; the last window flushes the rest."""
    frames = [len(c) // SPF for c in chunks]
    first = next(i for i, f in enumerate(frames) if f)
    assert windows[first][2] == 28 and frames[first] == 1, (frames, windows)
    for (_, _, end, last), f, (_, _, before, _) in zip(windows[first + 1:], frames[first + 1:],
                                                      windows[first:]):
        assert last or (f, end - before) == (1, 7), (frames, windows)


def direct_decode(decoder, codes: np.ndarray) -> list[np.ndarray]:
    """One decode of ``codes`` [frames, 7] by the decoder itself (no stream node)."""
    level = [torch.from_numpy(codes[:, list(s)].reshape(1, -1)) for s in LAYOUT.level_slots]
    kw = dict(noise=False) if isinstance(decoder, SnacDecoder) else {}
    return [decoder.decode(level, **kw)[0, 0].numpy()]


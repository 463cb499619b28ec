"""Sample-exact streaming of codec tokens into audio: the SNAC decoder as a stream consumer node.

An Orpheus-style speech LM emits audio tokens one at a time, 7 per *frame* (one SNAC coarse
frame, 2048 samples at 24 kHz). A :class:`~mstar_rt.StreamingGraphEdge` hands the decoder node
chunks of those tokens; the node decodes each chunk and EMITs the audio of the frames the chunk
completes. The concatenation of everything it emits equals :func:`decode_one_shot` -- one decode
of all valid frames -- sample for sample (up to float rounding), first and last frames included.

Why the node carries context: every SNAC layer is non-causal, so the samples of frame f depend
on frames [f - L, f + R] ((3, 3) for the 24 kHz model). The node emits frame f once the stream
holds the R frames after it (or has ended), decoding it with the L frames before it. Those may lie
in earlier chunks: a short policy's chunk does not hold them. So, per request, the node keeps
the tokens a later frame can still need -- the last L + R frames and any partial frame, never
more -- and extends each chunk on the left with them before planning (``carry_context=True``,
the default). Then every chunk policy streams exactly (all of them deliver every token), Orpheus'
own ``SlidingWindow(28, 7)`` included: first audio after R + 1 = 4 frames, then a frame per 7
tokens. The cost: each chunk decodes up to L + R + 1 frames, 7 for the 24 kHz SNAC (Orpheus'
reference decodes the 4-frame chunk and keeps its second frame: cheaper, but one frame of context
before and two after where three and three are needed, hence seams at every chunk boundary).

With ``carry_context=False`` the node uses only the context the chunk holds, and the policy must
keep the L frames before each new one: :meth:`SnacStreamNode.exact_policy` gives the smallest such
policy, ``LeftContext(7 * (L + R), 7)``, and :meth:`SnacStreamNode.check_policy` (with
``carry_context=False``) rejects policies that cannot be exact in that mode, such as
``SlidingWindow(28, 7)`` (4 frames; the 24 kHz SNAC needs 7).

Invalid tokens (outside their slot's code range) drop their whole frame without shifting the
frame alignment: a frame is always stream positions 7f .. 7f + 6. One-shot decoding then joins
the valid frames around the gap; a chunk joins them the same way, but holds fewer valid frames
around a gap (the node keeps context by stream position), so exactness is guaranteed for the
valid frames whose context chunk (L frames before, R after, by position) holds no dropped frame.

The node works with any decoder exposing ``decode(codes)`` (codes: one LongTensor
[B, frames * codes_per_frame_of_level] per codebook level; audio [B, 1, frames * samples]),
``receptive_field_frames() -> (L, R)`` and ``samples_per_frame`` -- e.g. the causal
:class:`mstar_rt.models.causal_codec.CausalConvDecoder` -- and with :class:`SnacDecoder`.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Protocol, Sequence, Union

import numpy as np
import torch

from mstar_rt import _core
from mstar_rt.model import NodeSubmodule, StreamChunk, WorkContext
from mstar_rt.models.snac import Noise, PositionalNoise, SnacDecoder
from mstar_rt.streaming import LeftContext


class StreamDecoder(Protocol):
    """What :class:`SnacStreamNode` needs of a decoder besides :class:`SnacDecoder` itself."""

    samples_per_frame: int

    def decode(self, codes: Sequence[torch.Tensor]) -> torch.Tensor: ...

    def receptive_field_frames(self) -> tuple[int, int]: ...


Decoder = Union[SnacDecoder, StreamDecoder]


@dataclass(frozen=True)
class AudioTokenLayout:
    """How audio codes are spelled as LM tokens. The token at audio stream position p has slot
    ``p % frame_size`` and is valid iff it lies in that slot's range
    ``[audio_base + slot * codebook_size, audio_base + (slot + 1) * codebook_size)``.
    ``slot_level[s]`` is the codebook level slot s feeds; a level's slots are its codes in time
    order. Defaults: Orpheus (base 128256 + 10, end of speech 128258) over the 24 kHz SNAC."""

    audio_base: int = 128266
    codebook_size: int = 4096
    end_token: int = 128258
    slot_level: tuple[int, ...] = (0, 1, 2, 2, 1, 2, 2)

    def __post_init__(self) -> None:
        object.__setattr__(self, "slot_level", tuple(int(v) for v in self.slot_level))
        levels = set(self.slot_level)
        if not self.slot_level or levels != set(range(len(levels))):
            raise ValueError(f"slot_level {self.slot_level} must name every level 0..n-1 at "
                             "least once")
        if self.codebook_size < 1:
            raise ValueError(f"codebook_size must be >= 1, got {self.codebook_size}")
        top = self.audio_base + self.frame_size * self.codebook_size
        if self.audio_base <= self.end_token < top:
            raise ValueError(f"end_token {self.end_token} lies inside the audio token range "
                             f"[{self.audio_base}, {top})")

    @property
    def frame_size(self) -> int:
        """Tokens per frame (7 for SNAC's levels of 1, 2 and 4 codes)."""
        return len(self.slot_level)

    @property
    def level_slots(self) -> tuple[tuple[int, ...], ...]:
        """Per codebook level, the slots that feed it, in time order."""
        return tuple(tuple(s for s, lv in enumerate(self.slot_level) if lv == level)
                     for level in range(max(self.slot_level) + 1))

    def code_of(self, token: int, position: int) -> Optional[int]:
        """The code that ``token`` at audio stream ``position`` spells, or None if it is not a
        code of that position's slot."""
        code = int(token) - self.audio_base - (position % self.frame_size) * self.codebook_size
        return code if 0 <= code < self.codebook_size else None

    def token_of(self, code: int, position: int) -> int:
        if not 0 <= code < self.codebook_size:
            raise ValueError(f"code {code} is outside [0, {self.codebook_size})")
        return self.audio_base + (position % self.frame_size) * self.codebook_size + int(code)

    def end_position(self, tokens: Sequence[int], start_position: int = 0) -> Optional[int]:
        """Stream position of the first ``end_token`` in ``tokens`` (which start at
        ``start_position``), or None."""
        hits = np.flatnonzero(np.asarray(tokens, dtype=np.int64) == self.end_token)
        return start_position + int(hits[0]) if len(hits) else None

    def frames(self, tokens: Sequence[int], start_position: int = 0) -> "ParsedFrames":
        """The complete frames among ``tokens`` (stream positions ``start_position`` ..): those
        whose 7 positions all lie before the end of ``tokens`` and before any ``end_token``."""
        fs = self.frame_size
        toks = np.asarray(tokens, dtype=np.int64).reshape(-1)
        end = self.end_position(toks, start_position)
        stop = start_position + len(toks) if end is None else end
        first = -(-start_position // fs)
        count = max(0, stop // fs - first)
        skip = first * fs - start_position
        grid = toks[skip: skip + count * fs].reshape(count, fs)
        codes = grid - self.audio_base - np.arange(fs) * self.codebook_size
        valid = ((codes >= 0) & (codes < self.codebook_size)).all(axis=1)
        return ParsedFrames(first, np.where(valid[:, None], codes, -1), valid)


@dataclass(frozen=True)
class ParsedFrames:
    """Frames ``first .. first + len - 1``: ``codes`` [n, frame_size] by slot (-1 rows for
    invalid frames), ``valid`` [n] bool."""

    first: int
    codes: np.ndarray
    valid: np.ndarray

    def __len__(self) -> int:
        return len(self.valid)

    @property
    def stop(self) -> int:
        return self.first + len(self.valid)


def decode_one_shot(decoder: Decoder, layout: AudioTokenLayout, tokens: Sequence[int],
                    noise: Noise = False) -> np.ndarray:
    """Audio (float32) of all valid complete frames of ``tokens`` decoded at once: what a
    sample-exact stream must add up to. Invalid and trailing incomplete frames are left out."""
    _check_decoder(decoder, layout, noise)
    parsed = layout.frames(tokens)
    codes = parsed.codes[parsed.valid]
    if not len(codes):
        return np.zeros(0, np.float32)
    return _decode_rows(decoder, layout, [codes], noise, [0])[0]


# Per-request counters the node keeps in ``request.state`` (top level, for the model to read).
COUNTERS = ("frames_emitted", "invalid_frames", "incomplete_frames", "short_context_frames")
_CURSOR = "_snac_stream_cursor"


@dataclass(frozen=True)
class _Cursor:
    """Where one request's stream stands: the next frame to emit, the stream position of the end
    token once seen, whether the tail was flushed, and ``chunk``: the tokens kept for later
    chunks. Carrying context, those are the last L + R frames and any partial frame (what a
    later frame can still need); else the last chunk. Either way :meth:`SnacStreamNode.end_stream`
    flushes from them when the stream ends where a chunk already sent ended."""

    next_frame: int = 0
    emitted: int = 0
    end_position: Optional[int] = None
    flushed: bool = False
    chunk: Optional[StreamChunk] = None


@dataclass
class _Work:
    """One chunk, planned: decode ``codes`` (valid frames), keep frames [keep_lo, keep_hi) of
    them; on success commit ``cursor`` and add ``counts`` to the request's counters."""

    state: dict
    cursor: _Cursor
    counts: dict
    codes: np.ndarray
    keep_lo: int = 0
    keep_hi: int = 0
    offset: int = 0  # valid-frame index of codes[0] in the whole stream (PositionalNoise)

    def commit(self) -> None:
        self.state[_CURSOR] = self.cursor
        for name, n in self.counts.items():
            self.state[name] = self.state.get(name, 0) + n


class SnacStreamNode(NodeSubmodule):
    """A stream consumer node: chunks of audio tokens in (``input_name``, a
    :class:`StreamChunk`), ``{output_name: float32 samples}`` out per chunk (empty when no
    frame became ready). Chunks of several requests with equally many frames to decode run as
    one decoder call. Per request it keeps, in ``request.state``, the counters
    ``frames_emitted``, ``invalid_frames``, ``incomplete_frames`` and ``short_context_frames``
    (frames emitted with less context than exactness needs: 0 unless dropped frames lie in the
    context -- under any policy while ``carry_context``, else under a policy that passes
    :meth:`check_policy`).

    ``carry_context``: keep each request's last L + R frames of tokens (and any partial frame)
    and put them before the next chunk, so that any chunk policy streams exactly; False uses
    only the context a chunk holds (then the policy must, see :meth:`exact_policy`)."""

    def __init__(self, decoder: Decoder, layout: AudioTokenLayout = AudioTokenLayout(),
                 max_batch: int = 8, noise: Noise = False, input_name: str = "token",
                 output_name: str = "audio", carry_context: bool = True) -> None:
        _check_decoder(decoder, layout, noise)
        self.decoder, self.layout, self.noise = decoder, layout, noise
        self.carry_context = carry_context
        self.max_batch = max_batch
        self.input_name, self.output_name = input_name, output_name
        self.left, self.right = _receptive_field(decoder)
        self.samples_per_frame = _samples_per_frame(decoder)
        #: decoder batch size -> how many decoder calls ran with it
        self.decode_batch_sizes: Counter[int] = Counter()

    @staticmethod
    def exact_policy(decoder: Decoder,
                     layout: AudioTokenLayout = AudioTokenLayout()) -> _core.ChunkPolicy:
        """The smallest policy that streams ``decoder`` exactly without carried context: a frame
        of new tokens per chunk, after (L + R) frames of context. (Carrying context, any policy
        is exact; this one then decodes no more than the node would anyway.)"""
        left, right = _receptive_field(decoder)
        return LeftContext(layout.frame_size * (left + right), layout.frame_size)

    @staticmethod
    def check_policy(decoder: Decoder, policy: _core.ChunkPolicy,
                     layout: AudioTokenLayout = AudioTokenLayout(),
                     carry_context: bool = True) -> None:
        """ValueError, naming the minimum chunk, if some stream length would make a node with
        this ``carry_context`` decode a frame with less context than ``decoder`` needs (or lose
        frames). With ``carry_context`` (the node's default) every policy passes: each delivers
        every token, and the node itself keeps the context a chunk lacks."""
        if carry_context:
            return
        left, right = _receptive_field(decoder)
        problem = _policy_problem(policy, left, right, layout.frame_size)
        if problem:
            fs = layout.frame_size
            raise ValueError(
                f"{policy} cannot stream {type(decoder).__name__} exactly: {problem}. Each frame "
                f"({fs} tokens) needs {left} frames of context before it and {right} after it, so "
                f"a chunk must hold at least {fs * (left + right + 1)} tokens "
                f"({left + right + 1} frames), {fs * (left + right)} of them context before the "
                f"new ones: use {SnacStreamNode.exact_policy(decoder, layout)} or "
                f"SlidingWindow({fs * (left + right + 1)}, {fs})")

    # ---- NodeSubmodule ------------------------------------------------------------------------

    def prepare_inputs(self, ctx: WorkContext, inputs: dict[str, Any]) -> _Work:
        chunk = inputs.get(self.input_name)
        if not isinstance(chunk, StreamChunk):
            raise TypeError(f"SnacStreamNode reads input '{self.input_name}' as a StreamChunk "
                            f"(feed it through a StreamingGraphEdge), got {type(chunk).__name__}")
        state = ctx.request.state
        cursor = state.get(_CURSOR) or _Cursor()
        if self.carry_context:
            chunk = _extend(cursor.chunk, chunk)
        return self._plan(state, cursor, chunk, ctx.request.id)

    def end_stream(self, ctx: WorkContext) -> Mapping[str, Any]:
        """The stream ended exactly where the last chunk ended (or carried nothing): the
        frames held back for their right context are decoded from the kept tokens."""
        state = ctx.request.state
        cursor = state.get(_CURSOR) or _Cursor()
        prev = cursor.chunk
        chunk = (StreamChunk([], 0, 0, 0, True) if prev is None
                  else StreamChunk(prev.items, prev.begin, prev.end, prev.end, True))
        return self._decode([self._plan(state, cursor, chunk, ctx.request.id)])[0]

    def forward(self, batch: list[_Work]) -> list[Mapping[str, Any]]:
        return self._decode(batch)

    def _decode(self, batch: list[_Work]) -> list[Mapping[str, Any]]:
        spf = self.samples_per_frame
        audio = [np.zeros(0, np.float32) for _ in batch]
        groups: dict[int, list[int]] = {}
        for i, work in enumerate(batch):
            if len(work.codes):
                groups.setdefault(len(work.codes), []).append(i)
        for rows in groups.values():  # equal lengths: a decoder call needs no padding
            decoded = _decode_rows(self.decoder, self.layout, [batch[i].codes for i in rows],
                                   self.noise, [batch[i].offset for i in rows])
            self.decode_batch_sizes[len(rows)] += 1
            for row, i in enumerate(rows):
                audio[i] = decoded[row, batch[i].keep_lo * spf: batch[i].keep_hi * spf].copy()
        for work in batch:  # only now: a failed batch is retried from the same cursor
            work.commit()
        return [{self.output_name: a} for a in audio]

    # ---- planning -----------------------------------------------------------------------------

    def _plan(self, state: dict, cur: _Cursor, chunk: StreamChunk, request_id: int) -> _Work:
        layout, fs = self.layout, self.layout.frame_size
        counts = dict.fromkeys(COUNTERS, 0)
        empty = np.zeros((0, fs), np.int64)
        if cur.flushed:  # tokens after the end token, or chunks after the flush
            return _Work(state, cur, counts, empty)
        end = cur.end_position
        if end is None:
            end = layout.end_position(chunk.items, chunk.begin)
        stop = chunk.end if end is None else min(chunk.end, end)
        done = chunk.last or end is not None
        parsed = layout.frames(chunk.items[: max(0, stop - chunk.begin)], chunk.begin)
        first, hi = parsed.first, parsed.stop
        if cur.next_frame < (min(first, stop // fs) if done else first):
            raise ValueError(
                f"SnacStreamNode: {_frames_text(cur.next_frame, first)} of request {request_id} "
                f"left the stream before the chunk [{chunk.begin}, {chunk.end}) could decode "
                f"them with {self.right} frames of context after them; the chunk policy is too "
                "small for this decoder (see SnacStreamNode.check_policy / exact_policy)")
        target = hi if done else hi - self.right
        nxt = max(cur.next_frame, target)
        span = slice(max(0, cur.next_frame - first), max(0, target - first))
        counts["invalid_frames"] = int((~parsed.valid[span]).sum())
        if done:
            counts["incomplete_frames"] = int(stop % fs != 0)
        valid_index = np.flatnonzero(parsed.valid)  # chunk frame -> valid-frame order
        emit = np.flatnonzero((valid_index >= span.start) & (valid_index < span.stop))
        counts["frames_emitted"] = len(emit)
        cursor = _Cursor(nxt, cur.emitted + len(emit), end, done, self._kept(chunk, nxt, done))
        if not len(emit):
            return _Work(state, cursor, counts, empty)
        k0, k1, n = int(emit[0]), int(emit[-1]) + 1, len(valid_index)
        lo, hi_k = max(0, k0 - self.left), min(n, k1 + self.right)
        v0 = cur.emitted - k0  # valid frames before the chunk's first valid frame
        ks = np.arange(k0, k1)
        exact = ((ks >= self.left) | (v0 == 0)) & ((n - 1 - ks >= self.right) | done)
        counts["short_context_frames"] = int((~exact).sum())
        codes = parsed.codes[valid_index[lo:hi_k]]
        return _Work(state, cursor, counts, codes, k0 - lo, k1 - lo, v0 + lo)

    def _kept(self, chunk: StreamChunk, next_frame: int, done: bool) -> Optional[StreamChunk]:
        """The tokens of ``chunk`` to keep for the next ones: carrying context, those from the L
        frames before ``next_frame`` on (no later frame needs earlier ones), none once done."""
        if not self.carry_context:
            return chunk
        if done:
            return None
        start = (next_frame - self.left) * self.layout.frame_size
        start = min(chunk.end, max(chunk.begin, start))
        items = list(chunk.items[start - chunk.begin:])
        return StreamChunk(items, start, chunk.end, chunk.end, False)


def _extend(kept: Optional[StreamChunk], chunk: StreamChunk) -> StreamChunk:
    """``chunk`` preceded by the kept tokens before its begin. Every policy hands over every
    token, so the kept ones reach the chunk; if they did not, the gap is left for planning to
    report (frames lost)."""
    if kept is None or not kept.begin < chunk.begin <= kept.end:
        return chunk
    items = list(kept.items[: chunk.begin - kept.begin]) + list(chunk.items)
    return StreamChunk(items, kept.begin, chunk.new_begin, chunk.end, chunk.last)


def _policy_problem(policy: _core.ChunkPolicy, left: int, right: int, fs: int) -> str:
    """Why ``policy`` cannot stream exactly (the first failing chunk), or ''. Simulates the
    node's emission rule for every stream length up to a horizon past which chunks repeat."""
    context = policy.context
    horizon = 4 * policy.max_chunk + 4 * fs * (left + right + 2)
    chunks, nb = [], 0  # the non-last chunks (begin, end)
    while nb <= horizon or len(chunks) < 64:
        size = policy.new_size(len(chunks))
        chunks.append((max(0, nb - context), nb + size))
        nb += size

    def check(next_frame: int, begin: int, end: int, done: bool) -> tuple[int, str]:
        first, hi = -(-begin // fs), end // fs
        if next_frame < (min(first, hi) if done else first):
            return next_frame, (f"frame {next_frame} would leave the stream before a chunk "
                                f"holds the {right} frames after it (next chunk: tokens "
                                f"[{begin}, {end}))")
        target = hi if done else hi - right
        f = next_frame  # the first frame emitted has the least context before it
        if f < target and f - first < min(left, f):
            return next_frame, (f"frame {f} would be decoded from the chunk of tokens "
                                f"[{begin}, {end}) with {f - first} of the {min(left, f)} "
                                "frames before it that it needs")
        return max(next_frame, target), ""

    cursors, next_frame = [0], 0
    for begin, end in chunks:  # cursor after each non-last chunk
        next_frame, problem = check(next_frame, begin, end, False)
        if problem:
            return problem
        cursors.append(next_frame)
    last_end = 0
    for i, (begin, end) in enumerate(chunks):
        for n in range(last_end + 1, end + 1):  # streams ending inside chunk i, or at its end
            if n == end:  # chunk i, then the end of stream: end_stream flushes from chunk i
                _, problem = check(cursors[i + 1], begin, end, True)
            else:
                _, problem = check(cursors[i], max(0, last_end - context), n, True)
            if problem:
                return problem + f" (a stream of {n} tokens)"
        last_end = end
    return ""


def _frames_text(lo: int, hi: int) -> str:
    return f"frame {lo}" if hi - lo == 1 else f"frames {lo}..{hi - 1}"


def _receptive_field(decoder: Decoder) -> tuple[int, int]:
    left, right = decoder.receptive_field_frames()
    return int(left), int(right)


def _samples_per_frame(decoder: Decoder) -> int:
    if isinstance(decoder, SnacDecoder):
        return decoder.config.samples_per_coarse_frame
    return int(decoder.samples_per_frame)


def _check_decoder(decoder: Decoder, layout: AudioTokenLayout, noise: Noise) -> None:
    if isinstance(decoder, SnacDecoder):
        cfg = decoder.config
        per_frame = tuple(cfg.latent_frames_per_coarse_frame // s for s in cfg.vq_strides)
        if tuple(len(s) for s in layout.level_slots) != per_frame:
            raise ValueError(f"the token layout feeds levels with "
                             f"{[len(s) for s in layout.level_slots]} codes a frame; this SNAC "
                             f"(vq_strides {list(cfg.vq_strides)}) takes {list(per_frame)}")
        if cfg.window_alignment != 1:
            raise ValueError("SNAC models with chunk attention (attn_window_size="
                             f"{cfg.attn_window_size}) cannot be streamed by SnacStreamNode: "
                             "their decode chunks would have to stay aligned to attention "
                             "chunks across dropped frames")
        size = cfg.codebook_size
    else:
        if noise is not False:
            raise ValueError(f"noise={noise!r} needs a SnacDecoder; "
                             f"{type(decoder).__name__}.decode takes codes only")
        size = getattr(decoder, "codebook_size", layout.codebook_size)
    if layout.codebook_size > size:
        raise ValueError(f"the token layout spells {layout.codebook_size} codes a slot; the "
                         f"decoder's codebook has only {size}")


def _decode_rows(decoder: Decoder, layout: AudioTokenLayout, rows: Sequence[np.ndarray],
                 noise: Noise, offsets: Sequence[int]) -> np.ndarray:
    """Decodes equally long rows of frames ([n, frame_size] codes by slot) in one call; returns
    float32 audio [rows, n * samples_per_frame]."""
    grid = np.stack(rows)
    param = (next(iter(decoder.parameters()), None) if isinstance(decoder, torch.nn.Module)
             else None)
    device = param.device if param is not None else torch.device("cpu")
    codes = [torch.from_numpy(np.ascontiguousarray(grid[:, :, list(slots)].reshape(len(rows), -1)))
             .to(device) for slots in layout.level_slots]
    with torch.no_grad():
        if isinstance(decoder, SnacDecoder):
            if isinstance(noise, PositionalNoise):
                per_frame = decoder.config.latent_frames_per_coarse_frame
                noise = dataclasses.replace(noise, frame_offset=[o * per_frame for o in offsets])
            audio = decoder.decode(codes, noise=noise)
        else:
            audio = decoder.decode(codes)
    return audio.reshape(len(rows), -1).float().cpu().numpy()

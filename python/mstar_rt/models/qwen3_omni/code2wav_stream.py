"""Sample-exact streaming of Qwen3-Omni codec frames into audio: code2wav as a stream consumer.

The talker emits one frame of G codes per step (80 ms of audio). A
:class:`~mstar_rt.StreamingGraphEdge` hands this node windows of those frames under any chunk
policy; the node EMITs the audio each window completes, and the concatenation of everything it
emits equals :func:`decode_one_shot` -- one decode of all frames -- sample for sample (up to
float rounding), the tail included.

Why no lookahead and no flush: code2wav is causal and prefix-stable (a decode of T frames is a
prefix of a decode of more), so when frames T .. T + n - 1 arrive the samples
[samples_for(T), samples_for(T + n)) are final. At the end of the stream nothing is owed: the
samples one-shot decoding holds back (the last frame's final ``held_back_samples``, which would
read a frame that never comes) are held back by the stream too.

Why the node keeps state instead of re-decoding context: those samples read
``left_context_frames`` frames back (578 for the released model), almost all of it through the
transformer's sliding windows (``window - 1`` frames per layer). Re-decoding that much context per
window would cost far more than the window. So, per request, the node keeps what a later frame
can still read -- each layer's last ``window - 1`` keys and values, and the last
``conv_context_frames`` transformer outputs for the convolutions -- runs the transformer on the
new frames only (at their absolute positions, so rotary angles equal one-shot decoding's bit for
bit) and the convolutions on [kept outputs + new ones]. A window's items before the frames
already decoded (a policy's left context) are skipped: any policy works, its context is unused.

Windows of several requests run as one decoder call when they agree on new frames, cached
positions and kept outputs (every request in steady state under one policy); else grouped.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence

import numpy as np
import torch

from mstar_rt import _core
from mstar_rt.model import NodeSubmodule, StreamChunk, WorkContext
from mstar_rt.models.qwen3_omni.code2wav import Code2Wav
from mstar_rt.models.qwen3_omni.code2wav_layers import LayerCache
from mstar_rt.streaming import Ramp

_STATE = "_code2wav_stream"


@dataclass(frozen=True)
class _Stream:
    """One request's stream: ``frames`` decoded so far, each layer's cached keys and values
    ([1, kv_heads, <= window - 1, head_dim]), the last transformer outputs the convolutions
    still read ([1, <= conv_context_frames, hidden]), and whether it ended."""

    frames: int = 0
    cache: list[LayerCache] = field(default_factory=list)
    hidden: Optional[torch.Tensor] = None
    done: bool = False

    @property
    def key(self) -> tuple[int, int]:
        """What must agree for two requests to share a decoder call (with the new frames)."""
        if not self.cache or self.hidden is None:
            return 0, 0
        return self.cache[0][0].shape[2], self.hidden.shape[1]


@dataclass
class _Work:
    """One window, planned: decode ``codes`` [n, G] (the frames not yet decoded) after
    ``stream``; on success :meth:`commit` stores ``after``."""

    state: dict
    stream: _Stream
    codes: np.ndarray
    last: bool
    after: Optional[_Stream] = None

    def commit(self) -> None:
        if self.after is not None:
            self.state[_STATE] = self.after


class Code2WavStreamNode(NodeSubmodule):
    """A stream consumer node: windows of codec frames in (``input_name``, a
    :class:`StreamChunk` whose items are int arrays of shape [G]), ``{output_name: float32
    samples at 24 kHz}`` out per window that completes samples (nothing for one that does not:
    which windows those are depends on when the stream's end arrives, so an empty chunk would
    make the same request's output differ run to run). Per request
    the state lives in ``request.state`` and is committed only when a decode succeeds, so a
    failed batch is retried from the same place; it is freed when the stream ends."""

    cleanup_by_cache_id = True  # its state is in request.state (placement may segment it)

    def __init__(self, decoder: Code2Wav, max_batch: int = 8, input_name: str = "codes",
                 output_name: str = "audio") -> None:
        self.decoder = decoder.eval()
        self.max_batch = max_batch
        self.input_name, self.output_name = input_name, output_name
        self.groups = decoder.config.num_quantizers
        self.conv_context = decoder.conv_context_frames
        #: decoder batch size -> how many decoder calls ran with it
        self.decode_batch_sizes: Counter[int] = Counter()

    @staticmethod
    def first_audio_policy(first: Sequence[int] = (2, 4, 8),
                           steady: int = 12) -> _core.ChunkPolicy:
        """The first-audio latency knob: small first windows (frames), then ``steady`` ones.
        The first audio comes after ``first[0]`` frames (samples_for(first[0]) samples);
        larger steady windows batch better. The windows double up to ``steady`` so that what
        a listener already holds covers the making of the next window at any pace above about
        twice real time (a jump from 4 frames to 12 needs three times). No context is needed:
        the node keeps its own."""
        return Ramp(list(first), steady)

    # ---- NodeSubmodule ------------------------------------------------------------------------

    def prepare_inputs(self, ctx: WorkContext, inputs: dict[str, Any]) -> _Work:
        chunk = inputs.get(self.input_name)
        if not isinstance(chunk, StreamChunk):
            raise TypeError(f"Code2WavStreamNode reads input '{self.input_name}' as a "
                            f"StreamChunk (feed it through a StreamingGraphEdge), got "
                            f"{type(chunk).__name__}")
        state = ctx.request.state
        stream = state.get(_STATE) or _Stream()
        if stream.done:
            return _Work(state, stream, self._no_codes(), True)
        if chunk.begin > stream.frames:
            raise ValueError(f"Code2WavStreamNode: frames {stream.frames}..{chunk.begin - 1} of "
                             f"request {ctx.request.id} never reached the node (the window "
                             f"[{chunk.begin}, {chunk.end}) starts after them)")
        items = chunk.items[max(0, stream.frames - chunk.begin):]
        codes = self._codes(items, max(stream.frames, chunk.begin), ctx.request.id)
        return _Work(state, stream, codes, chunk.last)

    def end_stream(self, ctx: WorkContext) -> Mapping[str, Any]:
        """The stream ended where a window already sent ended (or carried no frames): every
        sample one-shot decoding gives is out already; only the state is freed."""
        stream = ctx.request.state.get(_STATE) or _Stream()
        ctx.request.state[_STATE] = _Stream(stream.frames, done=True)
        return {}

    def forward(self, batch: list[_Work]) -> list[Mapping[str, Any]]:
        audio = [np.zeros(0, np.float32) for _ in batch]
        groups: dict[tuple[int, int, int], list[int]] = {}
        for i, work in enumerate(batch):
            if len(work.codes):
                groups.setdefault((len(work.codes), *work.stream.key), []).append(i)
            else:
                work.after = _Stream(work.stream.frames, done=True) if work.last else None
        for rows in groups.values():
            decoded = self._decode([batch[i] for i in rows])
            self.decode_batch_sizes[len(rows)] += 1
            for i, samples in zip(rows, decoded):
                audio[i] = samples
        for work in batch:  # only now: a failed batch is retried from the same state
            work.commit()
        return [{self.output_name: a} if len(a) else {} for a in audio]

    def cleanup(self, request: Any) -> None:
        request.state.pop(_STATE, None)

    # ---- decoding -----------------------------------------------------------------------------

    @torch.no_grad()
    def _decode(self, rows: list[_Work]) -> list[np.ndarray]:
        """Decodes windows that agree on (new frames, cached positions, kept outputs) in one
        call; sets each work's ``after`` and returns its new samples."""
        dec, spf = self.decoder, self.decoder.samples_per_frame
        device = next(dec.parameters()).device
        n = len(rows[0].codes)
        codes = torch.from_numpy(np.stack([w.codes for w in rows])).transpose(1, 2).to(device)
        starts = torch.tensor([w.stream.frames for w in rows], device=device)
        positions = starts[:, None] + torch.arange(n, device=device)
        past = [(torch.cat([w.stream.cache[i][0] for w in rows]),
                 torch.cat([w.stream.cache[i][1] for w in rows]))
                for i in range(len(rows[0].stream.cache))]  # equal keys: all or none
        hidden, cache = dec.step(codes, positions, past or None)
        tails = [w.stream.hidden for w in rows if w.stream.hidden is not None]
        if tails:
            hidden = torch.cat((torch.cat(tails), hidden), dim=1)
        kept = hidden.shape[1] - n  # transformer outputs before the new frames
        wav = dec.vocode(hidden)[:, 0].float().cpu().numpy()
        out = []
        for r, work in enumerate(rows):
            done, frames = work.stream.frames, work.stream.frames + n
            lo = dec.samples_for(done) - (done - kept) * spf  # from the first new sample
            out.append(wav[r, lo:].copy())
            if work.last:
                work.after = _Stream(frames, done=True)
            else:
                tail = hidden[r:r + 1, max(0, hidden.shape[1] - self.conv_context):].clone()
                work.after = _Stream(frames, [(k[r:r + 1].clone(), v[r:r + 1].clone())
                                              for k, v in cache], tail)
        return out

    def _codes(self, items: Sequence[Any], begin: int, request_id: int) -> np.ndarray:
        """Stream items (one [G] array of codes each) as int64 [n, G], checked."""
        if not len(items):
            return self._no_codes()
        rows = [item.detach().cpu().numpy() if isinstance(item, torch.Tensor) else item
                for item in items]
        try:
            codes = np.asarray(rows)
        except ValueError:  # ragged
            codes = np.zeros(0)
        size = self.decoder.config.codebook_size
        if codes.shape != (len(items), self.groups) or codes.dtype.kind not in "iu":
            raise ValueError(f"Code2WavStreamNode: request {request_id} streamed items "
                             f"{begin}..{begin + len(items) - 1} that are not integer arrays of "
                             f"{self.groups} codes (one frame each); got "
                             f"{_describe(rows[0])} first")
        bad = np.flatnonzero(((codes < 0) | (codes >= size)).any(axis=1))
        if len(bad):
            raise ValueError(f"Code2WavStreamNode: frame {begin + int(bad[0])} of request "
                             f"{request_id} holds codes outside [0, {size}): "
                             f"{codes[bad[0]].tolist()}")
        return codes.astype(np.int64, copy=False)

    def _no_codes(self) -> np.ndarray:
        return np.zeros((0, self.groups), np.int64)


def _describe(item: Any) -> str:
    shape = getattr(item, "shape", None)
    return (f"{getattr(item, 'dtype', type(item).__name__)} {tuple(shape)}" if shape is not None
            else repr(item)[:40])


def decode_one_shot(decoder: Code2Wav, frames: Any) -> np.ndarray:
    """Float32 audio of all ``frames`` ([T, G] codes, or T arrays of G) in one decode: what a
    sample-exact stream adds up to. Empty for no frames."""
    codes = np.asarray(frames, dtype=np.int64).reshape(-1, decoder.config.num_quantizers)
    if not len(codes):
        return np.zeros(0, np.float32)
    device = next(decoder.parameters()).device
    with torch.no_grad():
        wav = decoder(torch.from_numpy(codes.T.copy())[None].to(device))
    return wav[0, 0].float().cpu().numpy()

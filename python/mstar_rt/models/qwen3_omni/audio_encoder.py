"""Qwen3-Omni's audio encoder (the thinker's ``audio_tower``): log-mel features -> one embedding
per 80 ms of audio, in the thinker's hidden width.

The pipeline, per audio:

1. the mel frames are cut into chunks of ``2 * n_window`` frames (100 = 1 s); a shorter tail
   chunk is zero-padded to the full chunk length;
2. three stride-2 3x3 conv2d layers (GELU) shrink each chunk 8x in time and in mel bins, and
   ``conv_out`` flattens (channels x bins) to ``d_model``; a full chunk yields 13 frames;
3. sinusoidal positions are added *per chunk* (every chunk starts at position 0);
4. the valid frames of all chunks are concatenated, and the transformer layers attend within
   windows of ``n_window_infer`` mel frames (8 chunks = 104 frames), never across them;
5. ``ln_post -> proj1 -> GELU -> proj2`` maps to ``output_dim``.

Padding rule: every audio is padded as if it were encoded alone (chunks of an audio of at least
one full chunk are padded to the full chunk, a shorter audio is not padded). The padded frames
leak into the last valid frames through the convs, so this choice matters: transformers pads
all chunks of a call to the longest one, which makes a short audio's embedding depend on what it
was batched with. Here it never does, and each audio equals transformers' output for that audio
alone. Parameter names match the checkpoint's ``thinker.audio_tower.*`` tensors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import nn
from torch.nn import functional as F

_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": F.gelu, "relu": F.relu, "silu": F.silu,
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


def _halve(frames: int) -> int:
    """Frames left after one stride-2, kernel-3, padding-1 conv (0 stays 0)."""
    return (frames - 1) // 2 + 1 if frames > 0 else 0


def feature_output_length(frames: int, n_window: int = 50) -> int:
    """How many embeddings ``frames`` mel frames become: full chunks of ``2 * n_window`` frames
    plus the tail chunk, each shrunk 8x by the convs (transformers'
    ``_get_feat_extract_output_lengths``, which hard-codes 13 frames per 100-frame chunk)."""
    chunk = 2 * n_window
    per_chunk = _halve(_halve(_halve(chunk)))
    return (frames // chunk) * per_chunk + _halve(_halve(_halve(frames % chunk)))


@dataclass(frozen=True)
class AudioEncoderConfig:
    num_mel_bins: int = 128
    d_model: int = 1280
    encoder_layers: int = 32
    encoder_attention_heads: int = 20
    encoder_ffn_dim: int = 5120
    output_dim: int = 3584
    n_window: int = 50
    n_window_infer: int = 800
    downsample_hidden_size: int = 480
    max_source_positions: int = 1500
    conv_chunksize: int = 500
    activation_function: str = "gelu"

    @property
    def chunk_frames(self) -> int:
        return 2 * self.n_window

    @property
    def conv_bins(self) -> int:
        """Mel bins left after the three convs (each halves, rounding up)."""
        return _halve(_halve(_halve(self.num_mel_bins)))

    @staticmethod
    def from_hf(config: Mapping[str, Any],
                source: str = "the audio_config") -> "AudioEncoderConfig":
        """Reads transformers' ``Qwen3OmniMoeAudioEncoderConfig`` dict (``thinker_config
        ["audio_config"]``); unrelated fields are ignored, a bad one is a ValueError naming it."""
        from mstar_rt.models.checkpoint import MAX_LAYERS, ConfigFields

        c = ConfigFields(config, source)
        d = AudioEncoderConfig()
        act = c.text("activation_function", d.activation_function)
        if act not in _ACTIVATIONS:
            raise ValueError(f"field 'activation_function' of {source} is {act!r}; supported: "
                             f"{sorted(_ACTIVATIONS)}")
        out = AudioEncoderConfig(
            num_mel_bins=c.integer("num_mel_bins", d.num_mel_bins),
            d_model=c.integer("d_model", d.d_model),
            encoder_layers=c.integer("encoder_layers", d.encoder_layers, maximum=MAX_LAYERS),
            encoder_attention_heads=c.integer("encoder_attention_heads",
                                              d.encoder_attention_heads),
            encoder_ffn_dim=c.integer("encoder_ffn_dim", d.encoder_ffn_dim),
            output_dim=c.integer("output_dim", d.output_dim),
            n_window=c.integer("n_window", d.n_window),
            n_window_infer=c.integer("n_window_infer", d.n_window_infer),
            downsample_hidden_size=c.integer("downsample_hidden_size",
                                             d.downsample_hidden_size),
            max_source_positions=c.integer("max_source_positions", d.max_source_positions),
            conv_chunksize=c.integer("conv_chunksize", d.conv_chunksize),
            activation_function=act,
        )
        out.check(source)
        return out

    def check(self, source: str) -> None:
        if self.d_model % self.encoder_attention_heads:
            raise ValueError(f"field 'd_model' of {source} ({self.d_model}) is not a multiple of "
                             f"'encoder_attention_heads' ({self.encoder_attention_heads})")
        if self.d_model % 2 or self.d_model < 4:
            raise ValueError(f"field 'd_model' of {source} ({self.d_model}) must be even and at "
                             "least 4 (sinusoidal positions use sin/cos halves)")
        if self.n_window_infer < self.chunk_frames:
            raise ValueError(f"field 'n_window_infer' of {source} ({self.n_window_infer}) is "
                             f"shorter than one chunk (2 * n_window = {self.chunk_frames})")
        per_chunk = feature_output_length(self.chunk_frames, self.n_window)
        if self.max_source_positions < per_chunk:
            raise ValueError(f"field 'max_source_positions' of {source} "
                             f"({self.max_source_positions}) is below the {per_chunk} frames "
                             "of one chunk")


def sinusoid_positions(length: int, channels: int, max_timescale: float = 10000.0) -> torch.Tensor:
    """``[length, channels]``: sin of every timescale, then cos (Whisper's layout)."""
    step = math.log(max_timescale) / (channels // 2 - 1)
    inv_timescales = torch.exp(-step * torch.arange(channels // 2).float())
    scaled = torch.arange(length)[:, None] * inv_timescales[None, :]
    return torch.cat([scaled.sin(), scaled.cos()], dim=1)


class _Windows:
    """The block-diagonal attention pattern: token index tables ``[count, length]``, one per
    distinct window length, so each length runs as one batched attention call."""

    def __init__(self, lengths: Sequence[int], device: torch.device) -> None:
        by_length: dict[int, list[int]] = {}  # window length -> start tokens
        start = 0
        for length in lengths:
            by_length.setdefault(length, []).append(start)
            start += length
        self.tables = [torch.tensor(s, device=device)[:, None]
                       + torch.arange(length, device=device)[None, :]
                       for length, s in by_length.items()]


class AudioAttention(nn.Module):
    def __init__(self, c: AudioEncoderConfig) -> None:
        super().__init__()
        self.heads = c.encoder_attention_heads
        self.head_dim = c.d_model // c.encoder_attention_heads
        self.q_proj = nn.Linear(c.d_model, c.d_model)
        self.k_proj = nn.Linear(c.d_model, c.d_model)
        self.v_proj = nn.Linear(c.d_model, c.d_model)
        self.out_proj = nn.Linear(c.d_model, c.d_model)

    def forward(self, x: torch.Tensor, windows: _Windows) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = (p(x).view(t, self.heads, self.head_dim) for p in
                   (self.q_proj, self.k_proj, self.v_proj))
        out = torch.empty_like(q)
        for table in windows.tables:  # [count, length] -> [count, heads, length, head_dim]
            qw, kw, vw = (y[table].transpose(1, 2) for y in (q, k, v))
            attended = F.scaled_dot_product_attention(qw, kw, vw)
            out[table.flatten()] = attended.transpose(1, 2).reshape(-1, self.heads, self.head_dim)
        return self.out_proj(out.reshape(t, -1))


class AudioEncoderLayer(nn.Module):
    def __init__(self, c: AudioEncoderConfig) -> None:
        super().__init__()
        self.self_attn = AudioAttention(c)
        self.self_attn_layer_norm = nn.LayerNorm(c.d_model)
        self.fc1 = nn.Linear(c.d_model, c.encoder_ffn_dim)
        self.fc2 = nn.Linear(c.encoder_ffn_dim, c.d_model)
        self.final_layer_norm = nn.LayerNorm(c.d_model)
        self.act = _ACTIVATIONS[c.activation_function]

    def forward(self, x: torch.Tensor, windows: _Windows) -> torch.Tensor:
        x = x + self.self_attn(self.self_attn_layer_norm(x), windows)
        x = x + self.fc2(self.act(self.fc1(self.final_layer_norm(x))))
        if x.dtype == torch.float16:  # as trained: keep fp16 activations finite
            limit = torch.finfo(x.dtype).max - 1000
            x = x.clamp(-limit, limit)
        return x


class AudioEncoder(nn.Module):
    """``forward([mel [num_mel_bins, T_i], ...]) -> [embeddings [output_length(T_i),
    output_dim], ...]``: several audios per call, their chunks sharing the conv batches and
    their windows the attention calls, each result independent of the others."""

    positions: torch.Tensor  # [max_source_positions, d_model], not in the checkpoint

    def __init__(self, config: AudioEncoderConfig) -> None:
        super().__init__()
        config.check("the audio encoder config")
        self.config = c = config
        hidden = c.downsample_hidden_size
        self.conv2d1 = nn.Conv2d(1, hidden, 3, 2, padding=1)
        self.conv2d2 = nn.Conv2d(hidden, hidden, 3, 2, padding=1)
        self.conv2d3 = nn.Conv2d(hidden, hidden, 3, 2, padding=1)
        self.conv_out = nn.Linear(hidden * c.conv_bins, c.d_model, bias=False)
        self.layers = nn.ModuleList(AudioEncoderLayer(c) for _ in range(c.encoder_layers))
        self.ln_post = nn.LayerNorm(c.d_model)
        self.proj1 = nn.Linear(c.d_model, c.d_model)
        self.proj2 = nn.Linear(c.d_model, c.output_dim)
        self.act = _ACTIVATIONS[c.activation_function]
        self.register_buffer("positions", torch.empty(c.max_source_positions, c.d_model),
                             persistent=False)
        self.init_buffers()

    @classmethod
    def from_hf(cls, config: Mapping[str, Any],
                source: str = "the audio_config") -> "AudioEncoder":
        """A randomly initialised encoder shaped by ``thinker_config["audio_config"]`` (fields
        it lacks take transformers' defaults)."""
        return cls(AudioEncoderConfig.from_hf(config, source))

    def init_buffers(self) -> None:
        """Recomputes the (non-checkpoint) position table; call after ``to_empty``."""
        c = self.config
        if self.positions.is_meta:
            return
        table = sinusoid_positions(c.max_source_positions, c.d_model)
        self.positions = table.to(self.positions.device, self.positions.dtype)

    def output_length(self, frames: int) -> int:
        return feature_output_length(frames, self.config.n_window)

    def window_length(self, frames: int) -> int:
        """Embeddings per attention window for an audio of ``frames`` mel frames: the inference
        window's chunks (``n_window_infer // (2 * n_window)``) times the embeddings of the
        audio's longest chunk (a full one, or the whole audio if shorter)."""
        c = self.config
        return (c.n_window_infer // c.chunk_frames) * self.output_length(min(frames,
                                                                             c.chunk_frames))

    def forward(self, features: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        frames = [self._check(i, f) for i, f in enumerate(features)]
        if not frames:
            return []
        embedded = self._embed_chunks(features, frames)  # per audio: [N_i, d_model]
        windows: list[int] = []
        for n, audio in zip(frames, embedded):
            size, count = self.window_length(n), audio.shape[0]
            windows += [size] * (count // size) + ([count % size] if count % size else [])
        x = torch.cat(embedded)
        table = _Windows(windows, x.device)
        for layer in self.layers:
            x = layer(x, table)
        x = self.proj2(self.act(self.proj1(self.ln_post(x))))
        return list(x.split([a.shape[0] for a in embedded]))

    def _check(self, index: int, mel: torch.Tensor) -> int:
        bins = self.config.num_mel_bins
        if not isinstance(mel, torch.Tensor) or mel.dim() != 2 or mel.shape[0] != bins \
                or mel.shape[1] < 1:
            shape = tuple(mel.shape) if isinstance(mel, torch.Tensor) else type(mel).__name__
            raise ValueError(f"audio {index} given to the audio encoder is {shape}; it must be "
                             f"log-mel features [{bins}, frames] with at least one frame")
        return int(mel.shape[1])

    def _embed_chunks(self, features: Sequence[torch.Tensor],
                      frames: list[int]) -> list[torch.Tensor]:
        """Convs, ``conv_out`` and positions for every chunk; chunks padded to the same length
        (all full-chunk audios share one length) run as one batch."""
        c = self.config
        weight = self.conv2d1.weight
        groups: dict[int, list[tuple[int, int, torch.Tensor]]] = {}  # padded length -> chunks
        for audio, (mel, n) in enumerate(zip(features, frames)):
            padded = min(n, c.chunk_frames)
            for start in range(0, n, c.chunk_frames):
                piece = mel[:, start:start + c.chunk_frames]
                groups.setdefault(padded, []).append((audio, piece.shape[1], piece))
        pieces: list[list[torch.Tensor]] = [[] for _ in frames]
        for padded, chunks in groups.items():
            batch = torch.zeros(len(chunks), 1, c.num_mel_bins, padded, dtype=weight.dtype,
                                device=weight.device)
            for row, (_, length, piece) in enumerate(chunks):
                batch[row, 0, :, :length] = piece.to(batch)
            out = torch.cat([self._convs(part) for part in batch.split(c.conv_chunksize)])
            for (audio, length, _), row in zip(chunks, out):
                pieces[audio].append(row[:self.output_length(length)])
        return [torch.cat(p) for p in pieces]

    def _convs(self, batch: torch.Tensor) -> torch.Tensor:
        """``[n, 1, bins, t]`` chunks -> ``[n, t / 8, d_model]`` with positions added."""
        x = F.gelu(self.conv2d1(batch))
        x = F.gelu(self.conv2d2(x))
        x = F.gelu(self.conv2d3(x))
        n, channels, bins, t = x.shape
        x = self.conv_out(x.permute(0, 3, 1, 2).reshape(n, t, channels * bins))
        return x + self.positions[:t].to(x.dtype)

"""Qwen3-Omni's code2wav: the talker's codec codes (G groups per 80 ms frame) -> 24 kHz audio.

Parameter names are the checkpoint's under ``code2wav.``, so ``load_state_dict`` takes its
tensors with that prefix stripped. Units, for the released model (``Code2WavConfig()``):

* a *frame* is one step of codes, G = 16 codes; it decodes to ``samples_per_frame`` =
  prod(upsampling_ratios) * prod(upsample_rates) = 4 * 480 = 1920 samples (80 ms);
* one decode of T frames gives ``samples_for(T)`` = T * 1920 - 555 samples: each decoder block's
  transposed conv trims the output that would read the step after the last (see
  :class:`~.code2wav_layers.CausalTransConv`), so the last frame's final 555 samples come only
  once the next frame is known. Decoding is *prefix-stable*: decode(codes[:T]) is a prefix of
  decode(codes[:T + n]), so a stream may emit samples [samples_for(T), samples_for(T + n)) when
  frames T .. T + n - 1 arrive, and the concatenation is the one-shot waveform;
* those samples need ``left_context_frames`` frames before frame T (578 for the released
  model): the transformer's sliding window reaches ``sliding_window - 1`` frames per layer
  (8 * 71 = 568), the convolutions 10 more (``conv_context_frames``). Decoding frames
  [T - left, T + n) and keeping the samples from samples_for(T) on is exact;
  :class:`~.code2wav_stream.Code2WavStreamNode` instead keeps each layer's last ``window - 1``
  keys and values, so it decodes only the conv context, not all 578 frames, again.

HF's ``chunked_decode(chunk_size=300, left_context_size=25)`` (what ``generate`` uses) is one-shot
decoding for up to 300 frames. Past that, each chunk boundary b drops the one-shot samples
[samples_for(b), b * 1920) -- the 555 held back for the next chunk's first frame -- and 25
frames of context, of 578, change the next chunk's first samples (slightly: the far context's
weight decays). :meth:`Code2Wav.chunked_decode` reproduces it; the stream node does not.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Optional

import torch
from torch import nn

from mstar_rt.models.qwen3_omni.code2wav_layers import (ACTIVATIONS, CausalConv,
                                                        CausalTransConv, ConvNeXtBlock,
                                                        DecoderBlock, LayerCache, PreTransformer,
                                                        ResidualUnit, SnakeBeta)


@dataclass(frozen=True)
class Code2WavConfig:
    """The fields of HF's ``code2wav_config`` that shape the model; defaults are the released
    Qwen3-Omni's. ``head_dim`` None means hidden_size // num_attention_heads."""

    codebook_size: int = 2048
    num_quantizers: int = 16
    hidden_size: int = 1024
    num_hidden_layers: int = 8
    num_attention_heads: int = 16
    num_key_value_heads: int = 16
    head_dim: Optional[int] = None
    intermediate_size: int = 3072
    hidden_act: str = "silu"
    attention_bias: bool = False
    sliding_window: int = 72
    rms_norm_eps: float = 1e-5
    layer_scale_initial_scale: float = 0.01
    rope_theta: float = 10000.0
    upsample_rates: tuple[int, ...] = (8, 5, 4, 3)
    upsampling_ratios: tuple[int, ...] = (2, 2)
    decoder_dim: int = 1536

    def __post_init__(self) -> None:
        head_dim = self.head_dim
        if head_dim is None:
            if self.hidden_size % self.num_attention_heads:
                raise ValueError(f"hidden_size {self.hidden_size} is not a multiple of "
                                 f"num_attention_heads {self.num_attention_heads}; give head_dim")
            head_dim = self.hidden_size // self.num_attention_heads
            object.__setattr__(self, "head_dim", head_dim)
        if head_dim % 2:
            raise ValueError(f"head_dim {head_dim} must be even (rotary positions)")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads {self.num_attention_heads} is not a multiple "
                             f"of num_key_value_heads {self.num_key_value_heads}")
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"hidden_act '{self.hidden_act}' is not one of "
                             f"{sorted(ACTIVATIONS)}")
        if not self.upsample_rates:
            raise ValueError("upsample_rates is empty; the decoder needs at least one block")
        if self.decoder_dim % 2 ** len(self.upsample_rates):
            raise ValueError(f"decoder_dim {self.decoder_dim} must halve "
                             f"{len(self.upsample_rates)} times (once per upsample rate)")

    @staticmethod
    def from_hf(config: Any, source: str = "code2wav_config") -> "Code2WavConfig":
        """From HF's ``code2wav_config`` (a dict or a ``PretrainedConfig``), each field checked so
        a bad one is a ValueError naming it. Generic HF keys are ignored; the rotary base is read
        from ``rope_parameters`` (transformers 5) or ``rope_theta`` (older files)."""
        from mstar_rt.models.checkpoint import ConfigFields

        if hasattr(config, "to_dict") and not isinstance(config, Mapping):
            config = config.to_dict()
        f, d = ConfigFields(config, source), Code2WavConfig()
        rope = f.mapping("rope_parameters")
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ValueError(f"field 'rope_parameters.rope_type' of {source} is {rope_type!r}; "
                             "code2wav supports only 'default' rotary positions")
        if rope:
            theta = ConfigFields(rope, f"field 'rope_parameters' of {source}").number(
                "rope_theta", d.rope_theta)
        else:
            theta = f.number("rope_theta", d.rope_theta)

        def sizes(name: str, default: tuple[int, ...], least: int) -> tuple[int, ...]:
            value = config.get(name, default)
            if not (isinstance(value, (list, tuple)) and len(value) >= least and len(value) <= 16
                    and all(type(v) is int and 1 <= v <= 4096 for v in value)):
                raise f.bad(name, value, f"a list of at least {least} integers in [1, 4096]")
            return tuple(value)

        fields: dict[str, Any] = {name: f.integer(name, getattr(d, name)) for name in (
            "codebook_size", "num_quantizers", "hidden_size", "num_attention_heads",
            "intermediate_size", "sliding_window", "decoder_dim")}
        fields.update(
            num_hidden_layers=f.integer("num_hidden_layers", d.num_hidden_layers, maximum=1024),
            num_key_value_heads=f.integer("num_key_value_heads", fields["num_attention_heads"]),
            head_dim=f.integer("head_dim") if config.get("head_dim") is not None else None,
            hidden_act=f.text("hidden_act", d.hidden_act),
            attention_bias=f.flag("attention_bias", d.attention_bias),
            rms_norm_eps=f.number("rms_norm_eps", d.rms_norm_eps),
            layer_scale_initial_scale=f.number("layer_scale_initial_scale",
                                               d.layer_scale_initial_scale, positive=False),
            rope_theta=theta,
            upsample_rates=sizes("upsample_rates", d.upsample_rates, 1),
            upsampling_ratios=sizes("upsampling_ratios", d.upsampling_ratios, 0))
        try:  # the rules between fields
            return Code2WavConfig(**fields)
        except ValueError as e:
            raise ValueError(f"{source}: {e}") from None

    @property
    def samples_per_frame(self) -> int:
        """The total upsampling: prod(upsampling_ratios) * prod(upsample_rates)."""
        return math.prod(self.upsampling_ratios) * math.prod(self.upsample_rates)


class Code2Wav(nn.Module):
    """Codes [B, G, T] (int, each in [0, codebook_size)) -> waveform [B, 1, samples_for(T)] in
    [-1, 1]. The two stages are public for streaming: :meth:`step` (embedding and transformer,
    with a per-layer key/value cache) and :meth:`vocode` (the convolutions)."""

    code_offset: torch.Tensor

    def __init__(self, config: Code2WavConfig = Code2WavConfig()) -> None:
        super().__init__()
        c = self.config = config
        assert c.head_dim is not None  # set by Code2WavConfig.__post_init__
        self.code_embedding = nn.Embedding(c.codebook_size * c.num_quantizers, c.hidden_size)
        self.register_buffer("code_offset", torch.arange(c.num_quantizers).view(1, -1, 1)
                             * c.codebook_size, persistent=False)
        self.pre_transformer = PreTransformer(
            c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads,
            c.head_dim, c.attention_bias, c.sliding_window, c.intermediate_size, c.hidden_act,
            c.rms_norm_eps, c.layer_scale_initial_scale, c.rope_theta)
        self.upsample = nn.ModuleList(
            nn.ModuleList([CausalTransConv(c.hidden_size, c.hidden_size, r, r),
                           ConvNeXtBlock(c.hidden_size)]) for r in c.upsampling_ratios)
        blocks = [DecoderBlock(c.decoder_dim // 2 ** i, c.decoder_dim // 2 ** (i + 1), r)
                  for i, r in enumerate(c.upsample_rates)]
        out = c.decoder_dim // 2 ** len(c.upsample_rates)
        self.decoder = nn.ModuleList([CausalConv(c.hidden_size, c.decoder_dim, 7), *blocks,
                                      SnakeBeta(out), CausalConv(out, 1, 7)])

    @classmethod
    def from_hf(cls, config: Any) -> "Code2Wav":
        """An (untrained) Code2Wav shaped by HF's ``code2wav_config``; load weights next."""
        return cls(Code2WavConfig.from_hf(config))

    # ---- sizes ---------------------------------------------------------------------------------

    @property
    def samples_per_frame(self) -> int:
        return self.config.samples_per_frame

    def samples_for(self, frames: int) -> int:
        """Samples a decode of ``frames`` frames gives (0 for none)."""
        n = frames
        for stage in self._vocoder_layers():
            if isinstance(stage, CausalTransConv):
                n = stage.out_length(n)
        return n

    @property
    def held_back_samples(self) -> int:
        """frames * samples_per_frame - samples_for(frames), for any frames >= 1 (555)."""
        return self.samples_per_frame - self.samples_for(1)

    @property
    def attention_context_frames(self) -> int:
        """Frames before a frame that its transformer output reads: (window - 1) per layer."""
        return self.config.num_hidden_layers * (self.config.sliding_window - 1)

    @property
    def conv_context_frames(self) -> int:
        """Transformer outputs before frame T that samples_for(T) .. onwards read (10)."""
        frames = 10 ** 6  # far from the start: no clipping; shifting by a frame shifts all
        return frames - self._first_frame_read(self.samples_for(frames))

    @property
    def left_context_frames(self) -> int:
        """Frames of codes before frame T that the samples frames T.. complete read (578)."""
        return self.attention_context_frames + self.conv_context_frames

    def receptive_field_frames(self) -> tuple[int, int]:
        """``(left, right)``: the samples that frame T completes read frames [T - left, T]."""
        return self.left_context_frames, 0

    def _vocoder_layers(self) -> list[nn.Module]:
        """Every layer after the transformer in order; residual units and ConvNeXt blocks whole."""
        layers = [m for pair in self.upsample for m in pair.children()]
        for m in self.decoder:
            layers += list(m.block) if isinstance(m, DecoderBlock) else [m]
        return layers

    def _first_frame_read(self, sample: int) -> int:
        """The first transformer output (frame) that output ``sample`` reads, walking back."""
        lo = sample
        for layer in reversed(self._vocoder_layers()):
            if isinstance(layer, CausalTransConv):
                lo //= layer.stride
            elif isinstance(layer, CausalConv):
                lo -= layer.reach
            elif isinstance(layer, ResidualUnit):
                lo -= layer.conv1.reach
            elif isinstance(layer, ConvNeXtBlock):
                lo -= layer.dwconv.reach
        return lo

    # ---- decoding ------------------------------------------------------------------------------

    def embed(self, codes: torch.Tensor) -> torch.Tensor:
        """[B, G, T] codes -> [B, T, hidden]: the mean of the G groups' embeddings."""
        self._check_codes(codes)
        return self.code_embedding(codes + self.code_offset).mean(1)

    def vocode(self, hidden: torch.Tensor) -> torch.Tensor:
        """Transformer outputs [B, T, hidden] -> waveform [B, 1, samples_for(T)] in [-1, 1]."""
        x = hidden.transpose(1, 2)
        for layer in [m for pair in self.upsample for m in pair.children()] + list(self.decoder):
            x = layer(x)
        return x.clamp(-1, 1)

    @torch.no_grad()
    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        """One decode of all of ``codes`` [B, G, T]: HF's ``code2wav(codes)``."""
        x = self.embed(codes)
        positions = torch.arange(x.shape[1], device=x.device).expand(x.shape[0], -1)
        hidden, _ = self.pre_transformer(x, positions)
        return self.vocode(hidden)

    def step(self, codes: torch.Tensor, positions: torch.Tensor,
             cache: Optional[list[LayerCache]]) -> tuple[torch.Tensor, list[LayerCache]]:
        """The transformer over new frames ``codes`` [B, G, n] at absolute ``positions`` [B, n],
        after the frames whose keys and values ``cache`` holds: (outputs [B, n, hidden], the
        cache for the next step)."""
        return self.pre_transformer(self.embed(codes), positions, cache)

    @torch.no_grad()
    def chunked_decode(self, codes: torch.Tensor, chunk_size: int = 300,
                       left_context_size: int = 25) -> torch.Tensor:
        """HF's ``chunked_decode``, as it is: chunks of ``chunk_size`` frames, each decoded after
        up to ``left_context_size`` frames and cut from the end of that context. Equal to
        :meth:`forward` for T <= chunk_size; longer, each chunk boundary loses
        :attr:`held_back_samples` samples, and a context under :attr:`left_context_frames`
        changes the next chunk's first samples."""
        if chunk_size < 1 or left_context_size < 0:
            raise ValueError(f"chunked_decode needs chunk_size >= 1 and left_context_size >= 0, "
                             f"got {chunk_size}, {left_context_size}")
        wavs, start, total = [], 0, codes.shape[-1]
        while start < total:
            end = min(start + chunk_size, total)
            context = left_context_size if start > left_context_size else start
            wav = self(codes[..., start - context: end])
            wavs.append(wav[..., context * self.samples_per_frame:])
            start = end
        if not wavs:
            return self(codes)  # lets _check_codes name the problem
        return torch.cat(wavs, dim=-1)

    def _check_codes(self, codes: torch.Tensor) -> None:
        g, size = self.config.num_quantizers, self.config.codebook_size
        if codes.dim() != 3 or codes.shape[1] != g or codes.dtype not in (torch.int64,
                                                                          torch.int32):
            raise ValueError(f"code2wav takes integer codes [batch, {g}, frames], got "
                             f"{codes.dtype} {tuple(codes.shape)}")
        if codes.shape[2] == 0:
            raise ValueError("code2wav got 0 frames of codes; decode at least one")
        if codes.numel() and (int(codes.min()) < 0 or int(codes.max()) >= size):
            raise ValueError(f"codes must lie in [0, {size}), got values in "
                             f"[{int(codes.min())}, {int(codes.max())}]")

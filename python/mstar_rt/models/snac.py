"""The SNAC neural audio codec's decoder (codes -> waveform), as Orpheus-style speech LMs use
it. Parameter names match the `snac` package, so a SNAC checkpoint's ``quantizer.*`` and
``decoder.*`` tensors load as they are (encoder tensors are skipped).

Units, for the 24 kHz speech model (``SnacConfig()``):

* a *latent frame* is one step of the decoder's input; it decodes to ``hop_length`` =
  prod(decoder_rates) = 8*8*4*2 = 512 samples (21.3 ms);
* codebook level i holds one code per ``vq_strides[i]`` latent frames ([4, 2, 1]);
* a *coarse frame* is one code of the coarsest level: lcm(vq_strides) = 4 latent frames, which
  carry 4/4 + 4/2 + 4/1 = 1 + 2 + 4 = 7 codes -- one Orpheus 7-token group -- and decode to
  4 * 512 = 2048 samples (85.3 ms).

Decoded audio is aligned to frames: latent frame f owns samples [f*hop, (f+1)*hop). Every
layer is non-causal, so a sample also depends on neighbouring frames; see
:meth:`SnacConfig.latent_receptive_field` for how many.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import os
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Sequence, Union

import torch
from torch import nn

from mstar_rt.models.snac_layers import (DecoderBlock, LocalMHA, NoiseDraw, Snake1d, WNConv1d)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_RESIDUAL_REACH = 3 * (1 + 3 + 9)  # kernel-7 convs with dilations 1, 3, 9: 3*d steps each side


@dataclass(frozen=True)
class SnacConfig:
    """The fields of a SNAC ``config.json``; defaults are the 24 kHz speech model
    (hubertsiuzdak/snac_24khz). ``latent_dim`` None means encoder_dim * 2**len(encoder_rates)."""

    sampling_rate: int = 24000
    encoder_dim: int = 48
    encoder_rates: tuple[int, ...] = (2, 4, 8, 8)
    latent_dim: Optional[int] = None
    decoder_dim: int = 1024
    decoder_rates: tuple[int, ...] = (8, 8, 4, 2)
    attn_window_size: Optional[int] = None
    codebook_size: int = 4096
    codebook_dim: int = 8
    vq_strides: tuple[int, ...] = (4, 2, 1)
    noise: bool = True
    depthwise: bool = True

    def __post_init__(self) -> None:
        for name in ("encoder_rates", "decoder_rates", "vq_strides"):
            object.__setattr__(self, name, tuple(int(v) for v in getattr(self, name)))
        if self.latent_dim is None:
            object.__setattr__(self, "latent_dim", self.encoder_dim * 2 ** len(self.encoder_rates))
        if not self.decoder_rates or not self.vq_strides:
            raise ValueError("a SNAC config needs at least one decoder rate and one vq stride")
        if self.decoder_dim % 2 ** len(self.decoder_rates):
            raise ValueError(f"decoder_dim {self.decoder_dim} must halve "
                             f"{len(self.decoder_rates)} times (one per decoder rate)")

    @staticmethod
    def from_dict(config: Mapping[str, Any], source: str = "the SNAC config") -> "SnacConfig":
        """Each field checked (type, range), so a bad one is a ValueError naming it."""
        from mstar_rt.models.checkpoint import dataclass_config

        if not isinstance(config, Mapping):
            raise ValueError(f"{source} must be a JSON object, not {type(config).__name__}")
        known = {f.name for f in dataclasses.fields(SnacConfig)}
        unknown = sorted(set(map(str, config)) - known)
        if unknown:
            raise ValueError(f"unknown SNAC config fields {unknown} in {source}; expected some "
                             f"of {sorted(known)}")
        return dataclass_config(SnacConfig, config, source)

    @staticmethod
    def from_dir(path: Union[str, os.PathLike]) -> "SnacConfig":
        from mstar_rt.models.checkpoint import read_config

        return SnacConfig.from_dict(read_config(path), os.path.join(path, "config.json"))

    def to_dict(self) -> dict[str, Any]:
        """The ``config.json`` form (lists, as `snac` writes them)."""
        return {k: list(v) if isinstance(v, tuple) else v
                for k, v in dataclasses.asdict(self).items()}

    @property
    def num_codebooks(self) -> int:
        return len(self.vq_strides)

    @property
    def hop_length(self) -> int:
        """Samples per latent frame: the decoder's total upsampling, prod(decoder_rates)."""
        return math.prod(self.decoder_rates)

    @property
    def latent_frames_per_coarse_frame(self) -> int:
        """Latent frames covered by one code of every level together: lcm(vq_strides)."""
        return math.lcm(*self.vq_strides)

    @property
    def codes_per_coarse_frame(self) -> int:
        """Codes (tokens) in one coarse frame, all levels: 7 for strides [4, 2, 1]."""
        return sum(self.latent_frames_per_coarse_frame // s for s in self.vq_strides)

    @property
    def samples_per_coarse_frame(self) -> int:
        """Samples one coarse frame (an Orpheus 7-token group) decodes to: 2048 at 24 kHz."""
        return self.latent_frames_per_coarse_frame * self.hop_length

    def latent_receptive_field(self) -> tuple[int, int]:
        """``(left, right)``: the samples of latent frame f depend on latent frames
        [f - left, f + right] and nothing else ((10, 10) for the 24 kHz model). With window
        attention the answer depends on f's place in its window; this is the worst case."""
        window = self.attn_window_size
        worst = (0, 0)
        for f in range(window or 1):
            lo, hi = self._latent_span(f * self.hop_length, (f + 1) * self.hop_length - 1)
            worst = (max(worst[0], f - lo), max(worst[1], hi - f))
        return worst

    def _latent_span(self, lo: int, hi: int) -> tuple[int, int]:
        """Latent frames that samples [lo, hi] (inclusive, from the start) depend on, walking the
        decoder backwards."""
        lo, hi = lo - 3, hi + 3  # last kernel-7 conv
        for stride in reversed(self.decoder_rates):
            lo, hi = lo - _RESIDUAL_REACH, hi + _RESIDUAL_REACH
            # transposed conv: output o = i*stride - pad + k for k in [0, 2*stride)
            pad = math.ceil(stride / 2)
            lo, hi = (lo + pad - 2 * stride) // stride + 1, (hi + pad) // stride
        if self.attn_window_size is not None:  # windows counted from the first frame
            w = self.attn_window_size
            lo, hi = lo // w * w, hi // w * w + w - 1
        return lo - 3, hi + 3  # first kernel-7 conv (the 1x1 after it reaches nowhere)

    @property
    def window_alignment(self) -> int:
        """Coarse frames a decode window's start and length must be multiples of: 1, or enough
        to keep attention windows where a one-shot decode has them."""
        if self.attn_window_size is None:
            return 1
        s = self.latent_frames_per_coarse_frame
        return math.lcm(s, self.attn_window_size) // s

    def receptive_field_frames(self) -> tuple[int, int]:
        """``(left, right)`` coarse frames of context that make a chunked decode exact: decoding
        coarse frames [a - left, b + right) (clipped to the stream) and keeping the samples of
        [a, b) gives what one decode of the whole stream gives there, up to float rounding --
        with noise off or :class:`PositionalNoise`. (3, 3) for the 24 kHz model."""
        left, right = self.latent_receptive_field()
        s, align = self.latent_frames_per_coarse_frame, self.window_alignment
        return (math.ceil(math.ceil(left / s) / align) * align,
                math.ceil(math.ceil(right / s) / align) * align)


@dataclass(frozen=True)
class PositionalNoise:
    """Noise that depends only on (seed, decoder block, absolute position), not on how the
    stream is cut into decode chunks, so chunked decodes agree with a one-shot one.
    ``frame_offset`` is the latent frame the decoded codes start at; ``seed`` and
    ``frame_offset`` may be one value for every batch row or a sequence with one per row."""

    seed: Union[int, Sequence[int]] = 0
    frame_offset: Union[int, Sequence[int]] = 0
    chunk: int = 4096  # positions drawn per generator seeding

    def draw(self, block: int, upsample: int, x: torch.Tensor) -> torch.Tensor:
        b, _, t = x.shape
        rows = []
        for seed, offset in zip(_per_row(self.seed, b, "seed"),
                                _per_row(self.frame_offset, b, "frame_offset")):
            if offset < 0:
                raise ValueError(f"PositionalNoise frame_offset must be >= 0, got {offset}")
            start = offset * upsample
            first, last = start // self.chunk, (start + t - 1) // self.chunk
            parts = [torch.randn(self.chunk, generator=torch.Generator().manual_seed(
                _mix(seed, block, c))) for c in range(first, last + 1)]
            rows.append(torch.cat(parts)[start - first * self.chunk:][:t])
        return torch.stack(rows).unsqueeze(1).to(device=x.device, dtype=x.dtype)


def _per_row(value: Union[int, Sequence[int]], batch: int, name: str) -> list[int]:
    if isinstance(value, int):
        return [value] * batch
    if len(value) != batch:
        raise ValueError(f"PositionalNoise {name} has {len(value)} values for {batch} rows")
    return [int(v) for v in value]


def _mix(seed: int, block: int, chunk: int) -> int:
    digest = hashlib.blake2b(f"{seed}:{block}:{chunk}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1  # manual_seed takes 63 bits


# What NoiseBlocks add: True = torch.randn on the default generator (what `snac` does, so equal
# seeds give equal audio), False = nothing, a Generator = randn drawn from it, PositionalNoise.
Noise = Union[bool, torch.Generator, PositionalNoise]


class _CodebookLevel(nn.Module):
    def __init__(self, config: SnacConfig, stride: int) -> None:
        super().__init__()
        self.stride = stride
        self.out_proj = WNConv1d(config.codebook_dim, config.latent_dim, 1)
        self.codebook = nn.Embedding(config.codebook_size, config.codebook_dim)


class _Quantizer(nn.Module):
    def __init__(self, config: SnacConfig) -> None:
        super().__init__()
        self.quantizers = nn.ModuleList(_CodebookLevel(config, s) for s in config.vq_strides)


class _Decoder(nn.Module):
    def __init__(self, config: SnacConfig) -> None:
        super().__init__()
        latent, channels = config.latent_dim, config.decoder_dim
        if config.depthwise:
            layers: list[nn.Module] = [WNConv1d(latent, latent, 7, padding=3, groups=latent),
                                       WNConv1d(latent, channels, 1)]
        else:
            layers = [WNConv1d(latent, channels, 7, padding=3)]
        if config.attn_window_size is not None:
            layers.append(LocalMHA(channels, config.attn_window_size))
        out = channels
        for i, stride in enumerate(config.decoder_rates):
            out = channels // 2 ** (i + 1)
            layers.append(DecoderBlock(channels // 2 ** i, out, stride, config.noise,
                                       groups=out if config.depthwise else 1))
        layers += [Snake1d(out), WNConv1d(out, 1, 7, padding=3), nn.Tanh()]
        self.model = nn.Sequential(*layers)
        self.rates = config.decoder_rates

    def forward(self, z: torch.Tensor, draw_for: Callable[[int, int], NoiseDraw]) -> torch.Tensor:
        block, upsample = 0, 1
        for layer in self.model:
            if isinstance(layer, DecoderBlock):
                upsample *= self.rates[block]
                z = layer(z, draw_for(block, upsample))
                block += 1
            else:
                z = layer(z)
        return z


class SnacDecoder(nn.Module):
    """SNAC codes -> audio. ``codes`` is one LongTensor per codebook level, [B, T * S / s_i]
    for T coarse frames (S = lcm(vq_strides), s_i = vq_strides[i]); audio is
    [B, 1, T * samples_per_coarse_frame]."""

    def __init__(self, config: SnacConfig) -> None:
        super().__init__()
        self.config = config
        self.quantizer = _Quantizer(config)
        self.decoder = _Decoder(config)

    @property
    def hop_length(self) -> int:
        return self.config.hop_length

    def receptive_field_frames(self) -> tuple[int, int]:
        return self.config.receptive_field_frames()

    @torch.no_grad()
    def codes_to_latent(self, codes: Sequence[torch.Tensor]) -> torch.Tensor:
        """The decoder's input [B, latent_dim, latent frames]: per level, codebook lookup, 1x1
        projection, each step repeated ``stride`` times; summed over levels."""
        self._check_codes(codes)
        z = None
        for level, c in zip(self.quantizer.quantizers, codes):
            z_i = level.out_proj(level.codebook(c).transpose(1, 2))
            z_i = z_i.repeat_interleave(level.stride, dim=-1)
            z = z_i if z is None else z + z_i
        return z

    @torch.no_grad()
    def decode(self, codes: Sequence[torch.Tensor], noise: Noise = True) -> torch.Tensor:
        """Audio [B, 1, samples] for ``codes``; see :data:`Noise` for ``noise``. With
        ``noise=True`` the default generator is drawn in `snac`'s order and shapes, so
        ``torch.manual_seed(s)`` before this and before ``SNAC.decode`` gives equal audio."""
        z = self.codes_to_latent(codes)
        return self.decoder(z, _noise_source(noise))

    def _check_codes(self, codes: Sequence[torch.Tensor]) -> None:
        cfg = self.config
        if len(codes) != cfg.num_codebooks:
            raise ValueError(f"SNAC decode needs {cfg.num_codebooks} code tensors (one per "
                             f"level), got {len(codes)}")
        frames = set()
        for i, (c, stride) in enumerate(zip(codes, cfg.vq_strides)):
            if c.dim() != 2 or c.dtype not in (torch.int64, torch.int32):
                raise ValueError(f"codes[{i}] must be an integer tensor [batch, steps], got "
                                 f"{c.dtype} {tuple(c.shape)}")
            frames.add((c.shape[0], c.shape[1] * stride))
        if len(frames) != 1:
            raise ValueError("codes levels disagree on batch or length: level i needs "
                             f"latent_frames / {list(cfg.vq_strides)}[i] steps, got shapes "
                             f"{[tuple(c.shape) for c in codes]}")
        (_, length), = frames
        if length == 0:
            raise ValueError("codes are empty; decode at least one coarse frame")
        if cfg.attn_window_size and length % cfg.attn_window_size:
            raise ValueError(f"this SNAC's attention needs a multiple of "
                             f"{cfg.attn_window_size} latent frames, got {length}")
        low = min(int(c.min()) for c in codes)
        high = max(int(c.max()) for c in codes)
        if low < 0 or high >= cfg.codebook_size:
            raise ValueError(f"codes must lie in [0, {cfg.codebook_size}), got values from "
                             f"{low} to {high}")

    def fold_weight_norm(self) -> "SnacDecoder":
        """Replaces every (g, v) pair by the weight it defines (parameters become
        ``<conv>.weight``); decoding no longer recomputes them."""
        for m in self.modules():
            if isinstance(m, WNConv1d):
                m.fold()
        return self

    @classmethod
    def from_snac_state_dict(cls, state_dict: Mapping[str, torch.Tensor],
                             config: SnacConfig = SnacConfig(), fold: bool = True,
                             source: str = "the state dict") -> "SnacDecoder":
        """A decoder holding a `snac.SNAC` state dict's quantizer and decoder tensors (weight
        norm as ``parametrizations.weight.original0/1`` or the older ``weight_g/weight_v``)."""
        from mstar_rt.models.checkpoint import meta_module

        # the config's sizes against the weights, before allocating
        meta_module(lambda: cls(config), f"the SNAC config for {source}") \
            .load_snac_state_dict(state_dict, source, check_only=True)
        model = cls(config)
        model.load_snac_state_dict(state_dict, source)
        return model.fold_weight_norm() if fold else model

    def load_snac_state_dict(self, state_dict: Mapping[str, torch.Tensor],
                             source: str = "the state dict", check_only: bool = False) -> None:
        """Loads a SNAC state dict into this (unfolded) decoder; unknown keys, missing
        parameters and shape mismatches are one ValueError listing them (``check_only``: only
        that check, which works on a decoder built on the meta device)."""
        if any(isinstance(m, WNConv1d) and m.folded for m in self.modules()):
            raise ValueError("load a SNAC state dict before fold_weight_norm(), not after")
        wanted = self.state_dict()
        state = {}
        for key, tensor in state_dict.items():
            if not _encoder_side(key):
                state[_modern_weight_norm_key(key)] = tensor
        problems = []
        unknown = sorted(k for k in state if k not in wanted)
        missing = sorted(k for k in wanted if k not in state)
        shapes = [f"{k} {tuple(state[k].shape)} (expected {tuple(v.shape)})"
                  for k, v in wanted.items() if k in state and state[k].shape != v.shape]
        # cast, an int8 or bool codebook became other numbers (a bool one, all zeros)
        dtypes = [f"{k} ({state[k].dtype})" for k in wanted if k in state
                  and isinstance(state[k], torch.Tensor) and not state[k].is_floating_point()]
        for label, keys in (("unknown keys", unknown), ("missing parameters", missing),
                            ("shape mismatches", shapes),
                            ("tensors that are not floating point", dtypes)):
            if keys:
                shown = ", ".join(keys[:8]) + (" ..." if len(keys) > 8 else "")
                problems.append(f"{len(keys)} {label}: {shown}")
        if problems:
            raise ValueError(f"{source} does not fit SnacDecoder({self.config}): "
                             + "; ".join(problems) + ". Check that config.json belongs to "
                             "these weights")
        if not check_only:
            self.load_state_dict(state)


def _encoder_side(key: str) -> bool:
    """Encoder tensors, and the quantizer's in_proj (used only when encoding)."""
    parts = key.split(".")
    return parts[0] == "encoder" or (parts[:2] == ["quantizer", "quantizers"]
                                     and len(parts) > 3 and parts[3] == "in_proj")


def _modern_weight_norm_key(key: str) -> str:
    for old, new in ((".weight_g", ".parametrizations.weight.original0"),
                     (".weight_v", ".parametrizations.weight.original1")):
        if key.endswith(old):
            return key[: -len(old)] + new
    return key


def _noise_source(noise: Noise) -> Callable[[int, int], NoiseDraw]:
    if isinstance(noise, PositionalNoise):
        return lambda block, up: (lambda x: noise.draw(block, up, x))
    if isinstance(noise, torch.Generator):
        return lambda block, up: (lambda x: torch.randn(
            (x.shape[0], 1, x.shape[2]), generator=noise, device=noise.device,
            dtype=x.dtype).to(x.device))
    if noise is True:
        return lambda block, up: (lambda x: torch.randn(
            (x.shape[0], 1, x.shape[2]), device=x.device, dtype=x.dtype))
    if noise is False:
        return lambda block, up: (lambda x: None)
    raise TypeError(f"noise must be a bool, a torch.Generator or PositionalNoise, got "
                    f"{type(noise).__name__}")


def read_snac_weights(path: Union[str, os.PathLike],
                      progress: bool = True) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint directory ``path``: safetensors (one file or sharded) if
    there are any, else ``pytorch_model.bin`` (read with ``weights_only=True``)."""
    from tqdm.auto import tqdm

    from mstar_rt.models.checkpoint import checkpoint_files

    names = os.listdir(path)
    if any(n.endswith(".safetensors") for n in names):
        from safetensors.torch import load_file

        files = checkpoint_files(path)
        state: dict[str, torch.Tensor] = {}
        for file in tqdm(files, desc=f"loading {os.path.basename(os.fspath(path))}",
                         unit="file", disable=not progress):
            try:
                state.update(load_file(file))
            except Exception as e:  # SafetensorError, OSError: truncated, corrupt, missing
                raise ValueError(f"{file} is not a readable safetensors file: "
                                 f"{type(e).__name__}: {e}") from None
        return state
    if "pytorch_model.bin" in names:
        file = os.path.join(path, "pytorch_model.bin")
        try:
            state = torch.load(file, map_location="cpu", weights_only=True)
        except Exception as e:  # truncated (a zip error), not a pickle, a disallowed global
            raise ValueError(f"{file} is not a readable PyTorch state dict: "
                             f"{type(e).__name__}: {e}") from None
        if not (isinstance(state, dict) and all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                                for k, v in state.items())):
            raise ValueError(f"{file} holds a {type(state).__name__}, not a state dict "
                             "(parameter name -> tensor)")
        return state
    raise FileNotFoundError(f"{path} holds no SNAC weights (expected model.safetensors or "
                            "pytorch_model.bin next to config.json)")


def load_snac(path: Union[str, os.PathLike], device: Union[str, torch.device] = "cpu",
              dtype: Union[torch.dtype, str, None] = None, progress: bool = True,
              fold: bool = True) -> SnacDecoder:
    """A :class:`SnacDecoder` from a SNAC checkpoint directory (``config.json`` plus
    ``model.safetensors`` or ``pytorch_model.bin``), weight norm folded unless ``fold=False``,
    in eval mode. Weights are folded in float32, then cast to ``dtype`` if given."""
    if isinstance(dtype, str):
        if dtype not in _DTYPES:
            raise ValueError(f"dtype '{dtype}' is not one of {list(_DTYPES)}")
        dtype = _DTYPES[dtype]
    config = SnacConfig.from_dir(path)
    state = read_snac_weights(path, progress)
    model = SnacDecoder.from_snac_state_dict(state, config, fold=fold,
                                             source=f"the checkpoint at {path}")
    model = model.to(device)
    if dtype is not None:
        model = model.to(dtype)
    return model.eval()

"""Helpers shared by the LeRobot parity-fixture generators (make_*_fixtures.py).

Runs ONLY in the separate LeRobot venv (see setup_lerobot_venv.sh); it is never imported by the
project's tests.  Nothing here re-implements LeRobot: these helpers seed, randomise parameters,
build tiny tokenizers with the `tokenizers` library, record what LeRobot's own methods return,
and write files.
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import json
import os
import random
import shutil
import sys
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

REPO_ROOT = Path(__file__).resolve().parents[2]
FIXTURES = Path(__file__).resolve().parent / "fixtures"
MAX_FAMILY_BYTES = 5 * 1024 * 1024


# --------------------------------------------------------------------------------------- seeding
def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    os.environ["PYTHONHASHSEED"] = str(seed)
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.set_num_threads(max(1, min(2, torch.get_num_threads())))


def randomize_parameters(module: torch.nn.Module, seed: int, vec_std: float = 0.1) -> None:
    """Give every parameter a non-trivial random value so every code path contributes.

    LeRobot/transformers init several tensors to zero (Gemma RMSNorm weights are used as
    ``1 + w``; the pi0.5 adaRMS ``dense`` layers start at zero, which would make every expert gate
    zero).  Rule, in sorted-name order from one generator:
      * tensors with >= 2 dims: N(0, 1/fan_in), fan_in = numel of one output row;
      * 1-D tensors (biases, norm scales): their init value + N(0, vec_std).
    Tied parameters (the same tensor under two names) are drawn once.
    """
    gen = torch.Generator().manual_seed(seed)
    seen: set[int] = set()
    with torch.no_grad():
        for name, p in sorted(module.named_parameters(remove_duplicate=False), key=lambda kv: kv[0]):
            if id(p) in seen or not p.is_floating_point():
                continue
            seen.add(id(p))
            if p.ndim >= 2:
                fan_in = p[0].numel()
                val = torch.randn(p.shape, generator=gen, dtype=torch.float32) / fan_in**0.5
                p.copy_(val.to(p.dtype))
            else:
                val = torch.randn(p.shape, generator=gen, dtype=torch.float32) * vec_std
                p.add_(val.to(p.dtype))


# --------------------------------------------------------------------------------------- inputs
def smooth_image(gen: torch.Generator, h: int, w: int) -> torch.Tensor:
    """A [3, H, W] float32 image in [0, 1] made of k/255 values (exactly representable as uint8),
    smooth enough that bilinear resizing matters."""
    coarse = torch.rand((1, 3, 4, 5), generator=gen)
    img = torch.nn.functional.interpolate(coarse, size=(h, w), mode="bilinear", align_corners=False)[0]
    img = img + 0.15 * torch.rand((3, h, w), generator=gen)
    img = (img.clamp(0, 1) * 255).round() / 255.0
    return img.to(torch.float32)


def make_stats(gen: torch.Generator, dim: int) -> dict[str, torch.Tensor]:
    """Dataset statistics in LeRobot's layout (all of mean/std/min/max/q01/q99)."""
    mean = torch.randn(dim, generator=gen) * 0.5
    std = 0.5 + torch.rand(dim, generator=gen)
    return {
        "mean": mean,
        "std": std,
        "min": mean - 3 * std,
        "max": mean + 3 * std,
        "q01": mean - 2.3 * std,
        "q99": mean + 2.3 * std,
        "count": torch.tensor([1000]),
    }


# --------------------------------------------------------------------------------------- tokenizers
PROMPT_WORDS = (
    "pick up the red green blue yellow block cube cup bowl and place put it in on into onto "
    "left right top bottom of table drawer open close push pull move grasp stack towel fold "
    "task state action robot arm gripper Task State Action"
).split()


def _unigram_pieces(prefix_space: str, extra_words: list[str]) -> list[tuple[str, float]]:
    chars = sorted(set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789,.;:!?'\"-_()"))
    pieces: list[tuple[str, float]] = []
    pieces += [(prefix_space, -6.0)]
    pieces += [(c, -8.0) for c in chars]
    pieces += [(prefix_space + c, -9.0) for c in chars]
    words = sorted(set(PROMPT_WORDS + extra_words))
    pieces += [(prefix_space + w, -2.0 - 0.01 * i) for i, w in enumerate(words)]
    pieces += [(w, -3.0 - 0.01 * i) for i, w in enumerate(words)]
    return pieces


def build_gemma_like_tokenizer(out_dir: Path, vocab_size: int) -> Any:
    """A tiny SentencePiece-style tokenizer (Gemma layout: <pad>=0, <eos>=1, <bos>=2, <unk>=3,
    '▁' for spaces, byte fallback, BOS prepended), built explicitly -- no training, so it is
    deterministic.  Padded with <unused_N> pieces to exactly `vocab_size` entries."""
    from tokenizers import Tokenizer, decoders, models, normalizers, processors
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<eos>", "<bos>", "<unk>"]
    vocab: list[tuple[str, float]] = [(s, 0.0) for s in specials]
    vocab += [(f"<0x{b:02X}>", 0.0) for b in range(256)]
    vocab += _unigram_pieces("▁", [])
    if len(vocab) > vocab_size:
        raise ValueError(f"tokenizer needs {len(vocab)} entries > vocab_size {vocab_size}")
    vocab += [(f"<unused{i}>", -100.0) for i in range(vocab_size - len(vocab))]
    tok = Tokenizer(models.Unigram(vocab, unk_id=3, byte_fallback=True))
    tok.normalizer = normalizers.Replace(" ", "▁")
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    tok.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A $B", special_tokens=[("<bos>", 2)]
    )
    tok.add_special_tokens(specials)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<bos>",
        eos_token="<eos>",
        unk_token="<unk>",
        pad_token="<pad>",
        model_max_length=1 << 30,
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(out_dir))
    return fast


def build_smollm_like_tokenizer(out_dir: Path, specials: list[str], extra_special: dict[str, str]) -> Any:
    """A tiny GPT-2/SmolLM2-style tokenizer (byte-level pre-tokenizer, no BOS added), built
    explicitly as a Unigram model over byte-level pieces -- deterministic, no training.
    `specials` get the first ids (SmolLM2 layout: <|endoftext|>=0, <|im_start|>=1, <|im_end|>=2,
    ...); `extra_special` become tokenizer attributes (e.g. fake_image_token)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab: list[tuple[str, float]] = [(s, 0.0) for s in specials]
    vocab += [(c, -10.0) for c in sorted(byte_alphabet)]
    words = sorted(set(PROMPT_WORDS))
    vocab += [("Ġ" + w, -2.0 - 0.01 * i) for i, w in enumerate(words)]
    vocab += [(w, -3.0 - 0.01 * i) for i, w in enumerate(words)]
    tok = Tokenizer(models.Unigram(vocab, unk_id=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(specials)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|im_end|>",
        unk_token="<|endoftext|>",
        model_max_length=1 << 30,
        extra_special_tokens=extra_special,
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(out_dir))
    return fast


# --------------------------------------------------------------------------------------- recording
class Recorder:
    """Wraps bound methods on an instance (instance attribute shadowing the class method) and
    records their inputs/outputs; the wrapped call itself is unchanged."""

    def __init__(self) -> None:
        self.calls: dict[str, list[tuple[tuple, dict, Any]]] = {}
        self._undo: list[Callable[[], None]] = []

    def wrap(self, obj: Any, name: str, key: str | None = None) -> None:
        key = key or name
        orig = getattr(obj, name)
        self.calls.setdefault(key, [])

        def wrapper(*args, **kwargs):
            out = orig(*args, **kwargs)
            self.calls[key].append((args, kwargs, out))
            return out

        setattr(obj, name, wrapper)
        self._undo.append(lambda: delattr(obj, name))

    def restore(self) -> None:
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()


def kv_cache_tensors(cache: Any, prefix: str) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for i, layer in enumerate(cache.layers):
        out[f"{prefix}.{i}.keys"] = layer.keys
        out[f"{prefix}.{i}.values"] = layer.values
    return out


# --------------------------------------------------------------------------------------- writing
def to_saveable(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for k, v in tensors.items():
        v = v.detach().cpu()
        if v.dtype == torch.bfloat16 or v.dtype == torch.float16 or v.dtype == torch.float64:
            v = v.to(torch.float32)
        out[k] = v.contiguous().clone()
    return out


def save_io(path: Path, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
    from safetensors.torch import save_file

    save_file(to_saveable(tensors), str(path), metadata={"json": json.dumps(meta, sort_keys=True)})
    path.with_suffix(".json").write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")


def state_dict_summary(sd: dict[str, torch.Tensor], n_edge: int = 6) -> dict[str, Any]:
    keys = list(sd)
    return {
        "num_tensors": len(keys),
        "num_params": int(sum(v.numel() for v in sd.values())),
        "first_keys": keys[:n_edge],
        "last_keys": keys[-n_edge:],
    }


def write_keys_json(path: Path, sd: dict[str, torch.Tensor], extra: dict[str, Any]) -> Path:
    doc = dict(extra)
    doc["num_tensors"] = len(sd)
    doc["num_params"] = int(sum(v.numel() for v in sd.values()))
    doc["keys"] = {k: list(v.shape) for k, v in sd.items()}
    text = json.dumps(doc, indent=1) + "\n"
    if len(text.encode()) > 1024 * 1024:
        path = path.with_suffix(".json.gz")
        with gzip.GzipFile(str(path), "wb", mtime=0) as fh:
            fh.write(text.encode())
    else:
        path.write_text(text)
    return path


def dir_size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def sha256_file(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def file_listing(root: Path) -> list[tuple[str, int]]:
    return sorted((str(f.relative_to(root)), f.stat().st_size) for f in root.rglob("*") if f.is_file())


def versions() -> dict[str, str]:
    import lerobot
    import safetensors
    import tokenizers
    import transformers

    return {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "tokenizers": tokenizers.__version__,
        "safetensors": safetensors.__version__,
        "lerobot": getattr(lerobot, "__version__", "?"),
    }


# --------------------------------------------------------------------------------------- RTC case
RTC_DELAY = 3  # inference_delay d: actions of the previous chunk that execute during inference
RTC_EXECUTED = 3  # actions of the previous chunk already executed: the left-over is chunk[3:]


@contextlib.contextmanager
def rtc_checkpoint(ckpt: Path, rtc_dir: Path, rtc: dict[str, Any]):
    """Writes ``rtc_dir/config.json``: the checkpoint's config with ``rtc_config`` set (read and
    written by LeRobot's own ``PreTrainedConfig``; nothing else changes), and yields a temporary
    checkpoint directory = ``ckpt`` with that config, for ``Policy.from_pretrained``."""
    import tempfile

    from lerobot.configs import RTCAttentionSchedule
    from lerobot.configs.policies import PreTrainedConfig
    from lerobot.policies.rtc.configuration_rtc import RTCConfig

    cfg = PreTrainedConfig.from_pretrained(str(ckpt))
    cfg.rtc_config = RTCConfig(
        enabled=True,
        prefix_attention_schedule=RTCAttentionSchedule(rtc["prefix_attention_schedule"]),
        max_guidance_weight=rtc["max_guidance_weight"],
        execution_horizon=rtc["execution_horizon"],
    )
    rtc_dir.mkdir(parents=True, exist_ok=True)
    cfg._save_pretrained(rtc_dir)
    plain = json.loads((ckpt / "config.json").read_text())
    with_rtc = json.loads((rtc_dir / "config.json").read_text())
    assert {k for k in plain if plain[k] != with_rtc.get(k)} == {"rtc_config"}, "config drifted"
    assert set(plain) == set(with_rtc)
    with tempfile.TemporaryDirectory() as tmp:
        for f in ckpt.iterdir():
            shutil.copy(f, tmp)
        shutil.copy(rtc_dir / "config.json", tmp)
        yield Path(tmp)


def record_rtc(policy: Any, post: Any, batch: dict, prev_chunk: torch.Tensor, noise: torch.Tensor,
               num_steps: int) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """LeRobot's guided real-time chunking, as its RTC rollout calls it:
    ``policy.predict_action_chunk(batch, noise=noise, inference_delay=d,
    prev_chunk_left_over=left_over)`` (``execution_horizon`` from the config's ``rtc_config``),
    with ``left_over = prev_chunk[:, RTC_EXECUTED:]`` (normalised, as the policy returned it).
    Records the Euler trajectory, the base and guided velocities and LeRobot's prefix weights;
    also the same call without ``prev_chunk_left_over`` (no guidance, same noise)."""
    model, rtc = policy.model, policy.rtc_processor
    assert policy._rtc_enabled() and rtc is not None
    left_over = prev_chunk[:, RTC_EXECUTED:].clone()
    rec = Recorder()
    rec.wrap(model, "denoise_step")
    rec.wrap(rtc, "denoise_step", "rtc_denoise_step")
    with torch.no_grad():
        chunk = policy.predict_action_chunk(dict(batch), noise=noise.clone(), inference_delay=RTC_DELAY,
                                            prev_chunk_left_over=left_over.clone())
    rec.restore()
    with torch.no_grad():
        unguided = policy.predict_action_chunk(dict(batch), noise=noise.clone(), inference_delay=RTC_DELAY,
                                               prev_chunk_left_over=None)
        again = policy.predict_action_chunk(dict(batch), noise=noise.clone(), inference_delay=RTC_DELAY,
                                            prev_chunk_left_over=left_over.clone())
    assert torch.equal(chunk, again), "guided reference is not deterministic"
    c = rec.calls
    assert len(c["denoise_step"]) == len(c["rtc_denoise_step"]) == num_steps
    x_ts = torch.stack([call[1]["x_t"] for call in c["denoise_step"]])
    ts = torch.stack([call[1]["timestep"] for call in c["denoise_step"]])
    v_base = torch.stack([call[2] for call in c["denoise_step"]])
    v_guided = torch.stack([call[2] for call in c["rtc_denoise_step"]])
    x_final = x_ts[-1] + (-1.0 / num_steps) * v_guided[-1]
    action_dim = chunk.shape[-1]
    assert torch.allclose(x_final[:, :, :action_dim], chunk, atol=1e-6)
    cfg = policy.config.rtc_config
    horizon = min(cfg.execution_horizon, left_over.shape[1])  # LeRobot clips it to the left-over
    weights = rtc.get_prefix_weights(RTC_DELAY, horizon, chunk.shape[1])
    tensors = {
        "input.noise": noise,
        "input.prev_chunk_left_over": left_over,
        "input.prev_actions": post(left_over.clone())[0],
        "model.prefix_weights": weights,
        "model.x_t": x_ts,
        "model.t": ts,
        "model.v_t_base": v_base,
        "model.v_t": v_guided,
        "model.actions_padded": x_final,
        "output.action_chunk_normalized": chunk,
        "output.action_chunk": post(chunk.clone()),
        "output.unguided.action_chunk_normalized": unguided,
        "output.unguided.action_chunk": post(unguided.clone()),
    }
    meta = {
        "rtc_config": {
            "enabled": cfg.enabled,
            "prefix_attention_schedule": str(cfg.prefix_attention_schedule.value),
            "max_guidance_weight": cfg.max_guidance_weight,
            "execution_horizon": cfg.execution_horizon,
        },
        "inference_delay": RTC_DELAY,
        "executed_of_previous_chunk": RTC_EXECUTED,
        "left_over_steps": int(left_over.shape[1]),
        "effective_execution_horizon": horizon,
        "max_abs_guided_minus_unguided": float((chunk - unguided).abs().max()),
    }
    return tensors, meta


def write_rtc_readme(rtc_dir: Path, family: str, meta: dict, tensors: dict[str, torch.Tensor]) -> None:
    r = meta["rtc_config"]
    lines = [
        f"# {family}: guided real-time chunking (LeRobot 0.6.1 `RTCProcessor`)",
        "",
        "Written by the family's generator with the fixture one folder up; do not edit by hand.",
        "",
        "* `config.json` -- `../checkpoint/config.json` with `rtc_config` set, as LeRobot's "
        "`PreTrainedConfig` writes it (no other field differs): "
        f"`{json.dumps(r)}`. A checkpoint with RTC = `../checkpoint/` with this `config.json`.",
        "* `io.safetensors` (+ `io.json`) -- the guided call. The observation is the plain fixture's "
        "(`../io.safetensors`: `input.*` cameras, state, task); the noise is new.",
        "",
        "```python",
        *meta["call"],
        "```",
        "",
        "Inside, `euler_integrate` routes every step through `RTCProcessor.denoise_step`: the "
        "left-over is zero-padded to `[1, chunk, max_action_dim]`; the execution horizon is clipped to "
        f"the left-over's length ({meta['left_over_steps']} -> {meta['effective_execution_horizon']}); "
        "weights `W = get_prefix_weights(d, horizon, chunk)` (1 below d, the schedule's ramp to the "
        "horizon, 0 after); `x1 = x - t v` with `v` the plain velocity (computed before `x` requires "
        "grad, so the autograd correction is `W (prev - x1)` itself); `tau = 1 - t`; "
        "`g = min(max_w, nan_to_num((1-tau)/tau * ((1-tau)^2 + tau^2)/(1-tau)^2, posinf=max_w))`; "
        "guided `v - g W (prev - x1)`; `x <- x - v_guided / num_steps`.",
        "",
        "| key | shape | dtype |",
        "| --- | --- | --- |",
    ]
    for k, v in tensors.items():
        lines.append(f"| `{k}` | {list(v.shape)} | {str(v.dtype).replace('torch.', '')} |")
    lines += [
        "",
        "`input.prev_chunk_left_over` = `../io.safetensors: output.action_chunk_normalized[:, "
        f"{meta['executed_of_previous_chunk']}:]` (normalised, what `predict_action_chunk` takes); "
        "`input.prev_actions` = the same after the postprocessor (un-normalised); "
        "`model.prefix_weights` = `RTCProcessor.get_prefix_weights`; `model.x_t[k]`, `model.t[k]` = "
        "the Euler state and time at step k; `model.v_t_base[k]` = `denoise_step` (plain velocity); "
        "`model.v_t[k]` = `RTCProcessor.denoise_step` (guided velocity the step used); "
        "`output.unguided.*` = the same call with `prev_chunk_left_over=None` (max |guided - unguided| "
        f"= {meta['max_abs_guided_minus_unguided']:.3g}).",
        "",
    ]
    (rtc_dir / "README.md").write_text("\n".join(lines))

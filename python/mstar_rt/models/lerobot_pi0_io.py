"""LeRobot's pre- and post-processing of a pi0 / pi0.5 policy, read from the policy directory
(``policy_preprocessor.json``, ``policy_postprocessor.json`` and their normalizer state files).

* Images: float ``[3, H, W]`` in [0, 1] as LeRobot feeds them (uint8 and ``[H, W, 3]`` are
  accepted and converted: ``/ 255``); resized with padding to the square resolution as openpi
  does (bilinear, no antialias, aspect ratio kept, zero bars centred, the odd row or column at
  the bottom / right), then scaled to [-1, 1].
* State and actions: normalised with the dataset statistics (MEAN_STD ``(x - mean) / (std +
  eps)``, MIN_MAX, QUANTILES ``2 (x - q01) / (q99 - q01) - 1``, QUANTILE10 or IDENTITY); the
  chunk is un-normalised the inverse way (MEAN_STD ``y std + mean``).
* Prompt: pi0 appends a newline to the task; pi0.5 writes the normalised state into it,
  discretised into 256 bins: ``"Task: {task}, State: {bins};\\nAction: "``. Tokens: ``<bos>``
  + pieces, truncated and right-padded to the tokenizer step's ``max_length``.
"""

from __future__ import annotations

import os
from typing import Any, Mapping, Optional, Union

import numpy as np
import torch
import torch.nn.functional as F

from mstar_rt.models.checkpoint import read_json, read_tokenizer
from mstar_rt.models.lerobot_inputs import unit_image
from mstar_rt.models.lerobot_normalizer import Normalizer, step_eps
from mstar_rt.models.lerobot_processor import processor_steps
from mstar_rt.models.lerobot_pi0_config import PiConfig

PathLike = Union[str, os.PathLike]
#: Processor steps whose effect is reproduced here (or that do nothing at inference).
PI_STEPS = frozenset({"rename_observations_processor", "to_batch_processor", "device_processor",
                      "pi0_new_line_processor", "tokenizer_processor", "normalizer_processor",
                      "pi05_prepare_state_tokenizer_processor_step", "relative_actions_processor",
                      "unnormalizer_processor", "absolute_actions_processor"})


# ---- images ------------------------------------------------------------------------------------

def resize_with_pad(image: torch.Tensor, size: int) -> torch.Tensor:
    """``[3, H, W]`` in [0, 1] -> ``[3, size, size]``: bilinear resize keeping the aspect ratio
    (openpi's ``int(H / ratio)``), clamped to [0, 1], zero-padded centred."""
    h, w = image.shape[1:]
    if (h, w) == (size, size):
        return image
    ratio = max(w / size, h / size)
    nh, nw = int(h / ratio), int(w / ratio)
    # channels-last in memory, as LeRobot hands the [B, H, W, C] image to interpolate
    x = image.permute(1, 2, 0)[None].permute(0, 3, 1, 2)
    x = F.interpolate(x, size=(nh, nw), mode="bilinear", align_corners=False).clamp(0.0, 1.0)
    top, left = (size - nh) // 2, (size - nw) // 2
    x = F.pad(x, (left, size - nw - left, top, size - nh - top), value=0.0)
    return x[0].contiguous()


def preprocess_image(image: Any, size: int, where: str = "image") -> torch.Tensor:
    """Any accepted image -> ``[3, size, size]`` in [-1, 1], as LeRobot's ``_preprocess_images``."""
    return resize_with_pad(unit_image(image, where), size) * 2.0 - 1.0


# ---- normalisation -----------------------------------------------------------------------------

def _normalizer(path: PathLike, step: Mapping[str, Any], name: str, mode: str,
                size: int) -> Normalizer:
    """``name``'s normalizer from the statistics file ``step`` names (none: no statistics)."""
    from safetensors.torch import load_file

    config = step.get("config") or {}
    eps = step_eps(config, f"{path} (its {step['registry_name']} step)")
    state_file = step.get("state_file")
    if not state_file:
        return Normalizer(name, mode, {}, eps, size, f"{path} (its {step['registry_name']} "
                          "step names no state_file)")
    file = os.path.join(path, state_file)
    try:
        flat = load_file(file)
    except Exception as e:
        raise ValueError(f"{file} is not a readable normalizer state file ({e})") from None
    prefix = name + "."
    stats = {k[len(prefix):]: v for k, v in flat.items() if k.startswith(prefix)}
    return Normalizer(name, mode, stats, eps, size, file)


_PROMPTS_KEPT = 1024


class PiProcessor:
    """Turns a raw observation into the model's inputs and the model's chunk into actions."""

    def __init__(self, config: PiConfig, state: Normalizer, action: Normalizer,
                 tokenizer: Any, max_length: int, pad_id: int) -> None:
        self.config, self.state, self.action = config, state, action
        self.tokenizer, self.max_length, self.pad_id = tokenizer, max_length, pad_id
        # prompt text -> ids: submit's check and the prefix node's both tokenize a request's
        # prompt, and a robot sends the same instruction step after step
        self._ids: dict[str, tuple[int, ...]] = {}

    @staticmethod
    def from_dir(path: PathLike, config: PiConfig, tokenizer: Optional[PathLike] = None
                 ) -> "PiProcessor":
        pre = processor_steps(path, "policy_preprocessor.json", PI_STEPS)
        post = processor_steps(path, "policy_postprocessor.json", PI_STEPS)
        norm = next((s for s in pre if s["registry_name"] == "normalizer_processor"), None)
        unnorm = next((s for s in post if s["registry_name"] == "unnormalizer_processor"), None)
        tok = next((s for s in pre if s["registry_name"] == "tokenizer_processor"), None)
        if norm is None or unnorm is None or tok is None:
            raise ValueError(f"{path}: the processor files need a normalizer_processor, an "
                             "unnormalizer_processor and a tokenizer_processor step")
        ncfg, ucfg, tcfg = (s.get("config") or {} for s in (norm, unnorm, tok))
        state_mode = (ncfg.get("norm_map") or {}).get("STATE", config.state_norm)
        action_mode = (ucfg.get("norm_map") or {}).get("ACTION", config.action_norm)
        state = _normalizer(path, norm, "observation.state", state_mode, config.state_dim)
        action = _normalizer(path, unnorm, "action", action_mode, config.action_dim)
        if tcfg.get("padding_side", "right") != "right":
            raise ValueError(f"{path}: the tokenizer pads on the {tcfg['padding_side']}; "
                             "only right padding is supported")
        tk, pad = load_tokenizer(path, tokenizer, tcfg.get("tokenizer_name"))
        if tk.get_vocab_size() > config.vocab_size:  # its ids past the embedding failed requests
            raise ValueError(f"the tokenizer ({tokenizer or path}) has {tk.get_vocab_size()} "
                             f"tokens, more than the checkpoint's {config.vocab_size}-row text "
                             "embedding; pass the tokenizer this policy was trained with")
        max_length = int(tcfg.get("max_length", config.tokenizer_max_length))
        return PiProcessor(config, state, action, tk, max_length, pad)

    def prompt(self, task: str, state: Optional[torch.Tensor] = None) -> str:
        """The text fed to the tokenizer (pi0.5: with the normalised ``state [S]``)."""
        if self.config.family == "pi0":
            return task if task.endswith("\n") else task + "\n"
        if state is None:
            raise ValueError("pi0.5's prompt holds the normalised state; give it")
        bins = np.digitize(state.detach().float().cpu().numpy(),
                           bins=np.linspace(-1, 1, 256 + 1)[:-1]) - 1
        text = task.strip().replace("_", " ").replace("\n", " ")
        return f"Task: {text}, State: {' '.join(map(str, bins))};\nAction: "

    def tokens(self, text: str) -> torch.Tensor:
        """The prompt's token ids, truncated to ``max_length`` (no padding: the model drops
        padded positions, which no token may see)."""
        ids = self._ids.get(text)
        if ids is None:
            ids = tuple(self.tokenizer.encode(text).ids[: self.max_length])
            if len(self._ids) >= _PROMPTS_KEPT:  # pi0.5's prompts hold the state: many differ
                self._ids.clear()
            self._ids[text] = ids
        return torch.tensor(ids, dtype=torch.long)

    def padded(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``ids`` right-padded to ``max_length`` and the attention mask, as LeRobot's batch."""
        out = torch.full((self.max_length,), self.pad_id, dtype=torch.long)
        out[: ids.numel()] = ids
        return out, torch.arange(self.max_length) < ids.numel()

    def state_vector(self, state: Any) -> torch.Tensor:
        """Raw ``state [state_dim]`` -> normalised float32 (a ValueError naming what is wrong)."""
        s = torch.as_tensor(np.asarray(state) if not isinstance(state, torch.Tensor)
                            else state)
        if s.dtype == torch.bool or s.is_complex():
            raise ValueError(f"'state' must be real numbers; got {s.dtype}")
        s = s.float().reshape(-1) if s.dim() <= 1 else s.float()
        if s.shape != (self.config.state_dim,):
            raise ValueError(f"'state' must be [{self.config.state_dim}]; got {list(s.shape)}")
        if not bool(torch.isfinite(s).all()):
            raise ValueError("'state' holds NaN or infinite values; give finite numbers")
        return self.state.normalize(s)

    def actions(self, chunk: torch.Tensor) -> torch.Tensor:
        """The model's chunk ``[H, max_action_dim]`` (normalised) -> ``[H, action_dim]``."""
        return self.action.unnormalize(chunk[..., : self.config.action_dim].float())

    def normalized_actions(self, actions: torch.Tensor) -> torch.Tensor:
        """Raw actions ``[N, action_dim]`` -> normalised, zero-padded to ``max_action_dim``
        (what RTC compares the new chunk with)."""
        a = self.action.normalize(actions.float())
        return F.pad(a, (0, self.config.max_action_dim - a.shape[-1]))


def load_tokenizer(path: PathLike, tokenizer: Optional[PathLike], name: Optional[str]
                   ) -> tuple[Any, int]:
    """A ``tokenizers.Tokenizer`` from ``tokenizer`` (a folder or a tokenizer.json), else from
    ``path/tokenizer/``, ``path`` itself, or the preprocessor's tokenizer ``name`` in the
    Hugging Face cache (no download); and its pad id."""
    def candidates() -> Any:  # the cache is asked only when the folders hold none
        if tokenizer is not None:
            yield tokenizer
            return
        yield from (os.path.join(path, "tokenizer"), path)
        cached = cached_tokenizer(name) if name else None
        if cached:
            yield cached

    for c in candidates():
        file = os.fspath(c)
        folder = os.path.dirname(file) if file.endswith(".json") else file
        if os.path.isdir(file):
            file = os.path.join(file, "tokenizer.json")
        if os.path.isfile(file):
            tk = read_tokenizer(file)
            pad = "<pad>"
            cfg = os.path.join(folder, "tokenizer_config.json")
            if os.path.isfile(cfg):
                settings = read_json(cfg, "the tokenizer's settings")
                if not isinstance(settings, dict):
                    raise ValueError(f"{cfg} holds a {type(settings).__name__}, not the "
                                     "tokenizer's settings (a JSON object)")
                value = settings.get("pad_token", pad)
                pad = value.get("content", pad) if isinstance(value, dict) else (value or pad)
            pad_id = tk.token_to_id(pad)
            return tk, 0 if pad_id is None else pad_id
    where = (tokenizer if tokenizer is not None else
             f"{path}/tokenizer, {path} or the Hugging Face cache of {name!r}")
    raise FileNotFoundError(f"no tokenizer.json in {where}; the policy's preprocessor uses "
                            f"the tokenizer {name!r}: pass tokenizer=<its folder>")


def cached_tokenizer(name: str) -> Optional[str]:
    """The folder of ``name``'s tokenizer in the Hugging Face cache, if it is there."""
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(name, local_files_only=True,
                                 allow_patterns=["tokenizer*", "special_tokens_map.json"])
    except Exception:  # not installed, not cached, offline: the caller names the fix
        return None

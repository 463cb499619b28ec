"""Loading a LeRobot SmolVLA checkpoint directory, as ``SmolVLAPolicy.save_pretrained`` and
the processor pipelines write it:

* ``config.json`` (the policy) and ``model.safetensors`` (LeRobot's state-dict keys);
* ``policy_preprocessor.json`` / ``policy_postprocessor.json`` and the normalizer states they
  name (``*_normalizer_processor.safetensors``: ``<feature>.<stat>`` tensors) -- or, in a
  checkpoint saved before LeRobot had processor pipelines, the statistics as buffers in
  ``model.safetensors`` (``normalize_inputs.buffer_observation_state.mean``, ...);
* the SmolVLM folder named by ``vlm_model_name``: its ``config.json`` gives the backbone's sizes
  and its ``tokenizer.json`` tokenizes the task.

Every file is checked before weights are allocated; a missing or unexpected key or a shape the
config does not give is a ValueError naming the key and the file.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Union

import torch

from mstar_rt.models.checkpoint import (check_weights, checkpoint_files, load_weights,
                                        meta_module, read_config, read_tokenizer)
from mstar_rt.models.lerobot_normalizer import Normalizer, step_eps
from mstar_rt.models.lerobot_processor import processor_steps
from mstar_rt.models.smolvla_config import (ACTION_KEY, STATE_KEY, SmolVLAConfig,
                                            smolvla_config)
from mstar_rt.models.smolvla_layers import SmolVLAModule, parameter_count

LM_HEAD = "model.vlm_with_expert.vlm.lm_head.weight"
_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


#: SmolVLA's processor steps reproduced here (or that do nothing at inference).
SMOLVLA_STEPS = frozenset({"rename_observations_processor", "to_batch_processor",
                           "smolvla_new_line_processor", "tokenizer_processor",
                           "device_processor", "normalizer_processor", "unnormalizer_processor",
                           # newer LeRobot saves these disabled (enabled: refused by name)
                           "relative_actions_processor", "absolute_actions_processor"})


def _processor_step(path: str, pipeline: str, registry: str) -> tuple[dict, str]:
    file = os.path.join(path, f"{pipeline}.json")
    for step in processor_steps(path, f"{pipeline}.json", SMOLVLA_STEPS):
        if step.get("registry_name") == registry:
            return dict(step.get("config") or {}), os.path.join(path, step.get("state_file", ""))
    raise ValueError(f"{file} has no '{registry}' step; SmolVLA needs it for the statistics")


#: Where LeRobot kept the statistics before its processor pipelines (the first
#: ``lerobot/smolvla_base``): ``<module>.buffer_<feature, '.' as '_'>.<stat>`` in the weights.
#: LeRobot 0.6.1 loads such weights skipping them (``strict=False``) and needs its migration
#: script (``processor/migrate_policy_normalization.py``) to turn them into processor files.
LEGACY_MODULES = ("normalize_inputs.", "normalize_targets.", "unnormalize_outputs.")
LEGACY_BUFFERS = {STATE_KEY: ("normalize_inputs.buffer_observation_state.",),
                  ACTION_KEY: ("unnormalize_outputs.buffer_action.",
                               "normalize_targets.buffer_action.")}


def legacy_statistics(path: str) -> dict[str, torch.Tensor]:
    """The checkpoint's in-weights statistics buffers (key -> tensor; none in a checkpoint
    saved with processor pipelines)."""
    from safetensors import safe_open

    found: dict[str, torch.Tensor] = {}
    for file in checkpoint_files(path):
        try:
            with safe_open(file, framework="pt") as f:
                for key in f.keys():
                    if key.startswith(LEGACY_MODULES):
                        found[key] = f.get_tensor(key)
        except Exception as e:  # SafetensorError, OSError: truncated, corrupt
            raise ValueError(f"{file} is not a readable safetensors file: "
                             f"{type(e).__name__}: {e}") from None
    return found


def _legacy_normalizer(path: str, key: str, config: SmolVLAConfig,
                       legacy: Mapping[str, torch.Tensor]) -> Optional[Normalizer]:
    """``key``'s normalizer from the in-weights buffers (as LeRobot's migration builds it:
    the config's mode, eps 1e-8), or None when the weights hold none for it."""
    for prefix in LEGACY_BUFFERS[key]:
        stats = {k[len(prefix):]: v.float() for k, v in legacy.items() if k.startswith(prefix)}
        if stats:
            break
    else:
        return None
    source = f"{os.path.join(path, 'model.safetensors')} ({prefix}*)"
    mode = config.norm_mode("STATE" if key == STATE_KEY else "ACTION")
    return Normalizer(key, mode, stats if mode != "IDENTITY" else {}, size=_size_of(key, config),
                      source=source)


def _size_of(key: str, config: SmolVLAConfig) -> int:
    return config.state_dim if key == STATE_KEY else config.action_dim


def load_normalizer(path: str, pipeline: str, registry: str, key: str,
                    config: SmolVLAConfig,
                    legacy: Optional[Mapping[str, torch.Tensor]] = None) -> Normalizer:
    """The normalizer of feature ``key`` from ``pipeline``'s ``registry`` step; without the
    pipeline file, from the ``legacy`` in-weights buffers (:func:`legacy_statistics`)."""
    from safetensors.torch import load_file

    if legacy and not os.path.exists(os.path.join(path, f"{pipeline}.json")):
        norm = _legacy_normalizer(path, key, config, legacy)
        if norm is not None:
            return norm
    step, state_file = _processor_step(path, pipeline, registry)
    feature = (step.get("features") or {}).get(key) or {}
    ftype = feature.get("type", "STATE" if key == STATE_KEY else "ACTION")
    mode = (step.get("norm_map") or {}).get(ftype, config.norm_mode(ftype))
    eps = step_eps(step, f"{os.path.join(path, pipeline)}.json ({registry} step)")
    if mode == "IDENTITY":
        return Normalizer(key, mode, {}, eps)
    try:
        state = load_file(state_file)
    except Exception as e:
        raise ValueError(f"the normalizer state {state_file} of {pipeline}.json cannot be read: "
                         f"{type(e).__name__}: {e}") from None
    stats = {k[len(key) + 1:]: v.float() for k, v in state.items() if k.startswith(key + ".")}
    return Normalizer(key, mode, stats, eps, _size_of(key, config), state_file)


def find_vlm(path: str, name: str, vlm_dir: Optional[str]) -> str:
    """The SmolVLM folder: ``vlm_dir`` if given; else ``vlm_model_name`` as a path (absolute,
    from the working directory, or from the checkpoint and the folders above it); else the
    Hugging Face cache (no download)."""
    if vlm_dir is not None:
        if not os.path.isfile(os.path.join(vlm_dir, "config.json")):
            raise FileNotFoundError(f"vlm_dir {vlm_dir} holds no config.json of a SmolVLM")
        return vlm_dir
    here = os.path.abspath(path)
    tries = [name] if os.path.isabs(name) else [name] + [
        os.path.join(d, name) for d in _ancestors(here)]
    for t in tries:
        if os.path.isfile(os.path.join(t, "config.json")):
            return t
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(name, local_files_only=True,
                                 allow_patterns=["config.json", "tokenizer*", "*.txt"])
    except Exception:
        pass
    raise FileNotFoundError(f"the SmolVLM backbone '{name}' (vlm_model_name in "
                            f"{os.path.join(path, 'config.json')}) is neither a folder here nor in "
                            "the Hugging Face cache; pass vlm_dir= (a folder with its config.json "
                            "and tokenizer.json)")


def _ancestors(path: str) -> list[str]:
    out = []
    while True:
        out.append(path)
        parent = os.path.dirname(path)
        if parent == path:
            return out
        path = parent


def load_tokenizer(vlm_dir: str, max_length: int) -> Any:
    """The prompt tokenizer (``tokenizer.json``, truncating to ``max_length``; no padding)."""
    file = os.path.join(vlm_dir, "tokenizer.json")
    try:
        tok = read_tokenizer(file)
    except ImportError as e:
        raise ImportError("reading SmolVLA's task needs the `tokenizers` package (pip install "
                          "tokenizers), or pass the task as token ids") from e
    tok.enable_truncation(max_length)
    tok.no_padding()
    return tok


def memory_estimate(config: SmolVLAConfig) -> dict[str, int]:
    """Sizes, built on the meta device: ``parameters`` (what is loaded), ``lm_head`` (the
    checkpoint's unused vocabulary projection, not loaded), and bytes per dtype of the weights
    (``weights.<dtype>``) and of one prefix token's K/V in the cache (``kv_per_token.<dtype>``)."""
    _n, params = parameter_count(meta_module(lambda: SmolVLAModule(config, False), "config"))
    t = config.text
    out = {"parameters": params, "lm_head": t.vocab_size * t.hidden_size}
    for name, size in _BYTES.items():
        out[f"weights.{name}"] = params * size
        out[f"kv_per_token.{name}"] = 2 * config.num_layers * t.num_kv_heads * t.head_dim * size
    return out


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB" if n >= 2**20 \
        else f"{n / 2**10:.1f} KiB"


def describe_memory(config: SmolVLAConfig, tensors: int) -> str:
    m = memory_estimate(config)
    return (f"{tensors} tensors, {m['parameters'] + m['lm_head']:,} parameters "
            f"({m['lm_head']:,} in the unused lm_head, not loaded); weights: "
            + ", ".join(f"{d} {_size(m['weights.' + d])}" for d in _BYTES)
            + "; KV cache per prefix token: "
            + ", ".join(f"{d} {_size(m['kv_per_token.' + d])}" for d in _BYTES))


@dataclass
class LeRobotSmolVLA:
    """A loaded LeRobot SmolVLA: weights, config, tokenizer and the state / action
    normalizers (what LeRobot's pre- and postprocessor do around the model)."""

    module: SmolVLAModule
    config: SmolVLAConfig
    tokenizer: Any
    state_normalizer: Normalizer
    action_normalizer: Normalizer
    tokenizer_file: str = ""  # where the tokenizer was looked for (named when it is missing)

    def tokenize(self, task: str) -> list[int]:
        """LeRobot's preprocessing of the task: a newline appended (unless there), then the
        backbone's tokenizer (its own special tokens, truncated to ``tokenizer_max_length``)."""
        if self.tokenizer is None:
            where = self.tokenizer_file or "the SmolVLM folder's tokenizer.json"
            raise ValueError(f"this SmolVLA has no tokenizer ({where} is missing): put "
                             "SmolVLM's tokenizer.json there, or pass the task as token ids")
        text = task if task.endswith("\n") else task + "\n"
        return list(self.tokenizer.encode(text).ids)

    def normalize_state(self, state: torch.Tensor) -> torch.Tensor:
        """Raw state ``[state_dim]`` -> normalised and zero-padded to ``max_state_dim``."""
        x = self.state_normalizer.normalize(state.float())
        pad = self.config.max_state_dim - x.shape[-1]
        return torch.nn.functional.pad(x, (0, pad))

    def unnormalize_actions(self, actions: torch.Tensor) -> torch.Tensor:
        """``[..., max_action_dim]`` model actions -> the first ``action_dim``, unnormalised."""
        return self.action_normalizer.unnormalize(actions[..., : self.config.action_dim].float())

    def normalize_actions(self, actions: torch.Tensor) -> torch.Tensor:
        """Raw actions ``[N, action_dim]`` -> normalised, zero-padded to ``max_action_dim``
        (what guided real-time chunking compares the new chunk with)."""
        x = self.action_normalizer.normalize(actions.float())
        return torch.nn.functional.pad(x, (0, self.config.max_action_dim - x.shape[-1]))


def load_lerobot_smolvla(path: Union[str, os.PathLike], dtype: Optional[torch.dtype] = None,
                         device: str = "cpu", vlm_dir: Optional[str] = None,
                         progress: bool = True) -> LeRobotSmolVLA:
    """Loads a LeRobot SmolVLA checkpoint directory (see the module doc) into a
    :class:`LeRobotSmolVLA` of ``dtype`` (default float32) on ``device``. ``vlm_dir`` overrides
    where the SmolVLM folder is looked for. Prints the parameter count and the weights' size per
    dtype unless ``progress`` is False. The checkpoint's ``lm_head`` is checked but not loaded
    (SmolVLA never produces logits)."""
    path = os.fspath(path)
    policy_file = os.path.join(path, "config.json")
    policy = read_config(path)
    name = policy.get("vlm_model_name", "HuggingFaceTB/SmolVLM2-500M-Video-Instruct")
    if not isinstance(name, str) or not name:
        raise ValueError(f"field 'vlm_model_name' of {policy_file} must name the SmolVLM folder")
    vlm_path = find_vlm(path, name, vlm_dir)
    config = smolvla_config(policy, read_config(vlm_path), policy_file,
                            os.path.join(vlm_path, "config.json"))
    # the config's sizes against the weights' headers, before allocating anything
    full = meta_module(lambda: SmolVLAModule(config, lm_head=True), policy_file)
    legacy = legacy_statistics(path)
    check_weights(full, path, allow_missing=(LM_HEAD,), ignore=tuple(legacy))
    state_norm = load_normalizer(path, "policy_preprocessor", "normalizer_processor", STATE_KEY,
                                 config, legacy)
    action_norm = load_normalizer(path, "policy_postprocessor", "unnormalizer_processor",
                                  ACTION_KEY, config, legacy)
    tokenizer_file = os.path.join(vlm_path, "tokenizer.json")
    tokenizer = load_tokenizer(vlm_path, config.tokenizer_max_length) if os.path.exists(
        tokenizer_file) else None
    if progress:
        print(f"SmolVLA {path}: {describe_memory(config, len(full.state_dict()))}")
        if tokenizer is None:
            print(f"SmolVLA {path}: no {tokenizer_file}: a task must come as token ids")
    with torch.device("meta"):  # sizes already checked by meta_module above
        module = SmolVLAModule(config, lm_head=False)
    module = module.to(dtype or torch.float32).to_empty(device=device)
    load_weights(module, path, progress=progress, ignore=(LM_HEAD, *legacy))
    return LeRobotSmolVLA(module.eval(), config, tokenizer, state_norm, action_norm,
                          tokenizer_file)

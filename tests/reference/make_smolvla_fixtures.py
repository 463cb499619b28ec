"""Parity fixtures for SmolVLA from the reference implementation, LeRobot 0.6.1.

Venv: this runs ONLY in the separate LeRobot venv (Python 3.12, torch 2.13, transformers 5.5,
lerobot==0.6.1 installed with --no-deps), made by

    bash tests/reference/setup_lerobot_venv.sh          # -> /work/venvs/lerobot (LEROBOT_VENV)

Run (CPU only, ~30 s, no network, no model hub; the script chdirs to the repository root because
the checkpoint's `vlm_model_name` is the repo-relative path of the tiny VLM folder):

    /work/venvs/lerobot/bin/python tests/reference/make_smolvla_fixtures.py [--no-full-size]

What it writes under tests/reference/fixtures/smolvla/:
  * `smolvlm_tiny/` -- a local stand-in for `HuggingFaceTB/SmolVLM2-500M-Video-Instruct`: a tiny
    `SmolVLMConfig` (config.json) and a `SmolVLMProcessor` (image/video processor configs and a
    tiny SmolLM2-layout tokenizer built with the `tokenizers` library).  SmolVLA needs no patch:
    `SmolVLAConfig(vlm_model_name=<that folder>, load_vlm_weights=False)` builds
    `SmolVLMForConditionalGeneration(AutoConfig.from_pretrained(folder))` and loads the processor
    from the same folder, exactly as with the hub name.
  * `checkpoint/` -- `SmolVLAPolicy.save_pretrained` (config.json, model.safetensors) and the
    pre/post-processor pipelines (`policy_preprocessor.json`, `policy_postprocessor.json`,
    normalizer-state safetensors), reloaded with `SmolVLAPolicy.from_pretrained` and
    `make_pre_post_processors(pretrained_path=...)` before the reference call:
        batch  = preprocessor({camera images, observation.state, task})
        chunk  = policy.predict_action_chunk(batch, noise=noise)     # normalised, unpadded
        action = postprocessor(chunk)
  * `io.safetensors` (+ `io.json`): inputs, the fixed noise, preprocessor outputs, intermediates
    recorded from LeRobot's own methods during that call, outputs;
  * `full_size_keys.json`: SmolVLA with SmolVLM2-500M sizes built on the meta device (the hub
    config cannot be fetched offline: the sizes are written in `_smolvla_tiny.FULL_SMOLVLM`);
  * `README.md`;
  * `rtc/`: guided real-time chunking, as for pi0 (see make_pi0_fixtures.py and
    `_lerobot_fixture_common.record_rtc`): `rtc/config.json` enables `rtc_config`
    (`_smolvla_tiny.RTC`), `rtc/io.safetensors` holds LeRobot's guided `predict_action_chunk` step
    by step. It runs last, with its own noise generator, so every other file is unchanged by it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _lerobot_fixture_common as common  # noqa: E402
from _smolvla_fixture_readme import write_readme  # noqa: E402
from _smolvla_tiny import (ACTION_DIM, CAMERAS, CHUNK, FAMILY, IMAGE_RES, NUM_STEPS,  # noqa: E402
                           NUM_VLM_LAYERS, PROMPT, RAW_IMAGE_HW, RTC, SCALE_FACTOR, SEED,
                           STATE_DIM, TINY_TEXT, TINY_VISION, full_size, make_config,
                           write_vlm_folder)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--no-full-size", action="store_true")
    args = ap.parse_args()
    os.chdir(common.REPO_ROOT)
    t_start = time.time()

    from lerobot.policies.factory import make_pre_post_processors
    from lerobot.policies.smolvla.modeling_smolvla import SmolVLAPolicy
    from lerobot.policies.smolvla.processor_smolvla import make_smolvla_pre_post_processors

    out = common.FIXTURES / FAMILY
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    ckpt = out / "checkpoint"
    vlm_dir = out / "smolvlm_tiny"
    vlm_name = str(vlm_dir.relative_to(common.REPO_ROOT))

    common.seed_everything(SEED)
    write_vlm_folder(vlm_dir, TINY_TEXT, TINY_VISION, SCALE_FACTOR)

    gen = torch.Generator().manual_seed(SEED + 1)
    images = {cam: common.smooth_image(gen, *RAW_IMAGE_HW) for cam in CAMERAS}
    state = torch.randn(STATE_DIM, generator=gen) * 0.7
    stats = {
        "observation.state": common.make_stats(gen, STATE_DIM),
        "action": common.make_stats(gen, ACTION_DIM),
    }
    noise = torch.randn((1, CHUNK, 32), generator=gen, dtype=torch.float32)

    cfg = make_config(vlm_name)
    policy = SmolVLAPolicy(cfg)
    common.randomize_parameters(policy, SEED + 2)
    policy.eval()
    pre, post = make_smolvla_pre_post_processors(cfg, dataset_stats=stats)
    policy.save_pretrained(ckpt)
    pre.save_pretrained(ckpt)
    post.save_pretrained(ckpt)
    saved_sd = {k: v.clone() for k, v in policy.state_dict().items()}
    del policy, pre, post

    policy = SmolVLAPolicy.from_pretrained(str(ckpt), strict=True)
    policy.eval()
    pre, post = make_pre_post_processors(policy.config, pretrained_path=str(ckpt))
    reloaded = policy.state_dict()
    assert list(reloaded) == list(saved_sd)
    for k in saved_sd:
        assert torch.equal(saved_sd[k], reloaded[k]), k

    model = policy.model
    raw = {cam: images[cam].clone() for cam in CAMERAS}
    raw["observation.state"] = state.clone()
    raw["task"] = PROMPT

    def fresh():
        return {k: (v.clone() if torch.is_tensor(v) else v) for k, v in raw.items()}

    from lerobot.lerobot_types import TransitionKey

    task_after = list(pre.step_through(fresh()))[-1][TransitionKey.COMPLEMENTARY_DATA].get("task")
    batch = pre(fresh())

    rec = common.Recorder()
    rec.wrap(policy, "prepare_images")
    rec.wrap(policy, "prepare_state")
    rec.wrap(model, "embed_prefix")
    rec.wrap(model, "embed_suffix")
    rec.wrap(model, "denoise_step")
    rec.wrap(model.vlm_with_expert, "forward", "vwe_forward")
    rec.wrap(model.vlm_with_expert, "embed_image")
    with torch.no_grad():
        chunk = policy.predict_action_chunk(dict(batch), noise=noise.clone())
    rec.restore()
    actions = post(chunk.clone())

    policy.reset()
    with torch.no_grad():
        chunk2 = policy.predict_action_chunk(dict(pre(fresh())), noise=noise.clone())
    assert torch.equal(chunk, chunk2), "reference is not deterministic"

    c = rec.calls
    imgs, img_masks = c["prepare_images"][0][2]
    state_padded = c["prepare_state"][0][2]
    prefix_embs, prefix_pad, prefix_att = c["embed_prefix"][0][2]
    (prefix_out, _), kv = c["vwe_forward"][0][2]
    x_ts = torch.stack([call[1]["x_t"] for call in c["denoise_step"]])
    ts = torch.stack([call[1]["timestep"] for call in c["denoise_step"]])
    v_ts = torch.stack([call[2] for call in c["denoise_step"]])
    suffix0 = c["embed_suffix"][0][2]
    x_final = x_ts[-1] + (-1.0 / NUM_STEPS) * v_ts[-1]
    assert torch.allclose(x_final[:, :, :ACTION_DIM], chunk, atol=1e-6)

    tensors: dict[str, torch.Tensor] = {}
    for i, cam in enumerate(CAMERAS):
        tensors[f"input.{cam}"] = images[cam]
        tensors[f"input.{cam}.uint8"] = (images[cam] * 255).round().to(torch.uint8)
        tensors[f"model.images.{i}"] = imgs[i]
        tensors[f"model.img_masks.{i}"] = img_masks[i]
        tensors[f"model.image_embs.{i}"] = c["embed_image"][i][2]
    tensors["input.observation.state"] = state
    tensors["input.noise"] = noise
    for name, st in stats.items():
        for k, v in st.items():
            tensors[f"stats.{name}.{k}"] = v
    tensors["batch.observation.language.tokens"] = batch["observation.language.tokens"]
    tensors["batch.observation.language.attention_mask"] = batch["observation.language.attention_mask"]
    tensors["batch.observation.state"] = batch["observation.state"]
    tensors["model.state_padded"] = state_padded
    tensors["model.prefix_embs"] = prefix_embs
    tensors["model.prefix_pad_masks"] = prefix_pad
    tensors["model.prefix_att_masks"] = prefix_att
    tensors["model.prefix_out"] = prefix_out
    tensors.update(common.kv_cache_tensors(kv, "model.prefix_kv"))
    tensors["model.suffix_embs.step0"] = suffix0[0]
    tensors["model.suffix_pad_masks"] = suffix0[1]
    tensors["model.suffix_att_masks"] = suffix0[2]
    tensors["model.suffix_out.step0"] = c["vwe_forward"][1][2][0][1]
    tensors["model.x_t"] = x_ts
    tensors["model.t"] = ts
    tensors["model.v_t"] = v_ts
    tensors["model.actions_padded"] = x_final
    tensors["output.action_chunk_normalized"] = chunk
    tensors["output.action_chunk"] = actions

    captured = []
    hook = model.action_out_proj.register_forward_hook(lambda m, i, o: captured.append(o))
    with torch.no_grad():
        model.forward(
            imgs,
            img_masks,
            batch["observation.language.tokens"],
            batch["observation.language.attention_mask"],
            state_padded,
            torch.zeros_like(noise),
            noise=noise.clone(),
            time=torch.ones(1),
        )
    hook.remove()
    tensors["model.v_t0_nocache"] = captured[0]
    cache_vs_nocache = float((captured[0] - v_ts[0]).abs().max())

    vlm_cfg = json.loads((vlm_dir / "config.json").read_text())
    meta = {
        "family": FAMILY,
        "prompt": PROMPT,
        "prompt_after_preprocessor": task_after,
        "cameras_in_order": list(CAMERAS),
        "raw_image_shape_chw": [3, *RAW_IMAGE_HW],
        "resize_imgs_with_padding": IMAGE_RES,
        "state_dim": STATE_DIM,
        "action_dim": ACTION_DIM,
        "max_state_dim": 32,
        "max_action_dim": 32,
        "chunk_size": CHUNK,
        "num_steps": NUM_STEPS,
        "tokenizer_max_length": policy.config.tokenizer_max_length,
        "pad_language_to": policy.config.pad_language_to,
        "vlm_model_name": vlm_name,
        "num_vlm_layers": NUM_VLM_LAYERS,
        "text_layers_in_vlm_config": TINY_TEXT["num_hidden_layers"],
        "expert_hidden_size": model.vlm_with_expert.expert_hidden_size,
        "normalization_mapping": {k: str(v.value) for k, v in policy.config.normalization_mapping.items()},
        "call": [
            "policy = SmolVLAPolicy.from_pretrained('checkpoint')   # cwd = repo root (vlm_model_name is repo-relative)",
            "pre, post = lerobot.policies.factory.make_pre_post_processors(policy.config, pretrained_path='checkpoint')",
            "batch = pre({camera keys: float32 [3,H,W] in [0,1], 'observation.state': [S], 'task': prompt})",
            "chunk = policy.predict_action_chunk(batch, noise=noise)   # -> model.sample_actions(..., noise=noise)",
            "actions = post(chunk)",
        ],
        "max_abs_diff_cached_vs_nocache_velocity_t1": cache_vs_nocache,
        "seed": SEED,
        "versions": common.versions(),
        "tolerance": "float32, 1e-4 absolute",
    }
    common.save_io(out / "io.safetensors", tensors, meta)

    summary = {"tiny": common.state_dict_summary(saved_sd)}
    if not args.no_full_size:
        summary["full_size"] = full_size(out)
    write_readme(out, meta, summary, tensors, vlm_cfg)
    summary["rtc"] = run_rtc(out, post, pre(fresh()), chunk)
    summary["files"] = common.file_listing(out)
    summary["total_bytes"] = common.dir_size(out)
    summary["cache_vs_nocache_velocity_max_abs_diff"] = cache_vs_nocache
    summary["action_chunk_abs_max"] = float(chunk.abs().max())
    summary["velocity_abs_mean"] = float(v_ts.abs().mean())
    summary["seconds"] = round(time.time() - t_start, 1)
    assert summary["total_bytes"] <= common.MAX_FAMILY_BYTES, summary["total_bytes"]
    print(json.dumps({FAMILY: summary}, indent=1))


def run_rtc(out: Path, post, batch: dict, chunk: torch.Tensor) -> dict:
    """`rtc/`: the policy reloaded from a checkpoint whose config enables `rtc_config`, its
    guided `predict_action_chunk` with the plain chunk's left-over as the previous chunk
    (see `_lerobot_fixture_common.record_rtc`). Runs after everything else, with its own noise
    generator: the plain fixture's files do not change."""
    from lerobot.policies.smolvla.modeling_smolvla import SmolVLAPolicy

    rtc_dir = out / "rtc"
    noise = torch.randn((1, CHUNK, 32), generator=torch.Generator().manual_seed(SEED + 3))
    with common.rtc_checkpoint(out / "checkpoint", rtc_dir, RTC) as ckpt:
        policy = SmolVLAPolicy.from_pretrained(str(ckpt), strict=True)
    policy.eval()
    tensors, meta = common.record_rtc(policy, post, batch, chunk, noise, NUM_STEPS)
    meta.update(
        family=FAMILY,
        observation="../io.safetensors (input.* cameras and state; prompt in ../io.json)",
        call=[
            "policy = SmolVLAPolicy.from_pretrained(<../checkpoint with rtc/config.json>)   # cwd = repo root",
            "batch = pre(observation)   # ../checkpoint's preprocessor, as in ../io.json",
            "left_over = previous_chunk_normalized[:, executed_of_previous_chunk:]",
            "chunk = policy.predict_action_chunk(batch, noise=noise, inference_delay=d, "
            "prev_chunk_left_over=left_over)",
            "actions = post(chunk)",
        ],
        seed=SEED + 3,
        versions=common.versions(),
        tolerance="float32, 1e-4 absolute",
    )
    common.save_io(rtc_dir / "io.safetensors", tensors, meta)
    common.write_rtc_readme(rtc_dir, FAMILY, meta, tensors)
    return {"guided_minus_unguided": meta["max_abs_guided_minus_unguided"],
            "bytes": common.dir_size(rtc_dir)}



if __name__ == "__main__":
    main()

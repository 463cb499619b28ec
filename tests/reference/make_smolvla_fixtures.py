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
    config cannot be fetched offline: the sizes are written in this script, see FULL_SMOLVLM);
  * `README.md`;
  * `rtc/`: guided real-time chunking, as for pi0 (see make_pi0_fixtures.py and
    `_lerobot_fixture_common.record_rtc`): `rtc/config.json` enables `rtc_config` (RTC below),
    `rtc/io.safetensors` holds LeRobot's guided `predict_action_chunk` step by step. It runs
    last, with its own noise generator, so every other file is unchanged by it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _lerobot_fixture_common as common  # noqa: E402

SEED = 4321
FAMILY = "smolvla"
CAMERAS = ("observation.images.camera1", "observation.images.camera2")
RAW_IMAGE_HW = (60, 80)  # resize_with_pad -> 48x64, padded on top to 64x64
IMAGE_RES = 64
STATE_DIM = 6
ACTION_DIM = 6
CHUNK = 10
NUM_STEPS = 10
PROMPT = "pick up the red block and put it in the bowl"
# the guided real-time-chunking case (fixtures/smolvla/rtc/); the horizon is below the left-over's
# length here (pi0's and pi0.5's cases clip it)
RTC = {"prefix_attention_schedule": "LINEAR", "max_guidance_weight": 10.0, "execution_horizon": 6}
TEXT_VOCAB = 384

SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<fake_token_around_image>",
    "<image>",
    "<global-img>",
    "<end_of_utterance>",
]
EXTRA_SPECIAL = {
    "fake_image_token": "<fake_token_around_image>",
    "image_token": "<image>",
    "global_image_token": "<global-img>",
    "end_of_utterance_token": "<end_of_utterance>",
}

TINY_TEXT = dict(  # llama; real SmolVLM2-500M: 960 / 2560 / 15 / 5 / 64 / 32 layers / 49280
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_hidden_layers=6,
    vocab_size=TEXT_VOCAB,
    rms_norm_eps=1e-5,
    rope_theta=100000.0,
    max_position_embeddings=8192,
    tie_word_embeddings=False,
)
TINY_VISION = dict(  # real: 768 / 3072 / 12 / 12 / patch 16 / 512
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    patch_size=8,
    image_size=IMAGE_RES,
)
SCALE_FACTOR = 4  # pixel-shuffle factor: (64/8)^2 = 64 patches -> 4 tokens per camera
NUM_VLM_LAYERS = 4  # SmolVLA keeps the first N text layers (real: 16 of 32)

# SmolVLM2-500M-Video-Instruct sizes (as published for that checkpoint; not fetchable here).
FULL_SMOLVLM = dict(
    text=dict(
        hidden_size=960,
        intermediate_size=2560,
        num_attention_heads=15,
        num_key_value_heads=5,
        head_dim=64,
        num_hidden_layers=32,
        vocab_size=49280,
        rms_norm_eps=1e-5,
        rope_theta=100000.0,
        max_position_embeddings=8192,
        tie_word_embeddings=False,
    ),
    vision=dict(
        hidden_size=768,
        intermediate_size=3072,
        num_hidden_layers=12,
        num_attention_heads=12,
        patch_size=16,
        image_size=512,
    ),
    scale_factor=4,
    image_token_id=49190,
)


def write_vlm_folder(folder: Path, text: dict, vision: dict, scale_factor: int, image_token_id=None):
    """A local SmolVLM "model id" folder: config.json + processor (+ tokenizer)."""
    from transformers import SmolVLMConfig, SmolVLMImageProcessor, SmolVLMProcessor, SmolVLMVideoProcessor

    folder.mkdir(parents=True, exist_ok=True)
    tok = common.build_smollm_like_tokenizer(folder / "_tok", SPECIAL_TOKENS, EXTRA_SPECIAL)
    shutil.rmtree(folder / "_tok")
    img_tok = tok.convert_tokens_to_ids("<image>") if image_token_id is None else image_token_id
    cfg = SmolVLMConfig(
        text_config={"model_type": "llama", "pad_token_id": 2, **text},
        vision_config=vision,
        scale_factor=scale_factor,
        image_token_id=img_tok,
        pad_token_id=2,
    )
    cfg.save_pretrained(str(folder))
    image_seq_len = (vision["image_size"] // vision["patch_size"]) ** 2 // scale_factor**2
    proc = SmolVLMProcessor(
        image_processor=SmolVLMImageProcessor(
            max_image_size={"longest_edge": vision["image_size"]},
            size={"longest_edge": vision["image_size"]},
        ),
        tokenizer=tok,
        video_processor=SmolVLMVideoProcessor(),
        image_seq_len=image_seq_len,
    )
    proc.save_pretrained(str(folder))
    return cfg, tok


def make_config(vlm_name: str):
    from lerobot.configs import FeatureType, PolicyFeature
    from lerobot.policies.smolvla.configuration_smolvla import SmolVLAConfig

    inputs = {cam: PolicyFeature(type=FeatureType.VISUAL, shape=(3, *RAW_IMAGE_HW)) for cam in CAMERAS}
    inputs["observation.state"] = PolicyFeature(type=FeatureType.STATE, shape=(STATE_DIM,))
    outputs = {"action": PolicyFeature(type=FeatureType.ACTION, shape=(ACTION_DIM,))}
    return SmolVLAConfig(
        device="cpu",
        chunk_size=CHUNK,
        n_action_steps=CHUNK,
        num_steps=NUM_STEPS,
        resize_imgs_with_padding=(IMAGE_RES, IMAGE_RES),
        vlm_model_name=vlm_name,
        load_vlm_weights=False,
        num_vlm_layers=NUM_VLM_LAYERS,
        input_features=inputs,
        output_features=outputs,
    )


def full_size(out: Path) -> dict:
    from lerobot.policies.smolvla.configuration_smolvla import SmolVLAConfig
    from lerobot.policies.smolvla.modeling_smolvla import SmolVLAPolicy

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "SmolVLM2-500M-Video-Instruct-sizes"
        write_vlm_folder(
            folder,
            FULL_SMOLVLM["text"],
            FULL_SMOLVLM["vision"],
            FULL_SMOLVLM["scale_factor"],
            FULL_SMOLVLM["image_token_id"],
        )
        cfg = SmolVLAConfig(device="cpu", vlm_model_name=str(folder))
        cfg.device = "meta"
        t0 = time.time()
        with torch.device("meta"):
            policy = SmolVLAPolicy(cfg)
        sd = policy.state_dict()
        path = common.write_keys_json(
            out / "full_size_keys.json",
            sd,
            {
                "family": FAMILY,
                "built": "SmolVLAPolicy(SmolVLAConfig()) on the meta device, LeRobot 0.6.1 defaults "
                "(num_vlm_layers=16, expert_width_multiplier=0.75, self_attn_every_n_layers=2, "
                "attention_mode=cross_attn, max_state_dim=max_action_dim=32), VLM = a local folder "
                "with SmolVLM2-500M-Video-Instruct sizes",
                "smolvlm_sizes": FULL_SMOLVLM,
                "caveat": "the hub config of HuggingFaceTB/SmolVLM2-500M-Video-Instruct could not be "
                "fetched offline; sizes are the published ones written in make_smolvla_fixtures.py",
            },
        )
        summary = common.state_dict_summary(sd)
        summary["file"] = path.name
        summary["build_seconds"] = round(time.time() - t0, 2)
        del policy, sd
    return summary


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


def write_readme(out: Path, meta: dict, summary: dict, tensors: dict, vlm_cfg: dict) -> None:
    tiny, full = summary["tiny"], summary.get("full_size")
    n_img = (IMAGE_RES // TINY_VISION["patch_size"]) ** 2 // SCALE_FACTOR**2
    lines = [
        "# smolvla parity fixture (LeRobot 0.6.1 `SmolVLAPolicy`)",
        "",
        "Generated by `tests/reference/make_smolvla_fixtures.py` in the LeRobot venv "
        "(`tests/reference/setup_lerobot_venv.sh`). Do not edit by hand; regenerate.",
        "",
        "## Files",
        "",
        "* `checkpoint/` -- exactly what LeRobot writes: `config.json` + `model.safetensors` "
        "(`PreTrainedPolicy.save_pretrained`), `policy_preprocessor.json` / `policy_postprocessor.json` "
        "and their normalizer-state `*.safetensors` (`PolicyProcessorPipeline.save_pretrained`).",
        f"* `smolvlm_tiny/` -- the VLM \"model id\" folder (`config.json` = `SmolVLMConfig`, processor "
        "configs, tokenizer). `checkpoint/config.json` has `vlm_model_name = "
        f"\"{meta['vlm_model_name']}\"` (repo-relative: LeRobot resolves it from the working directory; "
        "the real checkpoint says `HuggingFaceTB/SmolVLM2-500M-Video-Instruct`). LeRobot reads the VLM "
        "sizes from this folder, and the prompt tokenizer is the processor's tokenizer "
        "(`tokenizer.json`: SmolLM2 layout, byte-level pre-tokenizer, no BOS, "
        "`<|endoftext|>=0 <|im_start|>=1 <|im_end|>=2 (= pad) <fake_token_around_image>=3 <image>=4 "
        "<global-img>=5 <end_of_utterance>=6`, built with the `tokenizers` library as a Unigram model "
        "over byte-level pieces plus a few whole words -- the real tokenizer cannot be fetched offline).",
        "* `io.safetensors` (+ `io.json`: the same metadata) -- inputs, noise, intermediates, outputs.",
        "* `full_size_keys.json` -- full-size state-dict key -> shape (meta device; see caveat inside).",
        "",
        "## Tiny instance (no LeRobot patch: sizes come from `smolvlm_tiny/config.json`)",
        "",
        "| part | real (SmolVLM2-500M / smolvla_base) | tiny |",
        "| --- | --- | --- |",
        "| text (llama) hidden/mlp/heads/kv/head_dim/layers | 960/2560/15/5/64/32 | "
        + "/".join(str(TINY_TEXT[k]) for k in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim", "num_hidden_layers"))
        + " |",
        f"| `num_vlm_layers` (layers kept) | 16 | {NUM_VLM_LAYERS} |",
        f"| expert width (x0.75) / mlp (get_intermediate_size) / layers | 720/2048/16 | {meta['expert_hidden_size']}/256/{NUM_VLM_LAYERS} |",
        "| vision hidden/mlp/layers/heads/patch/image | 768/3072/12/12/16/512 | "
        + "/".join(str(TINY_VISION[k]) for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "patch_size", "image_size"))
        + " |",
        f"| pixel-shuffle scale_factor / image tokens per camera | 4 / 64 | {SCALE_FACTOR} / {n_img} |",
        f"| vocabulary | 49280 | {TEXT_VOCAB} |",
        f"| chunk_size / n_action_steps / num_steps | 50/50/10 | {CHUNK}/{CHUNK}/{NUM_STEPS} |",
        "",
        f"Tiny checkpoint: {tiny['num_tensors']} tensors, {tiny['num_params']:,} parameters, all re-drawn "
        "after construction (matrices N(0, 1/fan_in); vectors = init + N(0, 0.1)). Layers 0 and 2 of the "
        "expert are self-attention layers (`self_attn_every_n_layers=2`), layers 1 and 3 cross-attention "
        "(their `k_proj`/`v_proj` map the VLM's kv width to the expert's).",
        "",
        "First keys: " + ", ".join(f"`{k}`" for k in tiny["first_keys"]),
        "",
        "Last keys: " + ", ".join(f"`{k}`" for k in tiny["last_keys"]),
        "",
    ]
    if full:
        lines += [
            f"Full size (meta device): {full['num_tensors']} tensors, {full['num_params']:,} parameters "
            f"(`{full['file']}`), with the SmolVLM2-500M sizes written in the script (not verified against "
            "the hub config, which is unreachable here).",
            "",
        ]
    lines += [
        "## Reference call path (what produced the outputs)",
        "",
        "```python",
        *meta["call"],
        "```",
        "",
        "Inside `predict_action_chunk`: `images, img_masks = policy.prepare_images(batch)`; "
        "`state = policy.prepare_state(batch)` (zero-pad to 32); `model.sample_actions(images, img_masks, "
        "tokens, masks, state, noise=noise)`: `embed_prefix` -> `vlm_with_expert.forward(inputs_embeds="
        "[prefix, None], use_cache=True)` fills a DynamicCache with every layer's post-RoPE K/V of the "
        f"prefix -> `euler_integrate`: {NUM_STEPS} steps, dt = -1/{NUM_STEPS}, t = 1 + k*dt, "
        "`x <- x + dt * v` with `v = denoise_step(...)` (expert only; self-attention layers append the "
        "suffix K/V to the cache and the cache is cropped back to the prefix after each step; "
        "cross-attention layers project the cached VLM K/V with the expert's k_proj/v_proj) -> "
        "`[:, :, :action_dim]`.",
        "",
        "## Preprocessing (LeRobot's, to match exactly)",
        "",
        "1. Raw observation: each camera `float32 [3, H, W]` in [0, 1] (here 60x80, values k/255; "
        "`input.*.uint8` = same pixels), `observation.state float32 [6]`, `task` string.",
        "2. Preprocessor (`checkpoint/policy_preprocessor.json`): rename (no-op) -> add batch dim -> "
        "`NewLineTaskProcessorStep` (append `\\n`) -> tokenizer (`vlm_model_name`'s tokenizer, "
        f"padding='{meta['pad_language_to']}', right, max_length={meta['tokenizer_max_length']}, truncation; "
        "no BOS) -> device -> normalize state (MEAN_STD: `(x - mean) / (std + 1e-8)`); images IDENTITY. "
        f"Prompt fed to the tokenizer: `{json.dumps(meta['prompt_after_preprocessor'])}`.",
        "3. `prepare_images`: `resize_with_pad(img, 64, 64, pad_value=0)`: ratio = max(W/w, H/h), "
        "bilinear (align_corners=False, no antialias) to (int(H/ratio), int(W/ratio)), zero-pad on the "
        "LEFT and TOP (not centred, unlike pi0); then `x*2-1`. (`resize_imgs_with_padding` is (width, "
        "height); square here.)",
        "4. Image tokens: SmolVLM vision transformer `last_hidden_state` -> connector (pixel shuffle by "
        "`scale_factor`, then `modality_projection.proj`, no bias) -> `* sqrt(text_hidden)`. Text tokens: "
        "`embed_tokens(ids) * sqrt(text_hidden)` (LeRobot scales; Llama itself does not). Llama blocks: "
        "RMSNorm `w * x/rms(x)` (eps 1e-5; not Gemma's 1+w), SwiGLU MLP (silu). State: "
        "`state_proj(state_padded)`, one token at the end of the prefix.",
        "5. Prefix = [cam0 tokens, cam1 tokens, prompt tokens, state token]; att_masks 0 for images and "
        "text, 1 for the state (image/text do not see the state); positions = cumsum(pad_mask) - 1. "
        "Attention: LeRobot's own eager attention (float32 softmax, masked with finfo.min, scale "
        "head_dim^-0.5, GQA by repeating kv heads); RoPE = LeRobot's `apply_rope` (max_wavelength 10000, "
        "NOT the config's rope_theta; halves split, not interleaved).",
        "6. Suffix: `action_time_mlp_out(silu(action_time_mlp_in(cat(action_in_proj(x_t), "
        "sinusoidal(t, expert_width, 4e-3, 4.0)))))`, att_masks all 1 (causal among action tokens); "
        "expert positions restart at 0 in cross-attention layers (`expert_position_id - min`), and "
        "continue after the valid prefix length in self-attention layers.",
        "7. Output: `[:, :, :6]` of x at t=0 (normalised); postprocessor: `y*std + mean`.",
        "",
        "## io.safetensors",
        "",
        "| key | shape | dtype |",
        "| --- | --- | --- |",
    ]
    for k, v in tensors.items():
        lines.append(f"| `{k}` | {list(v.shape)} | {str(v.dtype).replace('torch.', '')} |")
    lines += [
        "",
        "Notes: `model.images.i` = `prepare_images` output; `model.image_embs.i` = `embed_image` (before "
        "the sqrt(hidden) scaling done in `embed_prefix`); `model.prefix_out` = final-normed prefix hidden "
        "states; `model.prefix_kv.L.*` = the prefix DynamicCache (`[B, kv_heads, L, head_dim]`, keys after "
        "RoPE); `model.x_t[k]`, `model.t[k]`, `model.v_t[k]` = `denoise_step` arguments/output at Euler step "
        "k; `model.suffix_out.step0` = expert final-norm output at step 0; `model.v_t0_nocache` = LeRobot's "
        "cache-free joint forward (`model.forward(..., noise, time=1)` at `action_out_proj`), max |diff| vs "
        f"cached = {meta['max_abs_diff_cached_vs_nocache_velocity_t1']:.3g}; `output.action_chunk_normalized` "
        "= `predict_action_chunk`; `output.action_chunk` = after the postprocessor.",
        "",
        f"Versions: {json.dumps(meta['versions'])}.",
        "",
    ]
    (out / "README.md").write_text("\n".join(lines))


if __name__ == "__main__":
    main()

"""Parity fixtures for pi0 and pi0.5 from the reference implementation, LeRobot 0.6.1.

Venv: this runs ONLY in the separate LeRobot venv (Python 3.12, torch 2.13, transformers 5.5,
lerobot==0.6.1 installed with --no-deps), made by

    bash tests/reference/setup_lerobot_venv.sh          # -> /work/venvs/lerobot (LEROBOT_VENV)

Run (from anywhere; CPU only, ~1 min, no network, no model hub):

    /work/venvs/lerobot/bin/python tests/reference/make_pi0_fixtures.py [--only pi0|pi05] [--no-full-size]

What it does, per family (pi0 -> fixtures/pi0/, pi0.5 -> fixtures/pi05/):
  * builds a TINY random instance through LeRobot's own classes (`PI0Policy` / `PI05Policy`).
    LeRobot accepts only the real variant names (gemma_2b / gemma_300m) and hard-codes the SigLIP
    and vocabulary sizes, so -- sizes only, every code path stays LeRobot's -- three names in the
    LeRobot modeling module are wrapped while the policy is built:
      - `get_gemma_config(variant)` returns tiny widths/depths for the two variant names
        (8 heads are kept: LeRobot's joint attention hard-codes `1 * 8 * head_dim`);
      - `PaliGemmaForConditionalGenerationWithPiGemma(config=...)` and
        `PiGemmaForCausalLM(config=...)` get their HF config shrunk first (SigLIP hidden /
        intermediate / layers / heads, vocabulary 257152 -> 512, projector width 2048 -> tiny
        backbone width) and then call the real class.
    The sizes actually used are written to `tiny_sizes.json` (LeRobot's config.json records only
    the variant names, so a loader must take the sizes from there or from the tensor shapes).
  * re-randomises every parameter (seeded; zero-initialised norms and adaRMS layers get non-zero
    values so every path contributes), saves the policy with `save_pretrained` and the
    pre/post-processor pipelines next to it (`checkpoint/`, the hub layout), reloads all three
    with LeRobot's `from_pretrained` / `make_pre_post_processors(pretrained_path=...)`, and runs
    the reloaded objects:
        batch  = preprocessor({camera images, observation.state, task})
        chunk  = policy.predict_action_chunk(batch, noise=noise)     # normalised, unpadded
        action = postprocessor(chunk)                                 # unnormalised
  * writes `io.safetensors` (+ `io.json`, same metadata): raw inputs, the fixed flow noise, the
    preprocessor outputs, intermediates recorded from LeRobot's own methods during that call
    (preprocessed images, image embeddings, prefix embeddings/masks, prefix hidden states and
    KV cache, per-step x_t / t / v_t, the KV-cache-free velocity at t=1) and the outputs;
  * `tokenizer/`: a tiny Gemma-layout tokenizer built with the `tokenizers` library (the real
    PaliGemma tokenizer cannot be fetched offline); the saved preprocessor still names
    "google/paligemma-3b-pt-224" -- this script redirects that name to `tokenizer/`;
  * `full_size_keys.json`: the full-size policy built on the meta device (key -> shape, count);
  * `README.md`: call path, preprocessing, sizes, file list;
  * `rtc/`: guided real-time chunking (LeRobot's `RTCProcessor`). `rtc/config.json` is the
    checkpoint's config with `rtc_config` enabled (written by LeRobot's `PreTrainedConfig`; RTC
    below); the policy is reloaded from the checkpoint with that config and called as LeRobot's
    RTC rollout calls it,
        chunk = policy.predict_action_chunk(batch, noise=noise2, inference_delay=3,
                                            prev_chunk_left_over=chunk_plain[:, 3:])
    (execution horizon from `rtc_config`), recording the Euler trajectory, the plain and guided
    velocities, the prefix weights and the same call without the left-over. It runs last, with
    its own noise generator, so every other file is unchanged by it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _lerobot_fixture_common as common  # noqa: E402

SEED = 1234
VOCAB = 512
REAL_VOCAB = 257152
PALIGEMMA_TOKENIZER = "google/paligemma-3b-pt-224"
CAMERAS = ("observation.images.base_0_rgb", "observation.images.left_wrist_0_rgb")
RAW_IMAGE_HW = (48, 64)  # non-square: exercises LeRobot's resize-with-pad
IMAGE_RES = 56  # SigLIP patch 14 kept -> 4x4 = 16 tokens per camera
STATE_DIM = 6
ACTION_DIM = 6
CHUNK = 10
NUM_STEPS = 10
PROMPT = "pick up the red block and put it in the bowl"
# the guided real-time-chunking case (fixtures/<family>/rtc/): a schedule each, to cover both ramps
RTC = {
    "pi0": {"prefix_attention_schedule": "LINEAR", "max_guidance_weight": 10.0, "execution_horizon": 8},
    "pi05": {"prefix_attention_schedule": "EXP", "max_guidance_weight": 5.0, "execution_horizon": 8},
}

# width, depth, mlp_dim, num_heads, num_kv_heads, head_dim (LeRobot's GemmaConfig fields)
TINY_GEMMA = {
    "gemma_2b": (64, 2, 128, 8, 1, 16),  # PaliGemma backbone (real: 2048, 18, 16384, 8, 1, 256)
    "gemma_300m": (32, 2, 64, 8, 1, 16),  # action expert (real: 1024, 18, 4096, 8, 1, 256)
}
TINY_SIGLIP = {  # real: 1152, 4304, 27, 16 (patch 14 kept)
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
}


def family_modules(family: str):
    if family == "pi0":
        from lerobot.policies.pi0 import modeling_pi0 as modeling
        from lerobot.policies.pi0.configuration_pi0 import PI0Config as Config
        from lerobot.policies.pi0.processor_pi0 import make_pi0_pre_post_processors as make_proc

        return modeling, Config, modeling.PI0Policy, make_proc
    from lerobot.policies.pi05 import modeling_pi05 as modeling
    from lerobot.policies.pi05.configuration_pi05 import PI05Config as Config
    from lerobot.policies.pi05.processor_pi05 import make_pi05_pre_post_processors as make_proc

    return modeling, Config, modeling.PI05Policy, make_proc


@contextlib.contextmanager
def tiny_sizes(modeling, record: dict):
    """Wrap the size builders of LeRobot's pi0/pi05 modeling module (sizes only)."""
    real_get = modeling.get_gemma_config
    real_pali = modeling.PaliGemmaForConditionalGenerationWithPiGemma
    real_expert = modeling.PiGemmaForCausalLM

    def get_gemma_config(variant):
        real_get(variant)  # keeps LeRobot's validation of the name
        return modeling.GemmaConfig(*TINY_GEMMA[variant])

    def shrink_vocab(cfg):
        for name in ("_vocab_size", "vocab_size", "image_token_index", "image_token_id"):
            if getattr(cfg, name, None) == REAL_VOCAB:
                setattr(cfg, name, VOCAB)

    def paligemma(config):
        shrink_vocab(config)
        shrink_vocab(config.text_config)
        shrink_vocab(config.vision_config)
        for k, v in TINY_SIGLIP.items():
            setattr(config.vision_config, k, v)
        config.vision_config.projection_dim = config.text_config.hidden_size  # LeRobot: 2048
        record["paligemma_hf_config"] = config.to_dict()
        return real_pali(config=config)

    def expert(config):
        shrink_vocab(config)
        record["gemma_expert_hf_config"] = config.to_dict()
        return real_expert(config=config)

    modeling.get_gemma_config = get_gemma_config
    modeling.PaliGemmaForConditionalGenerationWithPiGemma = paligemma
    modeling.PiGemmaForCausalLM = expert
    try:
        yield
    finally:
        modeling.get_gemma_config = real_get
        modeling.PaliGemmaForConditionalGenerationWithPiGemma = real_pali
        modeling.PiGemmaForCausalLM = real_expert


@contextlib.contextmanager
def tokenizer_redirect(local_dir: Path):
    """LeRobot's pi0/pi05 processors load "google/paligemma-3b-pt-224" from the hub; point that
    one name at the local tiny tokenizer."""
    from lerobot.processor import tokenizer_processor as tp

    real = tp.AutoTokenizer

    class _Redirect:
        @staticmethod
        def from_pretrained(name, *args, **kwargs):
            if str(name) == PALIGEMMA_TOKENIZER:
                name = str(local_dir)
            return real.from_pretrained(name, *args, **kwargs)

    tp.AutoTokenizer = _Redirect
    try:
        yield
    finally:
        tp.AutoTokenizer = real


def make_config(Config, family: str):
    from lerobot.configs import FeatureType, PolicyFeature

    inputs = {
        cam: PolicyFeature(type=FeatureType.VISUAL, shape=(3, *RAW_IMAGE_HW)) for cam in CAMERAS
    }
    inputs["observation.state"] = PolicyFeature(type=FeatureType.STATE, shape=(STATE_DIM,))
    outputs = {"action": PolicyFeature(type=FeatureType.ACTION, shape=(ACTION_DIM,))}
    return Config(
        device="cpu",
        dtype="float32",
        chunk_size=CHUNK,
        n_action_steps=CHUNK,
        num_inference_steps=NUM_STEPS,
        image_resolution=(IMAGE_RES, IMAGE_RES),
        input_features=inputs,
        output_features=outputs,
    )


def full_size(family: str, out_dir: Path) -> dict:
    modeling, Config, Policy, _ = family_modules(family)
    cfg = Config(device="cpu")
    cfg.device = "meta"  # PI0Policy.__init__ ends with self.model.to(config.device)
    t0 = time.time()
    with torch.device("meta"):
        policy = Policy(cfg)
    sd = policy.state_dict()
    path = common.write_keys_json(
        out_dir / "full_size_keys.json",
        sd,
        {
            "family": family,
            "built": f"{Policy.__name__}({Config.__name__}()) on the meta device, LeRobot 0.6.1 "
            "defaults (paligemma_variant=gemma_2b, action_expert_variant=gemma_300m, "
            "max_state_dim=max_action_dim=32, image_resolution=224)",
            "note": "keys of policy.state_dict() == keys save_pretrained writes (no tied tensors)",
        },
    )
    summary = common.state_dict_summary(sd)
    summary["file"] = path.name
    summary["build_seconds"] = round(time.time() - t0, 2)
    del policy, sd
    return summary


def run_family(family: str, do_full: bool) -> dict:
    modeling, Config, Policy, make_proc = family_modules(family)
    from lerobot.policies.factory import make_pre_post_processors

    out = common.FIXTURES / family
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    ckpt = out / "checkpoint"
    tok_dir = out / "tokenizer"

    common.seed_everything(SEED)
    tokenizer = common.build_gemma_like_tokenizer(tok_dir, VOCAB)

    # ---- inputs and statistics (seeded)
    gen = torch.Generator().manual_seed(SEED + 1)
    images = {cam: common.smooth_image(gen, *RAW_IMAGE_HW) for cam in CAMERAS}
    state = torch.randn(STATE_DIM, generator=gen) * 0.7
    stats = {
        "observation.state": common.make_stats(gen, STATE_DIM),
        "action": common.make_stats(gen, ACTION_DIM),
    }
    noise = torch.randn((1, CHUNK, 32), generator=gen, dtype=torch.float32)

    # ---- build, randomise, save
    sizes: dict = {}
    with tiny_sizes(modeling, sizes), tokenizer_redirect(tok_dir):
        cfg = make_config(Config, family)
        policy = Policy(cfg)
        common.randomize_parameters(policy, SEED + 2)
        policy.eval()
        pre, post = make_proc(cfg, dataset_stats=stats)
        policy.save_pretrained(ckpt)
        pre.save_pretrained(ckpt)
        post.save_pretrained(ckpt)
        saved_sd = {k: v.clone() for k, v in policy.state_dict().items()}
        del policy, pre, post

        # ---- reload exactly as a user of the checkpoint would
        policy = Policy.from_pretrained(str(ckpt), strict=True)
        policy.eval()
        pre, post = make_pre_post_processors(policy.config, pretrained_path=str(ckpt))
    reloaded_sd = policy.state_dict()
    assert list(reloaded_sd) == list(saved_sd)
    for k in saved_sd:
        assert torch.equal(saved_sd[k], reloaded_sd[k]), k
    (out / "tiny_sizes.json").write_text(
        json.dumps(
            {
                "why": "LeRobot's config.json names only the variants; these are the HF configs "
                "the tiny instance was built from (sizes patched, see make_pi0_fixtures.py)",
                "lerobot_gemma_config": {
                    v: dict(zip(["width", "depth", "mlp_dim", "num_heads", "num_kv_heads", "head_dim"], t))
                    for v, t in TINY_GEMMA.items()
                },
                "vocab_size": VOCAB,
                **sizes,
            },
            indent=1,
            sort_keys=True,
            default=str,
        )
        + "\n"
    )

    model = policy.model
    raw = {cam: images[cam].clone() for cam in CAMERAS}
    raw["observation.state"] = state.clone()
    raw["task"] = PROMPT

    # pi0.5's preprocessor turns the (normalised, discretised) state into prompt text: record it.
    steps = list(pre.step_through({k: (v.clone() if torch.is_tensor(v) else v) for k, v in raw.items()}))
    from lerobot.lerobot_types import TransitionKey

    task_after = steps[-1][TransitionKey.COMPLEMENTARY_DATA].get("task")

    batch = pre({k: (v.clone() if torch.is_tensor(v) else v) for k, v in raw.items()})

    # ---- record LeRobot's own intermediate values during the reference call
    rec = common.Recorder()
    rec.wrap(policy, "_preprocess_images")
    rec.wrap(model, "embed_prefix")
    rec.wrap(model, "embed_suffix")
    rec.wrap(model, "denoise_step")
    rec.wrap(model.paligemma_with_expert, "forward", "pwe_forward")
    rec.wrap(model.paligemma_with_expert, "embed_image")
    with torch.no_grad():
        chunk = policy.predict_action_chunk(dict(batch), noise=noise.clone())
    rec.restore()
    actions = post(chunk.clone())

    # determinism: the same call again, unrecorded
    with torch.no_grad():
        chunk2 = policy.predict_action_chunk(dict(pre(dict(raw))), noise=noise.clone())
    assert torch.equal(chunk, chunk2), "reference is not deterministic"

    c = rec.calls
    imgs, img_masks = c["_preprocess_images"][0][2]
    prefix_embs, prefix_pad, prefix_att = c["embed_prefix"][0][2]
    (prefix_out, _), kv = c["pwe_forward"][0][2]
    x_ts = torch.stack([call[1]["x_t"] for call in c["denoise_step"]])
    ts = torch.stack([call[1]["timestep"] for call in c["denoise_step"]])
    v_ts = torch.stack([call[2] for call in c["denoise_step"]])
    suffix0 = c["embed_suffix"][0][2]
    x_final = x_ts[-1] + (-1.0 / NUM_STEPS) * v_ts[-1]

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
    if family == "pi0":
        tensors["model.state_padded"] = policy.prepare_state(batch)
    tensors["model.prefix_embs"] = prefix_embs
    tensors["model.prefix_pad_masks"] = prefix_pad
    tensors["model.prefix_att_masks"] = prefix_att
    tensors["model.prefix_out"] = prefix_out
    tensors.update(common.kv_cache_tensors(kv, "model.prefix_kv"))
    tensors["model.suffix_embs.step0"] = suffix0[0]
    tensors["model.suffix_pad_masks"] = suffix0[1]
    tensors["model.suffix_att_masks"] = suffix0[2]
    if suffix0[3] is not None:
        tensors["model.adarms_cond.step0"] = suffix0[3]
    tensors["model.suffix_out.step0"] = c["pwe_forward"][1][2][0][1]
    tensors["model.x_t"] = x_ts
    tensors["model.t"] = ts
    tensors["model.v_t"] = v_ts
    tensors["model.actions_padded"] = x_final
    tensors["output.action_chunk_normalized"] = chunk
    tensors["output.action_chunk"] = actions

    # KV-cache-free velocity at t = 1: LeRobot's joint (prefix + suffix, no cache) forward,
    # read at action_out_proj.
    captured = []
    hook = model.action_out_proj.register_forward_hook(lambda m, i, o: captured.append(o))
    with torch.no_grad():
        zeros = torch.zeros_like(noise)
        one = torch.ones(1)
        lang = (batch["observation.language.tokens"], batch["observation.language.attention_mask"])
        if family == "pi0":
            model.forward(imgs, img_masks, *lang, policy.prepare_state(batch), zeros, noise.clone(), one)
        else:
            model.forward(imgs, img_masks, *lang, zeros, noise.clone(), one)
    hook.remove()
    v_nocache = captured[0]
    tensors["model.v_t0_nocache"] = v_nocache
    cache_vs_nocache = float((v_nocache - v_ts[0]).abs().max())
    assert torch.allclose(x_final[:, :, :ACTION_DIM], chunk, atol=1e-6)

    meta = {
        "family": family,
        "prompt": PROMPT,
        "prompt_after_preprocessor": task_after,
        "cameras_in_order": list(CAMERAS),
        "raw_image_shape_chw": [3, *RAW_IMAGE_HW],
        "image_resolution": IMAGE_RES,
        "state_dim": STATE_DIM,
        "action_dim": ACTION_DIM,
        "max_state_dim": 32,
        "max_action_dim": 32,
        "chunk_size": CHUNK,
        "num_inference_steps": NUM_STEPS,
        "tokenizer_max_length": policy.config.tokenizer_max_length,
        "normalization_mapping": {k: str(v.value) for k, v in policy.config.normalization_mapping.items()},
        "call": [
            f"policy = {Policy.__name__}.from_pretrained('checkpoint')",
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
    if do_full:
        summary["full_size"] = full_size(family, out)
    write_readme(out, family, Policy, meta, summary, tensors, sizes)
    summary["rtc"] = run_rtc(family, out, Policy, modeling, pre(dict(raw)), post, chunk)
    summary["files"] = common.file_listing(out)
    summary["total_bytes"] = common.dir_size(out)
    summary["cache_vs_nocache_velocity_max_abs_diff"] = cache_vs_nocache
    summary["action_chunk_abs_max"] = float(chunk.abs().max())
    summary["velocity_abs_mean"] = float(v_ts.abs().mean())
    assert summary["total_bytes"] <= common.MAX_FAMILY_BYTES, summary["total_bytes"]
    return summary


def run_rtc(family: str, out: Path, Policy, modeling, batch: dict, post, chunk: torch.Tensor) -> dict:
    """`rtc/`: the policy reloaded from a checkpoint whose config enables `rtc_config`, its
    guided `predict_action_chunk` with the plain chunk's left-over as the previous chunk
    (see `_lerobot_fixture_common.record_rtc`). Runs after everything else, with its own noise
    generator: the plain fixture's files do not change."""
    rtc_dir = out / "rtc"
    noise = torch.randn((1, CHUNK, 32), generator=torch.Generator().manual_seed(SEED + 3))
    with common.rtc_checkpoint(out / "checkpoint", rtc_dir, RTC[family]) as ckpt:
        with tiny_sizes(modeling, {}), tokenizer_redirect(out / "tokenizer"):
            policy = Policy.from_pretrained(str(ckpt), strict=True)
    policy.eval()
    tensors, meta = common.record_rtc(policy, post, batch, chunk, noise, NUM_STEPS)
    meta.update(
        family=family,
        observation="../io.safetensors (input.* cameras and state; prompt in ../io.json)",
        call=[
            f"policy = {Policy.__name__}.from_pretrained(<../checkpoint with rtc/config.json>)",
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
    common.write_rtc_readme(rtc_dir, family, meta, tensors)
    return {"guided_minus_unguided": meta["max_abs_guided_minus_unguided"],
            "bytes": common.dir_size(rtc_dir)}


def write_readme(out: Path, family: str, Policy, meta: dict, summary: dict, tensors: dict, sizes: dict) -> None:
    pi05 = family == "pi05"
    tiny = summary["tiny"]
    full = summary.get("full_size")
    lines = [
        f"# {family} parity fixture (LeRobot 0.6.1 `{Policy.__name__}`)",
        "",
        "Generated by `tests/reference/make_pi0_fixtures.py` in the LeRobot venv "
        "(`tests/reference/setup_lerobot_venv.sh`). Do not edit by hand; regenerate.",
        "",
        "## Files",
        "",
        "* `checkpoint/` -- exactly what LeRobot writes: `config.json` + `model.safetensors` "
        "(`PreTrainedPolicy.save_pretrained`), `policy_preprocessor.json` / "
        "`policy_postprocessor.json` and their normalizer-state `*.safetensors` "
        "(`PolicyProcessorPipeline.save_pretrained`).",
        "* `tokenizer/` -- tiny Gemma-layout tokenizer (`tokenizer.json`, built with the `tokenizers` "
        "library: Unigram pieces, `<pad>=0 <eos>=1 <bos>=2 <unk>=3`, 256 byte-fallback pieces, "
        "spaces -> `▁`, `<bos>` prepended, padded with `<unusedN>` to 512 entries). The saved "
        f"preprocessor names `{PALIGEMMA_TOKENIZER}`; map that name to this folder.",
        "* `tiny_sizes.json` -- the HF PaliGemma / Gemma-expert configs the tiny model was built from. "
        "`checkpoint/config.json` says `paligemma_variant=gemma_2b`, `action_expert_variant=gemma_300m` "
        "(LeRobot accepts nothing else); the real sizes of those names are in `full_size_keys.json`.",
        "* `io.safetensors` (+ `io.json`: the same metadata) -- inputs, noise, intermediates, outputs.",
        "* `full_size_keys.json` -- full-size state-dict key -> shape, built on the meta device.",
        "",
        "## Tiny instance",
        "",
        "| part | real | tiny |",
        "| --- | --- | --- |",
        "| PaliGemma backbone (gemma_2b) width/depth/mlp/heads/kv/head_dim | 2048/18/16384/8/1/256 | "
        + "/".join(map(str, TINY_GEMMA["gemma_2b"]))
        + " |",
        "| action expert (gemma_300m) | 1024/18/4096/8/1/256 | " + "/".join(map(str, TINY_GEMMA["gemma_300m"])) + " |",
        "| SigLIP hidden/mlp/layers/heads/patch | 1152/4304/27/16/14 | "
        + "/".join(str(TINY_SIGLIP[k]) for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"))
        + "/14 |",
        f"| image_resolution | 224 | {IMAGE_RES} (config field) |",
        f"| vocabulary (text embed, lm_heads) | 257152 | {VOCAB} |",
        "| projector out (`projection_dim`) | 2048 | 64 |",
        f"| chunk_size / n_action_steps / num_inference_steps | 50/50/10 | {CHUNK}/{CHUNK}/{NUM_STEPS} |",
        "",
        f"Tiny checkpoint: {tiny['num_tensors']} tensors, {tiny['num_params']:,} parameters. "
        "All parameters are re-drawn after construction (matrices N(0, 1/fan_in); vectors = "
        "init + N(0, 0.1)), so zero-initialised Gemma norms / adaRMS layers are non-trivial.",
        "",
        "First keys: " + ", ".join(f"`{k}`" for k in tiny["first_keys"]),
        "",
        "Last keys: " + ", ".join(f"`{k}`" for k in tiny["last_keys"]),
        "",
    ]
    if full:
        lines += [
            f"Full size (meta device, LeRobot defaults): {full['num_tensors']} tensors, "
            f"{full['num_params']:,} parameters (`{full['file']}`). Both `paligemma.lm_head.weight` and "
            "`paligemma.model.language_model.embed_tokens.weight` and the expert's `lm_head.weight` "
            "are separate tensors in the state dict (counted separately).",
            "",
        ]
    lines += [
        "## Reference call path (what produced the outputs)",
        "",
        "```python",
        *meta["call"],
        "```",
        "",
        "Inside `predict_action_chunk`: `images, img_masks = policy._preprocess_images(batch)`; "
        + ("`state = policy.prepare_state(batch)` (zero-pad to 32); " if not pi05 else "")
        + "`model.sample_actions(images, img_masks, tokens, masks"
        + (", state" if not pi05 else "")
        + ", noise=noise)`: `embed_prefix` -> prefix forward through the PaliGemma LM with a 4-D "
        "additive mask (0 / -2.3819763e38), filling a DynamicCache -> `euler_integrate`: "
        f"{NUM_STEPS} steps, dt = -1/{NUM_STEPS}, t = 1 + k*dt (1.0, 0.9, ... 0.1), "
        "`x <- x + dt * v(x, t)` with `v = denoise_step(...)` (expert over the suffix, attending to the "
        "cached prefix K/V; the cache is cloned per step) -> `[:, :, :action_dim]`.",
        "",
        "## Preprocessing (LeRobot's, to match exactly)",
        "",
        "1. Raw observation: each camera `float32 [3, H, W]` in [0, 1] (here 48x64, values k/255; "
        "`input.*.uint8` holds the same pixels as uint8), `observation.state float32 [6]`, `task` string.",
        "2. Preprocessor pipeline (`checkpoint/policy_preprocessor.json`): rename (no-op) -> add batch dim -> "
        + (
            "normalize state (QUANTILES: `2*(x-q01)/(q99-q01) - 1`, eps only when q99==q01) -> "
            "`Pi05PrepareStateTokenizerProcessorStep`: state (normalised) discretised "
            "`np.digitize(s, np.linspace(-1, 1, 257)[:-1]) - 1`, prompt becomes "
            "`f\"Task: {task.strip().replace('_',' ').replace(chr(10),' ')}, State: {' '.join(bins)};\\nAction: \"` -> "
            f"tokenizer (max_length={meta['tokenizer_max_length']}, padding='max_length', right, truncation) -> device. "
            "Action stats are QUANTILES too (used by the postprocessor)."
            if pi05
            else "`Pi0NewLineProcessor` (append `\\n` to the task) -> tokenizer "
            f"(max_length={meta['tokenizer_max_length']}, padding='max_length', right, truncation; `<bos>` + "
            "pieces + `<pad>`...) -> device -> normalize state (MEAN_STD: `(x - mean) / (std + 1e-8)`). "
            "Images: IDENTITY."
        ),
        f"   The exact prompt fed to the tokenizer is `io.json: prompt_after_preprocessor` = "
        f"`{json.dumps(meta['prompt_after_preprocessor'])}`.",
        "3. `_preprocess_images`: channels-first -> `[B,H,W,C]`; if `(H,W) != image_resolution`, "
        "`resize_with_pad_torch`: ratio = max(W/w, H/h), bilinear resize (align_corners=False, no "
        "antialias) to (int(H/ratio), int(W/ratio)), clamp to [0,1], zero-pad CENTERED (extra row/col at "
        "bottom/right); then `x*2-1` -> [-1, 1]; back to `[B,3,h,w]`. Missing cameras would be -1 images "
        "with mask 0 (not used here).",
        "4. Image tokens: SigLIP `last_hidden_state` (no pooling head) -> `multi_modal_projector.linear` "
        "(no 1/sqrt(d) scaling in transformers 5.5). Text tokens: `embed_tokens(ids) * sqrt(width)` "
        "(Gemma scaled embedding, scale cast to the weight dtype).",
        "   SigLIP: conv patch embed (stride 14) + learned position embedding, pre-LN encoder (LayerNorm "
        "eps 1e-6, gelu_pytorch_tanh MLP), `post_layernorm` included in `last_hidden_state`. Gemma "
        "blocks: RMSNorm `x/rms(x) * (1 + w)` (eps 1e-6, computed in float32), GeGLU MLP "
        "(gelu_pytorch_tanh), RoPE theta 10000 (HF `rotary_emb`; the joint cache-free forward uses the "
        "PaliGemma LM's for both streams), attention scale head_dim^-0.5, eager attention.",
        "5. Prefix = [cam0 tokens, cam1 tokens, prompt tokens]; pad mask = image masks + attention_mask; "
        "all prefix tokens bidirectional (att_mask 0); positions = cumsum(pad_mask) - 1.",
        "6. Suffix: "
        + (
            "`action_in_proj(x_t)`; time: sinusoidal(t, width, min_period=4e-3, max_period=4.0) -> "
            "`time_mlp_in` -> silu -> `time_mlp_out` -> silu = adaRMS condition of every expert norm "
            "(`dense` -> scale, shift, gate; `x*(1+scale)+shift`, residual `x + y*gate`). "
            "Suffix att_masks = [1, 0, 0, ...] (actions attend to the prefix and to each other)."
            if pi05
            else "[`state_proj(state)`, `action_time_mlp_out(silu(action_time_mlp_in(cat(action_in_proj(x_t), "
            "sinusoidal(t)))))`]; att_masks = [1, 1, 0, ...]: the state token starts a block, the action "
            "tokens another (state does not see actions; actions see state and prefix)."
        )
        + " Suffix positions continue after the number of valid prefix tokens.",
        "7. Output: `[:, :, :6]` of x at t=0 (normalised); postprocessor un-normalises "
        + ("(QUANTILES inverse: `(y+1)*(q99-q01)/2 + q01`)." if pi05 else "(MEAN_STD inverse: `y*std + mean`, no eps)."),
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
        "Notes: `model.images.i` = `_preprocess_images` output; `model.image_embs.i` = `embed_image`; "
        "`model.prefix_out` = final-normed prefix hidden states from the cache-filling forward; "
        "`model.prefix_kv.L.keys/values` = its DynamicCache (`[B, kv_heads, L, head_dim]`, keys after "
        "RoPE); `model.x_t[k]`, `model.t[k]`, `model.v_t[k]` = arguments and output of `denoise_step` at "
        "Euler step k (`model.v_t[0]` is the velocity at t=1); `model.suffix_out.step0` = expert final-norm "
        "output at step 0; `model.v_t0_nocache` = the same velocity from LeRobot's cache-free joint forward "
        f"(`model.forward(..., noise, time=1)` read at `action_out_proj`), max |diff| vs cached = "
        f"{meta['max_abs_diff_cached_vs_nocache_velocity_t1']:.3g}; `model.actions_padded` = final x "
        "(`[1, chunk, 32]`); `output.action_chunk_normalized` = `predict_action_chunk` output; "
        "`output.action_chunk` = after the postprocessor; `stats.*` = the dataset stats saved in the "
        "normalizer files.",
        "",
        f"Versions: {json.dumps(meta['versions'])}.",
        "",
    ]
    (out / "README.md").write_text("\n".join(lines))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", choices=["pi0", "pi05"], default=None)
    ap.add_argument("--no-full-size", action="store_true")
    args = ap.parse_args()
    families = [args.only] if args.only else ["pi0", "pi05"]
    report = {}
    for fam in families:
        t0 = time.time()
        report[fam] = run_family(fam, not args.no_full_size)
        report[fam]["seconds"] = round(time.time() - t0, 1)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()

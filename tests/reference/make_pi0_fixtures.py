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
    LeRobot modeling module are wrapped while the policy is built (`_pi0_tiny.py` holds the sizes
    and the wrappers):
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
    checkpoint's config with `rtc_config` enabled (written by LeRobot's `PreTrainedConfig`;
    `_pi0_tiny.RTC`); the policy is reloaded from the checkpoint with that config and called as
    LeRobot's RTC rollout calls it,
        chunk = policy.predict_action_chunk(batch, noise=noise2, inference_delay=3,
                                            prev_chunk_left_over=chunk_plain[:, 3:])
    (execution horizon from `rtc_config`), recording the Euler trajectory, the plain and guided
    velocities, the prefix weights and the same call without the left-over. It runs last, with
    its own noise generator, so every other file is unchanged by it.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _lerobot_fixture_common as common  # noqa: E402
import _pi0_tiny as pi0_tiny  # noqa: E402
from _pi0_fixture_readme import write_readme  # noqa: E402


def full_size(family: str, out_dir: Path) -> dict:
    modeling, Config, Policy, _ = pi0_tiny.family_modules(family)
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
    modeling, Config, Policy, make_proc = pi0_tiny.family_modules(family)
    from lerobot.policies.factory import make_pre_post_processors

    out = common.FIXTURES / family
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    ckpt = out / "checkpoint"
    tok_dir = out / "tokenizer"

    common.seed_everything(pi0_tiny.SEED)
    tokenizer = common.build_gemma_like_tokenizer(tok_dir, pi0_tiny.VOCAB)

    # ---- inputs and statistics (seeded)
    gen = torch.Generator().manual_seed(pi0_tiny.SEED + 1)
    images = {cam: common.smooth_image(gen, *pi0_tiny.RAW_IMAGE_HW) for cam in pi0_tiny.CAMERAS}
    state = torch.randn(pi0_tiny.STATE_DIM, generator=gen) * 0.7
    stats = {
        "observation.state": common.make_stats(gen, pi0_tiny.STATE_DIM),
        "action": common.make_stats(gen, pi0_tiny.ACTION_DIM),
    }
    noise = torch.randn((1, pi0_tiny.CHUNK, 32), generator=gen, dtype=torch.float32)

    # ---- build, randomise, save
    sizes: dict = {}
    with pi0_tiny.tiny_sizes(modeling, sizes), pi0_tiny.tokenizer_redirect(tok_dir):
        cfg = pi0_tiny.make_config(Config, family)
        policy = Policy(cfg)
        common.randomize_parameters(policy, pi0_tiny.SEED + 2)
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
                    for v, t in pi0_tiny.TINY_GEMMA.items()
                },
                "vocab_size": pi0_tiny.VOCAB,
                **sizes,
            },
            indent=1,
            sort_keys=True,
            default=str,
        )
        + "\n"
    )

    model = policy.model
    raw = {cam: images[cam].clone() for cam in pi0_tiny.CAMERAS}
    raw["observation.state"] = state.clone()
    raw["task"] = pi0_tiny.PROMPT

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
    x_final = x_ts[-1] + (-1.0 / pi0_tiny.NUM_STEPS) * v_ts[-1]

    tensors: dict[str, torch.Tensor] = {}
    for i, cam in enumerate(pi0_tiny.CAMERAS):
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
    assert torch.allclose(x_final[:, :, :pi0_tiny.ACTION_DIM], chunk, atol=1e-6)

    meta = {
        "family": family,
        "prompt": pi0_tiny.PROMPT,
        "prompt_after_preprocessor": task_after,
        "cameras_in_order": list(pi0_tiny.CAMERAS),
        "raw_image_shape_chw": [3, *pi0_tiny.RAW_IMAGE_HW],
        "image_resolution": pi0_tiny.IMAGE_RES,
        "state_dim": pi0_tiny.STATE_DIM,
        "action_dim": pi0_tiny.ACTION_DIM,
        "max_state_dim": 32,
        "max_action_dim": 32,
        "chunk_size": pi0_tiny.CHUNK,
        "num_inference_steps": pi0_tiny.NUM_STEPS,
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
        "seed": pi0_tiny.SEED,
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
    noise = torch.randn((1, pi0_tiny.CHUNK, 32), generator=torch.Generator().manual_seed(pi0_tiny.SEED + 3))
    with common.rtc_checkpoint(out / "checkpoint", rtc_dir, pi0_tiny.RTC[family]) as ckpt:
        with pi0_tiny.tiny_sizes(modeling, {}), pi0_tiny.tokenizer_redirect(out / "tokenizer"):
            policy = Policy.from_pretrained(str(ckpt), strict=True)
    policy.eval()
    tensors, meta = common.record_rtc(policy, post, batch, chunk, noise, pi0_tiny.NUM_STEPS)
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
        seed=pi0_tiny.SEED + 3,
        versions=common.versions(),
        tolerance="float32, 1e-4 absolute",
    )
    common.save_io(rtc_dir / "io.safetensors", tensors, meta)
    common.write_rtc_readme(rtc_dir, family, meta, tensors)
    return {"guided_minus_unguided": meta["max_abs_guided_minus_unguided"],
            "bytes": common.dir_size(rtc_dir)}



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

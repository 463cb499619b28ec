"""The LeRobot side of ``benchmarks/vla.py --lerobot``: runs ONLY in the LeRobot venv
(``bash tests/reference/setup_lerobot_venv.sh``), as a child process of the benchmark.

    $LEROBOT_VENV/bin/python benchmarks/vla_lerobot_worker.py OUT_DIR [--family pi0|pi05|smolvla]

At start it builds a random pi0 (or pi0.5) of the benchmark's size through LeRobot's own classes
(the sizes patched exactly as ``tests/reference/make_pi0_fixtures.py`` does, every code path
LeRobot's), or a SmolVLA over a local SmolVLM folder of the benchmark's sizes (as
``tests/reference/make_smolvla_fixtures.py`` builds its tiny one), saves it with
``save_pretrained`` (plus its pre/post-processors and a tokenizer) in OUT_DIR for our loader to
read, and prints one JSON line ``{"ready": OUT_DIR, ...}``. Then it answers JSON lines on stdin:

    {"cmd": "run", "robots": N, "seed": S}   ->  {"latency_s": [...], "actions": [[...]]}

``robots`` observations (two cameras, state, prompt; seeded) are served one after another, as a
LeRobot user serving N robots from one process would (``predict_action_chunk`` has no request
batching): preprocessor -> predict_action_chunk(noise) -> postprocessor per robot. Each robot's
fixed noise is ``torch.randn((1, chunk, 32))`` from ``seed + robot``, so our side can use the
same noise and compare the chunks.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any
from pathlib import Path

import torch

REFERENCE = Path(__file__).resolve().parents[1] / "tests" / "reference"
sys.path.insert(0, str(REFERENCE))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import _lerobot_fixture_common as common  # noqa: E402
import _pi0_tiny as fx  # noqa: E402  (make_pi0_fixtures.py's sizes and size patches)
from vla_observations import CAMERAS, CHUNK, PROMPT, RAW_IMAGE_HW, noise, observation  # noqa: E402

# The benchmark's size: pi0's structure, widths scaled for a CPU (see vla.py).
BENCH_GEMMA = {"gemma_2b": (256, 4, 1024, 8, 1, 32), "gemma_300m": (128, 4, 512, 8, 1, 32)}
BENCH_SIGLIP = {"hidden_size": 128, "intermediate_size": 512, "num_hidden_layers": 4,
                "num_attention_heads": 4}
IMAGE_RES = 112  # 8 x 8 patches of 14 px per camera
# SmolVLA at a width like pi0's backbone here (real: 960 wide, 16 of 32 layers kept).
BENCH_SMOL_TEXT = {"hidden_size": 256, "intermediate_size": 1024, "num_attention_heads": 8,
                   "num_key_value_heads": 2, "head_dim": 32, "num_hidden_layers": 8}
BENCH_SMOL_VISION = {"hidden_size": 128, "intermediate_size": 512, "num_hidden_layers": 4,
                     "num_attention_heads": 4, "patch_size": 8, "image_size": 128}
SMOL_VLM_LAYERS = 4  # of 8: 16 x 16 patches, pixel-shuffled by 4 -> 16 tokens per camera


def save_and_reload(Policy: Any, policy: Any, processors: tuple, ckpt: Path) -> tuple:
    """Saves the policy and its processors as LeRobot does and loads them back strictly: what
    runs is what a user's ``from_pretrained`` would give (and what our loader reads)."""
    from lerobot.policies.factory import make_pre_post_processors

    for part in (policy, *processors):
        part.save_pretrained(ckpt)
    policy = Policy.from_pretrained(str(ckpt), strict=True).eval()
    pre, post = make_pre_post_processors(policy.config, pretrained_path=str(ckpt))
    return policy, pre, post


def build(out: Path, family: str) -> tuple:
    fx.TINY_GEMMA.update(BENCH_GEMMA)
    fx.TINY_SIGLIP.update(BENCH_SIGLIP)
    fx.IMAGE_RES, fx.RAW_IMAGE_HW, fx.CHUNK, fx.CAMERAS = IMAGE_RES, RAW_IMAGE_HW, CHUNK, CAMERAS
    assert fx.PROMPT == PROMPT
    modeling, Config, Policy, make_proc = fx.family_modules(family)

    out.mkdir(parents=True, exist_ok=True)
    tok_dir = out / "tokenizer"
    common.seed_everything(fx.SEED)
    common.build_gemma_like_tokenizer(tok_dir, fx.VOCAB)
    gen = torch.Generator().manual_seed(fx.SEED + 1)
    stats = {"observation.state": common.make_stats(gen, fx.STATE_DIM),
             "action": common.make_stats(gen, fx.ACTION_DIM)}
    sizes: dict = {}
    with fx.tiny_sizes(modeling, sizes), fx.tokenizer_redirect(tok_dir):
        cfg = fx.make_config(Config, family)
        policy = Policy(cfg)
        common.randomize_parameters(policy, fx.SEED + 2)
        policy, pre, post = save_and_reload(Policy, policy, make_proc(cfg, dataset_stats=stats),
                                            out / "checkpoint")
    (out / "tiny_sizes.json").write_text(json.dumps({
        "lerobot_gemma_config": {v: dict(zip(["width", "depth", "mlp_dim", "num_heads",
                                               "num_kv_heads", "head_dim"], t))
                                 for v, t in BENCH_GEMMA.items()},
        "vocab_size": fx.VOCAB, **sizes}, default=str, indent=1))
    params = sum(p.numel() for p in policy.parameters())
    return policy, pre, post, params


def build_smolvla(out: Path) -> tuple:
    import _smolvla_tiny as sx
    from lerobot.policies.smolvla.modeling_smolvla import SmolVLAPolicy
    from lerobot.policies.smolvla.processor_smolvla import make_smolvla_pre_post_processors

    sx.CAMERAS, sx.RAW_IMAGE_HW, sx.CHUNK = CAMERAS, RAW_IMAGE_HW, CHUNK
    sx.IMAGE_RES, sx.NUM_VLM_LAYERS = BENCH_SMOL_VISION["image_size"], SMOL_VLM_LAYERS
    out.mkdir(parents=True, exist_ok=True)
    common.seed_everything(sx.SEED)
    vlm = out / "smolvlm"
    sx.write_vlm_folder(vlm, {**sx.TINY_TEXT, **BENCH_SMOL_TEXT},
                        {**sx.TINY_VISION, **BENCH_SMOL_VISION}, sx.SCALE_FACTOR)
    gen = torch.Generator().manual_seed(sx.SEED + 1)
    stats = {"observation.state": common.make_stats(gen, sx.STATE_DIM),
             "action": common.make_stats(gen, sx.ACTION_DIM)}
    cfg = sx.make_config(str(vlm))
    policy = SmolVLAPolicy(cfg)
    common.randomize_parameters(policy, sx.SEED + 2)
    policy, pre, post = save_and_reload(
        SmolVLAPolicy, policy, make_smolvla_pre_post_processors(cfg, dataset_stats=stats),
        out / "checkpoint")
    params = sum(p.numel() for p in policy.parameters())
    return policy, pre, post, params


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--family", choices=["pi0", "pi05", "smolvla"], default="pi0")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    policy, pre, post, params = (build_smolvla(args.out) if args.family == "smolvla" else
                                 build(args.out, args.family))
    print(json.dumps({"ready": str(args.out), "params": params, "chunk": CHUNK,
                      "cameras": list(CAMERAS), "prompt": PROMPT,
                      "raw_image_hw": list(RAW_IMAGE_HW)}), flush=True)
    for line in sys.stdin:
        msg = json.loads(line)
        if msg.get("cmd") != "run":
            print(json.dumps({"error": f"unknown command {msg!r}"}), flush=True)
            continue
        latencies, actions = [], []
        for robot in range(int(msg["robots"])):
            seed = int(msg["seed"]) + robot
            obs = observation(seed)
            t0 = time.perf_counter()
            with torch.no_grad():
                chunk = policy.predict_action_chunk(pre(obs), noise=noise(seed))
                act = post(chunk)
            latencies.append(time.perf_counter() - t0)
            actions.append(act[0].tolist())
        print(json.dumps({"latency_s": latencies, "actions": actions}), flush=True)


if __name__ == "__main__":
    main()

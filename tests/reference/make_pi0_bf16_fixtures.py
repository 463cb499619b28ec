"""LeRobot's bfloat16 chunk of the pi0 and pi0.5 fixtures: `fixtures/<family>/bf16/`.

Runs ONLY in the LeRobot venv (tests/reference/setup_lerobot_venv.sh), after
make_pi0_fixtures.py, whose files it reads and never changes:

    /work/venvs/lerobot/bin/python tests/reference/make_pi0_bf16_fixtures.py

For each family it loads `fixtures/<family>/checkpoint` with its config's `dtype` set to
`bfloat16` (what a user running LeRobot on a GPU sets: LeRobot then keeps the vision tower, the
projector, the norms and the heads in float32 and runs the Gemma layers in bfloat16), calls
`predict_action_chunk` on the fixture's raw inputs and flow noise exactly as the float32 fixture
was made, and writes `bf16/io.safetensors` (+ io.json): the action chunk and the dtype of every
parameter. Deterministic: a second run gives the same files.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file

import _lerobot_fixture_common as common
import _pi0_tiny as pi0_tiny


def run(family: str) -> dict:
    from lerobot.policies.factory import make_pre_post_processors

    fixture = common.FIXTURES / family
    io = load_file(str(fixture / "io.safetensors"))
    meta = json.loads((fixture / "io.json").read_text())
    modeling, _Config, Policy, _make_proc = pi0_tiny.family_modules(family)
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Path(tmp) / "checkpoint"
        shutil.copytree(fixture / "checkpoint", ckpt)
        cfg = json.loads((ckpt / "config.json").read_text())
        cfg["dtype"] = "bfloat16"
        (ckpt / "config.json").write_text(json.dumps(cfg, indent=4))
        with pi0_tiny.tiny_sizes(modeling, {}), pi0_tiny.tokenizer_redirect(fixture / "tokenizer"):
            policy = Policy.from_pretrained(str(ckpt), strict=True).eval()
            pre, post = make_pre_post_processors(policy.config, pretrained_path=str(ckpt))
    raw = {cam: io[f"input.{cam}"].clone() for cam in meta["cameras_in_order"]}
    raw["observation.state"] = io["input.observation.state"].clone()
    raw["task"] = meta["prompt"]
    with torch.no_grad():
        chunk = post(policy.predict_action_chunk(pre(raw), noise=io["input.noise"].clone()))
    dtypes = {name: str(p.dtype).removeprefix("torch.") for name, p in policy.named_parameters()}
    out = fixture / "bf16"
    out.mkdir(exist_ok=True)
    float32 = io["output.action_chunk"][0]
    info = {
        "family": family,
        "call": ["config.json: dtype = 'bfloat16' (else the checkpoint of ../checkpoint)",
                 "policy = Policy.from_pretrained(checkpoint); pre, post = "
                 "make_pre_post_processors(policy.config, pretrained_path=checkpoint)",
                 "actions = post(policy.predict_action_chunk(pre(raw), noise=noise))   "
                 "# raw and noise: ../io.safetensors"],
        "parameter_dtypes": dtypes,
        "max_abs_minus_float32_chunk": float((chunk[0].float() - float32).abs().max()),
        "versions": common.versions(),
    }
    common.save_io(out / "io.safetensors", {"output.action_chunk": chunk.float()}, info)
    return {"family": family, "minus_float32": info["max_abs_minus_float32_chunk"]}


def main() -> None:
    for family in ("pi0", "pi05"):
        print(json.dumps(run(family)))


if __name__ == "__main__":
    main()

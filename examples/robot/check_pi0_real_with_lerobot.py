"""Checks pi0_real_weights/ against LeRobot itself: LeRobot 0.6.1 loads the directory strictly
(``PI0Policy.from_pretrained(strict=True)``, its own pre/post-processors and the tokenizer in the
directory) and computes the same chunks as mstar_rt, without and with its guided RTC.

Two steps, one per venv (LeRobot's is made by tests/reference/setup_lerobot_venv.sh):

    python examples/robot/check_pi0_real_with_lerobot.py write build/pi0_real_check.safetensors
    /work/venvs/lerobot/bin/python examples/robot/check_pi0_real_with_lerobot.py \\
        compare build/pi0_real_check.safetensors

``write`` (the project's venv) saves an observation, flow noise, the plan still to execute and
mstar_rt's chunks (``reference_actions``, which the tests hold to the served walks); ``compare``
(LeRobot's venv) runs LeRobot's classes on the same inputs and prints the largest differences.
LeRobot builds its variants (gemma_2b, gemma_300m, So400m) at full size and its config.json
records only their names, so, as tests/reference/make_pi0_fixtures.py does, the size builders
are wrapped to give the tiny sizes while the policy is built; every code path stays LeRobot's.
"""

from __future__ import annotations

import pathlib
import sys

HERE = pathlib.Path(__file__).resolve().parent
CHECKPOINT = HERE / "pi0_real_weights"
DELAY = 3


def write(out: pathlib.Path) -> None:
    import torch
    from safetensors.torch import save_file

    sys.path.insert(0, str(HERE))
    from arm_env import ArmEnv
    from expert import expert_chunk
    from mstar_rt.models.lerobot_pi0_reference import reference_actions
    from pi0_real import CAMERA, RealPi0

    policy = RealPi0.load(CHECKPOINT)
    obs = ArmEnv().reset(7)
    plan = expert_chunk(obs)[:8] + 0.05  # a plan a little off what the policy would do
    noise = torch.randn(policy.horizon, policy.config.max_action_dim,
                        generator=torch.Generator().manual_seed(3))
    tensors = {"state": torch.from_numpy(obs), "noise": noise}
    for name, delay, p in (("free", 0, None), ("guided", DELAY, plan)):
        request = {**policy.request(obs, delay, p), "noise": noise}
        tensors[name] = reference_actions(policy.policy, request, policy.rtc)["action_chunk"]
        if p is not None:  # LeRobot's RTC takes the leftover in the model's (normalised) space
            tensors["prev_normalized"] = policy.policy.processor.normalized_actions(
                torch.as_tensor(request["prev_actions"]))
        tensors["image"] = torch.from_numpy(request["images"][CAMERA]).permute(2, 0, 1) / 255
    out.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.float().contiguous() for k, v in tensors.items()}, str(out))
    print(f"wrote {out}")


def compare(path: pathlib.Path) -> None:
    import json

    import torch
    from lerobot.policies.factory import make_pre_post_processors
    from lerobot.policies.pi0 import modeling_pi0 as modeling
    from lerobot.processor import tokenizer_processor
    from safetensors.torch import load_file

    config = json.loads((CHECKPOINT / "config.json").read_text())
    weights = load_file(str(CHECKPOINT / "model.safetensors"))
    vision = "model.paligemma_with_expert.paligemma.model.vision_tower.vision_model."
    backbone = "model.paligemma_with_expert.paligemma.model.language_model."
    expert = "model.paligemma_with_expert.gemma_expert.model."
    vocab, width = weights[backbone + "embed_tokens.weight"].shape
    patch = weights[vision + "embeddings.patch_embedding.weight"]

    def depth(layers: str) -> int:
        return len({k[len(layers):].split(".")[0] for k in weights if k.startswith(layers)})

    sizes = {}  # variant -> LeRobot's GemmaConfig fields, read from the tensors (8 heads, 1 KV)
    for variant, prefix in ((config["paligemma_variant"], backbone),
                            (config["action_expert_variant"], expert)):
        q = weights[prefix + "layers.0.self_attn.q_proj.weight"]
        mlp = weights[prefix + "layers.0.mlp.gate_proj.weight"]
        sizes[variant] = (q.shape[1], depth(prefix + "layers."), mlp.shape[0], 8, 1,
                          q.shape[0] // 8)

    real = (modeling.get_gemma_config, modeling.PaliGemmaForConditionalGenerationWithPiGemma,
            modeling.PiGemmaForCausalLM, tokenizer_processor.AutoTokenizer)

    def shrink(cfg):
        for name in ("_vocab_size", "vocab_size", "image_token_index", "image_token_id"):
            if getattr(cfg, name, None) == 257152:
                setattr(cfg, name, vocab)

    def paligemma(config):
        for c in (config, config.text_config, config.vision_config):
            shrink(c)
        v = config.vision_config
        v.hidden_size, v.patch_size = patch.shape[0], patch.shape[-1]
        v.intermediate_size = weights[vision + "encoder.layers.0.mlp.fc1.weight"].shape[0]
        v.num_hidden_layers = depth(vision + "encoder.layers.")
        v.num_attention_heads = 2  # the tower's (pi0_real.SIZES)
        v.projection_dim = width
        return real[1](config=config)

    def gemma_expert(config):
        shrink(config)
        return real[2](config=config)

    class Tokenizer:  # LeRobot asks for PaliGemma's by name; the directory holds the tiny one
        @staticmethod
        def from_pretrained(name, *args, **kwargs):
            from transformers import PreTrainedTokenizerFast

            return PreTrainedTokenizerFast(
                tokenizer_file=str(CHECKPOINT / "tokenizer" / "tokenizer.json"),
                bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", unk_token="<unk>")

    modeling.get_gemma_config = lambda v: (real[0](v), modeling.GemmaConfig(*sizes[v]))[1]
    modeling.PaliGemmaForConditionalGenerationWithPiGemma = paligemma
    modeling.PiGemmaForCausalLM = gemma_expert
    tokenizer_processor.AutoTokenizer = Tokenizer
    try:
        policy = modeling.PI0Policy.from_pretrained(str(CHECKPOINT), strict=True).eval()
        pre, post = make_pre_post_processors(policy.config, pretrained_path=str(CHECKPOINT))
    finally:
        (modeling.get_gemma_config, modeling.PaliGemmaForConditionalGenerationWithPiGemma,
         modeling.PiGemmaForCausalLM, tokenizer_processor.AutoTokenizer) = real

    ours = load_file(str(path))
    raw = {"observation.images.top": ours["image"], "observation.state": ours["state"],
           "task": "reach the red target"}
    rtc = policy.config.rtc_config
    with torch.no_grad():
        free = post(policy.predict_action_chunk(pre(dict(raw)), noise=ours["noise"][None]))[0]
        guided = post(policy.predict_action_chunk(
            pre(dict(raw)), noise=ours["noise"][None], inference_delay=DELAY,
            prev_chunk_left_over=ours["prev_normalized"][None],
            execution_horizon=rtc.execution_horizon))[0]
    print(f"LeRobot loaded {CHECKPOINT.name} strictly (rtc_config: {rtc})")
    print(f"plain chunk:        max |LeRobot - mstar_rt| = {(free - ours['free']).abs().max():.3g}")
    print(f"guided RTC (d = {DELAY}): max |LeRobot - mstar_rt| = "
          f"{(guided - ours['guided']).abs().max():.3g} (guidance moved the chunk by "
          f"{(guided - free).abs().max():.3g} rad)")


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in ("write", "compare"):
        sys.exit(__doc__)
    (write if sys.argv[1] == "write" else compare)(pathlib.Path(sys.argv[2]))

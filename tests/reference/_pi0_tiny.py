"""The tiny pi0 / pi0.5 of the parity fixtures, built through LeRobot 0.6.1's own classes
(make_pi0_fixtures.py; benchmarks/vla_lerobot_worker.py builds a larger one the same way).

LeRobot accepts only the real variant names (gemma_2b / gemma_300m) and hard-codes the SigLIP and
vocabulary sizes, so -- sizes only, every code path stays LeRobot's -- ``tiny_sizes`` wraps three
names in the LeRobot modeling module while the policy is built, and ``tokenizer_redirect`` points
the PaliGemma tokenizer's hub name at a local tiny tokenizer.

The sizes are module globals that vla_lerobot_worker.py rebinds and updates before it builds:
everything that reads them at build time lives here and reads them here.

Runs ONLY in the LeRobot venv (tests/reference/setup_lerobot_venv.sh).
"""

from __future__ import annotations

import contextlib
from pathlib import Path

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

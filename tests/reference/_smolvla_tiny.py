"""The tiny SmolVLA of the parity fixtures (make_smolvla_fixtures.py): its sizes, the local
SmolVLM "model id" folder LeRobot 0.6.1 builds the VLM and its processor from (config, image and
video processor, a tiny SmolLM2-layout tokenizer), the SmolVLAConfig around it, and the full-size
policy (SmolVLM2-500M sizes) on the meta device. No LeRobot patch: the sizes come from the folder.

Runs ONLY in the LeRobot venv (tests/reference/setup_lerobot_venv.sh).
"""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path

import torch

import _lerobot_fixture_common as common

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

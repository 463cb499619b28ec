"""A tiny random Qwen3-Omni (thinker -> talker + code predictor -> code2wav) for tests.

Token layout in miniature: text ids below 200, the chat and multimodal specials from 200, so a
prompt is written with :func:`chat_prompt`. The talker's vocabulary is ``codebook + 1024`` wide
with every codec special id in the top 1024, as the real one is (``generate`` suppresses that
range but ``codec_eos``). The vision encoder is built (the class needs it) but never fed.
"""

from __future__ import annotations

import math
import os
from typing import Any, Optional, Sequence

import torch

IM_START, IM_END, AUDIO, AUDIO_START, AUDIO_END = 200, 201, 202, 203, 204
IMAGE, VIDEO, VISION_START = 205, 206, 207
TTS_PAD, TTS_BOS, TTS_EOS = 208, 209, 210
SYSTEM, USER, ASSISTANT, NEWLINE = 211, 212, 213, 10
THINKER_VOCAB = 256
CODEBOOK = 32
TALKER_VOCAB = CODEBOOK + 1024
CODEC = dict(codec_pad_id=CODEBOOK + 4, codec_bos_id=CODEBOOK + 5,
             codec_eos_token_id=CODEBOOK + 6, codec_nothink_id=CODEBOOK + 7,
             codec_think_bos_id=CODEBOOK + 8, codec_think_eos_id=CODEBOOK + 9)
SPEAKERS = {"ethan": CODEBOOK + 20, "chelsie": CODEBOOK + 21}
GROUPS = 4
N_MELS = 128


def config(groups: int = GROUPS, thinker_layers: int = 3, accept_hidden_layer: int = 2,
           upsample: Sequence[Sequence[int]] = ((4, 3), (2,)),
           thinker_text: Optional[dict] = None) -> Any:
    """The tiny ``Qwen3OmniMoeConfig`` (float32, eager attention). ``upsample``: code2wav's
    (upsample_rates, upsampling_ratios); the released model's ((8, 5, 4, 3), (2, 2)) make
    1920 samples (80 ms) per frame, the default 24. ``thinker_text``: more fields of the
    thinker's ``text_config`` (``mlp_only_layers``, ``attention_bias``, larger sizes)."""
    from transformers import Qwen3OmniMoeConfig

    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1],
            "interleaved": True, "mrope_interleaved": True}
    text = dict(vocab_size=THINKER_VOCAB, hidden_size=32, intermediate_size=64,
                num_hidden_layers=thinker_layers, num_attention_heads=4, num_key_value_heads=2,
                head_dim=8, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
                rope_parameters=rope, max_position_embeddings=512)
    text.update(thinker_text or {})
    audio = dict(num_mel_bins=N_MELS, encoder_layers=2, encoder_attention_heads=2,
                 encoder_ffn_dim=32, d_model=16, output_dim=text["hidden_size"], n_window=50,
                 n_window_infer=800, downsample_hidden_size=8, max_source_positions=200)
    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, patch_size=4,
                  spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=text["hidden_size"],
                  num_position_embeddings=16, deepstack_visual_indexes=[0])
    thinker = dict(text_config=text, audio_config=audio, vision_config=vision,
                   audio_token_id=AUDIO, image_token_id=IMAGE, video_token_id=VIDEO,
                   audio_start_token_id=AUDIO_START, user_token_id=USER,
                   vision_start_token_id=VISION_START)
    talker_text = dict(vocab_size=TALKER_VOCAB, hidden_size=24, intermediate_size=48,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=8, moe_intermediate_size=16, shared_expert_intermediate_size=16,
                       num_experts=4, num_experts_per_tok=2, rope_parameters=rope,
                       max_position_embeddings=1024)
    predictor = dict(vocab_size=CODEBOOK, hidden_size=24, intermediate_size=48,
                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                     head_dim=8, num_code_groups=groups, max_position_embeddings=64)
    talker = dict(text_config=talker_text, code_predictor_config=predictor,
                  num_code_groups=groups, thinker_hidden_size=text["hidden_size"],
                  accept_hidden_layer=accept_hidden_layer, speaker_id=dict(SPEAKERS),
                  audio_token_id=AUDIO, image_token_id=IMAGE, video_token_id=VIDEO,
                  vision_start_token_id=VISION_START, audio_start_token_id=AUDIO_START,
                  spatial_merge_size=2, **CODEC)
    code2wav = dict(codebook_size=CODEBOOK, hidden_size=16, num_attention_heads=2,
                    num_key_value_heads=2, intermediate_size=32, num_hidden_layers=2,
                    num_quantizers=groups, sliding_window=8, upsample_rates=list(upsample[0]),
                    upsampling_ratios=list(upsample[1]), decoder_dim=16,
                    max_position_embeddings=512)
    cfg = Qwen3OmniMoeConfig(thinker_config=thinker, talker_config=talker,
                             code2wav_config=code2wav, im_start_token_id=IM_START,
                             im_end_token_id=IM_END, tts_pad_token_id=TTS_PAD,
                             tts_bos_token_id=TTS_BOS, tts_eos_token_id=TTS_EOS,
                             system_token_id=SYSTEM, user_token_id=USER,
                             assistant_token_id=ASSISTANT)
    return cfg


def model(seed: int = 0, **kw: Any) -> Any:
    """A random ``Qwen3OmniMoeForConditionalGeneration`` in float32 eval mode."""
    from transformers import Qwen3OmniMoeForConditionalGeneration

    torch.manual_seed(seed)
    cfg = config(**kw)
    cfg._attn_implementation = "eager"
    m = Qwen3OmniMoeForConditionalGeneration(cfg).float().eval()
    with torch.no_grad():  # random init leaves some tensors at exactly 0 / 1: make them matter
        for name, p in m.named_parameters():
            if p.dim() == 1 and ("norm" in name or "scale" in name or "alpha" in name
                                 or "beta" in name):
                p.add_(torch.randn_like(p) * 0.1)
        # transformers starts the talker's routers at zero (every expert ties, and which two
        # win is up to each implementation's topk) and leaves its fused experts uninitialised
        # (torch.empty: mostly ~1e-43, now and then NaN): give both real random values
        for name, p in m.talker.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0, 0.5)
            elif name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                p.normal_(0, 0.02)
        # At init code2wav's waveform peaks near 5e-5, where a tolerance of 1e-5 would prove
        # nothing; made loud, it peaks near 1 (a few samples clamp).
        for name, p in m.code2wav.named_parameters():
            if p.dim() >= 2 and "code_embedding" not in name:
                p.normal_(0, 0.6 / math.sqrt(p[0].numel()))
        m.code2wav.decoder[-1].conv.weight.mul_(4)
    return m


def save(m: Any, path: str) -> str:
    """Writes ``m`` in the hub layout (``config.json`` + safetensors, one tensor per expert)."""
    m.save_pretrained(path, safe_serialization=True)
    return path


def chat_prompt(text: Sequence[int] = (), audio_frames: Optional[int] = None,
                system: Sequence[int] = ()) -> list[int]:
    """``<|im_start|>system ...<|im_end|> <|im_start|>user [audio] text<|im_end|>
    <|im_start|>assistant\\n`` as ids. ``audio_frames``: mel frames of one audio input (its
    placeholder count is the encoder's output length for that many frames)."""
    ids: list[int] = []
    if system:
        ids += [IM_START, SYSTEM, NEWLINE, *system, IM_END, NEWLINE]
    ids += [IM_START, USER, NEWLINE]
    if audio_frames is not None:
        ids += [AUDIO_START] + [AUDIO] * audio_tokens(audio_frames) + [AUDIO_END]
    ids += [*text, IM_END, NEWLINE, IM_START, ASSISTANT, NEWLINE]
    return ids


def audio_tokens(frames: int) -> int:
    """How many audio placeholders ``frames`` mel frames become (the encoder's output length)."""
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
        _get_feat_extract_output_lengths)

    return int(_get_feat_extract_output_lengths(torch.tensor(frames)))


def mel(frames: int, seed: int = 1) -> torch.Tensor:
    """Random log-mel-like features ``[N_MELS, frames]``."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(N_MELS, frames, generator=g) * 0.5


def generate(m: Any, prompt: Sequence[int], features: Optional[torch.Tensor] = None,
             speaker: str = "ethan", thinker_max_new_tokens: int = 12,
             talker_max_new_tokens: int = 40, fixed_length: bool = False
             ) -> tuple[torch.Tensor, Any]:
    """transformers' own greedy ``generate`` (no repetition penalty): (sequences, waveform).
    ``fixed_length``: no end of speech before the maximum (min_new_tokens; the same as
    ``ignore_eos`` in our talker sampling)."""
    kw: dict[str, Any] = {}
    if fixed_length:
        kw.update(talker_min_new_tokens=talker_max_new_tokens)
    if features is not None:
        kw["input_features"] = features[None]
        kw["feature_attention_mask"] = torch.ones(1, features.shape[1], dtype=torch.long)
    with torch.no_grad():
        return m.generate(input_ids=torch.tensor([list(prompt)]), speaker=speaker,
                          thinker_max_new_tokens=thinker_max_new_tokens,
                          thinker_eos_token_id=IM_END, thinker_do_sample=False,
                          talker_max_new_tokens=talker_max_new_tokens,
                          talker_do_sample=False, talker_repetition_penalty=1.0, **kw)


if __name__ == "__main__":
    import tempfile
    import time

    m = model()
    print(sum(p.numel() for p in m.parameters()), "params")
    t = time.time()
    seq, wav = generate(m, chat_prompt([72, 105, 33]))
    print("text->", seq.shape, None if wav is None else wav.shape, f"{time.time() - t:.2f}s")
    f = mel(230)
    t = time.time()
    seq, wav = generate(m, chat_prompt([72], audio_frames=230), f)
    print("audio->", seq.shape, None if wav is None else wav.shape, f"{time.time() - t:.2f}s")
    with tempfile.TemporaryDirectory() as d:
        save(m, d)
        print(sorted(os.listdir(d)))

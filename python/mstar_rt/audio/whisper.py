"""Speech recognition with a Whisper-architecture checkpoint from a local directory.

The model is transformers' ``WhisperForConditionalGeneration`` (this module wraps it; it does
not reimplement Whisper) with greedy decoding; log-mel features come from transformers'
``WhisperFeatureExtractor`` (the directory's ``preprocessor_config.json``, else its defaults
with the config's mel-bin count); text from the directory's tokenizer. It runs on CPU or GPU:

    asr = WhisperASR("whisper-small.en")          # config.json, model.safetensors, tokenizer...
    asr.recognize(samples_16k).text

:meth:`WhisperASR.recognize` has the shape of ``PocketSphinxASR.recognize``, so a WhisperASR
can be the voice agent's ``asr``.
"""

from __future__ import annotations

import math
import os
import threading
import time
from typing import Any, Optional, Union

import numpy as np

from mstar_rt.audio.asr import Recognition
from mstar_rt.audio.samples import mono_float

MAX_SECONDS = 30.0  # Whisper's input window


class WhisperASR:
    """``WhisperASR(checkpoint_dir, language=None, task="transcribe", max_new_tokens=128,
    device="cpu", dtype=None)``. ``language`` (e.g. ``"en"``) is forced for multilingual
    models; None lets the model's generation config decide (English-only models need None).
    ``max_new_tokens`` is capped to what the decoder's positions hold after the start tokens.
    :meth:`recognize` is thread-safe (one call at a time)."""

    def __init__(self, checkpoint_dir: Union[str, os.PathLike], language: Optional[str] = None,
                 task: str = "transcribe", max_new_tokens: int = 128, device: str = "cpu",
                 dtype: Any = None) -> None:
        path = os.fspath(checkpoint_dir)
        missing = [f for f in ("config.json", "tokenizer.json")
                   if not os.path.exists(os.path.join(path, f))]
        if missing:
            raise FileNotFoundError(f"{path} has no {' or '.join(missing)}: give a Whisper "
                                    "checkpoint directory (config.json, model.safetensors, "
                                    "tokenizer.json + tokenizer_config.json, optionally "
                                    "preprocessor_config.json and generation_config.json)")
        import torch
        from transformers import (AutoTokenizer, WhisperFeatureExtractor,
                                  WhisperForConditionalGeneration)

        self.model = WhisperForConditionalGeneration.from_pretrained(
            path, local_files_only=True, dtype=dtype or torch.float32).to(device).eval()
        if os.path.exists(os.path.join(path, "preprocessor_config.json")):
            self.features = WhisperFeatureExtractor.from_pretrained(path, local_files_only=True)
        else:
            self.features = WhisperFeatureExtractor(feature_size=self.model.config.num_mel_bins)
        if self.features.feature_size != self.model.config.num_mel_bins:
            raise ValueError(f"{path}: preprocessor_config.json makes {self.features.feature_size} "
                             f"mel bins but the model takes {self.model.config.num_mel_bins}")
        self.tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        self.sample_rate = int(self.features.sampling_rate)
        # The decoder's positions hold the start tokens (at most 4) and the text.
        self.max_new_tokens = min(max_new_tokens, self.model.config.max_target_positions - 4)
        self.language, self.task = language, task
        self.device = device
        self._lock = threading.Lock()

    def check_audio(self, samples: Any) -> np.ndarray:
        """The samples as 1-D float32, or a ValueError / TypeError saying what to change."""
        x = mono_float(samples, "WhisperASR.recognize")
        if len(x) == 0:
            raise ValueError("WhisperASR.recognize got empty audio; give at least one sample")
        if len(x) > MAX_SECONDS * self.sample_rate:
            raise ValueError(f"WhisperASR.recognize got {len(x) / self.sample_rate:.1f} s of "
                             f"audio; Whisper reads at most {MAX_SECONDS:.0f} s at once: split it")
        if not np.all(np.isfinite(x)):
            raise ValueError("WhisperASR.recognize got NaN or infinite samples")
        return x

    def recognize(self, samples: Any) -> Recognition:
        """Transcribes one utterance of float samples at ``sample_rate`` (16 kHz). Confidence:
        the geometric mean of the chosen tokens' probabilities."""
        import torch

        x = self.check_audio(samples)
        with self._lock, torch.inference_mode():
            start = time.perf_counter()
            feats = self.features(x, sampling_rate=self.sample_rate, return_tensors="pt")
            inputs = feats.input_features.to(self.device, self.model.dtype)
            kwargs: dict[str, Any] = dict(max_new_tokens=self.max_new_tokens, do_sample=False,
                                          num_beams=1, return_dict_in_generate=True,
                                          output_scores=True)
            if self.language is not None:
                kwargs.update(language=self.language, task=self.task)
            out = self.model.generate(inputs, **kwargs)
            ids = out.sequences[0]
            text = self.tokenizer.decode(ids, skip_special_tokens=True).strip()
            confidence = _confidence(out.scores, ids)
            seconds = time.perf_counter() - start
        return Recognition(text, confidence, seconds)


def _confidence(scores: Any, ids: Any) -> float:
    """exp(mean log-probability) of the generated tokens (the last ``len(scores)`` ids)."""
    import torch

    if not scores:
        return 0.0
    chosen = ids[-len(scores):]
    logp = [torch.log_softmax(s[0].float(), -1)[int(t)] for s, t in zip(scores, chosen)]
    mean = float(torch.stack(logp).mean())
    return math.exp(mean) if math.isfinite(mean) else 0.0

"""Real-time audio: PortAudio streams over C++ rings, a streaming resampler, voice activity
detection with endpointing, speech recognition (PocketSphinx, or Whisper from a local
checkpoint), text to speech (Piper, espeak-ng, or Orpheus), the voice agent, whose response node
is a command responder or an LM walk (or, speech to speech, an omni model), and per-request
speech streaming metrics. Device and model modules load on first use (sounddevice loads
libportaudio; the VAD and recognizer load their bundled models)."""

import importlib
from typing import Any

from mstar_rt.audio.resample import Resampler

_LAZY = {
    "FLAG_NAMES": "devices", "AudioInput": "devices", "AudioOutput": "devices",
    "SileroVAD": "vad", "Endpointer": "vad", "VADEvent": "vad", "VADNode": "vad",
    "PocketSphinxASR": "asr", "ASRNode": "asr", "Recognition": "asr",
    "ROBOT_COMMANDS_JSGF": "asr",
    "PiperTTS": "tts", "EspeakTTS": "tts", "default_tts": "tts",
    "VoiceAgent": "agent", "ReplyModel": "agent", "CommandResponder": "commands",
    "open_agent": "agent", "OmniVoiceAgent": "omni_reply", "open_omni_agent": "omni_reply",
    "LMResponder": "lm_responder", "WhisperASR": "whisper", "OrpheusSpeech": "tts",
    "SpeechMetrics": "speech_metrics", "SpeechMeter": "speech_metrics",
    "Turn": "turns", "VoiceStats": "turns", "CommandGrammar": "grammar",
    "PartialRecognizer": "asr_stream", "PartialASRNode": "asr_stream",
}

__all__ = ["Resampler", *_LAZY]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'mstar_rt.audio' has no attribute {name!r}")
    return getattr(importlib.import_module(f"mstar_rt.audio.{module}"), name)

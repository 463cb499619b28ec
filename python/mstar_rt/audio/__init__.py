"""Real-time audio I/O: PortAudio streams over C++ rings, and a streaming resampler."""

from typing import Any

from mstar_rt.audio.resample import Resampler

__all__ = ["FLAG_NAMES", "AudioInput", "AudioOutput", "Resampler"]


def __getattr__(name: str) -> Any:
    # sounddevice loads libportaudio on import: only when a device class is asked for.
    if name in ("FLAG_NAMES", "AudioInput", "AudioOutput"):
        from mstar_rt.audio import devices

        return getattr(devices, name)
    raise AttributeError(f"module 'mstar_rt.audio' has no attribute {name!r}")

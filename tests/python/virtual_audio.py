"""The virtual audio rig shared by the audio tests: PulseAudio null sinks started by
scripts/virtual_audio.sh (mstar_mic's monitor is the microphone, mstar_spk the speaker)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


def require_tool(tool: str) -> None:
    """Skips locally when ``tool`` is not on PATH; fails in CI, where scripts/setup.sh installs
    it (so a missing install step cannot pass as a skip)."""
    if shutil.which(tool) is None:
        if IN_CI:
            pytest.fail(f"{tool} is not installed in CI (scripts/setup.sh installs it)")
        pytest.skip(f"{tool} is not installed (scripts/setup.sh installs it)")


def unavailable(why: str) -> None:
    """Skips locally; fails in CI, which installs everything (scripts/setup.sh)."""
    if IN_CI:
        pytest.fail(f"virtual audio devices unavailable in CI: {why}")
    pytest.skip(f"virtual audio devices unavailable: {why}")


def start_devices() -> ModuleType:
    """Starts (idempotently) the virtual devices; returns the module with the device classes."""
    for tool in ("pulseaudio", "pactl", "paplay", "parec", "espeak-ng"):
        if shutil.which(tool) is None:
            unavailable(f"{tool} is not installed (scripts/setup.sh installs it)")
    run = subprocess.run(["bash", str(ROOT / "scripts/virtual_audio.sh"), "start"],
                         capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    if run.returncode != 0:
        unavailable(f"scripts/virtual_audio.sh failed: {run.stderr.strip()}")
    # Only now: PortAudio lists ALSA's "pulse" device only if the server runs when it starts.
    try:
        from mstar_rt.audio import devices as audio
    except (ImportError, OSError) as e:  # sounddevice missing, or libportaudio2 missing
        unavailable(f"cannot import mstar_rt.audio.devices: {e}")
    return audio


def espeak16k(text: str) -> "object":
    """espeak-ng's speech of ``text`` as 16 kHz float32 samples (what the recognizer takes)."""
    import io
    import wave

    import numpy as np

    from mstar_rt.audio.resample import Resampler

    raw = subprocess.run(["espeak-ng", "--stdout", text], capture_output=True, check=True,
                         timeout=30, stdin=subprocess.DEVNULL).stdout
    with wave.open(io.BytesIO(raw)) as w:
        x = np.frombuffer(w.readframes(w.getnframes()), np.int16).astype(np.float32) / 32768
        return Resampler(w.getframerate(), 16000).process(x)

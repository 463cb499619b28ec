"""The voice soak section: one VoiceAgent session on the virtual audio devices
(scripts/virtual_audio.sh: PulseAudio null sinks) for a fixed time of back-to-back turns.

An espeak-ng robot command is played into the virtual microphone (paplay blocks until it has
played); as soon as the agent's reply to it is done, the next command is played. Recorded:
turns heard and recognized exactly, the output ring's underruns (blocks short of audio while a
reply was open), the input ring's overruns (capture blocks that did not fit), end-of-speech to
first reply sample written (``latency_write``), and at the end what the two rings and the two
Runtimes (listen walk, reply walk) still hold. Device-level xruns (ALSA recovering a late
callback, printed on stderr) and PortAudio's underflow flags are counted apart from the ring's
underruns. One turn per command is played before the baseline (warm-up)."""

from __future__ import annotations

import importlib
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np

from bench_common import ROOT
from soak_proc import Sampler, snapshot, wait_until

COMMANDS = ["move the arm to the left", "open the gripper", "pick up the cup",
            "close the gripper", "move the arm to the right", "put down the box"]
TURN_TIMEOUT_S = 25.0
TOOLS = ("pulseaudio", "pactl", "paplay", "espeak-ng")


class NotRun(RuntimeError):
    """The section cannot run on this machine; the message says why."""


def _start_devices() -> None:
    missing = [t for t in TOOLS if shutil.which(t) is None]
    if missing:
        raise NotRun(f"{missing} not installed (scripts/setup.sh installs them)")
    r = subprocess.run(["bash", str(ROOT / "scripts/virtual_audio.sh"), "start"],
                       capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    if r.returncode != 0:
        raise NotRun(f"scripts/virtual_audio.sh failed: {r.stderr.strip()}")


class _StderrCount:
    """Sends this process's fd 2 to a file while active, so that C libraries' messages (ALSA
    prints "underrun occurred" for every device-level xrun it recovers) can be counted."""

    def __init__(self) -> None:
        self.file = tempfile.NamedTemporaryFile("w+b", prefix="soak_voice_stderr_")
        self._saved = os.dup(2)
        os.dup2(self.file.fileno(), 2)

    def count(self, needle: bytes) -> int:
        self.file.flush()
        return Path(self.file.name).read_bytes().count(needle)

    def close(self) -> str:
        os.dup2(self._saved, 2)
        os.close(self._saved)
        text = Path(self.file.name).read_bytes().decode(errors="replace")
        self.file.close()
        return text


def _held_by_stream(runtime) -> dict:
    """What the listen walk's one long request holds after the session: the EMITted values its
    handle keeps for result() and its timeline records (both grow with every 32 ms window)."""
    values, nbytes, records = 0, 0, 0
    for handle in runtime.requests.entries():
        for vs in getattr(handle, "_emitted", {}).values():
            values += len(vs)
            for events in vs:
                for ev in events if isinstance(events, list) else [events]:
                    nbytes += int(getattr(getattr(ev, "audio", None), "nbytes", 0) or 0)
        records += len(runtime.conductor.timeline(handle.id))
    return {"listen_emitted_values_held": values, "listen_emitted_audio_mb_held": nbytes / 2**20,
            "listen_timeline_records_held": records}


XRUN = b"underrun occurred"


def _turn(agent, cmd: str, wav: Path, at: float, records: list) -> None:
    """Plays ``wav`` into the microphone and waits for the agent's reply to end."""
    before = len(agent.turns)
    subprocess.run(["paplay", "--device=mstar_mic", str(wav)], check=True, timeout=30,
                   stdin=subprocess.DEVNULL)
    ok = wait_until(lambda: len(agent.turns) > before and agent.turns[before].done.is_set(),
                    TURN_TIMEOUT_S)
    turn = agent.turns[before] if len(agent.turns) > before else None
    records.append({"at_s": round(at, 2), "command": cmd, "ok": ok,
                    "recognized": turn.text if turn else "",
                    "latency_write_ms": (1e3 * turn.latency_write if turn else None),
                    "underruns": turn.underruns if turn else None,
                    "extra_turns": len(agent.turns) - before - 1,
                    "error": turn.error if turn else "no turn"})


def run_voice(quick: bool, seconds: float, sample_s: float) -> dict:
    _start_devices()
    try:  # only now: PortAudio lists the "pulse" device only if the server runs when it starts
        for module in ("mstar_rt.audio.devices", "mstar_rt.audio.agent", "mstar_rt.audio.tts"):
            importlib.import_module(module)
    except (ImportError, OSError) as e:
        raise NotRun(f"cannot import the audio stack: {e}") from None
    with tempfile.TemporaryDirectory(prefix="soak_voice_") as tmp:
        wavs = []
        for i, cmd in enumerate(COMMANDS):
            path = Path(tmp) / f"{i}.wav"
            subprocess.run(["espeak-ng", "-w", str(path), cmd], check=True, timeout=30)
            wavs.append((cmd, path))
        return _session(wavs, seconds, sample_s)


def _session(wavs: list[tuple[str, Path]], seconds: float, sample_s: float) -> dict:
    from mstar_rt.audio.agent import open_agent
    from mstar_rt.audio.tts import default_tts

    tts = default_tts()
    pid = os.getpid()
    start = snapshot(pid)
    stderr = _StderrCount()
    agent = open_agent("mstar_mic.monitor", "mstar_spk", tts=tts)
    records: list[dict] = []
    warm: list[dict] = []
    try:
        agent.start()  # warms the reply walk up
        # One turn per command before the baseline: each new reply length grows the TTS's
        # buffers once, which is not what a soak is after.
        for cmd, wav in wavs:
            _turn(agent, cmd, wav, 0.0, warm)
        t0 = time.perf_counter()
        with Sampler(pid, sample_s, t0) as sampler:
            i = 0
            while time.perf_counter() - t0 < seconds:
                cmd, wav = wavs[i % len(wavs)]
                i += 1
                _turn(agent, cmd, wav, time.perf_counter() - t0, records)
        wait_until(lambda: not agent.speaking, TURN_TIMEOUT_S)
        time.sleep(0.3)
        xruns = stderr.count(XRUN)
        held = _held_by_stream(agent.listen_runtime)
        # What is held at the end: ring slots (frames) in use, and the two Runtimes' state.
        rings = {"output_ring_frames_in_use": int(agent.output.queued),
                 "input_ring_frames_in_use": int(agent.input.available)}
        assert agent.runtime is not None  # open_agent's agent replies through a Runtime
        reply_live = dict(agent.runtime.live)
        listen_live = dict(agent.listen_runtime.live)  # its one long request is expected
        out_counters = agent.output.counters()
        overruns, overrun_frames = agent.input.overruns, agent.input.overrun_frames
        agent_errors = list(agent.errors)
    finally:
        agent.stop()
        time.sleep(0.3)
        stderr_text = stderr.close()
    end = snapshot(pid)
    heard = [r for r in records if r["ok"]]
    lat = np.array([r["latency_write_ms"] for r in heard if r["latency_write_ms"] is not None])
    exact = sum(r["recognized"] == r["command"] for r in records)
    return {
        "seconds": seconds, "tts": type(tts).__name__, "turns": records, "warmup_turns": warm,
        "rings_at_end": rings, "reply_runtime_live_at_end": reply_live,
        "listen_runtime_live_at_end": listen_live, "output_counters": out_counters,
        "agent_errors": agent_errors[:5], "rss_series": sampler.series(),
        "stderr_tail": stderr_text.splitlines()[-10:],
        "start": start, "end": end,
        "figures": {
            "turns_played": len(records), "turns_heard": len(heard),
            "turns_recognized_exactly": exact,
            "underruns": int(out_counters["underruns"]),
            "underruns_in_soak_turns": int(sum(r["underruns"] or 0 for r in records)),
            "overruns": int(overruns), "overrun_frames": int(overrun_frames),
            "device_xruns": xruns,
            "portaudio_output_underflows": int(out_counters["flags"]["output_underflow"]),
            "latency_write_p50_ms": float(np.median(lat)) if len(lat) else None,
            "latency_write_max_ms": float(lat.max()) if len(lat) else None,
            **rings,
            "reply_runtime_live_at_end": sum(reply_live.values()),
            **held,
            "rss_growth_mb_per_min": sampler.rss_growth_mb_per_min(),
            "rss_start_mb": start["rss_mb"], "rss_end_mb": end["rss_mb"],
            "fds_start": start["fds"], "fds_end": end["fds"],
            "leaked_fds": end["fds"] - start["fds"],
            "threads_start": start["threads"], "threads_end": end["threads"],
            "leaked_threads": end["threads"] - start["threads"],
            "errors": (len(agent_errors) + sum(1 for r in records + warm if not r["ok"])
                       + (1 if sum(reply_live.values()) else 0)),
        },
    }

"""Streaming demonstration: token stream → sliding-window decoder → audio ring → paced speaker.

A stand-in "speech LM" emits 7 codec tokens per 85 ms audio frame (the Orpheus/SNAC layout) at
faster than real time. A StreamBuffer with SlidingWindow(28, 7) hands the decoder the last four
frames every frame, as the Orpheus decoder wants; the decoder keeps the new frame's samples (a
tone per frame here, the ring mechanics alone: examples/voice/tts.py runs the real SNAC
decoder) and pushes them into an audio Ring that a "speaker" thread drains at exactly 24 kHz
in 20 ms blocks. The end of stream flushes the tail, so the last frame is played too. Prints
time to first audio, underruns and sample accounting.
"""

from __future__ import annotations

import argparse
import threading
import time

import numpy as np

import mstar_rt

SAMPLE_RATE = 24_000
TOKENS_PER_FRAME = 7
SAMPLES_PER_FRAME = 2048
BLOCK = 480  # 20 ms speaker blocks


def speech_lm(tokens: mstar_rt.StreamBuffer, n_frames: int, token_s: float) -> None:
    rng = np.random.default_rng(0)
    for _ in range(n_frames * TOKENS_PER_FRAME):
        tokens.push(rng.integers(0, 4096, size=1, dtype=np.int32))
        time.sleep(token_s)
    tokens.close()


def decoder(tokens: mstar_rt.StreamBuffer, audio: mstar_rt.Ring) -> int:
    frames = 0
    for chunk in tokens:  # each chunk: up to 28 tokens, of which the last 7 (or fewer) are new
        new_frames = max(1, len(chunk.new) // TOKENS_PER_FRAME)
        for _ in range(new_frames):
            t = (np.arange(SAMPLES_PER_FRAME) + frames * SAMPLES_PER_FRAME) / SAMPLE_RATE
            pitch = 220.0 * 2 ** ((int(chunk.data[-1]) % 12) / 12)
            audio.push((0.2 * np.sin(2 * np.pi * pitch * t)).astype(np.float32))
            frames += 1
    audio.close()
    return frames


def speaker(audio: mstar_rt.Ring, report: dict) -> None:
    start = time.monotonic()
    next_tick = start
    played = underruns = 0
    first = None
    while True:
        block = audio.pop(BLOCK, timeout=1.0)
        if block is None:
            break
        if first is None:
            first = time.monotonic() - start
        elif len(block) < BLOCK and not (audio.closed and len(audio) == 0):
            underruns += 1  # short while more was to come (the tail after close is not)
        played += len(block)
        next_tick += len(block) / SAMPLE_RATE
        time.sleep(max(0.0, next_tick - time.monotonic()))
    report.update(first_audio_s=first, played=played, underruns=underruns)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--frames", type=int, default=24, help="audio frames to speak (85 ms each)")
    parser.add_argument("--token-ms", type=float, default=2.0, help="LM time per token")
    args = parser.parse_args()

    tokens = mstar_rt.StreamBuffer(np.int32, 64, mstar_rt.SlidingWindow(28, 7))
    audio = mstar_rt.Ring(np.float32, 1 << 16)
    report: dict = {}
    threads = [
        threading.Thread(target=speech_lm, args=(tokens, args.frames, args.token_ms / 1000)),
        threading.Thread(target=speaker, args=(audio, report)),
    ]
    for t in threads:
        t.start()
    frames = decoder(tokens, audio)
    for t in threads:
        t.join()

    expected = args.frames * SAMPLES_PER_FRAME
    print(f"policy            {tokens.policy}")
    print(f"frames decoded    {frames} of {args.frames}")
    print(f"time to 1st audio {report['first_audio_s'] * 1000:.1f} ms")
    print(f"samples played    {report['played']} (expected {expected})")
    print(f"underruns         {report['underruns']}")
    if frames != args.frames or report["played"] != expected:
        raise SystemExit("demo: samples were lost")


if __name__ == "__main__":
    main()

"""Text to speech with streamed audio: an Orpheus-style LM speaks SNAC codes, the SNAC decoder
turns each window of them into 24 kHz audio while the LM is still talking.

    python examples/voice/tts.py "Hello there." --out hello.wav     # tiny random model
    python examples/voice/tts.py "Hello there." --play              # speaker (sounddevice)
    python examples/voice/tts.py "Hi." --voice tara --out hi.wav \
        --checkpoint orpheus-3b-0.1-ft --snac snac_24khz              # real weights
    python examples/voice/tts.py --token-ids 101,202 --out a.wav    # text token ids (the
                                                                    # tiny model's are < 715)

The default model is random (a small Llama and a narrow SNAC with the real 24 kHz receptive
field) with codes constrained to valid frames: it makes noise-like speech-shaped audio and
exercises the same streaming path as real weights. Audio is written to the WAV file (16-bit mono)
chunk by chunk as it arrives; prints time to first audio, real-time factor, chunk arrival
intervals and whether the stream could have played without a gap.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
import wave
from typing import Any, Optional

import numpy as np
import torch

import mstar_rt
from mstar_rt.engines import SamplingParams
from mstar_rt.models.orpheus import OrpheusTTS
from mstar_rt.audio.speech_metrics import SpeechMeter, SpeechMetrics

T = 600.0  # seconds: the longest a request may take before we give up


class Speaker:
    """Plays chunks as they arrive: the PortAudio callback only copies from a Ring."""

    def __init__(self, sample_rate: int) -> None:
        try:
            import sounddevice
        except ImportError:
            sys.exit("--play needs the sounddevice package (pip install sounddevice)")
        self.ring = mstar_rt.Ring(np.float32, 1 << 22)
        self.drained = threading.Event()
        self.stream = sounddevice.OutputStream(samplerate=sample_rate, channels=1,
                                               dtype="float32", callback=self._callback)
        self.started = False

    def _callback(self, out: Any, frames: int, _time: Any, _status: Any) -> None:
        block = self.ring.peek(frames)  # never blocks: what is there, up to `frames`
        n = len(block)
        out[:n, 0] = block
        out[n:, 0] = 0.0
        self.ring.release(n)
        if n == 0 and self.ring.closed:
            self.drained.set()

    def push(self, samples: np.ndarray) -> None:
        self.ring.push(samples, T)
        if not self.started:
            self.stream.start()
            self.started = True

    def finish(self, audio_s: float) -> None:
        self.ring.close()
        if self.started:
            self.drained.wait(audio_s + 5.0)
            self.stream.stop()
        self.stream.close()


def build(args: argparse.Namespace) -> OrpheusTTS:
    constrain = args.constrain if args.constrain is not None else not args.checkpoint
    if args.checkpoint:
        if not args.snac:
            sys.exit("--checkpoint needs --snac DIR (a SNAC 24 kHz checkpoint) as well")
        dtype = getattr(torch, args.dtype) if args.dtype else None
        return OrpheusTTS.from_pretrained(args.checkpoint, args.snac, dtype=dtype,
                                          device=args.device, constrain_codes=constrain)
    return OrpheusTTS.tiny(args.seed, constrain_codes=constrain)


def speak(tts: OrpheusTTS, request: dict, out: Optional[str],
          speaker: Optional[Speaker]) -> tuple[SpeechMetrics, dict, int]:
    """Serves one request, writing and playing audio as it arrives; returns its metrics, its
    final state (frame counters) and the number of generated tokens."""
    wav = None
    meter = SpeechMeter(tts.sample_rate)
    tokens = 0
    try:
        with mstar_rt.Runtime(tts) as rt:
            meter.start()
            handle = rt.submit(request)  # a bad request is refused here: no file is left
            if out:
                wav = wave.open(out, "wb")
                wav.setnchannels(1)
                wav.setsampwidth(2)
                wav.setframerate(tts.sample_rate)
            for name, value in handle:
                if name == "token":
                    tokens += 1
                    continue
                meter.add(value)
                if len(value) == 0:
                    continue
                if wav is not None:
                    pcm = np.clip(value, -1.0, 1.0) * 32767.0
                    wav.writeframes(np.round(pcm).astype("<i2").tobytes())
                if speaker is not None:
                    speaker.push(value)
            handle.result(timeout=T)
    finally:
        if wav is not None:
            wav.close()
    return meter.finish(), handle.context.state, tokens


def print_table(m: SpeechMetrics, state: dict, tokens: int) -> None:
    gaps = m.chunk_intervals_s
    rows = [
        ("time to first audio", "never" if m.ttfa_s is None else f"{m.ttfa_s * 1e3:.1f} ms"),
        ("real-time factor", f"{m.rtf:.3f} (< 1: faster than real time)"),
        ("audio", f"{m.audio_s:.2f} s ({state.get('frames_emitted', 0)} frames)"),
        ("audio chunks", f"{len(gaps) + (m.audio_s > 0)}"),
        ("chunk interval", f"mean {np.mean(gaps) * 1e3:.1f} ms, max {max(gaps) * 1e3:.1f} ms"
         if gaps else "-"),
        ("streaming viable", f"{'yes' if m.viable else 'NO'} (worst margin "
                             f"{m.worst_margin_s * 1e3:.1f} ms)"),
        ("tokens generated", f"{tokens}"),
        ("invalid frames", f"{state.get('invalid_frames', 0)} dropped, "
                           f"{state.get('incomplete_frames', 0)} incomplete at the end"),
    ]
    for key, value in rows:
        print(f"  {key:<20} {value}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("text", nargs="?", default="Hello from mstar_rt, streaming speech.")
    ap.add_argument("--token-ids", help="comma-separated text token ids instead of text")
    ap.add_argument("--voice", help="speaker name the model was tuned on (e.g. tara)")
    ap.add_argument("--out", help="WAV file to write (16-bit mono)")
    ap.add_argument("--play", action="store_true", help="play on the speaker (sounddevice)")
    ap.add_argument("--checkpoint", help="Orpheus LM checkpoint directory (default: tiny random)")
    ap.add_argument("--snac", help="SNAC 24 kHz checkpoint directory (with --checkpoint)")
    ap.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="LM dtype")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--max-tokens", type=int, default=7 * 48, help="audio tokens at most (7/frame)")
    ap.add_argument("--temperature", type=float, default=0.6)
    ap.add_argument("--top-p", type=float, default=0.8)
    ap.add_argument("--repetition-penalty", type=float, default=1.3)
    ap.add_argument("--seed", type=int, default=0, help="sampling seed (and the tiny model's)")
    ap.add_argument("--ignore-eos", action="store_true",
                    help="speak exactly --max-tokens tokens (no end of speech)")
    ap.add_argument("--constrain", action=argparse.BooleanOptionalAction, default=None,
                    help="only valid codes (default: on for the tiny model, off for checkpoints)")
    ap.add_argument("--threads", type=int,
                    help="torch threads (default: 1 for the tiny model, torch's otherwise)")
    args = ap.parse_args()
    if not args.out and not args.play:
        ap.error("say where the audio goes: --out FILE.wav and/or --play")
    threads = args.threads or (None if args.checkpoint else 1)
    if threads:
        torch.set_num_threads(threads)

    t0 = time.perf_counter()
    tts = build(args)
    print(f"model ready in {time.perf_counter() - t0:.1f} s "
          f"({'checkpoint ' + args.checkpoint if args.checkpoint else 'tiny random'}, "
          f"constrained codes {'on' if tts.constrain_codes else 'off'}, torch threads "
          f"{torch.get_num_threads()})")
    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                                top_p=args.top_p, repetition_penalty=args.repetition_penalty,
                                seed=args.seed, ignore_eos=args.ignore_eos)
    except ValueError as e:  # one line naming the flag's field, as for a refused request
        sys.exit(f"tts.py: {e}")
    request: dict = {"params": params, "voice": args.voice}
    if args.token_ids:
        request["prompt"] = [int(t) for t in args.token_ids.split(",") if t.strip()]
    else:
        request["text"] = args.text
    speaker = Speaker(tts.sample_rate) if args.play else None
    try:
        metrics, state, tokens = speak(tts, request, args.out, speaker)
    except (ValueError, TypeError) as e:  # the request itself: one line, not a traceback
        sys.exit(f"tts.py: {e}")
    if speaker is not None:
        speaker.finish(metrics.audio_s)
    print(f"spoke {metrics.audio_s:.2f} s of audio"
          + (f" into {args.out}" if args.out else "") + ":")
    print_table(metrics, state, tokens)


if __name__ == "__main__":
    main()

"""Live voice agent: microphone → Silero VAD → PocketSphinx (robot command grammar) → command
responder → Piper TTS (espeak-ng without it) → speaker, with barge-in.

  python examples/voice/agent.py --live                # default devices; say "move the arm to
                                                        # the left", "open the gripper", "hello"
  python examples/voice/agent.py --wav in.wav --out reply.wav

Models from local checkpoint directories (nothing is downloaded) replace the defaults:

  --lm DIR          a Llama-family chat LM answers (config.json, safetensors, tokenizer.json,
                    tokenizer_config.json); its reply is spoken sentence by sentence as it writes
  --orpheus DIR --snac DIR   Orpheus speech LM + SNAC 24 kHz decoder speak, frame by frame
  --orpheus-tiny    a tiny random Orpheus instead (noise-like sound: tries the pipeline)
  --whisper DIR     a Whisper checkpoint recognizes (open vocabulary)

The headless mode runs the same agent on real PortAudio streams through the virtual devices of
scripts/virtual_audio.sh (started here): in.wav is played into the virtual microphone
(paplay --device=mstar_mic) and whatever the agent says is recorded from the virtual speaker
(mstar_spk.monitor) into reply.wav. Exits non-zero when no reply was heard.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
import wave
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]


def report(agent) -> None:
    for t in agent.turns:
        print(f"turn {t.index}: heard {t.text!r} -> {t.reply!r}; "
              f"first write {1e3 * t.latency_write:.0f} ms, at DAC {1e3 * t.latency_dac:.0f} ms "
              f"after speech end; underruns {t.underruns}"
              + ("; interrupted" if t.barged_in else "")
              + (f"; error {t.error}" if t.error else ""))
        stages = t.stages()
        if all(v == v for v in stages.values()):  # played: NaN-free
            print("  stages (ms): " + ", ".join(f"{k} {1e3 * v:.0f}" for k, v in stages.items())
                  + ("; preemptive" if t.preemptive else ""))
    if len(agent.turns) > 1:
        print(agent.stats().table())


def components(args) -> dict:
    """open_agent keyword arguments for the model flags (each loads its checkpoint once)."""
    parts: dict = {}
    if args.whisper:
        from mstar_rt.audio.whisper import WhisperASR

        parts["asr"] = WhisperASR(args.whisper, language=args.language, device=args.device)
    if args.lm:
        from mstar_rt.audio.lm_responder import LMResponder

        parts["responder"] = LMResponder(args.lm, max_new_tokens=args.max_new_tokens,
                                         temperature=args.temperature, device=args.device)
    if args.orpheus:
        from mstar_rt.audio.tts import OrpheusSpeech

        parts["tts"] = OrpheusSpeech.from_pretrained(args.orpheus, args.snac, voice=args.voice,
                                                     device=args.device)
    elif args.orpheus_tiny:
        from mstar_rt.audio.tts import OrpheusSpeech

        parts["tts"] = OrpheusSpeech.tiny()
    return parts


def make_agent(args, *streams):
    from mstar_rt.audio.agent import open_agent

    parts = components(args)
    agent = open_agent(*streams, barge_in=not args.no_barge_in, **parts)
    agent.owned += [p for p in parts.values() if hasattr(p, "close")]  # their own runtimes
    return agent


def live(args) -> int:
    agent = make_agent(args)
    print("listening (Ctrl-C to stop); try: 'move the arm to the left', 'open the gripper'")
    print("without headphones the agent hears itself: --no-barge-in makes it ignore speech "
          "while it talks")
    with agent:
        try:
            while True:
                time.sleep(0.5)
        except KeyboardInterrupt:
            pass
    report(agent)
    return 0


def headless(args) -> int:
    subprocess.run(["bash", str(ROOT / "scripts/virtual_audio.sh"), "start"], check=True,
                   timeout=60, stdout=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
    from mstar_rt.audio import devices
    from mstar_rt.audio.tap import Tap, speech_spans

    with wave.open(args.wav) as w:
        seconds = w.getnframes() / w.getframerate()
    tap = Tap(devices, "mstar_spk.monitor")
    agent = make_agent(args, "mstar_mic.monitor", "mstar_spk")
    try:
        tap.wait_flowing()
        with agent:
            time.sleep(0.3)  # streams flowing
            subprocess.run(["paplay", "--device=mstar_mic", args.wav], check=True,
                           timeout=seconds + 30, stdin=subprocess.DEVNULL)
            # Turns end with the endpointer's silence wait, then a reply plays out.
            deadline = time.monotonic() + args.timeout
            while time.monotonic() < deadline:
                time.sleep(0.2)
                if agent.turns and all(t.done.is_set() for t in agent.turns):
                    break
            time.sleep(0.3)
    finally:
        rec = tap.close()
    report(agent)
    with wave.open(args.out, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(tap.rate)
        w.writeframes((np.clip(rec, -1, 1) * 32767).astype(np.int16).tobytes())
    spans = speech_spans(rec, tap.rate)
    print(f"wrote {args.out}: {len(rec) / tap.rate:.1f} s, speech spans "
          f"{[(round(a / tap.rate, 2), round(b / tap.rate, 2)) for a, b in spans]}")
    return 0 if spans and agent.turns else 1


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--live", action="store_true", help="run on the default devices")
    p.add_argument("--wav", help="headless: the user's speech (WAV) for the virtual microphone")
    p.add_argument("--out", default="reply.wav", help="headless: the recorded reply (WAV)")
    p.add_argument("--timeout", type=float, default=20.0, help="headless: wait for replies")
    p.add_argument("--no-barge-in", action="store_true", help="half-duplex: ignore speech while talking")
    models = p.add_argument_group("models from local checkpoint directories")
    models.add_argument("--lm", metavar="DIR", help="Llama-family chat LM as the responder")
    models.add_argument("--max-new-tokens", type=int, default=48, help="--lm: reply length cap")
    models.add_argument("--temperature", type=float, default=0.0, help="--lm: 0 is greedy")
    models.add_argument("--orpheus", metavar="DIR",
                        help="Orpheus speech LM as the TTS (needs --snac)")
    models.add_argument("--snac", metavar="DIR", help="--orpheus: the SNAC 24 kHz checkpoint")
    models.add_argument("--voice", default="tara", help="--orpheus: the voice name")
    models.add_argument("--orpheus-tiny", action="store_true",
                        help="a tiny random Orpheus as the TTS (no checkpoint; noise-like)")
    models.add_argument("--whisper", metavar="DIR", help="Whisper checkpoint as the recognizer")
    models.add_argument("--language", help="--whisper: force a language (e.g. en)")
    models.add_argument("--device", default="cpu", help="where the models run (cpu, cuda)")
    args = p.parse_args()
    if args.orpheus and not args.snac:
        p.error("--orpheus needs --snac DIR (the SNAC 24 kHz decoder checkpoint)")
    if args.live:
        return live(args)
    if args.wav:
        return headless(args)
    p.error("give --live or --wav")
    return 2


if __name__ == "__main__":
    sys.exit(main())

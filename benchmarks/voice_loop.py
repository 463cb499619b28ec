#!/usr/bin/env python3
"""Voice loop benchmark: voice-to-voice latency (end of user speech → first reply sample at the
virtual speaker) of the voice agent vs a blocking Python loop doing the same steps.

    python benchmarks/voice_loop.py [--quick] [--out benchmarks/results/voice_loop.json]
    # + voice_loop.png beside the JSON: stages per system, latency per turn

Both run on real PortAudio streams through the virtual devices of scripts/virtual_audio.sh, with
the same components: Silero VAD + endpointer, PocketSphinx with the robot command grammar, a
command responder, Piper's joe voice (espeak-ng without it). Each turn plays an espeak-ng robot
command into the virtual microphone; two independent recording streams (mstar_mic.monitor and
mstar_spk.monitor) time the end of the user's speech and the first reply sample heard, so both
systems are measured by the same clock and the same detector.
  * agent     VoiceAgent: mic thread (VAD/endpointing, a streaming recognizer's partials) +
              reply walk on the Runtime (asr → respond → DynamicLoop(tts), one EMITted chunk per
              sentence) started preemptively at the first pause and streamed into the output ring
              once the endpoint is confirmed; a partial that is a whole command shortens the
              endpointer's silence (adaptive endpointing).
  * baseline  one Python loop: read the mic until the endpointer ends the utterance, recognize,
              synthesize the whole reply, write it, wait until it has played, listen again.
Replies are three sentences (the command's confirmation plus two fixed ones), as a talking agent
gives; on one-sentence replies both would wait for the same single synthesis. Underruns are the
output ring's (blocks short of audio while a reply was open). The systems alternate in blocks of
turns; figures are medians (p50) over all turns of each. Every turn of both systems is also cut
into stages (mstar_rt.audio.turns: end of speech → request submitted → recognized → reply text →
first TTS audio → endpoint → first write → first sample at the DAC), by each system's own clock;
the table gives their p50s, which add up to that clock's voice-to-voice latency.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_common import machine, use_source_tree  # noqa: E402

use_source_tree()

DEFAULT_OUT = ROOT / "benchmarks" / "results" / "voice_loop.json"
COMMANDS = ["move the arm to the left", "open the gripper", "pick up the cup",
            "close the gripper", "move the arm to the right", "put down the box"]
TAIL = " I will tell you when it is done. Is there anything else?"
TURN_TIMEOUT = 25.0


class Talkative:
    """The command responder's reply plus two fixed sentences."""

    def __init__(self) -> None:
        from mstar_rt.audio.agent import CommandResponder
        self.inner = CommandResponder()

    def __call__(self, text: str) -> str:
        return self.inner(text) + TAIL


class Baseline:
    """The blocking loop, on its own thread; ``done`` counts finished turns."""

    def __init__(self, devices, tts, responder, output_latency: float) -> None:
        from mstar_rt.audio.agent import RATE, WINDOW
        from mstar_rt.audio.asr import ROBOT_COMMANDS_JSGF, PocketSphinxASR
        from mstar_rt.audio.listen import CaptureClock
        from mstar_rt.audio.vad import Endpointer, SileroVAD

        self.vad, self.end = SileroVAD(RATE), Endpointer(sample_rate=RATE, window=WINDOW)
        self.asr, self.tts, self.responder = PocketSphinxASR(ROBOT_COMMANDS_JSGF), tts, responder
        self.inp = devices.AudioInput(48000, blocksize=480, pulse_source="mstar_mic.monitor",
                                      target_rate=RATE, ring_seconds=8.0)
        self.out = devices.AudioOutput(48000, blocksize=480, pulse_sink="mstar_spk",
                                       source_rate=tts.sample_rate, latency=output_latency,
                                       ring_seconds=60.0)
        quiet = np.zeros(RATE // 2, np.float32)  # warm up as the agent does
        self.asr.recognize(quiet)
        self.vad(quiet[:WINDOW])
        self.vad.reset()
        self.texts: list[str] = []
        self.underruns: list[int] = []
        self.turns: list = []  # mstar_rt.audio.turns.Turn, stage times by this loop's clock
        self.heard = 0  # 16 kHz samples read
        self.clock = CaptureClock(self.inp)  # the agent's mapping of samples to time
        self.done = 0
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        from mstar_rt.audio.agent import WINDOW
        from mstar_rt.audio.turns import Turn, dac_time
        buf = np.zeros(0, np.float32)
        while not self._stop.is_set():
            try:  # 1. record until the endpointer says the utterance ended
                block = self.inp.read(3 * WINDOW, timeout=0.5)
            except TimeoutError:
                continue
            self.heard += len(block)
            self.clock.note(self.heard)
            buf = np.concatenate([buf, block])
            utterance = None
            while len(buf) >= WINDOW and utterance is None:
                w, buf = buf[:WINDOW], buf[WINDOW:]
                for ev in self.end.push(w, self.vad(w)):
                    if ev.kind == "end":
                        utterance, end_sample = ev.audio, ev.sample
            if utterance is None:
                continue
            now = time.monotonic()
            turn = Turn(len(self.turns), now, self.clock.time_of(end_sample), now,
                        submitted=now)
            text = self.asr.recognize(utterance).text  # 2. recognize
            turn.recognized_at = time.monotonic()
            reply = self.responder(text)
            turn.replied_at = time.monotonic()
            audio = np.concatenate(list(self.tts.synthesize_stream(reply)))  # 3. whole reply
            turn.first_audio = time.monotonic()
            u0 = self.out.underruns
            frame = self.out.counters()["written"]
            turn.first_write = time.monotonic()
            self.out.write(audio, timeout=TURN_TIMEOUT)  # 4. play it, wait until played
            self.out.drain(timeout=TURN_TIMEOUT)
            time.sleep(self.out.latency)
            turn.first_dac = dac_time(self.out, frame)
            self.turns.append(turn)
            self.texts.append(text)
            self.underruns.append(self.out.underruns - u0)
            self.inp.clear()  # what it heard while talking is not a new turn
            buf = np.zeros(0, np.float32)
            self.done += 1

    def close(self) -> None:
        self._stop.set()
        self.thread.join(timeout=5)
        self.inp.close()
        self.out.close()


def _wait(pred, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def _measure(mic, spk, t0: float) -> float:
    """Seconds from the end of the user's speech to the first reply sample heard."""
    from mstar_rt.audio.tap import speech_spans

    def spans(tap, t):
        start = max(tap.frame_at(t), 0)
        return [(tap.time_of(start + a), tap.time_of(start + b))
                for a, b in speech_spans(tap.audio()[start:], tap.rate)]

    user = spans(mic, t0)
    if not user:
        return float("nan")
    reply = spans(spk, user[-1][1])
    return reply[0][0] - user[-1][1] if reply else float("nan")


def run_turns(kind, system, wavs, mic, spk, records, all_turns) -> None:
    for cmd, wav in wavs:
        before = len(system.turns) if kind == "agent" else system.done
        t0 = time.monotonic()
        subprocess.run(["paplay", "--device=mstar_mic", str(wav)], check=True, timeout=30,
                       stdin=subprocess.DEVNULL)
        if kind == "agent":
            ok = _wait(lambda: len(system.turns) > before and system.turns[before].done.is_set(),
                       TURN_TIMEOUT)
            turn = system.turns[before] if ok else None
            text = turn.text if turn else ""
            under = turn.underruns if turn else -1
        else:
            ok = _wait(lambda: system.done > before, TURN_TIMEOUT)
            turn = system.turns[before] if ok else None
            text = system.texts[before] if ok else ""
            under = system.underruns[before] if ok else -1
        if turn is not None:
            all_turns[kind].append(turn)
        time.sleep(0.4)  # the recorder's latency
        v2v = _measure(mic, spk, t0)
        stages = turn.stages() if turn is not None else {}
        records.append({"system": kind, "command": cmd, "recognized": text, "ok": ok,
                        "v2v_s": v2v, "underruns": under,
                        "own_clock_v2v_s": turn.latency_dac if turn is not None else None,
                        "preemptive": bool(turn is not None and turn.preemptive),
                        "guessed": bool(getattr(turn, "guessed", False)),
                        "partial": getattr(turn, "partial", ""),
                        "wasted_preemptive_s": turn.wasted_preemptive_s if turn else 0.0,
                        "stages_s": stages})
        marks = ("submitted", "recognized_at", "replied_at", "first_audio", "first_write",
                 "first_dac")
        missing = [m for m in marks if turn is not None and np.isnan(getattr(turn, m))]
        print(f"  {kind:<9}{cmd!r:<30} heard {text!r:<30} v2v {1e3 * v2v:7.0f} ms  "
              f"underruns {under}  stages " + " ".join(f"{1e3 * v:.0f}" for v in stages.values())
              + (f"  (no {', '.join(missing)})" if missing else ""), flush=True)
        time.sleep(0.3)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="10 turns per system instead of 18")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--output-latency", type=float, default=0.1,
                    help="output device buffering in seconds, the same for both systems")
    args = ap.parse_args()
    subprocess.run(["bash", str(ROOT / "scripts/virtual_audio.sh"), "start"], check=True,
                   timeout=60, stdout=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
    from mstar_rt.audio import devices
    from mstar_rt.audio.agent import open_agent
    from mstar_rt.audio.tap import Tap
    from mstar_rt.audio.tts import default_tts

    turns = 10 if args.quick else 18
    block = 5 if args.quick else 6
    tmp = Path(tempfile.mkdtemp(prefix="voice_loop_"))
    wavs = []
    for i, cmd in enumerate(COMMANDS):
        path = tmp / f"{i}.wav"
        subprocess.run(["espeak-ng", "-w", str(path), cmd], check=True, timeout=30)
        wavs.append((cmd, path))
    plan = [wavs[i % len(wavs)] for i in range(turns)]
    tts = default_tts()
    responder = Talkative()
    mic, spk = Tap(devices, "mstar_mic.monitor"), Tap(devices, "mstar_spk.monitor")
    records: list[dict] = []
    all_turns: dict[str, list] = {"agent": [], "baseline": []}
    # the output device's own underflows (its callback came late): all, and with a reply playing
    xruns = {k: [0, 0] for k in ("agent", "baseline")}
    try:
        mic.wait_flowing()
        spk.wait_flowing()
        for b in range(0, turns, block):
            for kind in (("agent", "baseline") if (b // block) % 2 == 0
                         else ("baseline", "agent")):
                if kind == "agent":
                    system = open_agent("mstar_mic.monitor", "mstar_spk", tts=tts,
                                        responder=responder, output_latency=args.output_latency)
                    system.start()
                else:
                    system = Baseline(devices, tts, responder, args.output_latency)
                time.sleep(0.5)
                out = system.owned[1] if kind == "agent" else system.out
                x0 = (out.flag_counts["output_underflow"], out.audible_xruns)
                try:
                    run_turns(kind, system, plan[b:b + block], mic, spk, records, all_turns)
                    xruns[kind][0] += out.flag_counts["output_underflow"] - x0[0]
                    xruns[kind][1] += out.audible_xruns - x0[1]
                finally:
                    system.stop() if kind == "agent" else system.close()
    finally:
        mic.close()
        spk.close()

    figures: dict[str, float] = {}
    for kind in ("agent", "baseline"):
        rs = [r for r in records if r["system"] == kind]
        v = np.array([r["v2v_s"] for r in rs], float)
        good = v[np.isfinite(v)]
        figures[f"v2v_latency_p50_ms_{kind}"] = float(1e3 * np.median(good)) if len(good) else None
        figures[f"v2v_latency_p90_ms_{kind}"] = (float(1e3 * np.percentile(good, 90))
                                                if len(good) else None)
        figures[f"turns_{kind}"] = len(rs)
        figures[f"turns_measured_{kind}"] = int(len(good))
        figures[f"recognized_exact_{kind}"] = sum(r["recognized"] == r["command"] for r in rs)
        figures[f"underruns_{kind}"] = int(sum(max(r["underruns"], 0) for r in rs))
        figures[f"device_underflows_{kind}"], figures[f"audible_xruns_{kind}"] = xruns[kind]
    from mstar_rt.audio.turns import STAGES, STAGE_DOC, VoiceStats

    stats = {kind: VoiceStats(all_turns[kind]).summary() for kind in ("agent", "baseline")}
    for kind in ("agent", "baseline"):
        for st in STAGES:
            figures[f"stage_{st}_p50_ms_{kind}"] = stats[kind][f"{st}_p50_ms"]
    a, b = figures["v2v_latency_p50_ms_agent"], figures["v2v_latency_p50_ms_baseline"]
    figures["v2v_p50_ms"] = a
    figures["wasted_preemptive_ms_per_turn"] = stats["agent"]["wasted_preemptive_ms_per_turn"]
    figures["preemptive_share"] = stats["agent"]["preemptive_share"]
    figures["guessed_share"] = stats["agent"]["guessed_share"]
    figures["endpoint_p50_ms_agent"] = stats["agent"]["endpoint_p50_ms"]
    ratios = {"v2v_latency_baseline_over_agent": (b / a) if a and b else None}
    result = {"name": "voice_loop", "quick": args.quick, "machine": machine(),
              "output_latency_s": args.output_latency,
              "tts": type(tts).__name__, "figures": figures, "ratios": ratios, "turns": records}

    print(f"\n{'system':<10}{'turns':>6}{'exact':>7}{'v2v p50 ms':>12}{'p90 ms':>9}"
          f"{'underruns':>11}{'device xruns (audible)':>24}")
    for kind in ("agent", "baseline"):
        print(f"{kind:<10}{figures[f'turns_{kind}']:>6}{figures[f'recognized_exact_{kind}']:>7}"
              f"{figures[f'v2v_latency_p50_ms_{kind}'] or float('nan'):>12.0f}"
              f"{figures[f'v2v_latency_p90_ms_{kind}'] or float('nan'):>9.0f}"
              f"{figures[f'underruns_{kind}']:>11}{figures[f'device_underflows_{kind}']:>14}"
              f" ({figures[f'audible_xruns_{kind}']})")
    print(f"\n{'stage (p50 ms, own clock)':<27}{'agent':>8}{'baseline':>10}  ends at")
    for st in STAGES:
        va, vb = stats["agent"][f"{st}_p50_ms"], stats["baseline"][f"{st}_p50_ms"]
        print(f"{st:<27}{va if va is not None else float('nan'):>8.0f}"
              f"{vb if vb is not None else float('nan'):>10.0f}  {STAGE_DOC[st]}")
    print(f"{'v2v (own clock)':<27}{stats['agent']['v2v_p50_ms'] or float('nan'):>8.0f}"
          f"{stats['baseline']['v2v_p50_ms'] or float('nan'):>10.0f}")
    print(f"wasted preemptive work: {figures['wasted_preemptive_ms_per_turn'] or 0:.0f} ms per "
          f"turn; preemptive replies used in {100 * (figures['preemptive_share'] or 0):.0f}% of "
          f"turns, replies started from the streaming recognizer's text in "
          f"{100 * (figures['guessed_share'] or 0):.0f}%")
    r = ratios["v2v_latency_baseline_over_agent"]
    print(f"v2v_latency_baseline_over_agent: {r:.2f}" if r else "ratio: n/a")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    png = args.out.with_suffix(".png")
    if plot(records, stats, STAGES, png):
        print(f"wrote {args.out} and {png}")
    else:
        print(f"wrote {args.out} (no matplotlib: no plot)")
    return 0


def plot(records: list[dict], stats: dict, stages: list[str], path: Path) -> bool:
    """Left: each system's p50 stages stacked (own clock); right: voice-to-voice latency per
    turn, in the order the turns ran (the blocks alternate, so drift shows in both)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4))
    kinds = ("agent", "baseline")
    bottoms = [0.0, 0.0]
    for st in stages:
        heights = [stats[k][f"{st}_p50_ms"] or 0.0 for k in kinds]
        left.bar(kinds, heights, 0.5, bottom=bottoms, label=st)
        bottoms = [b + h for b, h in zip(bottoms, heights)]
    left.set_ylabel("ms after the end of speech (p50 per stage)")
    left.set_title("where a turn's latency goes")
    left.legend(fontsize=7)
    for kind in kinds:
        turns = [(i, r["v2v_s"]) for i, r in enumerate(records)
                 if r["system"] == kind and r["v2v_s"] is not None and np.isfinite(r["v2v_s"])]
        right.plot([i for i, _ in turns], [1e3 * v for _, v in turns], "o", label=kind)
    right.set_xlabel("turn (in the order run)")
    right.set_ylabel("voice-to-voice latency (ms)")
    right.set_title("every turn, measured at the virtual devices")
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""TTS streaming benchmark: time to first audio with streaming vs decoding after generation
ends, and the real-time factor of streamed speech at 1, 4 and 8 concurrent requests.

    python benchmarks/tts_stream.py [--quick] [--threads 1] [--out results/tts_stream.json]

Model: OrpheusTTS with a random Llama speech LM (LM below: hidden 256, 4 layers, ~3.5 M
parameters, the Orpheus token layout in miniature, 64 codes per slot) and a reduced-width SNAC
decoder with the real 24 kHz model's rates, strides and receptive field (decoder_dim 64), float32
on CPU, codes constrained to valid frames. Every request speaks exactly UTTERANCE_FRAMES frames
(70 frames = 490 tokens = 5.97 s of audio, a sentence or two) with Orpheus' sampling settings
(temperature 0.6, top-p 0.8, repetition penalty 1.3, seeded) and end of speech off.

  * streaming      the OrpheusTTS walk graph: decoded tokens flow through the model's chunk policy
                   (its default, Orpheus' SlidingWindow(28, 7); the SNAC node carries the left
                   context the windows lack, so it is exact) into the SNAC node, which EMITs each
                   frame as soon as its right context is in. Time to first audio (TTFA) = submit
                   -> the first chunk with a sample above 1e-4, measured by the client
                   (SpeechMeter).
  * non-streaming  the same LM (same weights, prompt, sampling, seed; CausalLM with the same
                   non-sampling prefill and code constraint) generates every token, then the
                   client decodes them in one SNAC call: TTFA = submit -> that decode's end.
Both run in the same process, alternating, the same number of times; figures are medians. The
non-streaming tokens and audio are checked equal to the streamed ones (same computation).

RTF at N concurrent requests: N requests submitted at once to one Runtime (different texts and
seeds); per request RTF = (submit -> last audio chunk) / audio duration, and "viable" = with
playback starting at the first audio, every chunk arrived before the audio before it had played.
Also times the full-size SNAC 24 kHz decoder (random weights, ~20 M parameters with encoder; the
decoder alone is what runs) on 4 and 7 frames, batch 1, the cost a GPU run would stream with.
Writes benchmarks/results/tts_stream.json and a PNG of audio arrival vs playback for one request.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

import mstar_rt
from mstar_rt.engines import KVCacheEngine, SamplingParams
from mstar_rt.models.causal_lm import CausalLM
from mstar_rt.models.orpheus import OrpheusTokens, OrpheusTTS, tiny_lm, tiny_snac
from mstar_rt.models.snac import SnacConfig, SnacDecoder
from mstar_rt.models.snac_stream import decode_one_shot
from mstar_rt.audio.speech_metrics import SpeechMetrics

from bench_common import machine  # noqa: E402  (benchmarks/ is on sys.path)

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "tts_stream.json"
LM = dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
          num_key_value_heads=2, head_dim=64, max_position_embeddings=2048)
SNAC_WIDTH = dict(decoder_dim=64, latent_dim=64)
UTTERANCE_FRAMES = 70
CONCURRENCY = (1, 4, 8)
FULL = dict(ttfa_reps=5, rtf_reps=3, snac_reps=5)
QUICK = dict(ttfa_reps=2, rtf_reps=1, snac_reps=3)
TARGET_RATIO = 10.0
TIMEOUT_S = 600.0
TEXTS = ["The quick brown fox jumps over the lazy dog.", "Streaming speech starts early.",
         "Every frame is decoded exactly once.", "Hello from the benchmark.",
         "Real time means keeping ahead of playback.", "Seven tokens make one frame.",
         "Four frames of context are not enough.", "The end of stream flushes the tail."]

try:
    from tqdm import tqdm
except ImportError:
    tqdm = None


def params(seed: int) -> SamplingParams:
    return SamplingParams(max_tokens=7 * UTTERANCE_FRAMES, temperature=0.6, top_p=0.8,
                          repetition_penalty=1.3, seed=seed, ignore_eos=True)


def build() -> tuple[OrpheusTTS, CausalLM]:
    tokens = OrpheusTokens.tiny()
    lm = tiny_lm(tokens, seed=0, **LM)
    tts = OrpheusTTS(lm, tiny_snac(0, **SNAC_WIDTH), tokens, constrain_codes=True,
                     engine=KVCacheEngine(page_size=16, num_pages=512))
    baseline = CausalLM(lm, eos_token_ids=(tokens.end_of_speech,), prefill_samples=False,
                        logits_processor=tts.lm.constrain,
                        engine=KVCacheEngine(page_size=16, num_pages=512))
    return tts, baseline


# ---- one request, both ways ----------------------------------------------------------------------

class Listener:
    """Collects one request's audio chunks with their arrival times, on its own thread."""

    def __init__(self, rt: mstar_rt.Runtime, request: dict) -> None:
        self.events: list[tuple[float, np.ndarray]] = []
        self.tokens: list[int] = []
        self.error: Optional[BaseException] = None
        self.submit_t = time.perf_counter()
        self.handle = rt.submit(request)
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            for name, value in self.handle:
                if name == "audio":
                    self.events.append((time.perf_counter(), value))
                elif name == "token":
                    self.tokens.append(value)
        except BaseException as e:  # noqa: BLE001 - reported by wait()
            self.error = e

    def wait(self) -> SpeechMetrics:
        self.handle.result(timeout=TIMEOUT_S)
        self.thread.join(TIMEOUT_S)
        if self.error is not None or self.thread.is_alive():
            raise RuntimeError(f"listener failed: {self.error!r}")
        return SpeechMetrics.from_events(self.submit_t, self.events)

    @property
    def audio(self) -> np.ndarray:
        return np.concatenate([a for _, a in self.events])


def run_streaming(rt: mstar_rt.Runtime, text: str, seed: int) -> dict:
    listener = Listener(rt, {"text": text, "params": params(seed)})
    m = listener.wait()
    check_frames("streaming", len(listener.audio))
    return {"ttfa_s": m.ttfa_s, "metrics": m, "tokens": listener.tokens, "audio": listener.audio,
            "events": [(t - listener.submit_t, len(a)) for t, a in listener.events]}


def run_nonstreaming(rt: mstar_rt.Runtime, tts: OrpheusTTS, text: str, seed: int) -> dict:
    prompt = tts.prompt_ids({"text": text})
    t0 = time.perf_counter()
    tokens = rt.submit({"prompt": prompt, "params": params(seed)}).result(TIMEOUT_S)["token"]
    t_gen = time.perf_counter()
    audio = decode_one_shot(tts.decoder, tts.layout, tokens)
    t1 = time.perf_counter()
    if not np.abs(audio).max() > 1e-4:
        raise AssertionError("the one-shot audio is silent")
    check_frames("non-streaming", len(audio))
    return {"ttfa_s": t1 - t0, "generate_s": t_gen - t0, "decode_s": t1 - t_gen,
            "tokens": tokens, "audio": audio}


def check_frames(kind: str, samples: int) -> None:
    """A run that made less audio must not look fast."""
    if samples != UTTERANCE_FRAMES * 2048:
        raise AssertionError(f"{kind}: {samples} samples, expected {UTTERANCE_FRAMES} frames")


def run_concurrent(rt: mstar_rt.Runtime, n: int, rep: int) -> list[SpeechMetrics]:
    listeners = [Listener(rt, {"text": TEXTS[i % len(TEXTS)], "params": params(1000 * rep + i)})
                 for i in range(n)]
    out = [lst.wait() for lst in listeners]
    for lst in listeners:
        check_frames(f"{n} requests", len(lst.audio))
    return out


def cpu_counters() -> tuple[float, float, float]:
    """Machine-wide busy CPU s, this process's CPU s and the wall clock: other processes on a
    shared VM take the same cores, and the result should say how much."""
    f = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    busy = (f[0] + f[1] + f[2] + f[5] + f[6]) / os.sysconf("SC_CLK_TCK")
    return busy, time.process_time(), time.monotonic()


def foreign_cpu_pct(c0: tuple, c1: tuple) -> float:
    busy, own, wall = (b - a for a, b in zip(c0, c1))
    return max(0.0, 100.0 * (busy - own) / wall)


# ---- the decoder alone ---------------------------------------------------------------------------

def time_decoder(decoder: SnacDecoder, frames: int, reps: int) -> float:
    """Median ms of one decode of ``frames`` coarse frames, batch 1, noise off."""
    cfg = decoder.config
    g = torch.Generator().manual_seed(0)
    codes = [torch.randint(0, cfg.codebook_size, (1, frames * 4 // s), generator=g)
             for s in cfg.vq_strides]
    decoder.decode(codes, noise=False)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        decoder.decode(codes, noise=False)
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


# ---- main ----------------------------------------------------------------------------------------

def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer repetitions (under a minute)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch intra-op threads (default 1: the LM and the SNAC node each have "
                         "a worker thread, one per core here)")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = ap.parse_args()
    cfg = QUICK if args.quick else FULL
    torch.set_num_threads(args.threads)

    tts, baseline = build()
    lm_params_m = sum(p.numel() for p in tts.module.parameters()) / 1e6
    snac_params_m = sum(p.numel() for p in tts.decoder.parameters()) / 1e6
    total = 2 * cfg["ttfa_reps"] + len(CONCURRENCY) * cfg["rtf_reps"] + 1
    bar = tqdm(total=total, desc="tts_stream", unit="run") if tqdm else None

    def step(label: str) -> None:
        if bar:
            bar.set_postfix_str(label, refresh=False)
            bar.update(1)
        else:
            print(f"  {label}", flush=True)

    stream_runs: list[dict] = []
    batch_runs: list[dict] = []
    concurrent: dict[int, list[SpeechMetrics]] = {n: [] for n in CONCURRENCY}
    mismatches = 0
    own_cpu: list[float] = []
    with mstar_rt.Runtime(tts) as rt, mstar_rt.Runtime(baseline) as brt:
        run_streaming(rt, TEXTS[0], 7)  # warm up both paths and the batched codec
        run_nonstreaming(brt, tts, TEXTS[0], 7)
        run_concurrent(rt, 2, 99)
        c0 = cpu_counters()
        for rep in range(cfg["ttfa_reps"]):
            order = ("stream", "batch") if rep % 2 == 0 else ("batch", "stream")
            for kind in order:
                if kind == "stream":
                    r = run_streaming(rt, TEXTS[rep % len(TEXTS)], rep)
                    stream_runs.append(r)
                else:
                    r = run_nonstreaming(brt, tts, TEXTS[rep % len(TEXTS)], rep)
                    batch_runs.append(r)
                step(f"{kind} TTFA {r['ttfa_s'] * 1e3:.0f} ms")
            s, b = stream_runs[-1], batch_runs[-1]
            if s["tokens"] != b["tokens"] or float(np.abs(s["audio"] - b["audio"]).max()) > 1e-5:
                mismatches += 1
        for rep in range(cfg["rtf_reps"]):
            for n in (CONCURRENCY if rep % 2 == 0 else CONCURRENCY[::-1]):
                c1 = cpu_counters()
                ms = run_concurrent(rt, n, rep)
                c2 = cpu_counters()
                own_cpu.append((c2[1] - c1[1]) / (c2[2] - c1[2]))
                concurrent[n].extend(ms)
                step(f"{n} req RTF {statistics.median(m.rtf for m in ms):.2f}")
    foreign = foreign_cpu_pct(c0, cpu_counters())
    full = SnacDecoder(SnacConfig()).fold_weight_norm().eval()
    full_ms = {f: time_decoder(full, f, cfg["snac_reps"]) for f in (4, 7)}
    small_ms = {f: time_decoder(tts.decoder, f, cfg["snac_reps"]) for f in (4, 7)}
    full_params_m = sum(p.numel() for p in full.parameters()) / 1e6
    step("SNAC decode timing")
    if bar:
        bar.close()

    med = statistics.median
    frame_ms = 2048 / 24.0
    figures: dict[str, Any] = {
        "ttfa_stream_ms": round(1e3 * med(r["ttfa_s"] for r in stream_runs), 1),
        "ttfa_nonstream_ms": round(1e3 * med(r["ttfa_s"] for r in batch_runs), 1),
        "nonstream_generate_ms": round(1e3 * med(r["generate_s"] for r in batch_runs), 1),
        "nonstream_one_shot_decode_ms": round(1e3 * med(r["decode_s"] for r in batch_runs), 1),
        "utterance_audio_s": round(UTTERANCE_FRAMES * 2048 / 24000, 3),
        "utterance_tokens": 7 * UTTERANCE_FRAMES,
        "nonstream_equals_stream_runs": len(stream_runs) - mismatches,
        "ttfa_runs": len(stream_runs),
    }
    for n in CONCURRENCY:
        ms = concurrent[n]
        figures[f"rtf_{n}req"] = round(med(m.rtf for m in ms), 3)
        figures[f"rtf_max_{n}req"] = round(max(m.rtf for m in ms), 3)
        figures[f"ttfa_ms_{n}req"] = round(1e3 * med(m.ttfa_s for m in ms), 1)
        figures[f"viable_pct_{n}req"] = round(100.0 * sum(m.viable for m in ms) / len(ms), 1)
        figures[f"worst_margin_ms_{n}req"] = round(1e3 * min(m.worst_margin_s for m in ms), 1)
        figures[f"max_chunk_gap_ms_{n}req"] = round(
            1e3 * max(max(m.chunk_intervals_s) for m in ms), 1)
    figures.update({
        "full_snac_decode_4frames_ms": round(full_ms[4], 1),
        "full_snac_decode_7frames_ms": round(full_ms[7], 1),
        # an exact stream decodes 7 frames (3 + 1 + 3) per new frame (85.3 ms of audio)
        "full_snac_stream_rtf_1req": round(full_ms[7] / frame_ms, 3),
        "full_snac_decoder_params_millions": round(full_params_m, 2),
        "reduced_snac_decode_4frames_ms": round(small_ms[4], 1),
        "reduced_snac_decode_7frames_ms": round(small_ms[7], 1),
        "reduced_snac_stream_rtf_1req": round(small_ms[7] / frame_ms, 3),
        "reduced_snac_params_millions": round(snac_params_m, 3),
        "lm_params_millions": round(lm_params_m, 2),
        "torch_threads": torch.get_num_threads(),
        "foreign_cpu_pct": round(foreign, 1),
        "own_cpu_cores_rtf_cells": round(statistics.mean(own_cpu), 2),
    })
    ratio = figures["ttfa_nonstream_ms"] / figures["ttfa_stream_ms"]
    ratios = {"ttfa_nonstream_over_stream": round(ratio, 2)}
    config = {"lm": {"architecture": "LlamaForCausalLM (ours, random weights)", **LM,
                     "vocab_size": tts.module.config.vocab_size,
                     "params_millions": round(lm_params_m, 2)},
              "snac": {**tts.decoder.config.to_dict(), "params_millions":
                       round(snac_params_m, 3), "receptive_field_frames":
                       list(tts.decoder.receptive_field_frames())},
              "policy": str(tts.policy), "carry_context": tts.codec.carry_context,
              "sampling": str(params(0)),
              "utterance_frames": UTTERANCE_FRAMES, "concurrency": list(CONCURRENCY),
              "repetitions": {k: v for k, v in cfg.items()}, "torch_threads": args.threads,
              "dtype": "float32", "device": "cpu", "torch": torch.__version__}
    notes = {"ttfa": "client side: submit -> first audio chunk with |x| > 1e-4 (streaming), "
                     "submit -> end of the one-shot decode of all tokens (non-streaming); "
                     "medians over the repetitions",
             "rtf": "per request (submit -> last chunk) / audio duration; median over the "
                    "requests of all repetitions (rtf_max: the slowest request)",
             "foreign_cpu": "CPU time of other processes during the timed runs, % of one CPU "
                            "(from /proc/stat); own_cpu_cores: this process's CPU s per wall s "
                            "in the concurrent cells",
             "full_snac": "the 24 kHz SNAC decoder at full width, random weights, batch 1, "
                          "noise off, on this CPU with the same torch threads; an exact stream "
                          "decodes 7 frames per new frame, Orpheus' reference decoder 4 (not "
                          "exact)"}

    print(f"\nLM: random Llama {LM['hidden_size']}h x {LM['num_hidden_layers']}L "
          f"({lm_params_m:.1f} M params); SNAC: decoder_dim {SNAC_WIDTH['decoder_dim']} "
          f"({snac_params_m:.2f} M params, receptive field "
          f"{tts.decoder.receptive_field_frames()} frames); policy {tts.policy}; fp32 CPU, "
          f"torch threads {torch.get_num_threads()}; utterance {UTTERANCE_FRAMES} frames = "
          f"{figures['utterance_audio_s']} s of audio ({7 * UTTERANCE_FRAMES} tokens)")
    print(f"\ntime to first audio, 1 request (median of {len(stream_runs)}):")
    print(f"  streaming                  {figures['ttfa_stream_ms']:>8.1f} ms")
    print(f"  decode after generation    {figures['ttfa_nonstream_ms']:>8.1f} ms "
          f"(generate {figures['nonstream_generate_ms']:.0f} + one-shot decode "
          f"{figures['nonstream_one_shot_decode_ms']:.0f})")
    print(f"  ttfa_nonstream_over_stream {ratio:>8.2f}  (target >= {TARGET_RATIO:g}: "
          f"{'met' if ratio >= TARGET_RATIO else 'NOT met'}); same tokens and audio both ways "
          f"in {len(stream_runs) - mismatches}/{len(stream_runs)} runs")
    print(f"\n{'requests':>8}{'RTF med':>9}{'RTF max':>9}{'TTFA ms':>9}{'max gap ms':>12}"
          f"{'viable %':>10}{'worst margin ms':>17}")
    for n in CONCURRENCY:
        print(f"{n:>8}{figures[f'rtf_{n}req']:>9.3f}{figures[f'rtf_max_{n}req']:>9.3f}"
              f"{figures[f'ttfa_ms_{n}req']:>9.1f}{figures[f'max_chunk_gap_ms_{n}req']:>12.1f}"
              f"{figures[f'viable_pct_{n}req']:>10.0f}{figures[f'worst_margin_ms_{n}req']:>17.1f}")
    print(f"this process used {figures['own_cpu_cores_rtf_cells']:.2f} cores in the concurrent "
          f"cells; other processes used {figures['foreign_cpu_pct']:.0f}% of a CPU meanwhile")
    print(f"\nSNAC decode, batch 1 (median ms): full size ({full_params_m:.1f} M) 4 frames "
          f"{full_ms[4]:.1f}, 7 frames {full_ms[7]:.1f} -> streaming RTF "
          f"{figures['full_snac_stream_rtf_1req']:.2f} for one request; reduced 4 frames "
          f"{small_ms[4]:.1f}, 7 frames {small_ms[7]:.1f}")

    args.out.parent.mkdir(parents=True, exist_ok=True)
    result = {"name": "tts_stream", "quick": args.quick, "machine": machine(), "config": config,
              "figures": figures, "ratios": ratios, "notes": notes}
    args.out.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")
    plot(args.out.with_suffix(".png"), stream_runs[-1], batch_runs[-1], figures)
    return 0


def plot(path: Path, stream: dict, batch: dict, figures: dict) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    fig, ax = plt.subplots(figsize=(8, 4.5))
    times = [0.0] + [t for t, _ in stream["events"]]
    received = np.cumsum([0] + [n for _, n in stream["events"]]) / 24000
    ax.step(times, received, where="post", color="tab:green", label="streamed audio received")
    start = stream["ttfa_s"]
    total = received[-1]
    ax.plot([start, start + total], [0, total], color="tab:green", linestyle="--",
            label="playback from first audio (streaming)")
    end = batch["ttfa_s"]
    ax.step([0, end, end + total], [0, total, total], where="post", color="tab:red",
            label="decode after generation: all audio at once")
    ax.plot([end, end + total], [0, total], color="tab:red", linestyle=":",
            label="playback (non-streaming)")
    ax.axvline(start, color="tab:green", alpha=0.3)
    ax.annotate(f"TTFA {start * 1e3:.0f} ms", (start, total * 0.9), fontsize=8,
                xytext=(4, 0), textcoords="offset points", color="tab:green")
    ax.annotate(f"TTFA {end * 1e3:.0f} ms", (end, total * 0.5), fontsize=8,
                xytext=(4, 0), textcoords="offset points", color="tab:red")
    ax.set_xlabel("seconds since submit")
    ax.set_ylabel("seconds of audio")
    ax.set_title(f"one request, {figures['utterance_audio_s']} s of speech: arrival vs playback "
                 f"(ratio {figures['ttfa_nonstream_ms'] / figures['ttfa_stream_ms']:.1f}x)",
                 fontsize=10)
    ax.legend(fontsize=8, loc="lower right")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())

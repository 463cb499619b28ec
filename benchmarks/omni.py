#!/usr/bin/env python3
"""Qwen3-Omni benchmark: time to first audio streamed vs after generation, and audio seconds
per wall second at 1, 4 and 8 concurrent requests against transformers' ``generate``.

    python benchmarks/omni.py [--quick] [--out benchmarks/results/omni.json]

Model: the tiny random Qwen3-Omni of tests/python/omni_tiny.py (thinker 3 layers of width 32,
talker 2 of width 24, 4 experts, 4 code groups) with the released code2wav rates (1920 samples,
80 ms, per frame), float32 on CPU, loaded by both sides from one ``save_pretrained`` directory.
Every request is the same text prompt answered greedily at a fixed length (no end of text or
speech before the maximum: ``ignore_eos`` here, ``min_new_tokens`` there; the prompt is one whose
reply has no end of text within THINKER_TOKENS): THINKER_TOKENS text tokens, FRAMES - 1 frames.

* streamed       our walk graph: submit -> the first ``audio`` chunk (code2wav's first window,
                 Ramp([2, 4, 8], 12), is 2 frames).
* after generation  transformers' ``generate`` (thinker, then talker + code predictor, then
                 code2wav): call -> return, when its audio first exists. Ratio
                 ``omni_ttfa_nonstream_over_stream`` (target >= 5).
* throughput     N requests submitted at once to one Runtime: audio seconds made / wall seconds,
                 against ``generate`` one request at a time. Ratio ``omni_throughput_8req_vs_hf``
                 (target >= 4).
Both sides' outputs are checked equal (tokens; waveform within 1e-4) before timing. Writes
benchmarks/results/omni.json and omni.png (throughput by concurrency).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from bench_common import ROOT, machine, use_source_tree

use_source_tree()
sys.path.insert(0, str(ROOT / "tests" / "python"))

import mstar_rt  # noqa: E402
from mstar_rt.models.qwen3_omni.checkpoint import load_qwen3_omni  # noqa: E402
from mstar_rt.models.qwen3_omni.omni import Qwen3Omni  # noqa: E402

import omni_tiny as ot  # noqa: E402

RELEASED_RATES = ((8, 5, 4, 3), (2, 2))
THINKER_TOKENS, FRAMES = 16, 51  # 50 frames of audio: 4 s
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "omni.json"


def inputs(prompt: list[int]) -> dict:
    return {"prompt": prompt, "speaker": "ethan",
            "thinker_sampling": {"max_tokens": THINKER_TOKENS},
            "talker_sampling": {"temperature": 0.0, "max_tokens": FRAMES, "ignore_eos": True}}


def hf_generate(hf, prompt):
    t = time.perf_counter()
    seq, wav = ot.generate(hf, prompt, thinker_max_new_tokens=THINKER_TOKENS,
                           talker_max_new_tokens=FRAMES, fixed_length=True)
    return time.perf_counter() - t, seq[0, len(prompt):].tolist(), wav.reshape(-1).numpy()


def ours_one(rt, prompt):
    t0 = time.perf_counter()
    first, tokens, audio = None, [], []
    for name, value in rt.submit(inputs(prompt)):
        if name == "audio" and len(value):
            first = first or time.perf_counter() - t0
            audio.append(value)
        elif name == "token":
            tokens.append(value)
    return first, time.perf_counter() - t0, tokens, np.concatenate(audio)


def ours_batch(rt, prompt, n):
    t0 = time.perf_counter()
    handles = [rt.submit(inputs(prompt)) for _ in range(n)]
    samples = sum(sum(len(v) for k, v in h if k == "audio") for h in handles)
    return samples, time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer repetitions (under a minute)")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = ap.parse_args()
    reps = 2 if args.quick else 5
    torch.set_num_threads(1)
    hf = ot.model(upsample=RELEASED_RATES)
    prompt = ot.chat_prompt([72, 105, 33])
    with tempfile.TemporaryDirectory() as d:
        omni = Qwen3Omni(load_qwen3_omni(ot.save(hf, d), progress=False))
    rate = omni.sample_rate
    with mstar_rt.Runtime(omni) as rt:
        _, hf_tokens, hf_wav = hf_generate(hf, prompt)
        _, _, tokens, audio = ours_one(rt, prompt)
        assert tokens == hf_tokens and audio.shape == hf_wav.shape, (tokens, hf_tokens, audio.shape, hf_wav.shape)
        assert float(np.abs(audio - hf_wav).max()) < 1e-4, "waveforms differ"
        audio_s = len(audio) / rate
        ttfa, ours_total, hf_total = [], [], []
        for _ in tqdm(range(reps), desc="time to first audio"):
            first, total, _, _ = ours_one(rt, prompt)
            ttfa.append(first)
            ours_total.append(total)
            hf_total.append(hf_generate(hf, prompt)[0])
        rows = {}
        for n in tqdm((1, 4, 8), desc="throughput"):
            runs = [ours_batch(rt, prompt, n) for _ in range(max(reps // 2, 1))]
            rows[n] = statistics.median(s / rate / w for s, w in runs)
    hf_rate = audio_s / statistics.median(hf_total)
    result = {
        "machine": machine(), "quick": args.quick, "audio_s_per_request": audio_s,
        "thinker_tokens": THINKER_TOKENS, "frames": FRAMES - 1,
        "ttfa_stream_ms": 1000 * statistics.median(ttfa),
        "ours_request_s": statistics.median(ours_total),
        "hf_generate_s": statistics.median(hf_total),
        "audio_s_per_wall_s": {str(n): v for n, v in rows.items()},
        "hf_audio_s_per_wall_s": hf_rate,
        "ratios": {
            "omni_ttfa_nonstream_over_stream": statistics.median(hf_total) /
            statistics.median(ttfa),
            "omni_throughput_8req_vs_hf": rows[8] / hf_rate,
            "omni_throughput_1req_vs_hf": rows[1] / hf_rate}}
    print(f"\nQwen3-Omni (tiny random, released code2wav rates), {audio_s:.2f} s of audio "
          f"and {THINKER_TOKENS} tokens per request")
    print(f"{'':34}{'ours':>12}{'transformers':>14}")
    print(f"{'time to first audio (ms)':34}{result['ttfa_stream_ms']:12.0f}"
          f"{1000 * result['hf_generate_s']:14.0f}")
    print(f"{'one request, whole (s)':34}{result['ours_request_s']:12.2f}"
          f"{result['hf_generate_s']:14.2f}")
    for n, v in rows.items():
        theirs = f"{hf_rate:14.2f}" if n == 1 else f"{'one at a time':>16}"
        print(f"{f'audio s / wall s, {n} concurrent':34}{v:12.2f}{theirs}")
    for k, v in result["ratios"].items():
        print(f"{k:34}{v:12.2f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    plot(args.out.with_suffix(".png"), rows, hf_rate)
    return 0


def plot(path: Path, rows: dict, hf_rate: float) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    fig, ax = plt.subplots(figsize=(5, 3.2))
    ax.bar([str(n) for n in rows], list(rows.values()), label="mstar_rt")
    ax.axhline(hf_rate, color="k", ls="--", label="transformers generate")
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("audio s per wall s")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())

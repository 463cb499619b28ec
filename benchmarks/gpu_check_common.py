"""What benchmarks/gpu_check.py runs with -- the device, the dtype, the model's shapes, the
CUDA-graph buckets -- and the Report every section records into (written after every section)."""

from __future__ import annotations

import argparse
import json
import math
import time
from typing import Any

import torch

from bench_common import machine  # benchmarks/ is on sys.path

BUCKETS = (1, 2, 4, 8, 16, 32, 64)
# Llama-3.2-1B shapes with random weights (nothing can be downloaded on the GPU machines).
MODEL = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
             num_attention_heads=32, num_key_value_heads=8, head_dim=64,
             max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=True,
             rope_theta=500000.0,
             rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                           "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
             eos_token_id=None, bos_token_id=None, pad_token_id=None)
MAX_SEQ_LEN = 1024
DEVICE, DTYPE = "cuda", torch.bfloat16
# --dry-run-cpu: every section on the CPU with a tiny model, to catch mistakes in this script
# before it spends GPU time (graphs run eagerly there; FlashInfer is left out). It rebinds DEVICE
# and MODEL (to "cpu" and TINY), so the sections read them as gpu_check_common.DEVICE / .MODEL.
TINY = dict(MODEL, vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=32)


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


class Report:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args, self.t0 = args, time.perf_counter()
        self.data: dict[str, Any] = {"name": "gpu_check", "quick": args.quick,
                                     "machine": machine(), "figures": {}, "ratios": {},
                                     "checks": {}, "notes": []}
        self.failed: list[str] = []

    def left(self) -> float:
        return self.args.budget_s - (time.perf_counter() - self.t0)

    def log(self, msg: str) -> None:
        print(f"[{time.perf_counter() - self.t0:6.1f}s] {msg}", flush=True)

    def note(self, msg: str) -> None:
        self.log("NOTE: " + msg)
        self.data["notes"].append(msg)

    def check(self, name: str, value: float, limit: float) -> None:
        ok = value <= limit and not math.isnan(value)
        self.data["checks"][name] = {"value": value, "limit": limit, "ok": ok}
        if not ok:
            self.failed.append(name)
        self.log(f"{'ok  ' if ok else 'FAIL'} {name}: {value:.3g} (limit {limit:.3g})")

    def write(self) -> None:
        self.data["failed"] = self.failed
        self.data["elapsed_s"] = round(time.perf_counter() - self.t0, 1)
        self.args.out.parent.mkdir(parents=True, exist_ok=True)
        self.args.out.write_text(json.dumps(self.data, indent=2))

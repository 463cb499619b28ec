#!/usr/bin/env python3
"""GPU check of the engines' CUDA path: FlashInfer vs torch attention, CUDA-graph decode vs
eager, and decode speed against transformers' generate.

    PYTHONPATH=python python benchmarks/gpu_check.py [--quick] [--no-flashinfer] [--no-hf]
                                                    [--budget-s 420] [--out PATH]

On a CUDA machine (bf16 throughout; one model config, head_dim 64, so FlashInfer JIT-compiles as
few kernels as it can):
  1. attention: random paged caches, steps mixing prefill, decode, appends, non-persisted works,
     a fork reading shared pages, and the Causal / PrefixBidirectional / BlockCausal masks; the
     torch and FlashInfer backends each against a float32 torch reference (max abs diff), and
     the pages each wrote (must be identical);
  2. CUDA-graph decode vs eager on a random ~1.2B Llama (Llama-3.2-1B shapes), per backend,
     at batches that pad up to a bucket;
  3. full-size pi0 and 4. full-size SmolVLA (random bf16 weights) through the Runtime:
     action-chunk latency at 1 robot and chunks/s at 8, flow steps eager vs CUDA graphs
     (benchmarks/gpu_check_vla.py);
  5. CUDA tensors between two worker processes placed on the GPU, worker to worker and through
     the parent: arriving on the reader's device, equal to in process (gpu_check_placement.py);
  6. decode speed at batch 1/4/16 through mstar_rt.Runtime: eager and CUDA graphs, torch and
     FlashInfer attention, vs transformers generate on the same weights.
Writes benchmarks/results/gpu_check.json after every section (a run cut short keeps what it
measured), and at the end gpu_check.png beside it (gpu_check_plot.py), and exits 1 when a
correctness check failed. Sections past --budget-s are skipped.
Without CUDA it says so and exits 0, writing a {"skipped": reason} record only where no real
result would be overwritten. If the compiled core (mstar_rt._core) does not import, e.g. on a
machine with another Python, it is built first with CMake (about half a minute on 16 cores).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable, Optional

import torch

import gpu_check_common as common
from bench_common import machine, use_source_tree  # benchmarks/ is on sys.path
from gpu_check_attention import attention_check
from gpu_check_common import Report
from gpu_check_decode import build_models, graph_check, speed
from gpu_check_placement import placement_check
from gpu_check_plot import plot
from gpu_check_vla import pi0_check, smolvla_check

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "gpu_check.json"


def skip_without_cuda(out: Path, quick: bool, reason: str) -> int:
    print(f"gpu_check: {reason}; it needs a CUDA GPU (and flashinfer-python for the FlashInfer "
          "parts). Nothing was measured.")
    try:
        previous = json.loads(out.read_text())
    except (OSError, ValueError):
        previous = None
    if previous is not None and "skipped" not in previous:
        print(f"gpu_check: kept the real result already in {out}")
        return 0
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"name": "gpu_check", "quick": quick, "machine": machine(),
                               "skipped": reason, "figures": {}, "ratios": {}}, indent=2))
    print(f"gpu_check: wrote {out} (skipped)")
    return 0


def ensure_core(report: Report) -> None:
    """Builds mstar_rt._core for this interpreter when neither the tree's nor an installed one
    imports."""
    use_source_tree()
    try:
        import mstar_rt  # noqa: F401
        return
    except ImportError as e:
        report.note(f"mstar_rt._core did not import ({e}); building it with CMake")
    sys.path.insert(0, str(ROOT / "python"))
    build = ROOT / "build" / "gpu-check-core"
    gen = "-G Ninja" if shutil.which("ninja") else ""
    cmd = (f"cmake -S {ROOT} -B {build} {gen} -DMSTAR_BUILD_PYTHON=ON "
           f"-DPython_EXECUTABLE={sys.executable} "
           f"-Dpybind11_DIR=$({sys.executable} -m pybind11 --cmakedir) >/dev/null && "
           f"cmake --build {build} -j {os.cpu_count() or 4} >/dev/null")
    done = subprocess.run(["bash", "-c", cmd], timeout=600)
    found = glob.glob(str(build / "bindings" / "_core*.so"))
    if done.returncode or not found:
        raise SystemExit("gpu_check: could not build mstar_rt._core for this Python (CMake, "
                         "pybind11 and the Python headers are needed); build it and rerun")
    so = found[0]
    shutil.copy(so, ROOT / "python" / "mstar_rt")
    import mstar_rt  # noqa: F401,F811


def flashinfer_version() -> Optional[str]:
    try:
        import flashinfer
        return str(getattr(flashinfer, "__version__", "unknown"))
    except ImportError:
        return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer scenarios and shorter timings")
    ap.add_argument("--no-flashinfer", action="store_true", help="torch backend only")
    ap.add_argument("--no-hf", action="store_true", help="skip transformers generate")
    ap.add_argument("--only", default="",
                    help="comma-separated sections to run (attention, model, graphs, pi0, smolvla, "
                         "placement, speed)")
    ap.add_argument("--budget-s", type=float, default=420.0,
                    help="skip sections that would start after this many seconds")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--dry-run-cpu", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.dry_run_cpu:
        common.DEVICE, common.MODEL = "cpu", common.TINY
        args.no_flashinfer, args.budget_s = True, 1e9
        if args.out == DEFAULT_OUT:
            args.out = Path("/tmp/gpu_check_dry_run.json")
    elif not torch.cuda.is_available():
        return skip_without_cuda(args.out, args.quick, "no CUDA device is visible to torch "
                                 f"{torch.__version__}")
    report = Report(args)
    ensure_core(report)
    fi = None if args.no_flashinfer else flashinfer_version()
    gpu = torch.cuda.get_device_name() if common.DEVICE == "cuda" else "cpu dry run"
    report.data["machine"] += f"; {gpu}; torch {torch.__version__}; flashinfer {fi or 'absent'}"
    report.log(report.data["machine"])
    if fi is None and not args.no_flashinfer:
        report.note("flashinfer is not installed: its checks and timings are skipped "
                    "(pip install 'mstar_rt[cuda]', or carry flashinfer-python wheels)")
    use_fi = fi is not None
    sections: list[tuple[str, Callable[[], None]]] = []
    sections.append(("attention", lambda: attention_check(report, use_fi)))
    models: dict[str, Any] = {}

    def load() -> None:
        models["ours"], models["hf"] = build_models(report)
    sections.append(("model", load))
    sections.append(("graphs", lambda: graph_check(
        report, models["ours"], models["hf"], ["torch"] + (["flashinfer"] if use_fi else []))))
    # the VLAs before decode speed: their tables are what the open issues ask of a GPU
    sections.append(("pi0", lambda: pi0_check(report)))
    sections.append(("smolvla", lambda: smolvla_check(report)))
    sections.append(("placement", lambda: placement_check(report)))
    sections.append(("speed", lambda: speed(report, models["ours"], models["hf"], use_fi)))
    only = {s for s in args.only.split(",") if s}
    if only & {"graphs", "speed"}:
        only.add("model")
    for name, run in sections:
        if only and name not in only:
            continue
        if report.left() < 30:
            report.note(f"section '{name}' skipped: budget")
            continue
        report.log(f"== {name}")
        try:
            run()
        except Exception as e:  # keep going: later sections may still measure something
            report.failed.append(f"{name}: {type(e).__name__}: {e}")
            report.log(f"FAIL section {name}: {type(e).__name__}: {e}")
            import traceback
            traceback.print_exc()
            if name == "model":
                break
        report.write()
    report.write()
    png = args.out.with_suffix(".png")
    print(f"wrote {args.out}" + (f" and {png}" if plot(report.data, png) else "")
          + f"; failed: {report.failed or 'none'}")
    return 1 if report.failed else 0


if __name__ == "__main__":
    sys.exit(main())

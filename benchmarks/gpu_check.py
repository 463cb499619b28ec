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
  3. decode speed at batch 1/4/16 through mstar_rt.Runtime: eager and CUDA graphs, torch and
     FlashInfer attention, vs transformers generate on the same weights.
Writes benchmarks/results/gpu_check.json after every section (a run cut short keeps what it
measured) and exits 1 when a correctness check failed. Sections past --budget-s are skipped.
Without CUDA it says so and exits 0, writing a {"skipped": reason} record only where no real
result would be overwritten. If the compiled core (mstar_rt._core) does not import, e.g. on a
machine with another Python, it is built first with CMake (about half a minute on 16 cores).
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from bench_common import machine  # benchmarks/ is on sys.path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "gpu_check.json"
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
# before it spends GPU time (graphs run eagerly there; FlashInfer is left out).
TINY = dict(MODEL, vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=32)


def sync() -> None:
    if DEVICE == "cuda":
        sync()


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
    """Builds mstar_rt._core for this interpreter when the one in the tree does not import."""
    sys.path.insert(0, str(ROOT / "python"))
    try:
        import mstar_rt  # noqa: F401
        return
    except ImportError as e:
        report.note(f"mstar_rt._core did not import ({e}); building it with CMake")
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


# ---- 1. attention: FlashInfer and torch vs a float32 reference --------------------------------

def scenarios(quick: bool) -> dict[str, list]:
    from mstar_rt.engines.masks import CAUSAL, BlockCausal, PrefixBidirectional

    g = torch.Generator().manual_seed(0)

    def rand(lo: int, hi: int) -> int:
        return int(torch.randint(lo, hi, (1,), generator=g))

    decode = [(rand(1, 2000), 1, True, CAUSAL) for _ in range(8 if quick else 32)]
    out = {
        "decode": decode,
        "prefill": [(0, 512, True, CAUSAL), (0, 77, True, CAUSAL), (0, 1, True, CAUSAL)],
        "append": [(300, 64, True, CAUSAL), (1000, 17, True, CAUSAL), (5, 200, True, CAUSAL)],
        "mixed": decode[:12] + [(0, 333, True, CAUSAL), (40, 90, True, CAUSAL)],
        "prefix_bidirectional": [(0, 300, True, PrefixBidirectional(256)),
                                 (0, 100, True, PrefixBidirectional(40)),
                                 (20, 50, True, PrefixBidirectional(45))] + decode[:4],
        "block_causal": [(0, 256, True, BlockCausal(64)),
                         (128, 128, True, BlockCausal(32, start=128)),
                         (7, 1, True, BlockCausal(16))] + decode[:4],
        "non_persisted": [(700, 50, False, BlockCausal(10, start=700)), (300, 1, False, CAUSAL),
                          (0, 20, False, CAUSAL), (64, 64, True, CAUSAL)] + decode[:4],
    }
    if quick:
        for name in ("append", "prefix_bidirectional"):
            del out[name]
    return out


def build_step(layout: Any, spec: list, page_size: int, fork: bool = False):
    from mstar_rt.engines.attention_base import SeqStep
    from mstar_rt.engines.masks import CAUSAL
    from mstar_rt.engines.paged_kv import PagedKVCache

    tokens = sum(c + n for c, n, _p, _m in spec) + 64
    cache = PagedKVCache(layout, page_size, num_pages=tokens // page_size + 2 * len(spec) + 8)
    for t in cache.k + cache.v:
        t.normal_()
    steps = []
    for r, (cached, new, persist, mask) in enumerate(spec):
        if cached:
            cache.admit(r, "main", cached)
            cache.commit(r, "main", cached)
        if fork and r == 0:
            cache.fork(r, "main", "branch")
        seq = cache.admit(r, "main", new) if persist else cache.sequence(r, "main")
        steps.append(SeqStep(cached, new, list(seq.pages) if seq else [], persist, mask))
    if fork:
        b = cache.sequence(0, "branch")
        steps.append(SeqStep(b.length, 3, list(b.pages), False, CAUSAL))
    return cache, steps


def attention_check(report: Report, use_fi: bool) -> None:
    from mstar_rt.engines.masks import CAUSAL
    from mstar_rt.engines.paged_kv import KVLayout, PagedKVCache
    from mstar_rt.engines.torch_backend import TorchAttention

    hq, hkv, d, ps = 32, 8, 64, 16
    specs = scenarios(report.args.quick)
    specs["fork"] = [(37, 1, True, CAUSAL), (100, 5, True, CAUSAL)]
    rows = []
    for name, spec in specs.items():
        if report.left() < 60:
            report.note(f"attention scenario '{name}' skipped: budget")
            continue
        layout = KVLayout(1, hkv, d, DTYPE, DEVICE)
        cache, steps = build_step(layout, spec, ps, fork=name == "fork")
        ref_cache = PagedKVCache(KVLayout(1, hkv, d, torch.float32, DEVICE), ps, cache.num_pages)
        n = sum(s.new for s in steps)
        g = torch.Generator(device=DEVICE).manual_seed(1)
        q = torch.randn(n, hq, d, generator=g, device=DEVICE)
        k, v = (torch.randn(n, hkv, d, generator=g, device=DEVICE) for _ in range(2))
        before = [cache.k[0].clone(), cache.v[0].clone()]
        ref_cache.k[0].copy_(before[0])
        ref_cache.v[0].copy_(before[1])
        ref = TorchAttention(ref_cache)
        expect = ref.attend(0, q, k, v, ref.plan(steps))
        row = {"scenario": name, "tokens": n, "works": len(steps)}
        backends: list[tuple[str, Callable]] = [("torch", TorchAttention)]
        if use_fi:
            from mstar_rt.engines.flashinfer_backend import FlashInferAttention
            backends.append(("flashinfer", FlashInferAttention))
        pages = {}
        for bname, make in backends:
            cache.k[0].copy_(before[0])
            cache.v[0].copy_(before[1])
            be = make(cache)
            qb, kb, vb = (t.to(DTYPE) for t in (q, k, v))
            got = be.attend(0, qb, kb, vb, be.plan(steps))
            sync()
            row[bname] = (got.float() - expect).abs().max().item()
            pages[bname] = (cache.k[0].clone(), cache.v[0].clone())
        if "flashinfer" in pages:
            same = all(torch.equal(a, b) for a, b in zip(pages["torch"], pages["flashinfer"]))
            report.check(f"attention_{name}_pages_written_identically", 0.0 if same else 1.0, 0.0)
            # bf16 inputs: allow FlashInfer twice the torch backend's error, at least 2e-2.
            report.check(f"attention_{name}_flashinfer_maxdiff", row["flashinfer"],
                         max(2 * row["torch"], 2e-2))
            report.data["figures"][f"attn_maxdiff_{name}_flashinfer"] = round(row["flashinfer"], 5)
        report.data["figures"][f"attn_maxdiff_{name}_torch"] = round(row["torch"], 5)
        rows.append(row)
        report.write()
    print("\nattention max |diff| vs float32 torch reference (bf16 inputs)")
    print(f"{'scenario':24s} {'tokens':>7s} {'works':>6s} {'torch':>10s} {'flashinfer':>11s}")
    for r in rows:
        fi = f"{r['flashinfer']:.2e}" if "flashinfer" in r else "-"
        print(f"{r['scenario']:24s} {r['tokens']:7d} {r['works']:6d} {r['torch']:10.2e} {fi:>11s}")
    print()


# ---- the model ----------------------------------------------------------------------------------

def build_models(report: Report) -> tuple[Any, Any]:
    import transformers

    from mstar_rt.models.llama import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(**MODEL)
    with torch.device(DEVICE):
        hf = transformers.LlamaForCausalLM(cfg)
    hf = hf.to(DTYPE).eval()
    config = LlamaConfig.from_hf(hf.config.to_dict())
    with torch.device("meta"):
        ours = LlamaForCausalLM(config)
    ours = ours.to_empty(device=DEVICE).to(torch.bfloat16)
    ours.rotary.inv_freq = config.rope.inv_freq(config.head_dim).to(DEVICE)
    missing, _unexpected = ours.load_state_dict(hf.state_dict(), strict=False)
    if missing:
        raise RuntimeError(f"parameters not loaded from the transformers model: {missing}")
    params = sum(p.numel() for p in ours.parameters())
    report.data["figures"]["model_params_M"] = round(params / 1e6, 1)
    report.log(f"random Llama: {params / 1e6:.0f}M parameters, bf16")
    return ours.eval(), hf


def prefill(model: Any, backend: Any, prompts: list[torch.Tensor]) -> list:
    """Prefills every prompt in one step; returns the SeqSteps of the next decode step."""
    from mstar_rt.engines.attention_base import SeqStep
    from mstar_rt.engines.kv_engine import KVStep

    cache = backend.cache
    steps = []
    for r, p in enumerate(prompts):
        seq = cache.admit(r, "main", len(p), reserve=len(p) + 16)
        steps.append(SeqStep(0, len(p), list(seq.pages)))
    with torch.inference_mode():
        model(torch.cat(prompts), KVStep(backend, backend.plan(steps)))
    out = []
    for r, p in enumerate(prompts):
        cache.commit(r, "main", len(p))
        seq = cache.admit(r, "main", 1)
        out.append(SeqStep(seq.length, 1, list(seq.pages)))
    return out


def parity_check(report: Report, model: Any, hf: Any, prompt: torch.Tensor) -> None:
    """Our eager prefill vs transformers on the same weights (last position's logits)."""
    from mstar_rt.engines.attention import select_backend
    from mstar_rt.engines.attention_base import SeqStep
    from mstar_rt.engines.kv_engine import KVStep
    from mstar_rt.engines.paged_kv import PagedKVCache

    with torch.inference_mode():
        ref = hf(prompt[None]).logits[0, -1].float()
        cache = PagedKVCache(model.kv_layout(), 16, 64)
        backend = select_backend("torch", cache)
        seq = cache.admit(0, "main", len(prompt))
        plan = backend.plan([SeqStep(0, len(prompt), list(seq.pages))])
        hidden = model(prompt, KVStep(backend, plan))
        ours = model.logits(hidden[plan.last_token])[0].float()
    diff = (ours - ref).abs().max().item()
    report.data["figures"]["hf_parity_prefill_logits_maxdiff"] = round(diff, 4)
    report.check("prefill_logits_vs_transformers_rel", diff / max(1.0, ref.abs().max().item()),
                 5e-2)


def graph_check(report: Report, model: Any, hf: Any, backend_names: list[str]) -> None:
    from mstar_rt.engines.attention import select_backend
    from mstar_rt.engines.cuda_graphs import DecodeGraphs
    from mstar_rt.engines.kv_engine import KVStep
    from mstar_rt.engines.paged_kv import PagedKVCache

    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, MODEL["vocab_size"], (n,), generator=g).to(DEVICE)
               for n in (37, 5, 120, 64, 1, 16, 99, 250, 8, 31, 77, 3)]
    parity_check(report, model, hf, prompts[7])
    tokens = torch.randint(0, MODEL["vocab_size"], (len(prompts),), generator=g).to(DEVICE)
    for name in backend_names:
        if report.left() < 45:
            report.note(f"graph check for '{name}' skipped: budget")
            continue
        cache = PagedKVCache(model.kv_layout(), 16, 256)
        backend = select_backend(name, cache)
        steps = prefill(model, backend, prompts)
        graphs = DecodeGraphs.for_backend(model, backend, MAX_SEQ_LEN, BUCKETS)
        worst, agree, total = 0.0, 0, 0
        for n in (12, 3, 1, 12):  # buckets 16, 4, 1, then a replay of 16
            before = [t.clone() for t in cache.k + cache.v]
            with torch.inference_mode():
                plan = backend.plan(steps[:n])
                hidden = model(tokens[:n], KVStep(backend, plan))
                eager = model.logits(hidden[plan.last_token]).float()
            for dst, src in zip(cache.k + cache.v, before):
                dst.copy_(src)
            out = graphs.run(tokens[:n], steps[:n])
            assert out is not None, "the decode step was not served by the graphs"
            got = out.logits.float()
            scale = max(1.0, eager.abs().max().item())
            worst = max(worst, (got - eager).abs().max().item() / scale)
            agree += int((got.argmax(-1) == eager.argmax(-1)).sum())
            total += n
        report.data["figures"][f"graph_vs_eager_rel_logits_maxdiff_{name}"] = round(worst, 5)
        report.data["figures"][f"graph_vs_eager_argmax_agree_{name}"] = round(agree / total, 3)
        report.check(f"graph_decode_{name}_matches_eager", worst, 5e-2)
        report.log(f"{name}: {graphs.captures} graphs captured, {graphs.runs} static steps")
        report.write()


# ---- 3. decode speed ----------------------------------------------------------------------------

def time_ours(report: Report, model: Any, backend: str, graphs: bool, batches: tuple,
              prompt_len: int, new: int, reps: int) -> dict[int, float]:
    from mstar_rt import Runtime
    from mstar_rt.engines import KVCacheEngine, SamplingParams
    from mstar_rt.models.causal_lm import CausalLM

    lm = CausalLM(model, engine=KVCacheEngine(page_size=16, num_pages=4096, max_batch=64,
                                              attention_backend=backend),
                  max_seq_len=MAX_SEQ_LEN, max_batch=64, cuda_graphs=graphs)
    g = torch.Generator().manual_seed(3)
    params = SamplingParams(max_tokens=new, ignore_eos=True)
    out = {}
    with Runtime(lm) as rt:
        for b in batches:
            if report.left() < 20:
                report.note(f"ours {backend} graphs={graphs} b={b} skipped: budget")
                continue
            prompts = [torch.randint(0, MODEL["vocab_size"], (prompt_len,), generator=g).tolist()
                       for _ in range(b)]
            times = []
            for rep in range(reps + 1):  # the first run warms up (JIT, graph capture)
                t0 = time.perf_counter()
                hs = [rt.submit({"prompt": p, "params": params}) for p in prompts]
                for h in hs:
                    assert len(h.result(timeout=300)["token"]) == new
                if rep:
                    times.append(time.perf_counter() - t0)
            out[b] = min(times)
    return out


def time_hf(report: Report, hf: Any, batches: tuple, prompt_len: int, new: int,
            reps: int) -> dict[int, float]:
    out = {}
    g = torch.Generator().manual_seed(3)
    for b in batches:
        if report.left() < 20:
            report.note(f"transformers b={b} skipped: budget")
            continue
        ids = torch.randint(0, MODEL["vocab_size"], (b, prompt_len), generator=g).to(DEVICE)
        times = []
        for rep in range(reps + 1):
            sync()
            t0 = time.perf_counter()
            with torch.inference_mode():
                seq = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                                  min_new_tokens=new, do_sample=False, pad_token_id=0)
            sync()
            assert seq.shape[1] == prompt_len + new
            if rep:
                times.append(time.perf_counter() - t0)
        out[b] = min(times)
    return out


def speed(report: Report, model: Any, hf: Any, use_fi: bool) -> None:
    quick = report.args.quick
    batches = (1, 4, 16)
    prompt_len, new, reps = (64, 32, 1) if quick else (128, 64, 2)
    variants = [("eager_torch", "torch", False), ("graphs_torch", "torch", True)]
    if use_fi:
        variants += [("eager_flashinfer", "flashinfer", False),
                     ("graphs_flashinfer", "flashinfer", True)]
    secs: dict[str, dict[int, float]] = {}
    for label, backend, graphs in variants:
        report.log(f"timing {label}")
        secs[label] = time_ours(report, model, backend, graphs, batches, prompt_len, new, reps)
        report.write()
    if not report.args.no_hf:
        report.log("timing transformers generate")
        secs["hf_generate"] = time_hf(report, hf, batches, prompt_len, new, reps)
    figures, ratios = report.data["figures"], report.data["ratios"]
    for label, by_b in secs.items():
        for b, s in by_b.items():
            figures[f"decode_tok_s_b{b}_{label}"] = round(b * new / s, 1)
            figures[f"ms_per_step_b{b}_{label}"] = round(1000 * s / new, 3)
    for b in batches:
        def tps(label: str) -> Optional[float]:
            return figures.get(f"decode_tok_s_b{b}_{label}")
        for label in secs:
            if label != "hf_generate" and tps(label) and tps("hf_generate"):
                ratios[f"b{b}_{label}_vs_hf"] = round(tps(label) / tps("hf_generate"), 3)
        for be in ("torch", "flashinfer"):
            graphs, eager = tps(f"graphs_{be}"), tps(f"eager_{be}")
            if graphs and eager:
                ratios[f"b{b}_graphs_vs_eager_{be}"] = round(graphs / eager, 3)
    report.data["figures"]["timing_prompt_len"] = prompt_len
    report.data["figures"]["timing_new_tokens"] = new
    report.write()
    print(f"\ndecode tokens/s (prompt {prompt_len}, {new} new tokens each; prefill included)")
    print(f"{'variant':20s}" + "".join(f"{'b=' + str(b):>12s}" for b in batches))
    for label in secs:
        cells = [figures.get(f"decode_tok_s_b{b}_{label}") for b in batches]
        print(f"{label:20s}" + "".join(f"{c:12.1f}" if c else f"{'-':>12s}" for c in cells))
    print()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer scenarios and shorter timings")
    ap.add_argument("--no-flashinfer", action="store_true", help="torch backend only")
    ap.add_argument("--no-hf", action="store_true", help="skip transformers generate")
    ap.add_argument("--budget-s", type=float, default=420.0,
                    help="skip sections that would start after this many seconds")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--dry-run-cpu", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.dry_run_cpu:
        global DEVICE, MODEL
        DEVICE, MODEL = "cpu", TINY
        args.no_flashinfer, args.budget_s = True, 1e9
        if args.out == DEFAULT_OUT:
            args.out = Path("/tmp/gpu_check_dry_run.json")
    elif not torch.cuda.is_available():
        return skip_without_cuda(args.out, args.quick, "no CUDA device is visible to torch "
                                 f"{torch.__version__}")
    report = Report(args)
    ensure_core(report)
    fi = None if args.no_flashinfer else flashinfer_version()
    gpu = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu dry run"
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
    sections.append(("speed", lambda: speed(report, models["ours"], models["hf"], use_fi)))
    for name, run in sections:
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
    print(f"wrote {args.out}; failed: {report.failed or 'none'}")
    return 1 if report.failed else 0


if __name__ == "__main__":
    sys.exit(main())

"""Sections 2 and 3 of benchmarks/gpu_check.py: a random Llama (Llama-3.2-1B shapes) built with
transformers and loaded into ours, our eager prefill against transformers' logits, CUDA-graph
decode against eager per attention backend (at batches that pad up to a bucket), and decode speed
at batch 1/4/16 through mstar_rt.Runtime -- eager and CUDA graphs, torch and FlashInfer
attention -- against transformers' generate on the same weights."""

from __future__ import annotations

import time
from typing import Any, Optional

import torch

import gpu_check_common as common
from gpu_check_common import BUCKETS, DTYPE, MAX_SEQ_LEN, Report, sync


# ---- the model ----------------------------------------------------------------------------------

def build_models(report: Report) -> tuple[Any, Any]:
    import transformers

    from mstar_rt.models.llama import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(**common.MODEL)
    with torch.device(common.DEVICE):
        hf = transformers.LlamaForCausalLM(cfg)
    hf = hf.to(DTYPE).eval()
    config = LlamaConfig.from_hf(hf.config.to_dict())
    with torch.device("meta"):
        ours = LlamaForCausalLM(config)
    ours = ours.to_empty(device=common.DEVICE).to(torch.bfloat16)
    ours.rotary.inv_freq = config.rope.inv_freq(config.head_dim).to(common.DEVICE)
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
    prompts = [torch.randint(0, common.MODEL["vocab_size"], (n,), generator=g).to(common.DEVICE)
               for n in (37, 5, 120, 64, 1, 16, 99, 250, 8, 31, 77, 3)]
    parity_check(report, model, hf, prompts[7])
    tokens = torch.randint(0, common.MODEL["vocab_size"], (len(prompts),), generator=g).to(
        common.DEVICE)
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


# ---- 5. decode speed ----------------------------------------------------------------------------

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
            prompts = [torch.randint(0, common.MODEL["vocab_size"], (prompt_len,),
                                     generator=g).tolist() for _ in range(b)]
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
        ids = torch.randint(0, common.MODEL["vocab_size"], (b, prompt_len), generator=g).to(
            common.DEVICE)
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

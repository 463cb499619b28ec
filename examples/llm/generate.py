"""Serve a Llama-architecture LM with continuous batching: N prompts at once, tokens streamed.

    python examples/llm/generate.py                       # a tiny random model
    python examples/llm/generate.py --checkpoint DIR      # a HF checkpoint (config.json + safetensors)

Prompts are token ids (this runtime takes ids; tokenize with your tokenizer of choice).
"""

from __future__ import annotations

import argparse
import time

import torch

import mstar_rt
from mstar_rt.engines import KVCacheEngine, SamplingParams
from mstar_rt.models.causal_lm import CausalLM
from mstar_rt.models.llama import LlamaConfig, LlamaForCausalLM


def tiny_model(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=32, max_position_embeddings=1024)
    module = LlamaForCausalLM(config)
    for p in module.parameters():  # random weights at a scale that gives varied tokens
        torch.nn.init.normal_(p, std=0.05)
    return module.eval()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", help="HF Llama checkpoint directory (default: tiny random)")
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--num-pages", type=int, default=256)
    args = ap.parse_args()

    engine = KVCacheEngine(page_size=args.page_size, num_pages=args.num_pages)
    if args.checkpoint:
        lm = CausalLM.from_pretrained(args.checkpoint, engine=engine)
    else:
        lm = CausalLM(tiny_model(), engine=engine)
    vocab = lm.module.config.vocab_size
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, vocab, (8 + 5 * i,), generator=gen).tolist()
               for i in range(args.requests)]
    with mstar_rt.Runtime(lm) as runtime:
        t0 = time.perf_counter()
        handles = [runtime.submit({"prompt": p, "params": SamplingParams(
            max_tokens=args.max_tokens, temperature=args.temperature, seed=i, ignore_eos=True)})
            for i, p in enumerate(prompts)]
        first = None
        print("request 0 streams:", end=" ", flush=True)
        for _name, token in handles[0]:
            first = first or time.perf_counter() - t0
            print(token, end=" ", flush=True)
        print()
        results = [h.result(timeout=600) for h in handles]
        wall = time.perf_counter() - t0
        tokens = sum(len(r["token"]) for r in results)
        steps = runtime.engines["lm"].step_sizes
        print(f"{len(prompts)} requests, {tokens} tokens in {wall:.2f} s "
              f"({tokens / wall:.0f} tokens/s), first token after {first * 1e3:.0f} ms, "
              f"{len(steps)} engine steps (largest batch {max(steps)})")
        cache = runtime.engines["lm"].cache
    print(f"KV pages free after the requests: {cache.free_pages}/{cache.num_pages}")


if __name__ == "__main__":
    main()

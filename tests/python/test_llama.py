"""Llama served by CausalLM on a KVCacheEngine against transformers: logits and greedy tokens of
batched requests over small pages, both config.json dialects, sharded checkpoints, the errors a
user meets (prompt too long, wrong checkpoint keys, unsupported dtype or backend), seeded
sampling that does not depend on the batch, and bfloat16 on CPU."""

from __future__ import annotations

import json
import re
import shutil
from typing import Callable

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from safetensors.torch import load_file, save_file  # noqa: E402

from mstar_rt import Runtime  # noqa: E402
from mstar_rt.engines import KVCacheEngine, SamplingParams  # noqa: E402
from mstar_rt.models.causal_lm import CausalLM  # noqa: E402
from mstar_rt.models.llama import LlamaConfig, load_llama  # noqa: E402

from llama_ref import (  # noqa: E402
    T,
    VARIANTS,
    as_4x,
    as_5x,
    greedy,
    hf_generate,
    make_hf,
    make_lm,
    make_prompts,
    max_diff,
    read_config,
    run_all,
    teacher_forced,
    top2_gap,
    write_config,
)
from walk_models import engine_threads, wait_until  # noqa: E402

LENGTHS = (1, 3, 6, 9, 14, 17, 23, 30)  # 8 requests; with 64 new tokens each spans 17-24 pages
NEW = 64
TOL = 1e-4  # float32 logits against transformers


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Callable:
    """``checkpoint(variant) -> (hf_model, dir)``: a tiny random Llama saved once per module."""
    made: dict = {}

    def get(variant: str):
        if variant not in made:
            hf = make_hf(variant)
            path = tmp_path_factory.mktemp(variant)
            hf.save_pretrained(path)
            made[variant] = (hf, path)
        return made[variant]

    return get


def check_against_hf(hf, prompts: list[list[int]], results: list[dict], n: int,
                     tol: float = TOL) -> None:
    """Each step's logits match HF's given the same prefix, and each token is HF's argmax
    there; by induction the whole sequence is HF's greedy continuation."""
    for p, r in zip(prompts, results):
        assert len(r["token"]) == n
        ref = teacher_forced(hf, p, r["token"])
        diff = max_diff(r["logits"], ref)
        assert diff < tol, f"prompt of {len(p)}: logits differ from transformers by {diff}"
        assert r["token"] == ref.argmax(-1).tolist(), f"prompt of {len(p)}: not HF's greedy"


# ---- 1. parity with transformers ---------------------------------------------------------------

@pytest.mark.parametrize("variant", list(VARIANTS))
def test_batched_paged_decoding_matches_transformers(variant, checkpoint, serve):
    hf, path = checkpoint(variant)
    module = load_llama(path, progress=False)
    assert module.kv_layout().dtype == torch.float32
    prompts = make_prompts(hf.config.vocab_size, LENGTHS)
    rt = serve(make_lm(module, page_size=4, num_pages=256))
    results = run_all(rt, [greedy(p, NEW) for p in prompts])
    engine = rt.engines["lm"]
    assert max(engine.step_sizes) > 1, "the requests never shared a step"
    check_against_hf(hf, prompts, results, NEW)
    # And against HF's own cached generate, for the longest prompt (the most pages).
    tokens, logits = hf_generate(hf, prompts[-1], NEW)
    assert results[-1]["token"] == tokens
    assert max_diff(results[-1]["logits"], logits) < TOL
    assert wait_until(lambda: engine.cache.free_pages == engine.cache.num_pages, T), \
        "finished requests kept KV pages"


# ---- 2. transformers 4.x and 5.x config.json ---------------------------------------------------

@pytest.mark.parametrize("variant", ["llama3", "linear_bias"])
def test_config_dialects_give_the_same_model(variant, checkpoint, tmp_path, serve):
    hf, path = checkpoint(variant)
    saved = read_config(path)
    modern = LlamaConfig.from_hf(as_5x(saved))
    assert modern.rope.kind == VARIANTS[variant]["rope_scaling"]["rope_type"]
    prompts = make_prompts(hf.config.vocab_size, (5, 20, 33), seed=2)
    hf_inv_freq = hf.model.rotary_emb.inv_freq.float()
    for type_key in ("rope_type", "type"):
        d = tmp_path / type_key
        shutil.copytree(path, d)
        write_config(d, as_4x(saved, type_key))
        assert "rope_parameters" not in read_config(d) and "rope_theta" in read_config(d)
        assert LlamaConfig.from_dir(d) == modern
        module = load_llama(d, progress=False)
        torch.testing.assert_close(module.rotary.inv_freq.float(), hf_inv_freq)
        rt = serve(make_lm(module))
        check_against_hf(hf, prompts, run_all(rt, [greedy(p, 12) for p in prompts]), 12)
    # The check can fail: the same weights with the scaling dropped drift far from HF.
    d = tmp_path / "unscaled"
    shutil.copytree(path, d)
    write_config(d, {**as_4x(saved), "rope_scaling": None})
    rt = serve(make_lm(load_llama(d, progress=False)))
    r = run_all(rt, [greedy(prompts[-1], 12)])[0]
    assert max_diff(r["logits"], teacher_forced(hf, prompts[-1], r["token"])) > 1e-2


# ---- 3. sharded checkpoints --------------------------------------------------------------------

def test_sharded_checkpoint_loads(tmp_path, serve):
    hf = make_hf("tied")
    hf.save_pretrained(tmp_path, max_shard_size="20KB")
    with open(tmp_path / "model.safetensors.index.json") as f:
        shards = set(json.load(f)["weight_map"].values())
    assert len(shards) >= 3 and not (tmp_path / "model.safetensors").exists()
    lm = CausalLM.from_pretrained(tmp_path, progress=False, emit_logits=True,
                                  engine=KVCacheEngine(page_size=4, num_pages=128))
    reference = hf.state_dict()
    for name, tensor in lm.module.state_dict().items():
        assert torch.equal(tensor, reference[name]), name
    prompts = make_prompts(hf.config.vocab_size, (2, 11, 25), seed=3)
    rt = serve(lm)
    check_against_hf(hf, prompts, run_all(rt, [greedy(p, 16) for p in prompts]), 16)


def test_a_tensor_in_two_shards_is_refused_naming_both(tmp_path):
    make_hf("tied").save_pretrained(tmp_path, max_shard_size="20KB")
    with open(tmp_path / "model.safetensors.index.json") as f:
        shards = sorted(set(json.load(f)["weight_map"].values()))
    last = tmp_path / shards[-1]
    tensors = load_file(last)
    tensors["model.embed_tokens.weight"] = torch.zeros(1)  # a stale copy: it won, without a word
    save_file(tensors, last, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"'model.embed_tokens.weight' is in both .*"
                                         + re.escape(shards[-1])):
        load_llama(tmp_path, progress=False)


def test_eos_from_config_stops_generation(checkpoint, tmp_path, serve):
    hf, path = checkpoint("gqa")
    prompt = make_prompts(hf.config.vocab_size, (7,), seed=4)[0]
    tokens, _ = hf_generate(hf, prompt, 12)
    eos = tokens[5]
    stop_at = tokens.index(eos) + 1
    shutil.copytree(path, tmp_path / "ckpt")
    write_config(tmp_path / "ckpt", {**read_config(path), "eos_token_id": [eos]})
    rt = serve(CausalLM.from_pretrained(tmp_path / "ckpt", progress=False,
                                        engine=KVCacheEngine(page_size=4, num_pages=64)))
    stopped, ignored = run_all(rt, [greedy(prompt, 12), greedy(prompt, 12, ignore_eos=True)])
    assert stopped["token"] == tokens[:stop_at]
    assert ignored["token"] == tokens


# ---- 4. clear errors ---------------------------------------------------------------------------

def test_prompt_longer_than_max_seq_len_is_refused(checkpoint, serve):
    hf, path = checkpoint("gqa")
    module = load_llama(path, progress=False)
    with pytest.raises(ValueError, match="maximum sequence length is 128"):  # config default
        make_lm(module).validate_inputs({"prompt": [0] * 128})
    rt = serve(make_lm(module, max_seq_len=24))
    prompts = make_prompts(hf.config.vocab_size, (6, 23, 20, 9), seed=6)
    running = rt.submit(greedy(prompts[0], 16))  # in flight while the others are refused
    for n in (24, 40):
        with pytest.raises(ValueError, match="maximum sequence length is 24"):
            rt.submit(greedy([1] * n, 4))
    results = run_all(rt, [greedy(p, 16) for p in prompts[1:]])
    # Generation stops at the maximum length: prompt + new tokens <= 24.
    assert [len(r["token"]) for r in results] == [1, 4, 15]
    done = running.result(timeout=T)
    assert len(done["token"]) == 16
    for p, r in zip(prompts, [done] + results):
        ref = teacher_forced(hf, p, r["token"])
        assert max_diff(r["logits"], ref) < TOL


def test_checkpoint_key_errors_name_the_keys(checkpoint, tmp_path):
    _hf, path = checkpoint("gqa")
    tensors = load_file(path / "model.safetensors")

    def variant(name: str, weights: dict, config: dict | None = None):
        d = tmp_path / name
        shutil.copytree(path, d)
        save_file(weights, d / "model.safetensors", metadata={"format": "pt"})
        if config is not None:
            write_config(d, config)
        return d

    extra = "model.layers.0.self_attn.q_norm.weight"
    with pytest.raises(ValueError, match=re.escape(extra)):
        load_llama(variant("extra", {**tensors, extra: torch.ones(16)}), progress=False)
    for key in ("model.layers.1.mlp.up_proj.weight", "lm_head.weight"):  # lm_head: untied
        kept = {k: v for k, v in tensors.items() if k != key}
        with pytest.raises(ValueError, match=re.escape(key)):
            load_llama(variant(key, kept), progress=False)
    wrong = variant("shape", tensors, {**read_config(path), "intermediate_size": 80})
    with pytest.raises(ValueError, match="shape"):
        load_llama(wrong, progress=False)


@pytest.mark.parametrize("changes, words", [
    # Granite: the same keys, multipliers the Llama maths lacks (logits off by 0.4)
    ({"model_type": "granite", "embedding_multiplier": 12.0}, "is a 'granite' model"),
    ({"model_type": "qwen2"}, "is a 'qwen2' model"),
    # Mistral attending over a window only (logits off by 0.15 past it)
    ({"model_type": "mistral", "sliding_window": 16}, "sets sliding_window 16"),
])
def test_a_look_alike_of_another_architecture_is_refused_by_its_model_type(checkpoint, tmp_path,
                                                                         changes, words):
    _hf, path = checkpoint("gqa")
    d = tmp_path / "other"
    shutil.copytree(path, d)
    write_config(d, {**read_config(path), **changes})
    with pytest.raises(ValueError, match=words):
        load_llama(d, progress=False)


def test_mistral_without_a_sliding_window_is_a_llama(checkpoint, tmp_path):
    _hf, path = checkpoint("gqa")
    config = read_config(path)
    for window in (None, config["max_position_embeddings"]):  # full attention either way
        d = tmp_path / f"mistral{window}"
        shutil.copytree(path, d)
        write_config(d, {**config, "model_type": "mistral", "sliding_window": window})
        assert LlamaConfig.from_dir(d).num_hidden_layers == config["num_hidden_layers"]


def test_float16_on_cpu_is_refused_with_the_supported_dtypes(checkpoint):
    _hf, path = checkpoint("gqa")
    module = load_llama(path, dtype=torch.float16, progress=False)
    assert module.kv_layout().dtype == torch.float16
    with pytest.raises(ValueError) as err:
        Runtime(make_lm(module))
    message = str(err.value)
    assert re.search(r"\bfloat16", message) and "float32" in message and "bfloat16" in message
    assert engine_threads() == []


def test_flashinfer_on_cpu_says_what_to_do(checkpoint):
    _hf, path = checkpoint("gqa")
    lm = CausalLM(load_llama(path, progress=False),
                  engine=KVCacheEngine(page_size=4, num_pages=64, attention_backend="flashinfer"))
    with pytest.raises((ValueError, ImportError)) as err:
        Runtime(lm)
    message = str(err.value).lower()
    assert "flashinfer" in message and re.search(r"cuda|attention_backend|install", message), \
        f"unhelpful error: {type(err.value).__name__}: {err.value}"
    assert engine_threads() == []


# ---- 5. seeded sampling ------------------------------------------------------------------------

def test_seeded_sampling_does_not_depend_on_the_batch(checkpoint, serve):
    hf, path = checkpoint("gqa")
    rt = serve(make_lm(load_llama(path, progress=False), emit_logits=False))
    engine = rt.engines["lm"]
    prompts = make_prompts(hf.config.vocab_size, LENGTHS, seed=7)

    def sampled(prompt: list[int], seed: int, **kw) -> dict:
        return {"prompt": prompt, "params": SamplingParams(max_tokens=24, temperature=1.3,
                                                           seed=seed, **kw)}

    target = sampled(prompts[3], 1234, top_k=40, top_p=0.95)
    alone = run_all(rt, [target])[0]["token"]
    others = [greedy(prompts[3], 24), sampled(prompts[1], 1), sampled(prompts[2], 2, top_k=5),
              sampled(prompts[4], 3, repetition_penalty=1.3), target,
              sampled(prompts[3], 99, top_k=40, top_p=0.95), sampled(prompts[6], 4, top_p=0.5),
              greedy(prompts[7], 24, repetition_penalty=1.2)]
    before = len(engine.step_sizes)
    batched = run_all(rt, others)
    assert max(engine.step_sizes[before:]) > 1, "the sampled requests never shared a step"
    assert batched[4]["token"] == alone
    assert batched[5]["token"] != alone, "a different seed drew the same 24 tokens"
    assert alone != batched[0]["token"], "temperature 1.3 drew the greedy tokens"


# ---- 6. bfloat16 on CPU ------------------------------------------------------------------------

def test_bfloat16_checkpoint_runs_on_cpu(tmp_path, serve):
    hf = make_hf("gqa").to(torch.bfloat16)
    hf.save_pretrained(tmp_path)
    module = load_llama(tmp_path, progress=False)  # dtype from config.json
    assert module.kv_layout().dtype == torch.bfloat16
    prompts = make_prompts(hf.config.vocab_size, LENGTHS, seed=8)
    rt = serve(make_lm(module))
    results = run_all(rt, [greedy(p, 8) for p in prompts])
    for p, r in zip(prompts, results):
        ref = teacher_forced(hf, p, r["token"])
        ours = torch.stack(r["logits"])
        assert torch.isfinite(ours).all()
        # bf16 rounds differently along the two paths; loose closeness, and the token must be
        # HF's argmax wherever HF's margin exceeds that slack.
        slack = (ours - ref).abs().max(dim=-1).values
        assert slack.max() < 0.5, f"bf16 logits differ from transformers by {slack.max()}"
        clear = top2_gap(ref) > 2 * slack
        assert clear.any()
        assert torch.equal(torch.tensor(r["token"])[clear], ref.argmax(-1)[clear])

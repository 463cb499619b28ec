"""Per-request sampling: greedy is argmax; temperature, top-k, top-p and repetition penalty draw
from the distribution transformers' logits processors define; seeded generators reproduce, also
when batched with other requests; bad SamplingParams name the field to fix."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import (RepetitionPenaltyLogitsProcessor,
                                                    TemperatureLogitsWarper, TopKLogitsWarper,
                                                    TopPLogitsWarper)

from mstar_rt import Runtime
from mstar_rt.engines import KVCacheEngine, SamplingParams
from mstar_rt.engines.sampling import make_generator, sample
from mstar_rt.models.causal_lm import CausalLM

from kv_models import tiny_llama

V = 12
CPU = torch.device("cpu")
DRAWS = 6000


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conftest.py


def hf_probs(logits: torch.Tensor, history: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The distribution transformers samples from (processors in generate()'s order)."""
    ids, scores = history[None].long(), logits[None].float().clone()
    if p.repetition_penalty != 1.0:
        scores = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(ids, scores)
    scores = TemperatureLogitsWarper(p.temperature)(ids, scores)
    if p.top_k:
        scores = TopKLogitsWarper(p.top_k)(ids, scores)
    if p.top_p < 1.0:
        scores = TopPLogitsWarper(p.top_p)(ids, scores)
    return scores[0].double().softmax(-1)


def draw(logits: torch.Tensor, history: torch.Tensor, p: SamplingParams, n: int,
         seed: int) -> torch.Tensor:
    """``n`` tokens from one generator, as one batch of ``n`` identical rows."""
    g = torch.Generator().manual_seed(seed)
    return sample(logits.expand(n, -1), [p] * n, [g] * n, [history] * n)


def spread_logits(seed: int) -> torch.Tensor:
    """Distinct logits whose cumulative probabilities (at every temperature used here) keep clear
    of the top_p thresholds, so float rounding cannot decide a boundary token."""
    g = torch.Generator().manual_seed(seed)
    return torch.linspace(-2.0, 2.5, V)[torch.randperm(V, generator=g)] + 0.05 * torch.randn(
        V, generator=g)


HISTORY = torch.tensor([3, 3, 7, 0, 11, 5])
CASES = [
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=1.0, top_k=3),
    SamplingParams(temperature=1.3, top_p=0.8),
    SamplingParams(temperature=0.9, top_k=5, top_p=0.7),
    SamplingParams(temperature=1.0, repetition_penalty=1.5),
    SamplingParams(temperature=0.8, top_k=6, top_p=0.9, repetition_penalty=1.3),
    SamplingParams(temperature=2.0, top_k=V + 4),      # top_k beyond the vocabulary: off
    SamplingParams(temperature=1.0, top_p=0.01),       # only the most likely token survives
    SamplingParams(temperature=1.0, top_k=1, repetition_penalty=0.5),
]


def check_margin(logits: torch.Tensor, p: SamplingParams) -> None:
    if p.top_p >= 1.0:
        return
    q = hf_probs(logits, HISTORY, SamplingParams(temperature=p.temperature, top_k=p.top_k,
                                                 repetition_penalty=p.repetition_penalty))
    cum = q.sort(descending=True).values.cumsum(0)
    assert (cum - p.top_p).abs().min() > 1e-3, "test logits sit on a top_p boundary"


@pytest.mark.parametrize("p", CASES, ids=lambda p: f"T{p.temperature}-k{p.top_k}-p{p.top_p}-"
                                                   f"r{p.repetition_penalty}")
def test_samples_follow_the_transformers_distribution(p):
    logits = spread_logits(seed=1)
    check_margin(logits, p)
    want = hf_probs(logits, HISTORY, p)
    tokens = draw(logits, HISTORY, p, DRAWS, seed=2)
    freq = torch.bincount(tokens, minlength=V).double() / DRAWS
    support = want > 0
    assert support[tokens].all(), f"drew tokens {sorted(set(tokens[~support[tokens]].tolist()))} " \
                                  f"that transformers filters out"
    assert ((freq > 0) | (want < 0.01)).all(), "a likely token was never drawn"
    assert (freq - want).abs().max() < 0.03, (freq, want)


@pytest.mark.parametrize("p", CASES, ids=lambda p: f"T{p.temperature}-k{p.top_k}-p{p.top_p}-"
                                                   f"r{p.repetition_penalty}")
def test_the_sampled_distribution_equals_transformers(p, monkeypatch):
    """The exact probabilities handed to the draw (a white-box check that catches what the
    frequencies cannot: a wrong boundary token of tiny probability)."""
    logits = spread_logits(seed=3)
    check_margin(logits, p)
    seen: list[torch.Tensor] = []
    real = torch.multinomial

    def spy(probs, *args, **kwargs):
        seen.append(probs.detach().clone())
        return real(probs, *args, **kwargs)

    monkeypatch.setattr(torch, "multinomial", spy)
    g = torch.Generator().manual_seed(0)
    token = sample(logits[None], [p], [g], [HISTORY])
    monkeypatch.undo()
    want = hf_probs(logits, HISTORY, p)
    assert len(seen) == 1, "sample() no longer draws with torch.multinomial; adapt this test"
    got = seen[0].double() / seen[0].double().sum()
    assert torch.equal(got > 0, want > 0), (got, want)
    assert (got - want).abs().max() < 1e-6
    assert want[token[0]] > 0


def test_greedy_is_argmax_also_beside_sampled_rows():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(16, 50, generator=g)
    empty = torch.empty(0, dtype=torch.long)
    greedy = SamplingParams()
    assert torch.equal(sample(logits, [greedy] * 16, [None] * 16, [empty] * 16),
                       logits.argmax(-1))
    params = [greedy if i % 2 else SamplingParams(temperature=1.0, seed=i) for i in range(16)]
    gens = [make_generator(p, CPU) for p in params]
    out = sample(logits, params, gens, [empty] * 16)
    assert torch.equal(out[1::2], logits[1::2].argmax(-1))
    assert make_generator(greedy, CPU) is None


def test_greedy_with_repetition_penalty_is_argmax_of_the_penalised_logits():
    logits = torch.tensor([[2.0, 1.9, -0.5, -0.45, 0.1]])
    history = torch.tensor([0, 3])  # penalise the best positive and a negative logit
    p = SamplingParams(repetition_penalty=1.2)
    want = RepetitionPenaltyLogitsProcessor(1.2)(history[None], logits.clone()).argmax(-1)
    got = sample(logits, [p], [None], [history])
    assert got.tolist() == want.tolist() == [1]


def test_seeded_generators_reproduce_whatever_the_batch():
    logits = spread_logits(seed=4)
    p = SamplingParams(temperature=1.0, top_p=0.95, seed=123)

    def run(batch_with: int) -> list[int]:
        gens = [make_generator(p, CPU)] + [
            make_generator(SamplingParams(temperature=1.0, seed=1000 + j), CPU)
            for j in range(batch_with)]
        params = [p] + [SamplingParams(temperature=1.0)] * batch_with
        others = torch.randn(batch_with, V)
        rows = torch.cat([logits[None], others])
        return [int(sample(rows, params, gens, [HISTORY] * (1 + batch_with))[0])
                for _ in range(40)]

    alone = run(0)
    assert run(3) == alone and run(7) == alone
    other_seed = SamplingParams(temperature=1.0, top_p=0.95, seed=124)
    g = make_generator(other_seed, CPU)
    assert [int(sample(logits[None], [other_seed], [g], [HISTORY])[0])
            for _ in range(40)] != alone


def test_an_unseeded_generator_leaves_the_global_rng_alone():
    """Sampling without a seed must not reseed torch's global generator (a user's
    torch.manual_seed elsewhere would silently stop reproducing)."""
    torch.manual_seed(0)
    want = torch.rand(4)
    torch.manual_seed(0)
    make_generator(SamplingParams(temperature=1.0), CPU)
    assert torch.equal(torch.rand(4), want)


def test_seeded_sampling_through_the_runtime_reproduces_beside_other_requests():
    module = tiny_llama(seed=6)
    prompt = [5, 9, 2, 40]
    seeded = SamplingParams(max_tokens=12, temperature=1.0, top_k=20, seed=77)
    with Runtime(CausalLM(module, engine=KVCacheEngine(page_size=4, num_pages=64))) as rt:
        alone = rt.submit({"prompt": prompt, "params": seeded}).result(timeout=30)["token"]
        crowd = [rt.submit({"prompt": [i, i + 1], "params": dict(max_tokens=12, temperature=1.5)})
                 for i in range(4)]
        again = rt.submit({"prompt": prompt, "params": seeded})
        crowd += [rt.submit({"prompt": [i + 7], "params": dict(max_tokens=8, temperature=0.5,
                                                                seed=i)}) for i in range(3)]
        assert again.result(timeout=30)["token"] == alone
        for h in crowd:
            h.result(timeout=30)
        # top_k=1 samples the argmax, whatever the temperature
        greedy = rt.submit({"prompt": prompt, "params": SamplingParams(max_tokens=12)})
        top1 = rt.submit({"prompt": prompt, "params": SamplingParams(
            max_tokens=12, temperature=3.0, top_k=1, seed=1)})
        assert top1.result(timeout=30)["token"] == greedy.result(timeout=30)["token"]


@pytest.mark.parametrize("field,value,needs", [
    ("max_tokens", 0, ">= 1"), ("temperature", -0.5, ">= 0"), ("top_k", -1, ">= 0"),
    ("top_p", 0.0, "0 < top_p <= 1"), ("top_p", 1.5, "0 < top_p <= 1"),
    ("repetition_penalty", 0.0, "> 0"),
    # each of these failed inside a batch step (or was silently changed) before
    ("max_tokens", 2.5, "an integer >= 1"), ("max_tokens", "3", "an integer >= 1"),
    ("max_tokens", True, "an integer >= 1"), ("temperature", float("nan"), ">= 0"),
    ("top_p", float("nan"), "0 < top_p"), ("seed", 2**70, "an integer in"),
    ("seed", 1.5, "an integer in"), ("stop_token_ids", 5, "a tuple of token ids"),
    ("stop_token_ids", (1, -3), "a tuple of token ids"), ("ignore_eos", "yes", "true or false")])
def test_sampling_params_errors_name_the_field(field, value, needs):
    with pytest.raises(ValueError) as e:
        SamplingParams(**{field: value})
    assert f"{field}={value!r}" in str(e.value) and needs in str(e.value)


def test_sampling_params_report_every_bad_field_and_submit_rejects_them():
    with pytest.raises(ValueError) as e:
        SamplingParams(max_tokens=-2, top_k=-3)
    assert "max_tokens=-2" in str(e.value) and "top_k=-3" in str(e.value)
    module = tiny_llama(vocab=32, hidden=16, layers=1, heads=2, kv_heads=1)
    with Runtime(CausalLM(module, engine=KVCacheEngine(page_size=4, num_pages=16))) as rt:
        with pytest.raises(ValueError, match="top_p=2"):
            rt.submit({"prompt": [1, 2], "params": {"top_p": 2}})
        with pytest.raises(TypeError, match="topp"):
            rt.submit({"prompt": [1, 2], "params": {"topp": 0.5}})
        with pytest.raises(ValueError, match=r"stop_token_ids \[40\] lie outside the "
                                             r"vocabulary \[0, 32\)"):
            rt.submit({"prompt": [1, 2], "params": {"stop_token_ids": [3, 40]}})
        for prompt, error, words in [
                ([1.7, 2.9], TypeError, "must be integers, got float"),
                ([True, False], TypeError, "must be integers, got bool"),
                ([[1, 2], [3, 4]], ValueError, r"1-D token ids, got shape \[2, 2\]"),
                ("hello", TypeError, "not str; tokenize text first"),
                (None, TypeError, "not NoneType")]:
            with pytest.raises(error, match=words):
                rt.submit({"prompt": prompt})
        assert rt.live["requests"] == 0
        # a list of stop ids is the tuple, and works
        out = rt.submit({"prompt": [1, 2], "params": {"stop_token_ids": [0, 1, 2, 3, 4, 5, 6, 7,
                         8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25,
                         26, 27, 28, 29, 30, 31], "max_tokens": 5}}).result(timeout=30)
        assert len(out["token"]) == 1  # whatever came first stopped it


def test_a_request_failing_its_stop_check_leaves_its_batch_mates_tokens_as_alone(monkeypatch):
    """The step's forward ran for all; a stop check raising for one request used to re-run the
    whole step item by item, so the others appended and sampled twice (tokens unlike alone)."""
    lm = CausalLM(tiny_llama(seed=6), engine=KVCacheEngine(page_size=16, num_pages=128))
    good = [{"prompt": [1, 2, 3 + i], "params": SamplingParams(
        max_tokens=12, temperature=0.8, seed=i, ignore_eos=True)} for i in range(3)]
    check_stop = type(lm.lm).check_stop

    def failing(self, works, outputs):
        if any(w.payload[1]["history"][0] == 7 for w in works):
            raise RuntimeError("stop check failed on purpose")
        return check_stop(self, works, outputs)

    with Runtime(lm) as rt:
        alone = [rt.submit(g).result(timeout=60)["token"] for g in good]
        monkeypatch.setattr(type(lm.lm), "check_stop", failing)
        bad = {"prompt": [7, 8, 9], "params": SamplingParams(max_tokens=12, ignore_eos=True)}
        handles = [rt.submit(g) for g in good[:2]] + [rt.submit(bad)] + [rt.submit(good[2])]
        with pytest.raises(Exception, match="stop check failed on purpose"):
            handles[2].result(timeout=60)
        together = [h.result(timeout=60)["token"] for h in handles[:2] + handles[3:]]
        assert together == alone
        assert rt.live["requests"] == 0

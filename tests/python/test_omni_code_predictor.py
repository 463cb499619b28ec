"""Qwen3-Omni's code predictor against transformers' ``talker.code_predictor``: greedy codes
equal ``generate``'s, the frame embedding equals the sum the talker feeds itself, the stepwise
API equals ``predict``, rows from different requests batched at the same step equal each run
alone (greedy and seeded sampling), parameter names are the checkpoint's, and errors name what
was wrong."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from mstar_rt.engines.sampling import SamplingParams  # noqa: E402
from mstar_rt.models.qwen3_omni.code_predictor import (PREDICTOR_SAMPLING,  # noqa: E402
                                                       CodePredictor, PredictorState)

import omni_tiny  # noqa: E402

PREFIX = "talker.code_predictor."
HIDDEN = 24

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conftest.py


def _sharpen(m):
    """Matrices scaled up (std 0.02 -> 0.16): attention sharp and logits decisive, so a slip
    changes codes instead of hiding in near-uniform distributions."""
    with torch.no_grad():
        for p in m.talker.code_predictor.parameters():
            if p.dim() >= 2:
                p.mul_(8.0)
    return m


@pytest.fixture(scope="module", params=[4, 7], ids=["G4", "G7"])
def hf(request):
    return _sharpen(omni_tiny.model(groups=request.param))


@pytest.fixture(scope="module")
def predictor(hf) -> CodePredictor:
    ours = CodePredictor.from_hf(hf.config.talker_config.code_predictor_config.to_dict())
    ours.load_state_dict(hf.talker.code_predictor.state_dict(), strict=True)
    return ours.eval()


def inputs(batch: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, HIDDEN, generator=g), torch.randn(batch, HIDDEN, generator=g)


def hf_generate(hf, past_hidden, code0_embed):
    groups = hf.config.talker_config.num_code_groups
    with torch.no_grad():
        return hf.talker.code_predictor.generate(
            inputs_embeds=torch.stack([past_hidden, code0_embed], dim=1),
            max_new_tokens=groups - 1, do_sample=False, output_hidden_states=True,
            return_dict_in_generate=True)


def test_greedy_codes_equal_transformers(hf, predictor):
    past_hidden, code0_embed = inputs(3)
    theirs = hf_generate(hf, past_hidden, code0_embed).sequences
    ours = predictor.predict(past_hidden, code0_embed)
    assert ours.shape == (3, predictor.groups - 1)
    assert torch.equal(ours, theirs)
    assert len(set(map(tuple, ours.tolist()))) == 3  # rows differ: a real test of batching


@pytest.mark.filterwarnings("ignore:Passing `repetition_penalty`")
def test_greedy_with_repetition_penalty_equals_transformers(hf, predictor):
    """The penalty reads the frame's codes so far, as ``generate`` from embeddings does."""
    past_hidden, code0_embed = inputs(3, seed=4)
    groups = predictor.groups
    with torch.no_grad():
        theirs = hf.talker.code_predictor.generate(
            inputs_embeds=torch.stack([past_hidden, code0_embed], dim=1),
            max_new_tokens=groups - 1, do_sample=False, repetition_penalty=3.0)
    ours = predictor.predict(past_hidden, code0_embed, SamplingParams(repetition_penalty=3.0))
    assert torch.equal(ours, theirs)
    if groups == 7:  # long enough for a repeat: the penalty changes something
        assert not torch.equal(ours, predictor.predict(past_hidden, code0_embed))


def test_frame_embedding_equals_the_talkers_sum(hf, predictor):
    """What transformers' talker ``prepare_inputs_for_generation`` feeds itself next."""
    past_hidden, code0_embed = inputs(3, seed=1)
    result = hf_generate(hf, past_hidden, code0_embed)
    middle = [h[0] for h in result.hidden_states[1:]]
    last = hf.talker.code_predictor.get_input_embeddings()[-1](result.sequences[..., -1:])
    with torch.no_grad():
        theirs = torch.cat([code0_embed[:, None], *middle, last], dim=1).sum(1)
        ours = predictor.frame_embedding(code0_embed, result.sequences)
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)


def test_steps_equal_predict(predictor):
    past_hidden, code0_embed = inputs(3, seed=2)
    state = predictor.start(past_hidden, code0_embed)
    stepped = [predictor.step(state, j) for j in range(1, predictor.groups)]
    assert state.done
    assert torch.equal(torch.stack(stepped, dim=1), state.codes)
    assert torch.equal(state.codes, predictor.predict(past_hidden, code0_embed))


@pytest.mark.parametrize("sampling", [None, PREDICTOR_SAMPLING], ids=["greedy", "sampled"])
def test_rows_of_different_requests_batched_equal_each_alone(predictor, sampling):
    """Three requests, regrouped at every step the way a loop node batches whoever reached it;
    seeded sampling keeps each request's generator in its own state row."""
    requests = [inputs(1, seed=10 + r) for r in range(3)]
    params = [None if sampling is None else SamplingParams(
        temperature=1.0, top_k=sampling.top_k, top_p=sampling.top_p, seed=100 + r)
        for r in range(3)]
    alone = [predictor.predict(h, e, p) for (h, e), p in zip(requests, params)]
    states = [predictor.start(h, e, p) for (h, e), p in zip(requests, params)]
    groupings = [[[0, 1], [2]], [[2, 0], [1]], [[0, 1, 2]]]
    for j in range(1, predictor.groups):
        for group in groupings[(j - 1) % len(groupings)]:
            batch = PredictorState.stack([states[r] for r in group])
            predictor.step(batch, j)
            for r, row in zip(group, batch.split()):
                states[r] = row
    for state, expected in zip(states, alone):
        assert torch.equal(state.codes, expected)
    assert all(0 <= c < omni_tiny.CODEBOOK for s in states for c in s.codes.flatten().tolist())


def test_seeded_sampling_repeats_and_differs_from_greedy(predictor):
    past_hidden, code0_embed = inputs(4, seed=3)
    seeded = SamplingParams(temperature=1.5, seed=7)
    first = predictor.predict(past_hidden, code0_embed, seeded)
    assert torch.equal(first, predictor.predict(past_hidden, code0_embed, seeded))
    assert not torch.equal(first, predictor.predict(past_hidden, code0_embed))


def test_misuse_is_an_error_that_says_what(predictor):
    past_hidden, code0_embed = inputs(2)
    state = predictor.start(past_hidden, code0_embed)
    with pytest.raises(ValueError, match="step 2 .* next step is 1"):
        predictor.step(state, 2)
    other = predictor.start(past_hidden, code0_embed)
    predictor.step(other, 1)
    with pytest.raises(ValueError, match="same step"):
        PredictorState.stack([state, other])
    with pytest.raises(ValueError, match=r"\[batch, 24\]"):
        predictor.start(past_hidden[:, :8], code0_embed)
    with pytest.raises(ValueError, match="2 SamplingParams for 3 rows"):
        predictor.start(*inputs(3), [SamplingParams()] * 2)
    with pytest.raises(ValueError, match="frame_embedding"):
        predictor.frame_embedding(code0_embed, torch.zeros(2, 1, dtype=torch.long))


def test_parameter_names_are_the_checkpoints(hf, predictor, tmp_path):
    from safetensors import safe_open

    omni_tiny.save(hf, str(tmp_path))
    keys = set()
    for f in tmp_path.glob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            keys |= {k[len(PREFIX):] for k in st.keys() if k.startswith(PREFIX)}
    assert keys == set(predictor.state_dict())


def test_built_on_meta_then_loaded_matches(hf, predictor):
    """The loader's path: build on meta, ``to_empty``, load, ``init_buffers``."""
    with torch.device("meta"):
        ours = CodePredictor.from_hf(hf.config.talker_config.code_predictor_config.to_dict())
    ours = ours.to_empty(device="cpu")
    ours.load_state_dict(predictor.state_dict(), strict=True)
    ours.init_buffers()
    past_hidden, code0_embed = inputs(3)
    assert torch.equal(ours.eval().predict(past_hidden, code0_embed),
                       predictor.predict(past_hidden, code0_embed))


@pytest.mark.parametrize("change, field", [
    (dict(hidden_act="gelu"), "hidden_act"),
    (dict(num_key_value_heads=3), "num_attention_heads"),
    (dict(num_code_groups=1), "num_code_groups"),
    (dict(vocab_size=None), "vocab_size"),
    (dict(sliding_window=2, layer_types=["sliding_attention"] * 2), "sliding_window"),
    (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4}), "rope"),
])
def test_config_errors_name_the_field(hf, change, field):
    config = {**hf.config.talker_config.code_predictor_config.to_dict(), **change}
    with pytest.raises(ValueError, match=field):
        CodePredictor.from_hf(config)

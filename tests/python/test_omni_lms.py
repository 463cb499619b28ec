"""Qwen3-Omni's thinker and talker language models against transformers, run through our paged
KV cache the way the KV engine runs them: ragged steps that mix one request's prefill with other
requests' single-token decodes, over 4-token pages. Also: interleaved MRoPE with equal axes is
1-D RoPE (what lets us drop the three position axes for text and audio), a text+audio prompt
gets sequential positions in transformers, and the config reader's errors name the field."""

from __future__ import annotations

import re
from typing import Callable

import pytest
import torch
from torch.nn import functional as F

pytest.importorskip("transformers")

from mstar_rt.engines.attention_base import SeqStep  # noqa: E402
from mstar_rt.engines.kv_engine import KVStep  # noqa: E402
from mstar_rt.engines.paged_kv import PagedKVCache  # noqa: E402
from mstar_rt.engines.torch_backend import TorchAttention  # noqa: E402
from mstar_rt.models.qwen3_omni import moe as moe_module  # noqa: E402
from mstar_rt.models.qwen3_omni.moe import SparseMoE  # noqa: E402
from mstar_rt.models.qwen3_omni.talker import TalkerLM  # noqa: E402
from mstar_rt.models.qwen3_omni.text_lm import TextLMConfig  # noqa: E402
from mstar_rt.models.qwen3_omni.thinker import ThinkerLM  # noqa: E402

import omni_tiny  # noqa: E402

TOL = 1e-4  # float32 against transformers
# (request, new tokens) per step: request 2 prefills while 0 and 1 decode, then all decode.
SCHEDULE = [[(0, 7), (1, 3)], [(0, 1), (1, 1), (2, 12)]] + [[(0, 1), (1, 1), (2, 1)]] * 4
LENGTHS = {0: 12, 1: 8, 2: 16}


@pytest.fixture(scope="module")
def hf():
    """The tiny model with its matrices scaled up (std 0.02 -> 0.16), so that attention is
    sharp, routing decisive and any slip moves outputs far beyond TOL."""
    m = omni_tiny.model()
    with torch.no_grad():
        for name, p in m.named_parameters():
            if p.dim() >= 2 and name.startswith(("thinker.model.language_model", "thinker.lm",
                                                 "talker.")):
                p.mul_(8.0)
    return m


def thinker_from(hf) -> ThinkerLM:
    cfg = hf.config.thinker_config
    ours = ThinkerLM(TextLMConfig.from_hf(cfg.text_config.to_dict(), "thinker text_config",
                                          tie_word_embeddings=cfg.tie_word_embeddings))
    state = {k.replace("model.language_model.", "model."): v
             for k, v in hf.thinker.state_dict().items()
             if not k.startswith(("model.audio_tower.", "model.visual."))}
    ours.load_state_dict(state, strict=True)
    ours.init_buffers()
    return ours.eval()


def talker_from(hf) -> TalkerLM:
    cfg = hf.config.talker_config
    ours = TalkerLM(TextLMConfig.from_hf(cfg.text_config.to_dict(), "talker text_config",
                                         talker=True, tie_word_embeddings=cfg.tie_word_embeddings),
                    cfg.thinker_hidden_size)
    state = {k: v for k, v in hf.talker.state_dict().items()
             if not k.startswith("code_predictor.")}
    ours.load_state_dict(state, strict=True)
    ours.init_buffers()
    return ours.eval()


@torch.no_grad()
def run_paged(module, inputs: dict[int, torch.Tensor],
              fn: Callable[[torch.Tensor, KVStep], tuple], page_size: int = 4
              ) -> list[list[torch.Tensor]]:
    """Feeds ``inputs`` (per request: ids [L] or embeds [L, H]) step by step by SCHEDULE
    through a fresh paged cache; returns, per output of ``fn``, each request's rows in order."""
    cache = PagedKVCache(module.kv_layout(), page_size, 64)
    backend = TorchAttention(cache)
    done = {r: 0 for r in inputs}
    rows: dict[int, list[list[torch.Tensor]]] = {r: [] for r in inputs}
    for works in SCHEDULE:
        steps, xs = [], []
        for r, n in works:
            seq = cache.admit(r, "main", n)
            steps.append(SeqStep(seq.length, n, list(seq.pages)))
            xs.append(inputs[r][done[r]:done[r] + n])
        outs = fn(torch.cat(xs), KVStep(backend, steps))
        off = 0
        for r, n in works:
            rows[r].append([o[off:off + n] for o in outs])
            cache.commit(r, "main", n)
            done[r] += n
            off += n
    assert done == LENGTHS
    assert cache.sequence(2, "main").length == 16 and len(cache.sequence(2, "main").pages) == 4
    return [[torch.cat([step[i] for step in rows[r]]) for r in sorted(inputs)]
            for i in range(len(rows[0][0]))]


def prompts(vocab: int, seed: int = 3) -> dict[int, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {r: torch.randint(0, vocab, (n,), generator=g) for r, n in LENGTHS.items()}


def diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a - b).abs().max().item()


# ---- the thinker --------------------------------------------------------------------------------

@pytest.mark.parametrize("k", [0, 1, 2, 3])  # 3 layers: 0 = embeddings, 3 = normed output
def test_thinker_logits_and_layer_hidden_match_transformers(hf, k):
    ours = thinker_from(hf)
    ids = prompts(omni_tiny.THINKER_VOCAB)

    def step_fn(x: torch.Tensor, step: KVStep) -> tuple:
        final, at_k = ours(x, step, hidden_layer=k)
        return ours.logits(final), at_k

    logits, at_k = run_paged(ours, ids, step_fn)
    for r, seq in ids.items():
        with torch.no_grad():
            ref = hf.thinker(input_ids=seq[None], output_hidden_states=True)
        assert diff(logits[r], ref.logits[0]) < TOL, f"request {r}: logits"
        assert diff(at_k[r], ref.hidden_states[k][0]) < TOL, f"request {r}: hidden_states[{k}]"
    assert ref.logits.abs().max() > 1.0, "logits too small for the tolerance to mean anything"


def test_thinker_takes_embeds_and_no_hidden_layer(hf):
    ours = thinker_from(hf)
    ids = prompts(omni_tiny.THINKER_VOCAB, seed=4)
    by_ids = run_paged(ours, ids, lambda x, step: ours(x, step)[:1])[0]
    embeds = {r: ours.embed(s).detach() for r, s in ids.items()}

    def from_embeds(x: torch.Tensor, step: KVStep) -> tuple:
        final, at_k = ours(None, step, embeds=x)
        assert at_k is None, "hidden_layer=None must give None"
        return (final,)

    by_embeds = run_paged(ours, embeds, from_embeds)[0]
    for r in ids:
        assert torch.equal(by_ids[r], by_embeds[r])
    with pytest.raises(ValueError, match="exactly one"):
        ours(ids[0], None, embeds=embeds[0])
    with pytest.raises(ValueError, match=r"hidden_layer 4 is not in \[0, 3\]"):
        run_paged(ours, ids, lambda x, step: ours(x, step, hidden_layer=4))


def test_audio_prompt_positions_are_sequential_so_embeds_give_hfs_logits(hf):
    """transformers' thinker on a prompt with audio: the language model gets positions equal on
    all three axes and sequential, so feeding its input embeddings to our 1-D-RoPE thinker
    reproduces its logits and the accepted layer's hidden states."""
    prompt = torch.tensor(omni_tiny.chat_prompt([72, 105], audio_frames=120))
    features = omni_tiny.mel(120)
    seen: dict[str, torch.Tensor] = {}

    def grab(_module, args, kwargs):
        seen["embeds"] = kwargs["inputs_embeds"][0].detach().clone()
        seen["positions"] = kwargs["position_ids"].detach().clone()

    lm = hf.thinker.model.language_model
    handle = lm.register_forward_pre_hook(grab, with_kwargs=True)
    try:
        with torch.no_grad():
            ref = hf.thinker(input_ids=prompt[None], input_features=features[None],
                             feature_attention_mask=torch.ones(1, 120, dtype=torch.long),
                             attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             output_hidden_states=True)
    finally:
        handle.remove()
    pos = seen["positions"]
    axes = pos[-3:, 0]  # [3, T] (a leading text axis, when present, is dropped)
    assert torch.equal(axes, torch.arange(len(prompt)).expand(3, -1))
    ours = thinker_from(hf)
    cache = PagedKVCache(ours.kv_layout(), 4, 64)
    backend = TorchAttention(cache)
    seq = cache.admit(0, "main", len(prompt))
    step = KVStep(backend, [SeqStep(0, len(prompt), list(seq.pages))])
    k = hf.config.talker_config.accept_hidden_layer
    with torch.no_grad():
        final, at_k = ours(None, step, embeds=seen["embeds"], hidden_layer=k)
        assert diff(ours.logits(final), ref.logits[0]) < TOL
    assert diff(at_k, ref.hidden_states[k][0]) < TOL


# ---- the talker ---------------------------------------------------------------------------------

def talker_inputs(hf, seed: int = 5) -> dict[int, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    width = hf.config.talker_config.text_config.hidden_size
    return {r: torch.randn(n, width, generator=g) for r, n in LENGTHS.items()}


def test_talker_hidden_and_logits_match_transformers(hf):
    ours = talker_from(hf)
    embeds = talker_inputs(hf)

    def step_fn(x: torch.Tensor, step: KVStep) -> tuple:
        hidden = ours(x, step)
        return hidden, ours.logits(hidden)

    hidden, logits = run_paged(ours, embeds, step_fn)
    for r, x in embeds.items():
        with torch.no_grad():
            ref = hf.talker.model(inputs_embeds=x[None]).last_hidden_state[0]
            assert diff(hidden[r], ref) < TOL, f"request {r}: hidden"
            assert diff(logits[r], hf.talker.codec_head(ref)) < TOL, f"request {r}: logits"
    assert ours.config.norm_topk_prob is False and ours.config.shared_expert_intermediate_size


def test_talker_projections_and_codec_embedding_match_transformers(hf):
    ours = talker_from(hf)
    g = torch.Generator().manual_seed(6)
    x = torch.randn(9, hf.config.talker_config.thinker_hidden_size, generator=g)
    codes = torch.randint(0, omni_tiny.TALKER_VOCAB, (9,), generator=g)
    with torch.no_grad():
        assert diff(ours.text_projection(x), hf.talker.text_projection(x)) < TOL
        assert diff(ours.hidden_projection(x), hf.talker.hidden_projection(x)) < TOL
        assert torch.equal(ours.embed(codes), hf.talker.model.codec_embedding(codes))
        assert diff(ours.text_projection(x), ours.hidden_projection(x)) > 1e-2


# ---- the MoE block ------------------------------------------------------------------------------

def naive_moe(moe: SparseMoE, x: torch.Tensor) -> torch.Tensor:
    """Token by token, expert by expert: the definition the fused dispatch must equal."""
    experts, weights = moe.route(x)
    e = moe.experts
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(experts.shape[1]):
            gate, up = (e.gate_up_proj[experts[t, j]] @ x[t]).chunk(2)
            out[t] += weights[t, j] * (e.down_proj[experts[t, j]] @ (F.silu(gate) * up))
    if moe.shared_expert is not None:
        out += torch.sigmoid(moe.shared_expert_gate(x)) * moe.shared_expert(x)
    return out


@pytest.mark.parametrize("shared, norm", [(0, True), (16, False)])
@pytest.mark.parametrize("tokens", [1, 3, 37])  # 3 tokens leave some of the 8 experts idle
def test_moe_dispatch_equals_per_token_experts(shared, norm, tokens, monkeypatch):
    torch.manual_seed(tokens)
    moe = SparseMoE(32, 8, 2, 16, norm, shared)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
        x = torch.randn(tokens, 32)
        assert diff(moe(x), naive_moe(moe, x)) < 1e-5
        ours = moe(x)
        # torch's grouped GEMM (the CUDA bf16 path) computes the same on the CPU
        monkeypatch.setattr(moe_module, "_grouped_mm_fits", lambda xs, w: True)
        assert diff(moe(x), ours) < 1e-5


# ---- the check can fail -------------------------------------------------------------------------

def test_router_normalisation_flag_matters(hf):
    """Flipping ``norm_topk_prob`` in our thinker moves the logits far past TOL: the parity
    tests above do see the router's weights."""
    ours = thinker_from(hf)
    ids = prompts(omni_tiny.THINKER_VOCAB, seed=7)
    first = run_paged(ours, ids, lambda x, s: (ours.logits(ours(x, s)[0]),))[0]
    for m in ours.modules():
        if isinstance(m, SparseMoE):
            m.norm_topk_prob = not m.norm_topk_prob
    flipped = run_paged(ours, ids, lambda x, s: (ours.logits(ours(x, s)[0]),))[0]
    assert max(diff(a, b) for a, b in zip(first, flipped)) > 1e-2


def test_interleaved_mrope_with_equal_axes_is_1d_rope(hf):
    ours = thinker_from(hf)
    rotary = hf.thinker.model.language_model.rotary_emb
    assert list(rotary.mrope_section) == [2, 1, 1]
    pos = torch.arange(40)
    x = torch.zeros(1, 40, 8)
    cos, sin = ours.model.rotary.tables(pos, torch.float32)  # [T, 1, D]
    hf_cos, hf_sin = rotary(x, pos.view(1, 1, -1).expand(3, 1, -1))  # [1, T, D]
    assert diff(cos[:, 0], hf_cos[0]) < 1e-6 and diff(sin[:, 0], hf_sin[0]) < 1e-6
    # Vision-style positions (axes differ) are not 1-D RoPE: why vision is unsupported.
    grid = torch.stack([pos, pos // 4, pos % 4]).view(3, 1, -1)
    hf_cos, _ = rotary(x, grid)
    assert diff(cos[:, 0], hf_cos[0]) > 0.1


# ---- config errors ------------------------------------------------------------------------------

def test_config_errors_name_the_field(hf):
    text = hf.config.thinker_config.text_config.to_dict()
    talker = hf.config.talker_config.text_config.to_dict()
    cases: list[tuple[dict, bool, str]] = [
        ({**text, "hidden_act": "gelu"}, False, "'hidden_act'"),
        ({k: v for k, v in text.items() if k != "moe_intermediate_size"}, False,
         "'moe_intermediate_size'"),
        ({**text, "num_key_value_heads": 3}, False, "'num_attention_heads'"),
        ({**text, "mlp_only_layers": [7]}, False, "'mlp_only_layers'"),
        ({**text, "num_experts_per_tok": 9}, False, "'num_experts_per_tok'"),
        ({k: v for k, v in talker.items() if k != "shared_expert_intermediate_size"}, True,
         "'shared_expert_intermediate_size'"),
        ({**text, "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}}, False, "yarn"),
    ]
    for config, is_talker, field in cases:
        with pytest.raises(ValueError, match=re.escape(field)) as err:
            TextLMConfig.from_hf(config, "the test config", talker=is_talker)
        assert "the test config" in str(err.value)


def test_dense_layers_follow_mlp_only_layers_and_sparse_step(hf):
    text = hf.config.thinker_config.text_config.to_dict()
    c = TextLMConfig.from_hf({**text, "mlp_only_layers": [0], "decoder_sparse_step": 2}, "t")
    assert c.dense_layers == (0, 2)  # 0 listed; 2 since (2 + 1) % 2 != 0
    lm = ThinkerLM(c)
    kinds = [type(layer.mlp).__name__ for layer in lm.model.layers]
    assert kinds == ["SwiGLU", "SparseMoE", "SwiGLU"]
    # the talker ignores both, as transformers does
    talker = hf.config.talker_config.text_config.to_dict()
    c = TextLMConfig.from_hf({**talker, "mlp_only_layers": [0]}, "t", talker=True)
    assert c.dense_layers == ()
    # the mrope spelling of the rope type is plain rope
    mrope = {**text, "rope_parameters": {"type": "mrope", "rope_theta": 500.0,
                                         "mrope_section": [2, 1, 1]}}
    assert TextLMConfig.from_hf(mrope, "t").rope.theta == 500.0

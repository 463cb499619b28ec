"""What a voice-agent builder sends CausalLM and OrpheusTTS directly: a temperature or top_p too
small for float32 samples the top token (it failed the batch step on NaN probabilities), prompt
ids that are not integers are refused by name, NumPy scalars are taken as sampling parameters,
and the TTS refuses blank text and voices the model does not know. Every refused request leaves
every KV page free and the runtime serving the next request."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from mstar_rt.engines import KVCacheEngine, SamplingParams  # noqa: E402
from mstar_rt.models.causal_lm import CausalLM  # noqa: E402
from mstar_rt.models.orpheus import ORPHEUS_FT_VOICES, OrpheusTTS  # noqa: E402

from llama_ref import make_hf  # noqa: E402
from walk_models import ZERO_LIVE, settled, wait_until  # noqa: E402

T = 60.0  # the longest any single wait may take
PROMPT = [1, 2, 3, 4, 5]

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conftest.py


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    make_hf("gqa").save_pretrained(path)
    return path


@pytest.fixture
def lm_rt(llama_dir, serve):
    lm = CausalLM.from_pretrained(llama_dir, progress=False,
                                  engine=KVCacheEngine(page_size=4, num_pages=64))
    return serve(lm)


def all_pages_free(rt) -> bool:
    cache = rt.engines["lm"].cache
    return wait_until(lambda: cache.free_pages == cache.num_pages, T)


def tokens(rt, **params) -> list[int]:
    return rt.submit({"prompt": PROMPT, "params": SamplingParams(**params)}).result(T)["token"]


# ---- sampling parameters ------------------------------------------------------------------------

def test_a_temperature_or_top_p_below_float32_samples_the_top_token(lm_rt):
    greedy = tokens(lm_rt, max_tokens=6)
    mate = dict(max_tokens=6, temperature=1.0, seed=11)
    alone = tokens(lm_rt, **mate)
    tiny = [dict(max_tokens=6, temperature=t, seed=1) for t in (1e-38, 1e-40, 5e-324)]
    tiny.append(dict(max_tokens=6, temperature=1.0, top_p=5e-324, seed=1))
    handles = [lm_rt.submit({"prompt": PROMPT, "params": SamplingParams(**p)})
               for p in tiny + [mate]]
    got = [h.result(T)["token"] for h in handles]  # failed: probabilities with NaN
    assert got[:-1] == [greedy] * len(tiny)
    assert got[-1] == alone, "a batch-mate's seeded tokens moved"
    huge = tokens(lm_rt, max_tokens=6, temperature=1e300, seed=2)  # float32 inf: uniform
    assert len(huge) == 6 and huge != greedy
    assert all_pages_free(lm_rt)


def test_numpy_scalars_are_taken_as_sampling_parameters(lm_rt):
    p = SamplingParams(max_tokens=np.int64(4), temperature=np.float32(0.5), top_k=np.int32(7),
                       top_p=np.float16(0.5), seed=np.uint64(3))  # refused: "needs an integer"
    assert type(p.max_tokens) is int and type(p.temperature) is float and type(p.seed) is int
    json.dumps(dataclasses.asdict(p))  # a disaggregated decode's handoff carries them
    assert tokens(lm_rt, **dataclasses.asdict(p)) == tokens(lm_rt, **dataclasses.asdict(p))
    with pytest.raises(ValueError, match="top_k=np.float64\\(2.0\\) \\(needs an integer"):
        SamplingParams(top_k=np.float64(2.0))  # not truncated
    with pytest.raises(ValueError, match="max_tokens=0"):
        SamplingParams(max_tokens=np.int64(0))


def test_a_misspelt_sampling_parameter_is_refused_naming_the_fields(lm_rt):
    # was Python's "unexpected keyword argument 'temprature'", naming no field it takes
    with pytest.raises(TypeError, match=r"params \['temprature'\] are not sampling parameters; "
                                        r"the fields are \[.*'temperature'"):
        lm_rt.submit({"prompt": [1, 2], "params": {"max_tokens": 2, "temprature": 0.5}})
    assert settled(lm_rt, T) == ZERO_LIVE and all_pages_free(lm_rt)


# ---- prompts ------------------------------------------------------------------------------------

@pytest.mark.parametrize("prompt", [[None], ["a"], [1, "2"], (i for i in range(3)), [2**63],
                                    np.array([3, 2**63], dtype=np.uint64), [2**70]],
                         ids=["none", "str", "mixed", "generator", "2**63", "uint64", "bigint"])
def test_prompt_ids_that_are_not_integers_are_refused_by_name(lm_rt, prompt):
    # Before: NumPy's "can't convert np.ndarray of type numpy.object_", or 2**63 wrapped to
    # the negative id -9223372036854775808 in the error.
    with pytest.raises(TypeError, match="prompt token ids must be integers below 2\\*\\*63"):
        lm_rt.submit({"prompt": prompt, "params": {"max_tokens": 2}})
    assert settled(lm_rt, T) == ZERO_LIVE and all_pages_free(lm_rt)
    assert len(tokens(lm_rt, max_tokens=2)) == 2
    ok = np.array([1, 2], dtype=np.uint64)  # small unsigned ids still serve
    assert lm_rt.submit({"prompt": ok, "params": {"max_tokens": 1}}).result(T)["token"]


# ---- the TTS ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tts() -> OrpheusTTS:
    return OrpheusTTS.tiny(0, constrain_codes=True, voices=ORPHEUS_FT_VOICES,
                           engine=KVCacheEngine(page_size=16, num_pages=32))


SPEAK = SamplingParams(max_tokens=28, seed=1)


def test_blank_text_or_an_empty_prompt_is_refused(tts, serve):
    rt = serve(tts)
    for text in ("", "  \n\t "):  # spoke 28 tokens of babble from the bare prompt
        with pytest.raises(ValueError, match="'text' is empty or only whitespace"):
            rt.submit({"text": text, "params": SPEAK})
    with pytest.raises(ValueError, match="'prompt' is empty"):
        rt.submit({"prompt": [], "params": SPEAK})
    emoji = rt.submit({"text": "\U0001F600\U0001F389", "params": SPEAK}).result(T)
    assert len(emoji["token"]) == 28 and sum(map(len, emoji["audio"])) > 0
    assert settled(rt, T) == ZERO_LIVE and all_pages_free(rt)


def test_a_voice_the_model_does_not_know_is_refused_naming_its_voices(tts, serve):
    assert tts.voices == ORPHEUS_FT_VOICES  # what a serving deployment offers
    rt = serve(tts)
    with pytest.raises(ValueError, match="unknown voice 'Tara': this model speaks \\['tara'"):
        rt.submit({"text": "hi", "voice": "Tara", "params": SPEAK})
    for voice in ("tara", None):
        assert len(rt.submit({"text": "hi", "voice": voice, "params": SPEAK}).result(T)
                   ["token"]) == 28
    assert settled(rt, T) == ZERO_LIVE and all_pages_free(rt)
    anyone = OrpheusTTS.tiny(0)  # no voices given: any name is a prefix, as before
    assert anyone.voices == () and anyone.prompt_ids({"text": "hi", "voice": "bob"})
    with pytest.raises(TypeError, match="voices must be a sequence of voice names"):
        OrpheusTTS.tiny(0, voices="tara")


def test_tiny_temperature_speaks_instead_of_failing(tts, serve):
    rt = serve(tts)
    params = dict(max_tokens=14, temperature=1e-40, seed=3)
    got = rt.submit({"text": "hi", "params": params}).result(T)
    greedy = rt.submit({"text": "hi", "params": dict(max_tokens=14)}).result(T)
    assert got["token"] == greedy["token"]
    assert settled(rt, T) == ZERO_LIVE and all_pages_free(rt)

"""Qwen3-Omni code2wav: our module against transformers' (forward, chunked_decode, generate's
waveform) on the tiny random model; the left context that makes a decode of [context + new]
frames exact is exactly what the new samples read; HF's chunked_decode is one-shot decoding only
up to one chunk. Code2WavStreamNode streams through a Runtime under every chunk policy, with
concurrent requests of different lengths, to the one-shot waveform sample for sample, tail
included; empty and one-frame streams; shared decoder calls; retries; bounded state."""

import copy

import threading

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from mstar_rt import (EMIT, DynamicLoop, Fixed, GraphEdge, GraphNode, LeftContext,  # noqa: E402
                      Model, NodeSubmodule, Parallel, Ramp, SlidingWindow, StreamChunk,
                      StreamingGraphEdge)
from mstar_rt.model import RequestContext, WorkContext  # noqa: E402
from mstar_rt.models.qwen3_omni.code2wav import Code2Wav, Code2WavConfig  # noqa: E402
from mstar_rt.models.qwen3_omni.code2wav_stream import (_STATE, Code2WavStreamNode,  # noqa: E402
                                                        decode_one_shot)

import omni_tiny  # noqa: E402
from snac_streams import policy_spans  # noqa: E402
from walk_models import ZERO_LIVE, settled, wait_until  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conftest.py

TOL = 1e-5
T = 30.0  # seconds: the longest any single wait may take
G, SPF, HELD, LEFT = omni_tiny.GROUPS, 24, 15, 2 * 7 + 20  # window 8, two layers; conv reach


@pytest.fixture(scope="module")
def omni():
    """The tiny model; omni_tiny makes its code2wav loud (peaks near 1, not 5e-5)."""
    return omni_tiny.model()


@pytest.fixture(scope="module")
def hf(omni):
    return omni.code2wav


@pytest.fixture(scope="module")
def ours(hf):
    model = Code2Wav.from_hf(hf.config.to_dict())
    model.load_state_dict({k: v.clone() for k, v in hf.state_dict().items()})
    return model.eval()


def frames_of(n: int, seed: int, batch: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, omni_tiny.CODEBOOK, (batch, G, n), generator=g)


def err(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return float((a - b).abs().max()) if a.numel() else 0.0


# ---- the module against transformers -------------------------------------------------------------

def test_parameter_names_are_the_checkpoints_under_code2wav(omni, ours):
    want = {k[len("code2wav."):]: v for k, v in omni.state_dict().items()
            if k.startswith("code2wav.")}
    assert {k: tuple(v.shape) for k, v in ours.state_dict().items()} == \
        {k: tuple(v.shape) for k, v in want.items()}
    Code2Wav.from_hf(omni.config.code2wav_config).load_state_dict(want)  # strict


@pytest.mark.parametrize("frames", [1, 2, 7, 8, 9, 40, 123])
def test_forward_equals_transformers(hf, ours, frames):
    codes = frames_of(frames, seed=frames, batch=2)
    with torch.no_grad():
        want = hf(codes)
    got = ours(codes)
    assert got.shape == want.shape == (2, 1, ours.samples_for(frames))
    assert err(got, want) < TOL and float(want.abs().max()) > 0.05  # loud: TOL means something


@pytest.mark.parametrize("frames,chunk,context", [(40, 300, 25), (50, 16, 5), (61, 10, 3),
                                                  (70, 20, 40)])
def test_chunked_decode_equals_transformers(hf, ours, frames, chunk, context):
    codes = frames_of(frames, seed=100 + frames, batch=2)
    with torch.no_grad():
        want = hf.chunked_decode(codes, chunk_size=chunk, left_context_size=context)
    assert err(ours.chunked_decode(codes, chunk, context), want) < TOL


def test_sizes(hf, ours):
    assert ours.samples_per_frame == int(hf.total_upsample) == SPF
    assert [ours.samples_for(n) for n in (0, 1, 2, 50)] == [0, SPF - HELD, 2 * SPF - HELD,
                                                            50 * SPF - HELD]
    assert ours.held_back_samples == HELD
    codes = frames_of(20, seed=2)
    whole = ours(codes)
    for n in (1, 7, 19):  # prefix-stable: more frames only add samples
        assert err(ours(codes[..., :n]), whole[..., :ours.samples_for(n)]) < TOL
    assert (ours.attention_context_frames, ours.conv_context_frames) == (14, 20)
    assert ours.receptive_field_frames() == (LEFT, 0)
    released = Code2Wav(Code2WavConfig(hidden_size=8, num_attention_heads=2,
                                       num_key_value_heads=1, intermediate_size=8,
                                       decoder_dim=16, num_hidden_layers=2, codebook_size=4))
    assert (released.samples_per_frame, released.held_back_samples) == (1920, 555)
    assert (released.attention_context_frames, released.conv_context_frames) == (142, 10)
    full = Code2WavConfig()  # the released sizes: 8 layers of window 72
    assert full.num_hidden_layers * (full.sliding_window - 1) + 10 == 578


def test_from_hf_names_a_bad_field(hf):
    good = hf.config.to_dict()
    for field, value, words in [("hidden_size", 0, "hidden_size"),
                                ("upsample_rates", [4, "3"], "upsample_rates"),
                                ("num_key_value_heads", 3, "num_key_value_heads"),
                                ("hidden_act", "tanhh", "hidden_act"),
                                ("rope_parameters", {"rope_type": "yarn"}, "rope_type"),
                                ("decoder_dim", 18, "decoder_dim")]:
        with pytest.raises(ValueError, match=words):
            Code2Wav.from_hf({**good, field: value})
    old = {k: v for k, v in good.items() if k != "rope_parameters"}
    assert Code2WavConfig.from_hf({**old, "rope_theta": 500.0}).rope_theta == 500.0


def test_generate_waveform_is_one_shot_decoding_of_its_codes(omni, ours):
    """generate() decodes the talker's codes with chunked_decode(300, 25): under 300 frames,
    one chunk, so one-shot decoding."""
    seen = []
    chunked = omni.code2wav.chunked_decode
    omni.code2wav.chunked_decode = lambda codes, **kw: (seen.append((codes, kw)),
                                                        chunked(codes, **kw))[1]
    try:
        _, wav = omni_tiny.generate(omni, omni_tiny.chat_prompt([72, 105, 33]),
                                    talker_max_new_tokens=24)
    finally:
        del omni.code2wav.chunked_decode
    (codes, kw), = seen
    assert kw == dict(chunk_size=300, left_context_size=25) and 0 < codes.shape[-1] < 300
    assert err(ours(codes).float(), wav) < TOL


# ---- left context and chunked decoding -----------------------------------------------------------

def changed_by(model: Code2Wav, frames: int) -> dict[int, set]:
    """Float64, no clamping: frame a -> the frames g whose codes change a's new samples
    [samples_for(a), samples_for(a + 1)) at all."""
    model = copy.deepcopy(model).double()
    with torch.no_grad():
        model.decoder[-1].conv.weight.mul_(1e-3)  # far from the clamp at +-1
    codes = frames_of(frames, seed=5)
    base = model(codes)[0, 0]
    out: dict[int, set] = {a: set() for a in range(frames)}
    for g in range(frames):
        moved = codes.clone()
        moved[0, 1, g] = (moved[0, 1, g] + 1) % model.config.codebook_size
        diff = model(moved)[0, 0] != base
        for a in range(frames):
            if diff[model.samples_for(a): model.samples_for(a + 1)].any():
                out[a].add(g)
    return out


def test_new_samples_read_exactly_the_left_context(ours):
    for a, read in changed_by(ours, 60).items():
        assert read == set(range(max(0, a - LEFT), a + 1)), a


def test_left_context_holds_for_the_released_rates():
    """Rates 8, 5, 4, 3 after ratios 2, 2 (1920 samples a frame), narrow and shallow."""
    torch.manual_seed(0)
    model = Code2Wav(Code2WavConfig(hidden_size=8, num_attention_heads=2, num_key_value_heads=1,
                                    intermediate_size=8, decoder_dim=16, num_hidden_layers=1,
                                    sliding_window=3, codebook_size=omni_tiny.CODEBOOK,
                                    num_quantizers=G)).eval()
    with torch.no_grad():  # ConvNeXt's gamma starts at 1e-6: reach below float64 rounding
        for name, p in model.named_parameters():
            if name.endswith(("gamma", "scale")):
                p.uniform_(0.5, 1.0)
    left = model.left_context_frames
    assert left == 2 + 10
    for a, read in changed_by(model, 24).items():
        assert read == set(range(max(0, a - left), a + 1)), a


def test_decoding_context_plus_new_frames_is_exact(ours):
    codes = frames_of(90, seed=7)
    whole = ours(codes)[0, 0]
    for a, b in [(40, 41), (50, 67), (LEFT, 90)]:
        errors = []
        for context in (LEFT, 25):
            wav = ours(codes[..., a - context: b])[0, 0]
            new = wav[ours.samples_for(a) - (a - context) * SPF:]
            errors.append(err(new, whole[ours.samples_for(a): ours.samples_for(b)]))
        # one frame less already changes samples (test_new_samples_read_exactly_the_left_context),
        # if only by float32 rounding; HF's 25 frames (of 34 here) by more
        assert errors[0] < TOL and errors[1] > 1e-4, (a, b, errors)


def test_chunked_decode_is_one_shot_only_up_to_one_chunk(ours):
    """Past chunk_size, each chunk boundary b drops one-shot samples [samples_for(b), b * spf)
    (held back for a frame that is in the next chunk); with a context under LEFT the next
    chunk's samples differ too -- HF's 25 frames are short of the released model's 578."""
    codes = frames_of(75, seed=8)
    whole = ours(codes)[0, 0]
    assert err(ours.chunked_decode(codes, 300, 25)[0, 0], whole) < TOL
    keep = torch.ones(len(whole), dtype=torch.bool)
    for b in (30, 60):
        keep[ours.samples_for(b): b * SPF] = False
    exact = ours.chunked_decode(codes, 30, LEFT)[0, 0]
    assert len(exact) == len(whole) - 2 * HELD
    assert err(exact, whole[keep]) < TOL
    assert err(ours.chunked_decode(codes, 30, 25)[0, 0], whole[keep]) > 1e-4


# ---- the stream node, driven directly ------------------------------------------------------------

def direct(node: Code2WavStreamNode, codes: np.ndarray, policy, paced: bool = True):
    """``codes`` [n, G] through ``node`` over the windows the C++ chunk cursor makes; paced:
    windows taken as soon as ready (a stream ending on a window boundary then ends with
    end_stream, as the runtime calls it), else after the stream ended. A window that completes
    no sample gives no chunk (an empty one would depend on when the stream's end came)."""
    spans = policy_spans(np.asarray(codes, dtype=np.int64), policy, paced)
    ctx = WorkContext(RequestContext(1, {}), 0)
    chunks = []
    for b, nb, e, last in spans:
        work = node.prepare_inputs(ctx, {"codes": StreamChunk(list(codes[b:e]), b, nb, e, last)})
        chunks += node.forward([work])[0].values()
    if not spans or not spans[-1][3]:
        chunks += node.end_stream(ctx).values()
    return chunks, ctx.request.state


def np_codes(n: int, seed: int) -> np.ndarray:
    return frames_of(n, seed)[0].T.numpy().copy()


@pytest.mark.parametrize("policy", [Fixed(1), Fixed(3), SlidingWindow(5, 2), LeftContext(6, 4),
                                    Ramp([2, 4], 12), Ramp([1], 7, context=3)], ids=str)
def test_every_length_streams_exactly(ours, policy):
    node = Code2WavStreamNode(ours)
    for n in list(range(0, 14)) + [41]:
        codes = np_codes(n, seed=n)
        want = decode_one_shot(ours, codes)
        for paced in (True, False):
            chunks, state = direct(node, codes, policy, paced)
            audio = np.concatenate(chunks) if chunks else np.zeros(0, np.float32)
            assert all(len(c) for c in chunks), (n, paced)
            assert audio.shape == want.shape == (ours.samples_for(n),), (n, paced)
            assert np.abs(audio - want).max(initial=0) < TOL, (n, paced)
            assert all(c.dtype == np.float32 and c.ndim == 1 for c in chunks)
            assert state[_STATE].done and not state[_STATE].cache  # freed at the end


def test_state_is_bounded_and_a_failed_decode_is_retried(ours):
    node = Code2WavStreamNode(ours)
    codes = np_codes(40, seed=3)
    ctx = WorkContext(RequestContext(7, {}), 0)
    got = []
    for b in range(0, 40, 5):
        window = {"codes": StreamChunk(list(codes[b:b + 5]), b, b, b + 5, b + 5 == 40)}
        if b == 20:
            ours.step = lambda *a: (_ for _ in ()).throw(RuntimeError("device lost"))
            with pytest.raises(RuntimeError):
                node.forward([node.prepare_inputs(ctx, window)])
            del ours.step
        got.append(node.forward([node.prepare_inputs(ctx, window)])[0]["audio"])
        stream = ctx.request.state[_STATE]
        if b + 5 < 40:
            assert stream.cache[0][0].shape[2] == min(b + 5, 7)  # window - 1 positions
            assert stream.hidden.shape[1] == min(b + 5, 20)  # conv context
    assert np.abs(np.concatenate(got) - decode_one_shot(ours, codes)).max() < TOL


def test_bad_items_are_named(ours):
    node = Code2WavStreamNode(ours)
    ctx = WorkContext(RequestContext(3, {}), 0)
    with pytest.raises(ValueError, match=r"frame 2 of request 3 holds codes outside \[0, 32\)"):
        items = [np.zeros(G, np.int64)] * 2 + [np.full(G, 32)]
        node.prepare_inputs(ctx, {"codes": StreamChunk(items, 0, 0, 3, False)})
    with pytest.raises(ValueError, match="integer arrays of 4 codes"):
        node.prepare_inputs(ctx, {"codes": StreamChunk([np.zeros(3)], 0, 0, 1, False)})


# ---- the stream node in a Runtime ----------------------------------------------------------------

class Talker(NodeSubmodule):
    """The talker stand-in: streams the request's frames, one per DynamicLoop iteration
    (nothing for an empty request)."""

    max_batch = 8

    def __init__(self) -> None:
        self.finished = 0

    def prepare_inputs(self, ctx, inputs):
        return inputs["frames"], ctx.iteration

    def forward(self, batch):
        return [{"codes": frames[i]} if i < len(frames) else {} for frames, i in batch]

    def check_stop(self, batch, outputs):
        stops = [("talk",) if i + 1 >= max(len(frames), 1) else () for frames, i in batch]
        self.finished += sum(1 for s in stops if s)
        return stops


class Gated(Code2WavStreamNode):
    """Decodes only while ``go`` is set."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.go = threading.Event()
        self.go.set()

    def forward(self, batch):
        if not self.go.wait(T):
            raise TimeoutError("the test never let the decoder run")
        return super().forward(batch)


class Speech(Model):
    inputs = ("frames",)

    def __init__(self, node: Code2WavStreamNode, policy) -> None:
        self.nodes = [GraphNode("talker", ["frames"],
                                [StreamingGraphEdge("code2wav", "codes", policy)],
                                submodule=Talker(), engine="talker"),
                      GraphNode("code2wav", ["codes"], [GraphEdge(EMIT, "audio")],
                                submodule=node, engine="code2wav")]
        self.walks = {"speak": Parallel(DynamicLoop("talker", 1024, name="talk"), "code2wav")}


@pytest.mark.parametrize("policy", [Fixed(1), Fixed(5), SlidingWindow(7, 3), LeftContext(4, 3),
                                    Code2WavStreamNode.first_audio_policy()], ids=str)
def test_concurrent_streams_equal_one_shot_decoding(serve, ours, policy):
    rt = serve(Speech(Code2WavStreamNode(ours), policy))
    for lengths in [(0, 1, 13), (37, 2, 26)]:
        frames = [np_codes(n, seed=n + 1) for n in lengths]
        handles = [rt.submit({"frames": list(f)}) for f in frames]
        for h, f in zip(handles, frames):
            chunks = h.result(timeout=T).get("audio", [])  # none for 0 frames
            assert all(len(c) for c in chunks)  # never an empty chunk, whenever the end came
            audio = np.concatenate(chunks) if chunks else np.zeros(0, np.float32)
            want = decode_one_shot(ours, f)
            assert audio.shape == want.shape == (ours.samples_for(len(f)),)
            assert np.abs(audio - want).max(initial=0) < TOL, (len(f), str(policy))
    assert settled(rt) == ZERO_LIVE


def test_first_audio_comes_with_the_first_small_window(serve, ours):
    policy = Code2WavStreamNode.first_audio_policy()
    assert str(policy) == str(Ramp([2, 4, 8], 12))
    rt = serve(Speech(Code2WavStreamNode(ours), policy))
    chunks = rt.submit({"frames": list(np_codes(30, seed=4))}).result(timeout=T)["audio"]
    assert [len(c) for c in chunks if len(c)][:3] == [ours.samples_for(2), 4 * SPF, 8 * SPF]


def test_concurrent_requests_share_decoder_calls(serve, ours):
    node = Gated(ours, max_batch=4)
    model = Speech(node, Fixed(4))
    rt = serve(model)
    node.go.clear()
    frames = [np_codes(20, seed=10 + i) for i in range(4)]
    handles = [rt.submit({"frames": list(f)}) for f in frames]
    talker = model.nodes[0].submodule
    assert wait_until(lambda: talker.finished == 4, timeout=T)
    node.go.set()
    for h, f in zip(handles, frames):
        audio = np.concatenate(h.result(timeout=T)["audio"])
        assert np.abs(audio - decode_one_shot(ours, f)).max() < TOL
    assert max(node.decode_batch_sizes) == 4, node.decode_batch_sizes
    assert settled(rt) == ZERO_LIVE

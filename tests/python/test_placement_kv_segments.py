"""A KV engine's walks inside one worker (issue 17, item 0): when every node of a KV engine sits on
one worker, its walks become segments there, so a placed LM's decode loop, a placed policy's
(pi0, SmolVLA) flow steps and a placed TTS's code stream to SNAC cross to the worker once per walk, not once
per token or step. Tokens, logits, action chunks and audio equal the in-process Runtime's;
concurrent requests still share the engine's steps; a request's runs share its pages, which are
freed when it ends or is cancelled."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from mstar_rt import RequestCancelled, Runtime
from mstar_rt.models.causal_lm import SamplingParams
from mstar_rt.placement import NodeGroup, PlacedRuntime

import placement_models as pm
from placement_support import (LM_GROUPS, PROMPTS, T, generate, idle, reference_outputs,
                               start_placed_lm)
from walk_models import settled, wait_until

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conftest.py


@pytest.fixture(scope="module")
def reference():
    return reference_outputs()


@pytest.fixture(scope="module")
def placed_lm():
    yield from start_placed_lm()


def messages(rt: PlacedRuntime) -> int:
    """Messages the worker has taken (a stats request is one of them)."""
    return rt.worker_stats(1)["messages"]


def segments_of(rt: PlacedRuntime) -> list[str]:
    return [n for n in rt.node_names if n.startswith("segment:")]


def on_one_worker(factory: str, nodes: list[str]) -> PlacedRuntime:
    return PlacedRuntime(f"placement_models:{factory}", [NodeGroup(nodes, rank=1)],
                         progress=False)


def test_an_lm_on_one_worker_decodes_inside_it_with_the_same_tokens(placed_lm, reference):
    assert segments_of(placed_lm) == ["segment:prefill:0", "segment:decode:0"]
    for want, got in zip(reference["lm"], generate(placed_lm, PROMPTS)):
        assert got["token"] == want["token"]
        assert all(torch.equal(a, b) for a, b in zip(got["logits"], want["logits"]))
    # 40 tokens: a prefill run and a decode run (and the release), not one message per token
    before = messages(placed_lm)
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    out = placed_lm.submit({"prompt": PROMPTS[0], "params": params}).result(T)
    assert len(out["token"]) == 40
    idle(placed_lm, 1)
    assert messages(placed_lm) - before <= 5
    with Runtime(pm.tiny_llama()) as local:
        assert local.submit({"prompt": PROMPTS[0], "params": params}).result(T)["token"] == \
            out["token"]


def test_concurrent_requests_share_the_workers_decode_steps(placed_lm, reference):
    together = generate(placed_lm, PROMPTS, concurrent=True)
    assert [r["token"] for r in together] == [r["token"] for r in reference["lm"]]
    stats = idle(placed_lm, 1)
    assert stats["kv"]["lm"]["largest_step"] > 1
    assert stats["segment_runs"] == 0 and stats["kv_pages_in_use"] == 0


def test_a_cancel_mid_decode_frees_the_requests_pages(placed_lm, reference):
    params = SamplingParams(max_tokens=100, ignore_eos=True)
    handle = placed_lm.submit({"prompt": PROMPTS[1], "params": params})
    tokens = iter(handle)
    next(tokens), next(tokens)
    assert placed_lm.worker_stats(1)["kv_pages_in_use"] > 0
    handle.cancel()
    with pytest.raises(RequestCancelled):
        handle.result(T)
    stats = idle(placed_lm, 1)
    assert wait_until(lambda: placed_lm.worker_stats(1)["segment_runs"] == 0, T)
    assert stats["kv_pages_in_use"] == 0 and stats["kv"]["lm"]["sequences"] == 0
    assert generate(placed_lm, PROMPTS[:1])[0]["token"] == reference["lm"][0]["token"]
    assert settled(placed_lm) == dict(requests=0, handles=0, stored=0, queued=0, inflight=0)


def test_with_segments_off_each_token_crosses_on_its_own():
    with PlacedRuntime("placement_models:tiny_llama", LM_GROUPS, progress=False,
                       segments=False) as rt:
        assert segments_of(rt) == []
        before = messages(rt)
        params = SamplingParams(max_tokens=20, ignore_eos=True)
        assert len(rt.submit({"prompt": PROMPTS[0], "params": params}).result(T)["token"]) == 20
        assert messages(rt) - before >= 20  # the contrast: one crossing per token


def observation(family: str) -> tuple[dict, torch.Tensor]:
    """The fixture's observation (two cameras, a prompt, fixed noise) and LeRobot's chunk."""
    d = Path(__file__).resolve().parents[1] / "reference" / "fixtures" / family
    io = load_file(str(d / "io.safetensors"))
    meta = json.loads((d / "io.json").read_text())
    cameras = meta.get("cameras_in_order") or ["observation.images.camera1",
                                               "observation.images.camera2"]
    obs = {"images": {k: io[f"input.{k}"] for k in cameras},
           "state": io["input.observation.state"], "task": meta["prompt"],
           "noise": io["input.noise"]}
    return obs, io["output.action_chunk"].reshape(-1, *io["output.action_chunk"].shape[-2:])[0]


@pytest.mark.parametrize("family, factory", [("pi0", "lerobot_policy"),
                                             ("smolvla", "smolvla_policy")])
def test_a_lerobot_policy_on_one_worker_runs_its_flow_steps_inside_it(family, factory):
    obs, want = observation(family)
    with on_one_worker(factory, ["vision", "prefix", "denoise"]) as rt:
        assert segments_of(rt) == ["segment:prefix:0", "segment:action_gen:0"]
        before = messages(rt)
        got = rt.submit(obs).result(T)["actions"][0]
        assert (got.reshape(want.shape) - want).abs().max().item() <= 1e-4  # LeRobot's chunk
        idle(rt, 1)
        assert messages(rt) - before <= 5  # not one crossing per flow step (10 of them)
        seeded = [dict(obs, noise=None, seed=s) for s in (1, 2, 3)]
        with Runtime(getattr(pm, factory)()) as local:
            alone = [local.submit(o).result(T)["actions"][0] for o in seeded]
        handles = [rt.submit(o) for o in seeded]
        for a, h in zip(alone, handles):
            assert (h.result(T)["actions"][0] - a).abs().max().item() <= 1e-4
        assert idle(rt, 1)["kv_pages_in_use"] == 0


def test_a_tts_on_one_worker_streams_its_audio_from_inside_it():
    """Orpheus' speak walk (the LM's decode loop streaming codes to SNAC) is one segment: the
    stream stays in the worker, the audio reaches the caller as it is made."""
    req = {"text": "hello there", "params": SamplingParams(max_tokens=120, seed=0,
                                                           ignore_eos=True)}
    with Runtime(pm.tiny_tts()) as local:
        want = np.concatenate(local.submit(req).result(T)["audio"])
    with on_one_worker("tiny_tts", ["prefill", "decode", "snac_decoder"]) as rt:
        assert segments_of(rt) == ["segment:prefill:0", "segment:speak:0"]
        before = messages(rt)
        streamed = [v for k, v in rt.submit(req) if k == "audio"]
        assert len(streamed) > 1  # in pieces, as made
        np.testing.assert_allclose(np.concatenate(streamed), want, atol=1e-5)
        stats = idle(rt, 1)
        assert messages(rt) - before <= 5  # not one per token, nor per audio chunk
        assert stats["segment_runs"] == 0


def test_qwen3_omni_on_one_worker_runs_its_parts_inside_it(tmp_path):
    """Qwen3-Omni's walks are Parts (thinker and talker, each its own loop) joined by streams:
    placed whole on one worker, each walk is one segment and the worker asks the model which
    sub-walk comes next. Tokens and audio equal in-process; a request is a handful of messages,
    not one per token, talker step and code-predictor step; both KV caches are freed. Split
    (thinker on one worker, the rest on another), the code predictor's loop is a segment."""
    from omni_support import tiny_qwen3_omni

    import omni_tiny as ot

    local_model = tiny_qwen3_omni(str(tmp_path))
    prompt = ot.chat_prompt([5, 9, 13])
    req = {"prompt": prompt, "speaker": "ethan", "audio_features": [],
           "thinker_sampling": {"max_tokens": 12},
           "talker_sampling": {"temperature": 0.0, "max_tokens": 40}}

    def collect(handle) -> tuple[list, np.ndarray]:
        out = list(handle)
        audio = [v for k, v in out if k == "audio"]
        return [v for k, v in out if k == "token"], np.concatenate(audio)

    with Runtime(local_model) as local:
        want_tokens, want_audio = collect(local.submit(req))
        want_text = [v for k, v in local.submit({**req, "return_audio": False}) if k == "token"]
    nodes = [n.name for n in local_model.nodes]
    with PlacedRuntime("placement_models:tiny_omni", [NodeGroup(nodes, rank=1)],
                       model_kwargs={"directory": str(tmp_path)}, progress=False) as rt:
        assert segments_of(rt) == ["segment:text:0", "segment:speak:0"]
        before = messages(rt)
        tokens, audio = collect(rt.submit(req))
        assert tokens == want_tokens and len(want_tokens) > 1
        assert audio.shape == want_audio.shape and np.abs(want_audio).max() > 0.05
        np.testing.assert_allclose(audio, want_audio, atol=1e-5)
        assert [v for k, v in rt.submit({**req, "return_audio": False})
                if k == "token"] == want_text
        stats = idle(rt, 1)
        assert messages(rt) - before <= 8  # two requests and a stats call
        assert stats["segment_runs"] == 0
    # Thinker on one worker, talker, code predictor and code2wav on another. The thinker's
    # prefill and decode loop are segments whose streams to the talker leave item by item
    # (Conductor.push_stream); they enter the talker's loop, one segment run per request,
    # window by window (placement/stream_in.py); code2wav alone runs node by node.
    thinker = [n for n in nodes if n.startswith(("text_", "thinker_", "audio_encoder"))]
    groups = [NodeGroup(thinker, rank=1), NodeGroup([n for n in nodes if n not in thinker],
                                                    rank=2)]
    with PlacedRuntime("placement_models:tiny_omni", groups,
                       model_kwargs={"directory": str(tmp_path)}, progress=False) as rt:
        assert segments_of(rt) == ["segment:text:0", "segment:speak:0", "segment:speak:1",
                                   "segment:speak:2"]
        before, before2 = messages(rt), rt.worker_stats(2)["messages"]
        tokens, audio = collect(rt.submit(req))
        assert tokens == want_tokens
        np.testing.assert_allclose(audio, want_audio, atol=1e-5)
        assert [v for k, v in rt.submit({**req, "return_audio": False})
                if k == "token"] == want_text
        # two requests, their walks' runs (prefill, decode) and a stats call: not one per token
        assert messages(rt) - before <= 8 < len(want_tokens)
        # worker 2: a window per thinker token and code2wav's windows, not a crossing per
        # talker step and code-predictor run (40 frames)
        # (20 here, against 88 node by node)
        assert rt.worker_stats(2)["messages"] - before2 <= 2 * len(want_tokens) + 4
        for rank in (1, 2):
            assert idle(rt, rank)["segment_runs"] == 0

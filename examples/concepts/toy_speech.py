"""A complete small model in the shape of a speech LM with a codec (Orpheus → SNAC in miniature).

Two walks:
  prefill  "encode" reads the text, makes the first token (persisted into the next walk) and the
           end-of-speech token count.
  decode   a DynamicLoop runs "lm" once per token until it emits the end token; every token also
           streams (SlidingWindow(4, 2)) to "codec", which turns each window's new tokens into
           audio samples and EMITs them while the loop is still running; the tail is flushed.
The state machine: prefill → decode → done. Run it: python examples/concepts/toy_speech.py
"""

from __future__ import annotations

import numpy as np

import mstar_rt as m
from mstar_rt import EMIT, DynamicLoop, GraphEdge, GraphNode, Parallel, StreamingGraphEdge

END = -1


class Encode(m.NodeSubmodule):
    def forward(self, batch):
        return [{"token": len(x["text"]) % 7, "length": len(x["text"])} for x in batch]


class LanguageModel(m.NodeSubmodule):
    max_batch = 8  # decode steps of up to 8 requests run as one batch

    def prepare_inputs(self, ctx, inputs):
        return dict(inputs, step=ctx.iteration)

    def forward(self, batch):
        return [{"token": END if x["step"] + 1 >= x["length"] else (x["token"] * 5 + 3) % 11}
                for x in batch]

    def check_stop(self, batch, outputs):
        return [("speak",) if out["token"] == END else () for out in outputs]


class Codec(m.NodeSubmodule):
    def forward(self, batch):
        out = []
        for x in batch:
            window = x["token"]  # a StreamChunk: the tokens, and which of them are new
            tones = [t for t in window.new_items if t != END]
            t = np.arange(80) / 8000
            audio = np.concatenate([np.sin(2 * np.pi * (200 + 50 * k) * t) for k in tones]) \
                if tones else np.zeros(0)
            out.append({"audio": audio.astype(np.float32)})
        return out


class ToySpeech(m.Model):
    inputs = ("text",)
    walks = {
        "prefill": "encode",
        "decode": Parallel(DynamicLoop("lm", max_iters=64, name="speak"), "codec"),
    }

    def __init__(self) -> None:
        # Each node once: what it reads and writes and what runs it (engine= would give it its
        # own worker; here all three share the default one, which interleaves lm and codec).
        self.nodes = [
            GraphNode("encode", ["text"], [GraphEdge("lm", "token", persist=True),
                                           GraphEdge("lm", "length", persist=True)],
                      submodule=Encode()),
            GraphNode("lm", ["token", "length"],
                      [GraphEdge(EMIT, "token"),
                       StreamingGraphEdge("codec", "token", m.SlidingWindow(4, 2))],
                      submodule=LanguageModel()),
            GraphNode("codec", ["token"], [GraphEdge(EMIT, "audio")],
                      submodule=Codec()),
        ]

    def next_walk(self, request, finished_walk, persisted):
        return "decode" if finished_walk == "prefill" else None


def main() -> None:
    with m.Runtime(ToySpeech()) as runtime:
        handle = runtime.submit({"text": "hello there"})
        samples = 0
        for name, value in handle:  # EMIT outputs as they are produced
            if name == "audio":
                samples += len(value)
                print(f"audio chunk: {len(value):4d} samples")
            else:
                print(f"token: {value}")
        print(f"{samples} samples in all; {len(handle.stats())} node executions")
        handle.save_chrome_trace("toy_speech_trace.json")
        print("timeline: toy_speech_trace.json (open it in ui.perfetto.dev)")


if __name__ == "__main__":
    main()

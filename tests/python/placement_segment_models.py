"""A model for test_placement_segments.py, built by import path in the parent and the worker.

``main`` runs ``pre`` in the parent, then ``a``, ``b`` and a decode-like DynamicLoop ``gen``
(one token EMITted per step) in worker rank 1 -- one segment -- then ``post`` in the parent;
``next_walk`` reads the step count the worker mirrored and may run ``again``, which reads the
``g`` that ``main`` persisted (``c``, ``d`` as a second segment, then ``post``). Also
:class:`Chain` (a segment's plain outputs read by the parent) and :class:`Nested` (a fixed Loop
on a worker inside a DynamicLoop the parent runs)."""

from __future__ import annotations

import time
from typing import Any, Mapping, Optional

import torch

from mstar_rt import (EMIT, DynamicLoop, GraphEdge, GraphNode, Loop, Model, NodeSubmodule,
                      Parallel, Part, Sequential, StreamingGraphEdge)
from mstar_rt.streaming import Fixed

GROUP = ["a", "b", "gen", "c", "d"]


class Affine(NodeSubmodule):
    def __init__(self, src: str, dst: str, scale: float, shift: float) -> None:
        self.src, self.dst, self.scale, self.shift = src, dst, scale, shift

    def forward(self, batch: list[dict]) -> list[Mapping[str, Any]]:
        return [{self.dst: item[self.src] * self.scale + self.shift} for item in batch]


class MaybeFail(Affine):
    def forward(self, batch: list[dict]) -> list[Mapping[str, Any]]:
        for item in batch:
            if item["fail"]:
                raise ValueError("b fails on purpose")
        return super().forward(batch)


class Step(NodeSubmodule):
    """A loop's step: sees its iteration as ``step`` and sleeps ``pause`` seconds if given."""

    max_batch = 8

    def prepare_inputs(self, ctx: Any, inputs: dict) -> dict:
        time.sleep(inputs.get("pause") or 0.0)
        return {**inputs, "step": ctx.iteration}


class Gen(Step):
    """One step per iteration: g -> tanh(g) + 0.1, the step's token EMITted; stops after n."""

    def prepare_inputs(self, ctx: Any, inputs: dict) -> dict:
        ctx.request.state["gen_steps"] = ctx.iteration + 1
        return super().prepare_inputs(ctx, inputs)

    def forward(self, batch: list[dict]) -> list[Mapping[str, Any]]:
        out = []
        for item in batch:
            g = torch.tanh(item["g"]) + 0.1
            out.append({"g": g, "tok": int(g.sum() * 1000) % 97})
        return out

    def check_stop(self, batch: list[dict], outputs: list) -> list:
        return [("gen",) if b["step"] + 1 >= b["n"] else () for b in batch]


class Segmented(Model):
    inputs = ("x", "n", "pause", "fail", "again")
    input_defaults = {"n": 5, "pause": 0.0, "fail": False, "again": False}

    def __init__(self) -> None:
        self.nodes = [
            GraphNode("pre", ["x"], ["h0"], submodule=Affine("x", "h0", 0.5, 0.0)),
            GraphNode("a", ["h0"], ["h1"], submodule=Affine("h0", "h1", 2.0, 1.0)),
            GraphNode("b", ["h1", "fail"], ["g"], submodule=MaybeFail("h1", "g", 0.25, -0.5)),
            GraphNode("gen", ["g", "n", "pause"],
                      [GraphEdge("post", "g", persist=True), GraphEdge(EMIT, "tok")],
                      submodule=Gen()),
            GraphNode("post", ["g"], [GraphEdge(EMIT, "y")], submodule=Affine("g", "y", 3.0, 0.0)),
            GraphNode("c", ["g"], ["h3"], submodule=Affine("g", "h3", -1.0, 0.5)),
            GraphNode("d", ["h3"], ["g"], submodule=Affine("h3", "g", 0.5, 0.0)),
        ]
        self.walks = {"main": Sequential("pre", "a", "b", DynamicLoop("gen", 64, "gen",
                                                                       outputs=["g"]), "post"),
                      "again": Sequential("c", "d", "post")}

    def initial_walk(self, request: Any) -> str:
        return "main"

    def next_walk(self, request: Any, finished_walk: str,
                  persisted: Mapping[str, Any]) -> Optional[str]:
        if finished_walk == "main" and request.inputs["again"]:
            assert request.state["gen_steps"] == request.inputs["n"], request.state
            return "again"
        return None


def segmented() -> Segmented:
    return Segmented()


class Parted(Segmented):
    """One walk, a Part whose next sub-walk the model picks from the request: ``first``, then
    ``again`` when asked for, then ``end``."""

    def __init__(self) -> None:
        super().__init__()
        self.nodes = [n for n in self.nodes if n.name != "gen"]  # no walk runs it here
        self.walks = {"main": Part("p", {"first": Sequential("pre", "a", "b"),
                                         "again": Sequential("c", "d"), "end": "post"})}

    def next_walk(self, request: Any, finished_walk: str,
                  persisted: Mapping[str, Any]) -> Optional[str]:
        return None

    def next_part_walk(self, request: Any, part: str, finished: Optional[str]) -> Optional[str]:
        if finished == "first":
            return "again" if request.inputs["again"] else "end"
        return {None: "first", "again": "end"}.get(finished)


def parted() -> Parted:
    return Parted()


class Chain(Model):
    """``a`` -> ``b`` -> ``c``, plain names (no edge persists): with ``a`` and ``b`` on a worker
    (one segment) the parent's ``c`` reads what the segment made."""

    inputs = ("x",)

    def __init__(self) -> None:
        self.nodes = [GraphNode("a", ["x"], ["h"], submodule=Affine("x", "h", 2.0, 0.0)),
                      GraphNode("b", ["h"], ["k"], submodule=Affine("h", "k", 2.0, 1.0)),
                      GraphNode("c", ["k"], [GraphEdge(EMIT, "y")],
                                submodule=Affine("k", "y", -1.0, 0.5))]
        self.walks = {"w": Sequential("a", "b", "c")}


def chain() -> Chain:
    return Chain()


class Head(NodeSubmodule):
    """The outer loop's step (a talker): reads the inner loop's last ``w`` (absent at first),
    EMITs a token, and stops ``outer`` after ``n`` steps."""

    def prepare_inputs(self, ctx: Any, inputs: dict) -> dict:
        return {**inputs, "step": ctx.iteration}

    def forward(self, batch: list[dict]) -> list[Mapping[str, Any]]:
        out = []
        for item in batch:
            z = item["x"] if item.get("w") is None else torch.sin(item["w"] * 1.7)
            out.append({"z": z, "tok": z})
        return out

    def check_stop(self, batch: list[dict], outputs: list) -> list:
        return [("outer",) if b["step"] + 1 >= b["n"] else () for b in batch]


class Inner(NodeSubmodule):
    """One step of a fixed inner loop (a code predictor): reads ``z`` and its own iteration,
    keeps a running value in the request's state, makes ``w`` at the last step only."""

    steps = 3

    def prepare_inputs(self, ctx: Any, inputs: dict) -> tuple:
        return ctx.request.state, ctx.iteration, inputs["z"]

    def forward(self, batch: list[tuple]) -> list[Mapping[str, Any]]:
        out: list[Mapping[str, Any]] = []
        for state, j, z in batch:
            acc = state["acc"] = (z if j == 0 else state["acc"]) * 0.5 + j
            out.append({"w": acc} if j + 1 == self.steps else {})
        return out


class Nested(Model):
    """A DynamicLoop ``outer`` of ``head`` (in the parent) and a fixed Loop of ``inner`` (on a
    worker: one segment run per outer iteration)."""

    inputs = ("x", "n", "w")  # "w": None until the first inner loop makes it
    input_defaults = {"n": 4, "w": None}

    def __init__(self) -> None:
        self.nodes = [GraphNode("head", ["x", "w", "n"], ["z", GraphEdge(EMIT, "tok")],
                                submodule=Head()),
                      GraphNode("inner", ["z"], ["w"], submodule=Inner())]
        self.walks = {"main": DynamicLoop(
            Sequential("head", Loop("inner", Inner.steps, outputs=("w",))), 16, "outer")}


def nested() -> Nested:
    return Nested()


class Think(Step):
    """A thinker's decode step: t -> 0.9 t + 0.1, EMITted and streamed (``reply``) to the
    talker; stops ``think`` after ``n`` steps (``pause`` seconds each)."""

    def forward(self, batch: list[dict]) -> list[Mapping[str, Any]]:
        return [{"t": t, "tok": t, "reply": t} for t in (b["t"] * 0.9 + 0.1 for b in batch)]

    def check_stop(self, batch: list[dict], outputs: list) -> list:
        return [("think",) if b["step"] + 1 >= b["n"] else () for b in batch]


class Talk(NodeSubmodule):
    """A talker's step: its windows of ``prompt`` and ``reply`` (one item or none each) and
    its last frame make ``mix``, also streamed (``frames``) to ``sink``."""

    max_batch = 8

    def forward(self, batch: list[dict]) -> list[Mapping[str, Any]]:
        out = []
        for item in batch:
            heard = sum((v for v in list(item["prompt"].items) + list(item["reply"].items)),
                        torch.zeros(()))
            mix = item["frame"] * 0.5 + heard
            out.append({"mix": mix, "frames": mix})
        return out


class Voice(Step):
    """The talker's second node: ``frame`` from ``mix``, EMITted as ``audio``; stops ``talk``
    after ``m`` steps; raises at step ``fail_at``."""

    def forward(self, batch: list[dict]) -> list[Mapping[str, Any]]:
        for item in batch:
            if item["step"] == item["fail_at"]:
                raise ValueError("voice fails on purpose")
        return [{"frame": torch.tanh(item["mix"]), "audio": torch.tanh(item["mix"])}
                for item in batch]

    def check_stop(self, batch: list[dict], outputs: list) -> list:
        return [("talk",) if b["step"] + 1 >= b["m"] else () for b in batch]


class Sink(NodeSubmodule):
    """Reads the talker's frames two at a time (a code2wav): each window's sum EMITted."""

    def forward(self, batch: list[dict]) -> list[Mapping[str, Any]]:
        return [{"wave": sum(item["frames"].items, torch.zeros(()))} for item in batch]


class Fed(Model):
    """Qwen3-Omni's shape: a thinker (``prefill``, then a DynamicLoop of ``think``) streams a
    prompt item and one ``reply`` item per step to a talker loop (``talk``, ``voice``) reading
    one window of each per iteration (going on with empty ones after the thinker is done), whose
    ``frames`` stream to ``sink``. With the talker on a worker and the thinker elsewhere, its
    loop is one segment the streams enter (placement/stream_in.py)."""

    inputs = ("x", "n", "m", "pause", "fail_at", "frame")
    input_defaults = {"n": 5, "m": 7, "pause": 0.0, "fail_at": -1, "frame": torch.zeros(())}

    def __init__(self) -> None:
        to_talk = dict(chunk_policy=Fixed(1), continue_after_done=True)
        self.nodes = [
            GraphNode("prefill", ["x"], ["t", StreamingGraphEdge("talk", "prompt", **to_talk)],
                      submodule=Prefill()),
            GraphNode("think", ["t", "n", "pause"],
                      ["t", GraphEdge(EMIT, "tok"), StreamingGraphEdge("talk", "reply", **to_talk)],
                      submodule=Think()),
            GraphNode("talk", ["prompt", "reply", "frame"],
                      ["mix", StreamingGraphEdge("sink", "frames", Fixed(2))], submodule=Talk()),
            GraphNode("voice", ["mix", "m", "fail_at"], ["frame", GraphEdge(EMIT, "audio")],
                      submodule=Voice()),
            GraphNode("sink", ["frames"], [GraphEdge(EMIT, "wave")], submodule=Sink()),
        ]
        self.walks = {"speak": Parallel(
            Sequential("prefill", DynamicLoop("think", 64, "think", outputs=["t"])),
            DynamicLoop(Sequential("talk", "voice"), 64, "talk"),
            "sink")}


class Prefill(NodeSubmodule):
    def forward(self, batch: list[dict]) -> list[Mapping[str, Any]]:
        return [{"t": torch.tanh(item["x"]), "prompt": item["x"] * 2.0} for item in batch]


def fed() -> Fed:
    return Fed()

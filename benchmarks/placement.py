"""Cost of placement: a walk run in a worker process against the same walk in-process.

No-op nodes (each returns a 1-element tensor: only the runtime's own cost is timed) in three
walks -- a chain of 10 nodes, a Loop of 100 iterations, a 256-step decode DynamicLoop that
EMITs a token per step -- served by a Runtime in this process and by a PlacedRuntime with every
node on worker rank 1, for 1 request at a time and 16 at once. The two runtimes alternate so
machine noise hits both alike. Also timed: one parent -> worker -> parent crossing (a one-node
walk, placed minus in-process) and the bare ZeroMQ round trip it rides on (the same sockets and
thread hand-offs, no runtime), timed alternately with it: the floor a crossing can approach.
Last, a chain of 8 nodes placed alternately on ranks 1 and 2, each copying a 1 MiB tensor: per
hop through the parent (``direct_bytes=None``) against worker to worker (placement/direct.py);
with ``--ray`` the same hops between Ray actors of a local Ray instance (placement/peer_bytes.py).
And a small random Llama on a KV cache decoding 64 tokens: in-process, on a worker with its
walks as segments (the decode loop runs inside the worker), and on a worker node by node; then
disaggregated (prefill on worker 1, decode on worker 2, each request's K/V moving between them),
each worker's walk a segment against node by node (benchmarks/placement_kv.py). Last, the tiny
Qwen3-Omni with its thinker on worker 1 and the rest on worker 2, segments against node by node.

    python benchmarks/placement.py [--quick] [--ray]   # table + results/placement.{json,png}

Ratios (issue 17): ``placed_over_inproc_per_node_1req`` (the worst of the three walks; < 3
wanted) and ``crossing_over_zmq_floor`` (< 1.5 wanted), lower is better for both;
``direct_over_star_speedup`` (>= 1.5 wanted), higher is better.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench_common import alternate, child_pythonpath, machine, use_source_tree  # noqa: E402

use_source_tree()

import torch  # noqa: E402
import zmq  # noqa: E402

from mstar_rt import (EMIT, DynamicLoop, GraphEdge, GraphNode, Loop, Model,  # noqa: E402
                      NodeSubmodule, Runtime, Sequential)
from mstar_rt.placement import NodeGroup, PlacedRuntime  # noqa: E402
from placement_kv import kv_decode, omni_split  # noqa: E402
from placement_stream import LONG as LONG_ITEMS, stream_direct_vs_star  # noqa: E402

DECODE_STEPS = 256


class Noop(NodeSubmodule):
    """``y = x``: returns its 1-element tensor (a new one, as a real node would)."""

    def __init__(self, src: str, dst: str) -> None:
        self.src, self.dst = src, dst

    def forward(self, batch: list[dict]) -> list[dict]:
        return [{self.dst: item[self.src]} for item in batch]


class Decode(NodeSubmodule):
    max_batch = 16

    def prepare_inputs(self, ctx: Any, inputs: dict) -> dict:
        return {**inputs, "step": ctx.iteration}

    def forward(self, batch: list[dict]) -> list[dict]:
        return [{"x": b["x"], "tok": b["x"]} for b in batch]

    def check_stop(self, batch: list[dict], outputs: list) -> list:
        return [("decode",) if b["step"] + 1 >= DECODE_STEPS else () for b in batch]


class Walks(Model):
    """One walk per case; ``nodes`` counts the node executions of one request."""

    inputs = ("x", "walk")
    input_defaults = {"walk": "one"}
    nodes_per_request = {"one": 1, "chain10": 10, "loop100": 101, "decode256": DECODE_STEPS}

    def __init__(self) -> None:
        chain = [f"c{i}" for i in range(10)]
        self.nodes = [GraphNode("one", ["x"], [GraphEdge(EMIT, "y")], submodule=Noop("x", "y"))]
        self.nodes += [GraphNode(n, ["x" if i == 0 else f"v{i}"],
                                 [GraphEdge(EMIT, "y") if i == 9 else f"v{i + 1}"],
                                 submodule=Noop("x" if i == 0 else f"v{i}",
                                                "y" if i == 9 else f"v{i + 1}"))
                       for i, n in enumerate(chain)]
        self.nodes += [GraphNode("step", ["x"], ["x"], submodule=Noop("x", "x"), max_batch=16),
                       GraphNode("last", ["x"], [GraphEdge(EMIT, "y")], submodule=Noop("x", "y")),
                       GraphNode("decode", ["x"], ["x", GraphEdge(EMIT, "tok")],
                                 submodule=Decode())]
        self.walks = {"one": "one", "chain10": Sequential(*chain),
                      "loop100": Sequential(Loop("step", 100, outputs=["x"]), "last"),
                      "decode256": DynamicLoop("decode", DECODE_STEPS, "decode")}

    def initial_walk(self, request: Any) -> str:
        return request.inputs["walk"]


def walks() -> Walks:
    """The factory the worker imports (``placement:walks``, this file on its sys.path)."""
    return Walks()


HOPS = 8  # nodes of the alternating chain


class Copy(NodeSubmodule):
    """``dst = src.clone()``: a new tensor of the same size, as a real node would make."""

    def __init__(self, src: str, dst: str) -> None:
        self.src, self.dst = src, dst

    def forward(self, batch: list[dict]) -> list[dict]:
        return [{self.dst: item[self.src].clone()} for item in batch]


class Alternating(Model):
    """A chain of HOPS nodes, placed alternately on ranks 1 and 2: every hop is a tensor from
    one worker to the other."""

    inputs = ("x",)

    def __init__(self) -> None:
        names = [f"h{i}" for i in range(HOPS)]
        src = ["x"] + [f"t{i}" for i in range(1, HOPS)]
        dst = src[1:] + ["y"]
        self.nodes = [GraphNode(n, [a], [GraphEdge(EMIT, b) if b == "y" else b],
                                submodule=Copy(a, b)) for n, a, b in zip(names, src, dst)]
        self.walks = {"main": Sequential(*names)}


def alternating() -> Alternating:
    return Alternating()


def direct_vs_star(reps: int, nbytes: int = 1 << 20, ray: bool = False) -> dict[str, float]:
    """µs per hop of the alternating chain with ``nbytes`` tensors, through the parent (star)
    and worker to worker (direct), the two runtimes alternating. ``ray``: the ranks are Ray
    actors of a local Ray instance (tcp; the reader fetches from the maker)."""
    names = [f"h{i}" for i in range(HOPS)]
    extra: dict[str, Any] = dict(num_cpus=0.1) if ray else {}
    groups = [NodeGroup(names[0::2], rank=1, **extra), NodeGroup(names[1::2], rank=2, **extra)]
    rts = {mode: PlacedRuntime("placement:alternating", groups, progress=False,
                               shm_bytes=64 << 20, direct_bytes=bytes_,
                               launcher="ray" if ray else "process")
           for mode, bytes_ in (("star", None), ("direct", 64 << 10))}
    x = torch.randn(nbytes // 4)
    # Warm-up: one lap of every arena, so no timed hop touches a page of shared memory for the
    # first time (a fault per 4 KiB, ~0.4-0.65 ms per MiB here). Through the parent every
    # arena carries HOPS / 2 tensors per request; worker to worker the parent's arenas carry
    # only the input and the output, one each: 68 requests for a lap, not 20 (with 20 the
    # direct hop measured 0.8-0.9x the star's, every timed request faulting).
    per_request = {"star": HOPS // 2 * nbytes, "direct": nbytes}
    try:
        for mode, rt in rts.items():
            for _ in range((64 << 20) // per_request[mode] + 4):
                rt.submit({"x": x}).result(60)

        def one(rt: Any) -> float:
            t0 = time.perf_counter()
            rt.submit({"x": x}).result(60)
            return time.perf_counter() - t0

        t = alternate([(mode, lambda rt=rt: one(rt)) for mode, rt in rts.items()], reps,
                      "1 MiB hops")
    finally:
        for rt in rts.values():
            rt.close()
    tag = "ray_" if ray else ""
    return {f"{tag}{mode}_us_per_hop_1mib": statistics.median(v) / HOPS * 1e6
            for mode, v in t.items()} | {f"{tag}spin_us_2_workers": rts["star"].spin_us}


def ray_direct_vs_star(reps: int) -> dict[str, float]:
    """:func:`direct_vs_star` between Ray actors of a local Ray instance started here."""
    import os

    import ray

    os.environ["PYTHONPATH"] = child_pythonpath(str(HERE))  # the actors import this file
    ray.init(num_cpus=2, include_dashboard=False, logging_level="error", log_to_driver=False)
    try:
        return direct_vs_star(reps, ray=True)
    finally:
        ray.shutdown()


def run_batch(rt: Any, walk: str, n: int) -> float:
    """Seconds to serve ``n`` requests of ``walk`` submitted at once."""
    x = torch.ones(1)
    t0 = time.perf_counter()
    handles = [rt.submit({"x": x, "walk": walk}) for _ in range(n)]
    for h in handles:
        h.result(120)
    return time.perf_counter() - t0


ECHO = r"""
import queue, sys, threading, zmq
ctx = zmq.Context()
router = ctx.socket(zmq.ROUTER); router.bind(sys.argv[1])
push = ctx.socket(zmq.PUSH); push.connect(sys.argv[2])
q = queue.SimpleQueue()
def engine():
    while True:
        frames = q.get()
        if frames is None:
            return
        push.send_multipart(frames)
t = threading.Thread(target=engine, daemon=True)
t.start()
while True:
    ident, head, body = router.recv_multipart()
    if body == b"stop":
        q.put([head, body])
        q.put(None)
        break
    q.put([head, body])
t.join()
"""


class ZmqFloor:
    """Round trips through the sockets and thread hand-offs placement uses (caller -> sender
    thread -> DEALER -> worker's ROUTER reader -> its engine thread -> PUSH -> the parent's PULL
    reader -> caller), with a 1-element tensor's worth of message and nothing else; timed
    alternately with the crossings, so both see the same machine."""

    def __init__(self, workdir: str) -> None:
        import queue

        self.zctx = zmq.Context()
        self.pull = self.zctx.socket(zmq.PULL)
        self.pull.bind(f"ipc://{workdir}/floor-pull")
        self.proc = subprocess.Popen([sys.executable, "-c", ECHO, f"ipc://{workdir}/floor-router",
                                      f"ipc://{workdir}/floor-pull"],
                                     env={"PYTHONPATH": child_pythonpath()})
        self.dealer = self.zctx.socket(zmq.DEALER)
        self.dealer.connect(f"ipc://{workdir}/floor-router")
        self.out: queue.SimpleQueue = queue.SimpleQueue()
        self.done = threading.Event()
        self.threads = [threading.Thread(target=self._sender, daemon=True),
                        threading.Thread(target=self._receiver, daemon=True)]
        for t in self.threads:
            t.start()
        time.sleep(0.3)  # the echo process connects
        for _ in range(20):
            self.one()

    def _sender(self) -> None:
        while (frames := self.out.get()) is not None:
            self.dealer.send_multipart(frames)

    def _receiver(self) -> None:
        while True:
            if not self.pull.poll(100):
                if self.proc.poll() is not None:
                    return
                continue
            frames = self.pull.recv_multipart()
            if frames[1] == b"stop":
                return
            self.done.set()

    def one(self) -> float:
        """Seconds for one round trip."""
        self.done.clear()
        t0 = time.perf_counter()
        self.out.put([b"\x00" * 12, b"\x00" * 96])  # about a one-item batch message
        self.done.wait(5)
        return time.perf_counter() - t0

    def close(self) -> None:
        self.out.put([b"", b"stop"])
        self.out.put(None)
        self.proc.wait(5)
        for t in self.threads:
            t.join(5)
        self.zctx.destroy(0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer repetitions (about a minute)")
    ap.add_argument("--ray", action="store_true",
                    help="also the 1 MiB hops between Ray actors (local Ray instance, tcp)")
    args = ap.parse_args()
    scale = 1 if args.quick else 4
    reps_1 = {"one": 100 * scale, "chain10": 30 * scale, "loop100": 5 * scale,
              "decode256": 3 * scale}
    reps_16 = {"one": 10 * scale, "chain10": 6 * scale, "loop100": 2 * scale,
               "decode256": 1 * scale}
    local = Runtime(walks())
    all_nodes = [n.name for n in local.model.nodes]
    placed = PlacedRuntime("placement:walks", [NodeGroup(all_nodes, rank=1)], progress=False,
                           shm_bytes=4 << 20)
    # how long a receiver watches its mailbox before it sleeps (docs/placement.md): the default
    # for one worker, and for the two of the worker-to-worker hops
    figures: dict[str, float] = {"spin_us_1_worker": placed.spin_us}
    try:
        for walk in Walks.nodes_per_request:  # warm-up: first-use costs stay out
            for rt in (local, placed):
                run_batch(rt, walk, 4)
        floor = ZmqFloor(placed.workers[1]["endpoint"].removeprefix("ipc://").rsplit("/", 1)[0])
        for n_req, reps in ((1, reps_1), (16, reps_16)):
            for walk, count in Walks.nodes_per_request.items():
                cases = [("inproc", lambda: run_batch(local, walk, n_req)),
                         ("placed", lambda: run_batch(placed, walk, n_req))]
                if walk == "one" and n_req == 1:
                    cases.append(("floor", floor.one))
                t = alternate(cases, reps[walk], f"{walk} x{n_req}")
                for side in ("inproc", "placed"):
                    per_node = statistics.median(t[side]) / (n_req * count) * 1e6
                    figures[f"{side}_us_per_node_{walk}_{n_req}req"] = per_node
                if walk == "one" and n_req == 1:
                    figures["crossing_us_1req"] = (statistics.median(t["placed"])
                                                   - statistics.median(t["inproc"])) * 1e6
                    figures["zmq_floor_us"] = statistics.median(t["floor"]) * 1e6
        floor.close()
    finally:
        placed.close()
        local.close()
    # with only its own two runtimes open (the figure moved 0.44 -> 1.3-1.5 when the others left)
    figures.update(direct_vs_star(30 * scale))
    figures.update(stream_direct_vs_star(10 * scale))
    figures.update(stream_direct_vs_star(4 * scale, segment=True))
    figures.update(kv_decode(5 * scale))
    figures.update(kv_decode(5 * scale, disagg=True))
    figures.update(omni_split(4 * scale))
    if args.ray:
        figures.update(ray_direct_vs_star(10 * scale))
    ratios: dict[str, float] = {}
    for n_req in (1, 16):
        for walk in ("chain10", "loop100", "decode256"):
            ratios[f"placed_over_inproc_per_node_{walk}_{n_req}req"] = (
                figures[f"placed_us_per_node_{walk}_{n_req}req"]
                / figures[f"inproc_us_per_node_{walk}_{n_req}req"])
    ratios["placed_over_inproc_per_node_1req"] = max(
        ratios[f"placed_over_inproc_per_node_{w}_1req"] for w in ("chain10", "loop100",
                                                                 "decode256"))
    ratios["crossing_over_zmq_floor"] = figures["crossing_us_1req"] / figures["zmq_floor_us"]
    ratios["direct_over_star_speedup"] = (figures["star_us_per_hop_1mib"]
                                          / figures["direct_us_per_hop_1mib"])
    ratios["stream_direct_over_star_speedup"] = (figures["stream_star_us_per_item_1mib"]
                                                 / figures["stream_direct_us_per_item_1mib"])
    ratios["stream_in_direct_over_star_speedup"] = (figures["stream_in_star_us_per_item_1mib"]
                                                    / figures["stream_in_direct_us_per_item_1mib"])
    for n in (1, 8):
        ratios[f"kv_placed_over_inproc_per_token_{n}req"] = (
            figures[f"kv_segments_us_per_token_{n}req"] / figures[f"kv_inproc_us_per_token_{n}req"])
        for k in ("", "disagg_"):
            ratios[f"kv_{k}segments_speedup_{n}req"] = (
                figures[f"kv_{k}per_node_us_per_token_{n}req"]
                / figures[f"kv_{k}segments_us_per_token_{n}req"])
    ratios["omni_split_segments_speedup"] = (figures["omni_split_per_node_ms_per_request"]
                                             / figures["omni_split_segments_ms_per_request"])
    if args.ray:
        ratios["ray_direct_over_star_speedup"] = (figures["ray_star_us_per_hop_1mib"]
                                                  / figures["ray_direct_us_per_hop_1mib"])

    print(f"{'walk':>10} {'req':>4} {'in-process':>12} {'placed':>12} {'ratio':>6}   (µs per node)")
    for n_req in (1, 16):
        for walk in ("chain10", "loop100", "decode256"):
            a = figures[f"inproc_us_per_node_{walk}_{n_req}req"]
            b = figures[f"placed_us_per_node_{walk}_{n_req}req"]
            print(f"{walk:>10} {n_req:>4} {a:>12.1f} {b:>12.1f} {b / a:>6.2f}")
    print(f"crossing (1 request, 1-element tensor): {figures['crossing_us_1req']:.0f} µs; "
          f"bare ZeroMQ round trip: {figures['zmq_floor_us']:.0f} µs; "
          f"ratio {ratios['crossing_over_zmq_floor']:.2f}")
    print(f"1 MiB tensor per hop between two workers: through the parent "
          f"{figures['star_us_per_hop_1mib']:.0f} µs, worker to worker "
          f"{figures['direct_us_per_hop_1mib']:.0f} µs; direct_over_star_speedup "
          f"{ratios['direct_over_star_speedup']:.2f}")
    print(f"1 MiB stream items from one worker to another: through the parent "
          f"{figures['stream_star_us_per_item_1mib']:.0f} µs, worker to worker "
          f"{figures['stream_direct_us_per_item_1mib']:.0f} µs per item; "
          f"stream_direct_over_star_speedup {ratios['stream_direct_over_star_speedup']:.2f}")
    print(f"{LONG_ITEMS} such items per request into a two-node loop segment (16 MiB arena): "
          f"through the parent {figures['stream_in_star_us_per_item_1mib']:.0f} µs, worker to "
          f"worker {figures['stream_in_direct_us_per_item_1mib']:.0f} µs per item "
          f"({figures['stream_in_items_exported']:.0f} of {figures['stream_in_items_timed']:.0f} "
          "as handles); stream_in_direct_over_star_speedup "
          f"{ratios['stream_in_direct_over_star_speedup']:.2f}")
    if args.ray:
        print(f"the same between Ray actors (tcp): through the parent "
              f"{figures['ray_star_us_per_hop_1mib']:.0f} µs, fetched from the maker "
              f"{figures['ray_direct_us_per_hop_1mib']:.0f} µs; ray_direct_over_star_speedup "
              f"{ratios['ray_direct_over_star_speedup']:.2f}")
    print(f"{'KV-cache LM':>10} {'req':>4} {'in-process':>12} {'segments':>12} {'per node':>12}"
          "   (µs per token)")
    for n in (1, 8):
        print(f"{'decode':>10} {n:>4} " + " ".join(
            f"{figures[f'kv_{k}_us_per_token_{n}req']:>12.1f}"
            for k in ("inproc", "segments", "per_node")))
    for n in (1, 8):
        print(f"{'disagg':>10} {n:>4} {'':>12} " + " ".join(
            f"{figures[f'kv_disagg_{k}_us_per_token_{n}req']:>12.1f}"
            for k in ("segments", "per_node")))
    for k, what in (("", "one worker"), ("disagg_", "prefill and decode on two workers")):
        print(f"kv_{k}segments_speedup ({what}, per node over segments): 1 request "
              f"{ratios[f'kv_{k}segments_speedup_1req']:.2f}, 8 requests "
              f"{ratios[f'kv_{k}segments_speedup_8req']:.2f}")
    print("tiny Qwen3-Omni, thinker on worker 1, talker on worker 2 (ms per request / to first "
          "audio): segments " + " / ".join(
              f"{figures[f'omni_split_segments_{x}']:.0f}" for x in ("ms_per_request",
                                                                    "first_audio_ms"))
          + ", node by node " + " / ".join(
              f"{figures[f'omni_split_per_node_{x}']:.0f}" for x in ("ms_per_request",
                                                                    "first_audio_ms"))
          + f"; omni_split_segments_speedup {ratios['omni_split_segments_speedup']:.2f}")
    print(f"placed_over_inproc_per_node_1req (worst walk): "
          f"{ratios['placed_over_inproc_per_node_1req']:.2f}")
    print(f"mailbox watching (spin_us): {figures['spin_us_1_worker']:.0f} with one worker, "
          f"{figures['spin_us_2_workers']:.0f} with two; {machine()}")
    out = HERE / "results" / "placement.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"name": "placement", "quick": args.quick, "machine": machine(),
                               "figures": figures, "ratios": ratios}, indent=2))
    plot(figures, HERE / "results" / "placement.png")
    print(f"wrote {out}")


def plot(figures: dict[str, float], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.5))
    walks_ = ["chain10", "loop100", "decode256"]
    for ax, n_req in zip(axes[:2], (1, 16)):
        xs = range(len(walks_))
        ax.bar([x - 0.2 for x in xs], [figures[f"inproc_us_per_node_{w}_{n_req}req"]
                                       for w in walks_], 0.4, label="in-process")
        ax.bar([x + 0.2 for x in xs], [figures[f"placed_us_per_node_{w}_{n_req}req"]
                                       for w in walks_], 0.4, label="placed (rank 1)")
        ax.set_xticks(list(xs), walks_)
        ax.set_yscale("log")
        ax.set_ylabel("µs per node execution")
        ax.set_title(f"{n_req} request{'s' if n_req > 1 else ''}")
        ax.legend()
    ax = axes[2]
    for i, (side, label) in enumerate((("inproc", "in-process"), ("segments", "placed, segments"),
                                       ("per_node", "placed, node by node"))):
        ax.bar([x + (i - 1) * 0.27 for x in (0, 1)],
               [figures[f"kv_{side}_us_per_token_{n}req"] for n in (1, 8)], 0.27, label=label)
    ax.set_xticks([0, 1], ["1 request", "8 requests"])
    ax.set_ylabel("µs per generated token")
    ax.set_title("KV-cache LM (64 tokens)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()

"""gpu_check sections 3 and 4: full-size pi0 (PaliGemma 3B -- So400m at 224 px + gemma_2b -- and
the gemma_300m action expert) and full-size SmolVLA (smolvla_base: SmolVLM2-500M's first 16
layers and its 0.75-wide expert), random bfloat16 weights (nothing can be downloaded on the GPU
machines), served by the Runtime with the flow steps eager and as CUDA graphs of batch buckets:
action-chunk latency at 1 robot and chunks/s at 8, alternating, and the two paths' chunks
against each other. pi0 takes two cameras, the state, the normalizer statistics and the
tokenizer of the committed tiny LeRobot fixture (token ids fit the full vocabulary); SmolVLA
takes two random 224 px cameras, a random state and the task as token ids. With --dry-run-cpu
the fixtures' tiny policies run instead, on the CPU (graphs run eagerly there).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

import gpu_check_common as common
from gpu_check_common import Report

FIXTURES = Path(__file__).resolve().parent.parent / "tests" / "reference" / "fixtures"
FIXTURE = FIXTURES / "pi0"
ROBOTS = 8


def random_init(module: torch.nn.Module, seed: int, ones: tuple[str, ...] = ()) -> None:
    """Matrices N(0, 0.02); LayerNorm scales (SigLIP's, or those whose names hold one of
    ``ones``) 1; Gemma's (1 + w) norms and biases 0."""
    g = torch.Generator(device=common.DEVICE).manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.ndim >= 2:
                p.normal_(0.0, 0.02, generator=g)
            elif name.endswith("weight") and (
                    (name.startswith("vision_tower") and "norm" in name)
                    or any(o in name for o in ones)):
                p.fill_(1.0)
            else:
                p.zero_()


def build_policy(report: Report, full: bool) -> Any:
    from mstar_rt.models.lerobot_pi0_config import full_size
    from mstar_rt.models.lerobot_pi0_io import PiProcessor
    from mstar_rt.models.lerobot_pi0_layers import PiModule, lerobot_precision, make_rope
    from mstar_rt.models.lerobot_pi0_load import LeRobotPi0, load_lerobot_pi0

    tiny = load_lerobot_pi0(FIXTURE / "checkpoint", tokenizer=FIXTURE / "tokenizer",
                            sizes={"vision_heads": 2}, verbose=False)
    if not full:
        return tiny
    t = tiny.config
    config = replace(full_size("pi0"), cameras=t.cameras, state_dim=t.state_dim,
                     action_dim=t.action_dim)
    processor = PiProcessor.from_dir(FIXTURE / "checkpoint", config, FIXTURE / "tokenizer")
    t0 = time.perf_counter()
    with torch.device("meta"):
        module = PiModule(config)
    module = lerobot_precision(module.to_empty(device=common.DEVICE), common.DTYPE)
    module.rope = make_rope(config.backbone.head_dim).to(common.DEVICE)
    random_init(module, 0)
    params = sum(p.numel() for p in module.parameters())
    report.data["figures"]["pi0_params_billions"] = round(params / 1e9, 3)
    report.log(f"pi0 full size: {params / 1e9:.2f} B parameters in {common.DTYPE} (LeRobot's "
               f"mixed precision) on {common.DEVICE}, built in {time.perf_counter() - t0:.1f} s")
    return LeRobotPi0(config, module.eval(), processor, "random full-size pi0")


def observation(fx_io: dict, cameras: tuple, seed: int, chunk: int, dim: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"images": {c: (fx_io[f"input.{c}"] + 0.05 * seed).clamp(0, 1) for c in cameras},
            "state": fx_io["input.observation.state"] + 0.01 * seed, "task": "pick up the cube",
            "noise": torch.randn(chunk, dim, generator=g)}


def build_smolvla(report: Report, full: bool) -> Any:
    from mstar_rt.models.smolvla_checkpoint import LeRobotSmolVLA, Normalizer, load_lerobot_smolvla
    from mstar_rt.models.smolvla_config import smolvla_base_config
    from mstar_rt.models.smolvla_layers import SmolVLAModule

    if not full:
        return load_lerobot_smolvla(FIXTURES / "smolvla" / "checkpoint", progress=False)
    config = smolvla_base_config(cameras=("observation.images.camera1",
                                          "observation.images.camera2"))
    t0 = time.perf_counter()
    with torch.device("meta"):
        module = SmolVLAModule(config, lm_head=False)
    module = module.to_empty(device=common.DEVICE).to(common.DTYPE)
    random_init(module, 1, ones=("norm",))  # Llama-style norms scale by w, not (1 + w)
    params = sum(p.numel() for p in module.parameters())
    report.data["figures"]["smolvla_params_billions"] = round(params / 1e9, 3)
    report.log(f"smolvla_base: {params / 1e9:.2f} B parameters in {common.DTYPE} on "
               f"{common.DEVICE}, built in {time.perf_counter() - t0:.1f} s")

    def unit(key: str, n: int) -> Normalizer:
        return Normalizer(key, "MEAN_STD", {"mean": torch.zeros(n), "std": torch.ones(n)})

    return LeRobotSmolVLA(module.eval(), config, None, unit("observation.state", 6),
                          unit("action", 6))


def smolvla_observation(cameras: tuple, seed: int, chunk: int, dim: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"images": {c: torch.rand(3, 224, 224, generator=g) for c in cameras},
            "state": torch.randn(6, generator=g), "task": [1, 22, 333, 44, 5][: 2 + seed % 4],
            "noise": torch.randn(chunk, dim, generator=g)}


def pi0_check(report: Report) -> None:
    from safetensors.torch import load_file

    from mstar_rt.models.lerobot_pi0 import LeRobotPi0Policy

    policy = build_policy(report, full=common.DEVICE != "cpu")
    c = policy.config
    io = load_file(str(FIXTURE / "io.safetensors"))
    obs = [observation(io, c.cameras, s, c.chunk_size, c.max_action_dim) for s in range(64)]
    vla_check(report, "pi0", lambda graphs, engine: LeRobotPi0Policy(
        policy, engine=engine, max_batch=ROBOTS, cuda_graphs=graphs), c.max_prefix, obs)


def smolvla_check(report: Report) -> None:
    from mstar_rt.models.smolvla import SmolVLAPolicy

    policy = build_smolvla(report, full=common.DEVICE != "cpu")
    c = policy.config
    obs = [smolvla_observation(c.cameras, s, c.chunk_size, c.max_action_dim) for s in range(64)]
    vla_check(report, "smolvla", lambda graphs, engine: SmolVLAPolicy(
        policy, engine=engine, max_batch=ROBOTS, cuda_graphs=graphs), c.max_prefix, obs)


def vla_check(report: Report, name: str, make: Any, max_prefix: int, obs: list[dict]) -> None:
    """Eager against graphs for the policy ``make(graphs, engine)`` builds, on ``obs``."""
    from mstar_rt import Runtime
    from mstar_rt.engines import KVCacheEngine

    served: dict[str, Any] = {}
    runtimes = []
    try:
        for mode in ("eager", "graphs"):
            engine = KVCacheEngine(page_size=16, num_pages=ROBOTS * (max_prefix // 16 + 2),
                                   max_batch=ROBOTS)
            p = make(mode == "graphs", engine)
            t0 = time.perf_counter()
            p.warm_up()
            report.data["figures"][f"{name}_warm_up_s_{mode}"] = round(time.perf_counter() - t0,
                                                                       2)
            rt = Runtime(p)
            runtimes.append(rt)
            served[mode] = (rt, p)

        def chunks(mode: str, inputs: list[dict]) -> tuple[float, list[torch.Tensor]]:
            rt = served[mode][0]
            common.sync()
            t0 = time.perf_counter()
            hs = [rt.submit(x) for x in inputs]
            out = [h.result(timeout=300)["actions"][0] for h in hs]
            return time.perf_counter() - t0, out

        for mode in served:  # warm-up: allocator, cuBLAS handles, kernels of every shape
            chunks(mode, obs[:1])
            chunks(mode, obs[:ROBOTS])
        worst, scale = 0.0, 0.0
        lat: dict[str, list[float]] = {m: [] for m in served}
        rate: dict[str, list[float]] = {m: [] for m in served}
        reps = 3 if report.args.quick else 10
        for rep in range(reps):
            if report.left() < 20:
                report.note(f"{name} timing stopped after {rep} reps: budget")
                break
            one = [obs[rep % len(obs)]]
            eight = obs[ROBOTS * (rep % 4):ROBOTS * (rep % 4 + 1)]
            got = {}
            for mode in served:
                dt, got[mode] = chunks(mode, one)
                lat[mode].append(dt)
                wall, _ = chunks(mode, eight)
                rate[mode].append(ROBOTS / wall)
            scale = max(scale, got["eager"][0].abs().max().item())
            worst = max(worst, (got["graphs"][0] - got["eager"][0]).abs().max().item())
        f = report.data["figures"]
        for mode in served:
            if lat[mode]:
                f[f"{name}_chunk_ms_1robot_{mode}"] = round(statistics.median(lat[mode]) * 1e3,
                                                            2)
                f[f"{name}_chunks_per_s_8robots_{mode}"] = round(statistics.median(rate[mode]), 2)
        graphs = served["graphs"][1].graphs
        f[f"{name}_flow_graph_captures"] = graphs.captures
        f[f"{name}_flow_static_steps"] = graphs.runs
        if lat["eager"] and lat["graphs"]:
            report.data["ratios"][f"{name}_graphs_over_eager_speedup_1robot"] = round(
                statistics.median(lat["eager"]) / statistics.median(lat["graphs"]), 2)
            report.data["ratios"][f"{name}_graphs_over_eager_throughput_8robots"] = round(
                statistics.median(rate["graphs"]) / statistics.median(rate["eager"]), 2)
            # bfloat16: the padded static attention sums in another order than the eager one
            report.check(f"{name}_graph_chunk_vs_eager_rel", worst / max(scale, 1e-6), 5e-2)
    finally:
        for rt in runtimes:
            rt.close()

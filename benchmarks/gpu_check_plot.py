"""benchmarks/gpu_check.py's figure: what a GPU run is read for, as a PNG beside its JSON.

Three panels, each drawn only from what the run measured (a section skipped for budget or left
out with --only leaves its panel saying so): decode tokens/s against batch size per backend
(ours eager, ours with CUDA graphs, transformers' generate), the VLAs' chunk latency at 1 robot
and chunks/s at 8 robots, eager against CUDA graphs, and every check as its value over its limit
(a check passes at or below 1)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

DECODE = re.compile(r"decode_tok_s_b(\d+)_(.+)")


def decode_series(figures: dict[str, Any]) -> dict[str, list[tuple[int, float]]]:
    """Backend label -> [(batch, tokens/s)] sorted by batch."""
    series: dict[str, list[tuple[int, float]]] = {}
    for key, value in figures.items():
        m = DECODE.fullmatch(key)
        if m:
            series.setdefault(m.group(2), []).append((int(m.group(1)), float(value)))
    return {label: sorted(points) for label, points in sorted(series.items())}


def vla_bars(figures: dict[str, Any]) -> dict[str, dict[str, tuple[float, float]]]:
    """Family -> mode -> (ms per chunk at 1 robot, chunks/s at 8 robots)."""
    out: dict[str, dict[str, tuple[float, float]]] = {}
    for family in ("pi0", "smolvla"):
        for mode in ("eager", "graphs"):
            ms = figures.get(f"{family}_chunk_ms_1robot_{mode}")
            rate = figures.get(f"{family}_chunks_per_s_8robots_{mode}")
            if ms is not None and rate is not None:
                out.setdefault(family, {})[mode] = (float(ms), float(rate))
    return out


def check_ratios(checks: dict[str, Any]) -> list[tuple[str, float, bool]]:
    """(name, value / limit, ok) per check; a limit of 0 plots a pass as 0 and a failure as 2."""
    rows = []
    for name, c in sorted(checks.items()):
        limit, value = float(c["limit"]), float(c["value"])
        ratio = value / limit if limit > 0 else (0.0 if c["ok"] else 2.0)
        rows.append((name, ratio, bool(c["ok"])))
    return rows


def plot(data: dict[str, Any], path: Path) -> bool:
    """Draw ``data`` (gpu_check's JSON record) to ``path``; False where matplotlib is absent."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    figures = data.get("figures", {})
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    fig.suptitle(data.get("machine", ""), fontsize=8)

    ax = axes[0]
    series = decode_series(figures)
    for label, points in series.items():
        ax.plot([b for b, _ in points], [v for _, v in points], marker="o", label=label)
    if series:
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch (requests decoding at once)")
        ax.set_ylabel("tokens/s")
        ax.legend(fontsize=7)
    else:
        ax.text(0.5, 0.5, "decode speed not measured", ha="center", transform=ax.transAxes)
    ax.set_title("decode throughput")

    ax = axes[1]
    bars = vla_bars(figures)
    if bars:
        names = [f"{fam} {mode}" for fam, modes in bars.items() for mode in modes]
        ms = [v[0] for modes in bars.values() for v in modes.values()]
        rate = [v[1] for modes in bars.values() for v in modes.values()]
        xs = range(len(names))
        ax.bar([x - 0.2 for x in xs], ms, 0.4, label="ms per chunk, 1 robot")
        twin = ax.twinx()
        twin.bar([x + 0.2 for x in xs], rate, 0.4, color="tab:orange",
                 label="chunks/s, 8 robots")
        ax.set_xticks(list(xs), names, fontsize=8)
        ax.set_ylabel("ms per chunk (1 robot)")
        twin.set_ylabel("chunks/s (8 robots)")
        ax.legend(loc="upper left", fontsize=7)
        twin.legend(loc="upper right", fontsize=7)
    else:
        ax.text(0.5, 0.5, "VLA sections not run", ha="center", transform=ax.transAxes)
    ax.set_title("action chunks: eager vs CUDA graphs")

    ax = axes[2]
    rows = check_ratios(data.get("checks", {}))
    if rows:
        ax.barh([r[0] for r in rows], [max(r[1], 1e-6) for r in rows],
                color=["tab:green" if r[2] else "tab:red" for r in rows])
        ax.axvline(1.0, color="black", linewidth=0.8)
        ax.set_xscale("log")
        ax.set_xlabel("value / limit (passes at or below 1)")
        ax.tick_params(axis="y", labelsize=6)
    else:
        ax.text(0.5, 0.5, "no checks ran", ha="center", transform=ax.transAxes)
    ax.set_title("checks")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True

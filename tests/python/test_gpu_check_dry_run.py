"""benchmarks/gpu_check.py's pi0 section runs on the CPU (--dry-run-cpu: the fixture's tiny
policy, graphs eagerly) before it ever spends GPU time: every figure, ratio and check it
reports on a GPU comes out, and the check passes."""

import json
import subprocess
import sys
from pathlib import Path

from child_env import child_env

ROOT = Path(__file__).resolve().parents[2]


def test_gpu_check_pi0_section_dry_run_on_the_cpu(tmp_path):
    out = tmp_path / "gpu_check.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"),
                           "--dry-run-cpu", "--only", "pi0", "--quick", "--out", str(out)],
                          env=child_env(ROOT / "benchmarks"), capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["failed"] == [] and result["checks"]["pi0_graph_chunk_vs_eager_rel"]["ok"]
    f = result["figures"]
    for mode in ("eager", "graphs"):
        assert f[f"pi0_chunk_ms_1robot_{mode}"] > 0 and f[f"pi0_chunks_per_s_8robots_{mode}"] > 0
    assert f["pi0_flow_static_steps"] > 0 and f["pi0_flow_graph_captures"] == 0  # no CUDA here
    assert set(result["ratios"]) == {"pi0_graphs_over_eager_speedup_1robot",
                                     "pi0_graphs_over_eager_throughput_8robots"}
    assert "== attention" not in proc.stdout  # --only ran the one section

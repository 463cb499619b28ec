"""benchmarks/gpu_check.py's VLA sections (pi0, SmolVLA) and its placement section run on the
CPU (--dry-run-cpu: the fixtures' tiny policies, graphs eagerly; workers on the CPU) before they
ever spend GPU time: every figure, ratio and check they report on a GPU comes out, and the checks
pass."""

import json
import subprocess
import sys
from pathlib import Path

from child_env import child_env

ROOT = Path(__file__).resolve().parents[2]


def dry_run(tmp_path: Path, only: str) -> tuple[dict, str]:
    """gpu_check.py --dry-run-cpu --quick of sections ``only``: (its JSON, its output); it
    must exit 0 with no failed check."""
    out = tmp_path / "gpu_check.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"),
                           "--dry-run-cpu", "--only", only, "--quick", "--out", str(out)],
                          env=child_env(ROOT / "benchmarks"), capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["failed"] == []
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    return result, proc.stdout


def test_gpu_check_vla_sections_dry_run_on_the_cpu(tmp_path):
    result, stdout = dry_run(tmp_path, "pi0,smolvla")
    f = result["figures"]
    for name in ("pi0", "smolvla"):
        assert result["checks"][f"{name}_graph_chunk_vs_eager_rel"]["ok"]
        for mode in ("eager", "graphs"):
            assert f[f"{name}_chunk_ms_1robot_{mode}"] > 0
            assert f[f"{name}_chunks_per_s_8robots_{mode}"] > 0
        assert f[f"{name}_flow_static_steps"] > 0
        assert f[f"{name}_flow_graph_captures"] == 0  # no CUDA here
    assert set(result["ratios"]) == {f"{name}_graphs_over_eager_{what}" for name in
                                     ("pi0", "smolvla") for what in ("speedup_1robot",
                                                                     "throughput_8robots")}
    assert "== attention" not in stdout  # --only ran those sections alone


def test_gpu_check_placement_section_dry_runs_on_the_cpu(tmp_path):
    """The section that sends CUDA tensors between two workers, on the CPU: its checks pass
    (equal to in process, inputs where the reading node is, the large tensor worker to worker)."""
    result, _ = dry_run(tmp_path, "placement")
    assert {k for k in result["checks"] if k.startswith("placement_")} == {
        "placement_inputs_not_on_the_nodes_device", "placement_output_vs_in_process_rel",
        "placement_large_tensor_not_worker_to_worker"}
    assert result["figures"]["placement_ms_per_request_placed"] > 0


def test_gpu_check_plot_reads_every_series_of_a_gpu_record(tmp_path):
    """The figure's parsing of a record as a GPU run writes it: decode tokens/s per backend
    sorted by batch, the VLA bars per family and mode, each check's value over its limit."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import gpu_check_plot as gp
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    figures = {"decode_tok_s_b16_graphs_torch": 900.0, "decode_tok_s_b1_graphs_torch": 80.0,
               "decode_tok_s_b1_hf_generate": 30.0, "ms_per_step_b1_hf_generate": 33.0,
               "pi0_chunk_ms_1robot_eager": 40.0, "pi0_chunks_per_s_8robots_eager": 60.0,
               "pi0_chunk_ms_1robot_graphs": 20.0, "pi0_chunks_per_s_8robots_graphs": 90.0,
               "smolvla_chunk_ms_1robot_eager": 30.0}  # no 8-robot figure: no bar
    checks = {"a_rel": {"value": 0.025, "limit": 0.05, "ok": True},
              "b_flag": {"value": 1.0, "limit": 0.0, "ok": False}}
    assert gp.decode_series(figures) == {"graphs_torch": [(1, 80.0), (16, 900.0)],
                                         "hf_generate": [(1, 30.0)]}
    assert gp.vla_bars(figures) == {"pi0": {"eager": (40.0, 60.0), "graphs": (20.0, 90.0)}}
    assert gp.check_ratios(checks) == [("a_rel", 0.5, True), ("b_flag", 2.0, False)]
    png = tmp_path / "g.png"
    assert gp.plot({"machine": "test", "figures": figures, "checks": checks}, png)
    assert png.read_bytes()[:4] == b"\x89PNG"

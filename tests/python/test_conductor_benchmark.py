"""benchmarks/conductor.py --quick runs end to end: every cell is measured (each run checks that
every request ran all its node executions), and the result names both asyncio baselines."""

import json
import subprocess
import sys
from pathlib import Path

from child_env import child_env

ROOT = Path(__file__).resolve().parents[2]


def test_conductor_benchmark_quick_writes_its_result_and_plot(tmp_path):
    out = tmp_path / "conductor.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "conductor.py"), "--quick",
                           "--out", str(out)], env=child_env(ROOT / "benchmarks"),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["name"] == "conductor" and result["quick"] is True
    assert set(result["ratios"]) == {
        "py_nodes_16req_vs_asyncio", "py_nodes_1req_vs_asyncio", "cpp_nodes_16req_vs_asyncio",
        "py_nodes_16req_vs_asyncio_on_loop", "py_nodes_1req_vs_asyncio_on_loop"}
    figures = result["figures"]
    for walk in ("chain10", "loop100", "dynamic256"):
        for n in (1, 16):
            for kind in ("cpp", "py", "asyncio", "asyncio_threaded"):
                assert figures[f"us_per_node_{walk}_{n}req_{kind}"] > 0
    assert 0 < figures["cold_start_s"] < 60
    assert out.with_suffix(".png").exists()
    assert "py_nodes_16req_vs_asyncio" in proc.stdout

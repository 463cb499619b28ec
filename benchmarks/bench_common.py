"""What every benchmark records about the machine it ran on, and helpers they share."""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Callable


def machine() -> str:
    """Kernel, architecture, CPU model and core count, e.g. for the JSON result's "machine"."""
    model = platform.processor() or "unknown cpu"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    u = platform.uname()
    return f"{u.system} {u.release} {u.machine}; {model}; nproc={os.cpu_count()}"


ROOT = Path(__file__).resolve().parents[1]


def _source_tree_built() -> bool:
    """True when python/mstar_rt in this checkout holds a built extension (a developer's in-place
    build); otherwise the installed package (scripts/setup.sh) is the one to import."""
    return any((ROOT / "python" / "mstar_rt").glob("_core*.so"))


def use_source_tree() -> None:
    """Imports mstar_rt from this checkout if it is built in place, else from the install."""
    import sys

    if _source_tree_built() and str(ROOT / "python") not in sys.path:
        sys.path.insert(0, str(ROOT / "python"))


def child_pythonpath(*extra: str) -> str:
    """PYTHONPATH for a child process: the checkout if built in place, then ``extra``, then the
    current PYTHONPATH."""
    parts = ([str(ROOT / "python")] if _source_tree_built() else []) + list(extra)
    return os.pathsep.join(parts + [p for p in [os.environ.get("PYTHONPATH", "")] if p])


def build_cpp_driver(target: str, build_dir: Path = ROOT / "build" / "bench") -> Path:
    """Configures this checkout with the benchmark drivers on (Release), builds ``target`` and
    returns its path; exits with the build's output if that fails."""
    if shutil.which("cmake") is None:
        sys.exit(f"{target}: cmake is not on PATH; install CMake >= 3.18 to build the C++ driver")
    steps = [
        ["cmake", "-S", str(ROOT), "-B", str(build_dir), "-DMSTAR_BUILD_BENCHMARKS=ON",
         "-DMSTAR_BUILD_PYTHON=OFF", "-DCMAKE_BUILD_TYPE=Release"],
        ["cmake", "--build", str(build_dir), "--target", target, "-j", str(os.cpu_count() or 2)],
    ]
    print(f"building {target} in {build_dir.relative_to(ROOT)} ...", flush=True)
    for cmd in steps:
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            sys.stderr.write(r.stdout[-4000:] + r.stderr[-4000:])
            sys.exit(f"{target}: '{' '.join(cmd[:3])} ...' failed (exit {r.returncode}); see the "
                     "output above")
    exe = build_dir / "benchmarks" / target
    if not exe.exists():
        sys.exit(f"{target}: the build finished but {exe} is missing")
    return exe


def alternate(cases: list[tuple[str, Callable[[], float]]], reps: int, label: str
              ) -> dict[str, list[float]]:
    """Each case's seconds over ``reps`` rounds, the cases taking turns in every round (so
    machine noise hits them alike); a tqdm bar labelled ``label``."""
    from tqdm import tqdm

    times: dict[str, list[float]] = {name: [] for name, _ in cases}
    for _ in tqdm(range(reps), desc=label, leave=False):
        for name, fn in cases:
            times[name].append(fn())
    return times

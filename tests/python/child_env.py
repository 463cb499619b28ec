"""Environment for tests that run Python in a child process (examples, benchmarks, servers)."""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def child_env(*extra_path: str | Path, **overrides: str) -> dict[str, str]:
    """os.environ with PYTHONPATH = the checkout's python/ only if it is built in place (a
    developer's tree; CI imports the installed package, which has the compiled core), then
    ``extra_path``, then the current PYTHONPATH."""
    built = any((ROOT / "python" / "mstar_rt").glob("_core*.so"))
    parts = ([str(ROOT / "python")] if built else []) + [str(p) for p in extra_path]
    if os.environ.get("PYTHONPATH"):
        parts.append(os.environ["PYTHONPATH"])
    return {**os.environ, "PYTHONPATH": os.pathsep.join(parts), **overrides}

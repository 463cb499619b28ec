"""What every benchmark records about the machine it ran on."""

from __future__ import annotations

import os
import platform
from pathlib import Path


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

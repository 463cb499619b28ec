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

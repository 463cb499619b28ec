"""Starting a helper process of this package (a tensor-parallel follower, a decode process):
``python -m MODULE FD`` with one end of a socket pair, able to import this very package.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from multiprocessing.connection import Connection
from typing import Sequence


def spawn_child(module: str, import_path: Sequence[str] = ()) -> tuple[subprocess.Popen,
                                                                        Connection]:
    """Starts ``python -m module FD`` and returns it with our end of the pair. The package root
    (then ``import_path``) goes first on its PYTHONPATH, so the child runs the same source tree
    as its parent even when the package is not installed."""
    import mstar_rt

    ours, theirs = socket.socketpair()
    package_root = os.path.dirname(os.path.dirname(os.path.abspath(mstar_rt.__file__)))
    first = [package_root] + [os.path.abspath(p) for p in import_path]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(first + [
        p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    try:
        proc = subprocess.Popen([sys.executable, "-m", module, str(theirs.fileno())],
                                pass_fds=(theirs.fileno(),), env=env)
    finally:
        theirs.close()
    return proc, Connection(ours.detach())

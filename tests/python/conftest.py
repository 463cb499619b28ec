"""Fixtures shared by the runtime tests (test_runtime_*.py)."""

import pytest

from mstar_rt import Runtime

from leak_check import leftovers, serve_threads, shm_files
from walk_models import close_within, engine_threads, open_all_gates


@pytest.fixture(scope="module", autouse=True)
def nothing_left_behind():
    """Fails the module that leaves placement files in /dev/shm, placement workers or serving
    threads running."""
    before = shm_files(), serve_threads()
    yield
    files, pids, threads = leftovers(before)
    assert not files and not pids and not threads, (
        f"this module left behind /dev/shm files {sorted(files)}, worker pids {sorted(pids)} "
        f"and {len(threads)} serving threads (e.g. {sorted(threads)[:3]}): a server not "
        "stopped, or an app whose app.state.serve was never closed")


@pytest.fixture
def serve():
    """``serve(model)`` starts a Runtime that is closed (gates opened first) after the test, which
    then checks that no engine thread survived."""
    made = []

    def make(model, **kw):
        rt = Runtime(model, **kw)
        made.append(rt)
        return rt

    yield make
    open_all_gates()
    for rt in made:
        close_within(rt)
    assert engine_threads() == []


@pytest.fixture(scope="session")
def devices():
    """The virtual audio devices, started once per session (see virtual_audio.py)."""
    from virtual_audio import start_devices

    return start_devices()


@pytest.fixture(scope="module")
def one_torch_thread():
    """Torch at one intra-op thread for the module: the model tests run tiny ops, where an
    OpenMP pool only spins and fights the engine workers on 2 cores. A module opts in with
    ``pytestmark = pytest.mark.usefixtures("one_torch_thread")``."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)

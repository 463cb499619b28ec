"""The Python half of mstar_rt::embed (mstar_rt.embed), driven the way the C++ library drives
it: load a model from a file + class + JSON config, submit_to + attach with two callables.
The C++ half is tested by ctest (tests/cpp/test_embed_model.cpp) and, from an installed wheel,
by test_packaging.py."""

import pathlib
import threading

import numpy as np
import pytest

from mstar_rt import embed

MODEL = pathlib.Path(__file__).resolve().parents[1] / "cpp" / "embed_tiny_model.py"


class Sink:
    def __init__(self):
        self.outputs, self.ends = [], []
        self.done = threading.Event()

    def emit(self, name, node, array):
        self.outputs.append((name, array))

    def end(self, status, message, timeline):
        self.ends.append((status, message, timeline))
        self.done.set()


def test_load_builds_the_class_with_the_json_config_and_streams_in_order():
    rt = embed.load(str(MODEL), "TinyModel", '{"factor": 3.0, "steps": 2}')
    try:
        sink = Sink()
        rid = rt.submit_to({"x": np.array([1.0, 2.0], np.float32)})
        rt.attach(rid, sink.emit, sink.end)
        assert sink.done.wait(30)
        assert [n for n, _ in sink.outputs] == ["y", "step", "step"]
        assert sink.outputs[0][1].tolist() == [3.0, 6.0]
        status, message, timeline = sink.ends[0]
        assert (status, message) == ("finished", "")
        assert [t[0] for t in timeline] == ["scale", "count", "count"]
        assert not rt._pending and not rt._sinks
    finally:
        rt.close()


def test_outputs_made_before_attach_are_kept_and_a_failure_is_reported():
    rt = embed.load(str(MODEL), "TinyModel")
    try:
        rid = rt.submit_to({"x": np.array([-1.0], np.float32)})
        late = Sink()
        threading.Event().wait(0.2)  # let the request fail before anyone listens
        rt.attach(rid, late.emit, late.end)
        assert late.done.wait(30)
        status, message, _ = late.ends[0]
        assert status == "failed" and "x[0] is -1.0" in message
    finally:
        rt.close()


def test_requests_submitted_from_python_are_served_without_leaving_anything_behind():
    rt = embed.load(str(MODEL), "TinyModel")
    try:
        out = rt.submit({"x": np.array([1.0], np.float32)}).result(timeout=30)
        assert out["y"][0].tolist() == [2.0]
        assert not rt._pending and not rt._sinks
    finally:
        rt.close()


def test_load_errors_name_the_module_and_class():
    with pytest.raises(AttributeError, match="has no class 'Nope'"):
        embed.load(str(MODEL), "Nope")
    with pytest.raises(TypeError, match="not an mstar_rt.Model"):
        embed.load("json", "JSONDecoder")
    with pytest.raises(TypeError, match="must be a JSON object"):
        embed.load(str(MODEL), "TinyModel", "[1, 2]")
    with pytest.raises(FileNotFoundError):
        embed.load("/nonexistent/model.py", "M")


def test_to_array_gives_c_contiguous_numbers_and_refuses_objects():
    torch = pytest.importorskip("torch")
    a = embed.to_array(torch.arange(6, dtype=torch.float32).reshape(2, 3).t())
    assert a.flags.c_contiguous and a.shape == (3, 2) and a.dtype == np.float32
    with pytest.raises(TypeError, match="cannot reach C\\+\\+"):
        embed.to_array(np.array(["a"], dtype=object))


ONE_NODE = '''
import numpy as np
import mstar_rt as m
from mstar_rt import EMIT, GraphEdge, GraphNode


class Out(m.NodeSubmodule):
    def __init__(self, kind):
        self.kind = kind

    def forward(self, batch):
        import torch
        make = {"uint16": lambda: np.arange(3, dtype=np.uint16), "str": lambda: "text",
                "big_endian": lambda: np.arange(3).astype(">f4"),
                "bfloat16": lambda: torch.arange(3, dtype=torch.bfloat16)}[self.kind]
        return [{"y": make(), "z": np.ones(1, np.float32)} for _ in batch]


class OneNode(m.Model):
    inputs = ("x",)
    nodes = [GraphNode("out", ["x"], [GraphEdge(EMIT, "y"), GraphEdge(EMIT, "z")])]
    walks = {"main": "out"}

    def __init__(self, kind):
        self.submodules = {"out": Out(kind)}
'''


@pytest.mark.parametrize("kind, dtype", [("uint16", None), ("str", None),
                                         ("big_endian", np.float32), ("bfloat16", np.float32)])
def test_an_output_cpp_cannot_take_fails_its_request_even_when_its_walk_is_done(
        tmp_path, kind, dtype):
    """The walk has ended by the time its outputs reach the sink: the request must still end
    failed, naming the output, not finished without it (what C++ saw before)."""
    pytest.importorskip("torch")
    (tmp_path / "one_node.py").write_text(ONE_NODE)
    rt = embed.load(str(tmp_path / "one_node.py"), "OneNode", f'{{"kind": "{kind}"}}')
    try:
        for _ in range(2):  # a refused request leaves nothing that spoils the next
            sink = Sink()
            rid = rt.submit_to({"x": np.zeros(1, np.float32)})
            rt.attach(rid, sink.emit, sink.end)
            assert sink.done.wait(30)
            status, message, _ = sink.ends[0]
            if dtype is None:
                assert status == "failed" and "EMIT output 'y'" in message, (status, message)
                assert "cannot reach C++" in message and [n for n, _ in sink.outputs] == []
            else:  # widened or turned native: C++ reads the bytes as float32 in this order
                assert (status, message) == ("finished", "")
                y = dict(sink.outputs)["y"]
                assert y.dtype == dtype and y.dtype.isnative and y.tolist() == [0.0, 1.0, 2.0]
            assert rt.requests.get(rid) is None
    finally:
        rt.close()

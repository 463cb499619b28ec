"""The Python side of mstar_rt::embed: a C++ program serves a Python-defined model in-process.

The C++ library (cpp/include/mstar/embed.hpp) calls :func:`load` to build the model and its
:class:`EmbeddedRuntime`, then, per request, :meth:`EmbeddedRuntime.submit_to` and
:meth:`EmbeddedRuntime.attach` with two C++ callables: ``emit(name, node, array)`` for every EMIT
output, in order, and ``end(status, message, timeline)`` once. Values are handed over as
C-contiguous numpy arrays; C++ copies them.
"""

from __future__ import annotations

import json
import threading
from typing import Any, Callable, Mapping, Optional

import numpy as np

from mstar_rt.config import ModelSpec
from mstar_rt.config.errors import ConfigError, FactoryNotFound
from mstar_rt.model import Model
from mstar_rt.runtime import DeadlineExceeded, RequestCancelled, RequestHandle, Runtime

__all__ = ["EmbeddedRuntime", "load", "to_array"]


#: The numpy dtypes C++ tensors hold (mstar::DType; bfloat16 comes widened to float32).
CPP_DTYPES = frozenset({"float16", "float32", "float64", "int8", "int16", "int32", "int64",
                        "uint8", "bool"})


def to_array(value: Any) -> np.ndarray:
    """A node's output as a C-contiguous, native-byte-order numpy array of a dtype C++ holds
    (torch tensors are moved to CPU; bfloat16, which numpy lacks, is widened to float32)."""
    if hasattr(value, "detach") and hasattr(value, "cpu"):  # torch.Tensor, without importing torch
        value = value.detach().cpu()
        if str(value.dtype) == "torch.bfloat16":
            value = value.float()
        value = value.numpy()
    array = np.asarray(value)
    if array.dtype.name not in CPP_DTYPES:
        raise TypeError(f"an EMIT output of dtype {array.dtype} cannot reach C++; emit one of "
                        f"{sorted(CPP_DTYPES)} (a numpy array or torch tensor; cast wider "
                        "unsigned integers to int64)")
    if not array.dtype.isnative:  # C++ reads the bytes as this machine's order
        array = array.astype(array.dtype.newbyteorder("="))
    return np.ascontiguousarray(array)


def load(module: str, cls: str, config_json: str = "{}") -> "EmbeddedRuntime":
    """Builds ``module.cls(**config)`` (``module``: an importable name or a ``.py`` file) and
    serves it."""
    config = json.loads(config_json or "{}")
    if not isinstance(config, dict):
        raise TypeError(f"the model config must be a JSON object, got {config_json!r}")
    try:
        model = ModelSpec(f"{module}:{cls}", config).build()
    except FactoryNotFound:  # C++ callers name a class; say it in their words
        raise AttributeError(f"module {module} has no class {cls!r}") from None
    except ConfigError as e:  # worded for a YAML config: say it in a C++ caller's words
        text = str(e).replace("model.class: ", "").replace("model.args: ", "config_json: ")
        text = text.replace("add its folder to model.path",
                            "put its folder in PythonConfig::paths or $PYTHONPATH")
        kind = next((t for t in (FileNotFoundError, ImportError, TypeError) if isinstance(e, t)),
                    ValueError)  # the builtin C++ (and older callers) tell apart
        raise kind(text) from None
    return EmbeddedRuntime(model)


def _timeline(handle: RequestHandle) -> list[tuple]:
    """The request's node executions as C++ NodeRun fields (nanoseconds)."""
    return [(r["node"], r["walk"], r["iteration"], r["batch_size"], int(r["queued"] * 1e9),
             int(r["started"] * 1e9), int(r["finished"] * 1e9)) for r in handle.stats()]


class EmbeddedRuntime(Runtime):
    """A Runtime whose request outputs also go to C++ callables, in order."""

    def __init__(self, model: Model, **kw: Any) -> None:
        self._sinks: dict[int, tuple[Callable, Callable, Optional[Callable]]] = {}
        # Outputs and ends of requests submit_to returned but attach has not wired up yet.
        self._pending: dict[int, list] = {}
        self._sink_lock = threading.RLock()
        self._submitting: Optional[int] = None  # the thread inside submit_to's submit()
        # Requests with an output C++ could not take: why. Their later outputs are dropped and
        # their end is a failure, even when the walk had already finished.
        self._refused: dict[int, str] = {}
        super().__init__(model, **kw)

    def submit_to(self, inputs: Mapping[str, Any], deadline: Optional[float] = None,
                  priority: int = 0, fail_late: bool = False) -> int:
        """Submits; outputs wait until :meth:`attach` says where they go. Returns the id.

        The sink lock is held across the submit, so a worker's first output for this request
        waits until the request is known to be expecting a sink (it is buffered, not dropped).
        """
        with self._sink_lock:
            self._submitting = threading.get_ident()
            before = set(self._pending)
            try:
                rid = self.submit(inputs, deadline=deadline, priority=priority,
                                  fail_late=fail_late).id
            except DeadlineExceeded as e:
                # refused at once: a failed request, as the C++ Runtime returns, whose end
                # waits in _pending for attach (it was left there for good)
                new = [r for r in self._pending if r not in before]
                if not (e.refused and len(new) == 1):
                    raise
                rid = new[0]
            finally:
                self._submitting = None
            self._pending.setdefault(rid, [])
            return rid

    def attach(self, rid: int, emit: Callable, end: Callable,
               deliver: Optional[Callable] = None) -> None:
        """Sends the request's outputs (those so far, then the rest as they come) and its end.
        ``emit`` only queues an output; ``deliver`` (C++'s on_output, when set) is called after
        the sink lock is let go, so a slow callback holds up no other request's submit."""
        with self._sink_lock:
            self._sinks[rid] = (emit, end, deliver)
            for event in self._pending.pop(rid, []):
                self._forward(rid, event)
        if deliver is not None:
            deliver()

    def cancel_request(self, rid: int) -> bool:
        handle = self.requests.get(rid)
        return handle.cancel() if handle is not None else False

    def timeline_of(self, rid: int) -> list[tuple]:
        """A running request's node executions so far (Request::timeline)."""
        handle = self.requests.get(rid)
        return _timeline(handle) if handle is not None else []

    def close_soon(self) -> None:
        """Closes on a thread of its own: C++ destroyed the model on one of its workers (in an
        output callback), which cannot join itself."""
        threading.Thread(target=self.close, name="mstar-embed-close", daemon=True).start()

    def _forward(self, rid: int, event: tuple) -> None:
        sink = self._sinks.get(rid)
        if sink is None:  # a request submitted from Python (plain submit) has no sink: skip it
            if rid in self._pending or self._submitting == threading.get_ident():
                self._pending.setdefault(rid, []).append(event)
            return
        if event[0] == "emit":
            _, name, node, value = event
            if rid in self._refused:
                return
            try:
                sink[0](name, node, to_array(value))
            except Exception as e:  # an output C++ cannot take fails the request, not the runtime
                self._refused[rid] = f"EMIT output '{name}': {e}"
                # stops a walk still running; one already done ends failed in ended()
                self.report(self.conductor.fail(rid, self._refused[rid]))
        else:
            self._sinks.pop(rid, None)
            why = self._refused.pop(rid, None)
            if why is not None and event[1] != "failed":
                event = ("end", "failed", why, event[3])
            sink[1](*event[1:])

    def report(self, outcome: tuple) -> None:
        emits = outcome[0]
        if emits:
            with self._sink_lock:
                for rid, name, value, *_ in emits:
                    self._forward(rid, ("emit", name, "", value))
                calls = {rid: self._sinks[rid][2] for rid, *_ in emits if rid in self._sinks}
            for deliver in calls.values():  # before the request's end, on this same thread
                if deliver is not None:
                    deliver()
        super().report(outcome)

    def ended(self, handle: RequestHandle, error: Optional[BaseException]) -> None:
        rid = handle.id
        if error is None:
            status, message = "finished", ""
        elif isinstance(error, RequestCancelled):
            status, message = "cancelled", str(error)
        else:
            status, message = "failed", str(error)
        with self._sink_lock:
            self._forward(rid, ("end", status, message, _timeline(handle)))

"""mstar_rt C++ core: lock-free rings, chunk policies, stream buffers, the graph compiler, the conductor"""

# Typed face of the compiled module (bindings/**/*.cpp). tests/python/test_core_stub.py fails
# when this file and the extension drift apart: a name, a member's kind, a parameter or a base
# class added, removed or renamed on one side only.
# int stands for the bindings' size_t / int64 parameters and float for their double ones;
# parameters a binding leaves unnamed (pybind11 calls them arg0, arg1...) are positional-only.

from collections.abc import Callable, Sequence
from typing import Any, final

import numpy as np
import numpy.typing as npt
from typing_extensions import Self, TypeAlias

@final
class Outcome(tuple[Any, ...]):
    """What a Conductor call changed that the caller acts on."""

    n_fields: int
    n_sequence_fields: int
    n_unnamed_fields: int
    def __new__(cls, sequence: Sequence[Any], dict: dict[str, Any] = ...) -> Self: ...
    @property
    def emits(self) -> list[tuple[int, str, Any]]:
        """[(request, name, value)] streamed to callers, in order"""
    @property
    def walks_done(self) -> list[int]:
        """[request] whose walk ended: ask the model for the next walk"""
    @property
    def failed(self) -> list[tuple[int, str]]:
        """[(request, message)] that ended with an error"""
    @property
    def expired(self) -> list[tuple[int, str, bool, float]]:
        """[(request, node, refused, late_s)]: those of failed that their deadline ended"""
    @property
    def part_choices(self) -> list[tuple[int, int, str, int]]:
        """[(request, section, part, finished)]: a Part waits for the model to choose its next walk (finished: the index of the walk that ended, -1 at its start)"""

@final
class WorkItem(tuple[Any, ...]):
    """One node execution handed to an engine."""

    n_fields: int
    n_sequence_fields: int
    n_unnamed_fields: int
    def __new__(cls, sequence: Sequence[Any], dict: dict[str, Any] = ...) -> Self: ...
    @property
    def id(self) -> int:
        """the work item's id (complete / fail_items take it)"""
    @property
    def request(self) -> int:
        """the request's id"""
    @property
    def iteration(self) -> int:
        """of the innermost enclosing loop (0 outside loops)"""
    @property
    def inputs(self) -> dict[str, Any]:
        """{input name: value, or a list for an accumulated output or stream chunk}"""
    @property
    def chunk(self) -> tuple[int, int, int, bool] | None:
        """(begin, new_begin, end, last) of a stream consumer's chunk, else None"""

_Outcome: TypeAlias = Outcome
# A batch: (node, walk, items).
_Batch: TypeAlias = tuple[int, int, list[WorkItem]]

class StreamClosedError(RuntimeError): ...

class Ring:
    """Bounded lock-free single-producer / single-consumer ring of fixed-size numpy items.

    One thread pushes, one thread pops. Waits release the GIL. peek() returns a read-only view into
    the ring's own memory (no copy) that stays valid until release(); reserve() returns a writable
    view to fill in place before commit()."""

    def __init__(
        self,
        dtype: npt.DTypeLike,
        capacity: int,
        item_shape: Sequence[int] = ...,
        overflow: str = "block",
        mirror: int = 0,
    ) -> None: ...
    def push(self, items: npt.NDArray[Any], timeout: float | None = None) -> int: ...
    def reserve(self, max_count: int) -> npt.NDArray[Any]: ...
    def commit(self, count: int) -> None: ...
    def pop(self, max_count: int = 1, timeout: float | None = None) -> npt.NDArray[Any] | None: ...
    def peek(self, max_count: int) -> npt.NDArray[Any]: ...
    def release(self, count: int) -> None: ...
    def wait_for_items(self, count: int, timeout: float | None = None) -> bool: ...
    def close(self) -> None: ...
    def __len__(self) -> int: ...
    @property
    def closed(self) -> bool: ...
    @property
    def capacity(self) -> int: ...
    @property
    def dtype(self) -> np.dtype[Any]: ...
    @property
    def item_shape(self) -> tuple[int, ...]: ...
    @property
    def overflow(self) -> str: ...
    @property
    def stats(self) -> dict[str, int]: ...
    @property
    def storage_range(self) -> tuple[int, int]: ...

class ChunkPolicy:
    """When a streaming consumer fires and on which items (see docs/chunk_policies.md). Build one with
    Fixed, SlidingWindow, LeftContext or Ramp."""

    @staticmethod
    def fixed(k: int) -> ChunkPolicy: ...
    @staticmethod
    def sliding_window(window: int, stride: int) -> ChunkPolicy: ...
    @staticmethod
    def left_context(context: int, size: int) -> ChunkPolicy: ...
    @staticmethod
    def ramp(first: Sequence[int], steady: int, context: int = 0) -> ChunkPolicy: ...
    @property
    def context(self) -> int: ...
    @property
    def max_chunk(self) -> int: ...
    def new_size(self, index: int) -> int: ...
    def __repr__(self) -> str: ...

class Chunk:
    """A ready chunk: items [begin, end) of the stream, of which [new_begin, end) are new. `data` and
    `new` are read-only views into the ring (no copy), valid until release()."""

    @property
    def data(self) -> npt.NDArray[Any]: ...
    @property
    def new(self) -> npt.NDArray[Any]: ...
    @property
    def begin(self) -> int: ...
    @property
    def new_begin(self) -> int: ...
    @property
    def end(self) -> int: ...
    @property
    def index(self) -> int: ...
    @property
    def last(self) -> bool: ...
    @property
    def released(self) -> bool: ...
    def __len__(self) -> int: ...
    def release(self) -> None: ...
    def __enter__(self) -> Self: ...
    def __exit__(self, *args: object) -> None: ...
    def __repr__(self) -> str: ...

class ChunkIterator:
    def __iter__(self) -> Self: ...
    def __next__(self) -> Chunk: ...

class StreamBuffer:
    """A ring plus a chunk policy: one streaming edge. The producer pushes items; the consumer takes
    whole chunks as zero-copy views. A held chunk pins its items until released."""

    def __init__(
        self,
        dtype: npt.DTypeLike,
        capacity: int,
        policy: ChunkPolicy,
        item_shape: Sequence[int] = ...,
        overflow: str = "block",
    ) -> None: ...
    def push(self, items: npt.NDArray[Any], timeout: float | None = None) -> int: ...
    def reserve(self, max_count: int) -> npt.NDArray[Any]: ...
    def commit(self, count: int) -> None: ...
    def close(self) -> None: ...
    def next_chunk(self, timeout: float | None = None) -> Chunk | None: ...
    def __iter__(self) -> ChunkIterator: ...
    def __len__(self) -> int: ...
    @property
    def closed(self) -> bool: ...
    @property
    def holding(self) -> bool: ...
    @property
    def policy(self) -> ChunkPolicy: ...
    @property
    def capacity(self) -> int: ...
    @property
    def dtype(self) -> np.dtype[Any]: ...
    @property
    def item_shape(self) -> tuple[int, ...]: ...
    @property
    def overflow(self) -> str: ...
    @property
    def stats(self) -> dict[str, int]: ...
    @property
    def storage_range(self) -> tuple[int, int]: ...

@final  # a C type without Py_TPFLAGS_BASETYPE
class WorkContext:
    """WorkContext(request, iteration=0)

    Per-execution facts a submodule may want besides the inputs: the request and the iteration of the innermost enclosing loop."""

    request: Any
    """The RequestContext: id, inputs, walk, and the model's own per-request state."""
    iteration: int
    """The iteration of the innermost enclosing loop (0 outside loops)."""
    def __new__(cls, request: Any, iteration: int = 0) -> Self: ...

class GraphError(ValueError):
    """A malformed graph or walk; the message names what is wrong, where, and what to do."""

class Edge:
    """One output of a node (mstar::Edge): a value for a node, EMIT or no one in particular, or a stream to a node."""

    def __init__(self, to: str, name: str, persist: bool = False) -> None: ...
    @staticmethod
    def output(name: str) -> Edge:
        """A plain output, read by name."""
    @staticmethod
    def stream(to: str, name: str, policy: ChunkPolicy,
               continue_after_done: bool = False) -> Edge:
        """A stream to node ``to``; ``continue_after_done``: a consumer in its own loop goes
        on with empty windows after the stream is over."""
    @property
    def to(self) -> str: ...
    @property
    def name(self) -> str: ...
    @property
    def persist(self) -> bool: ...
    @property
    def streaming(self) -> bool: ...

class Section:
    """A walk's section tree (mstar::Section); a str is a node."""

    def __init__(self, node: str) -> None: ...
    @staticmethod
    def seq(parts: Sequence[Section | str]) -> Section: ...
    @staticmethod
    def par(branches: Sequence[Section | str]) -> Section: ...
    @staticmethod
    def loop(
        body: Section | str,
        max_iters: int,
        outputs: Sequence[str] = ...,
        accumulated: Sequence[str] = ...,
    ) -> Section: ...
    @staticmethod
    def dynamic_loop(
        name: str,
        body: Section | str,
        max_iters: int,
        outputs: Sequence[str] = ...,
        accumulated: Sequence[str] = ...,
    ) -> Section: ...
    @staticmethod
    def part(name: str, walks: Sequence[tuple[str, Section | str]]) -> Section:
        """A Part: sub-walks [(key, section)] the model chooses among at run time."""

class GraphSpec:
    """The compiled graph IR (mstar::GraphSpec)."""

    @property
    def names(self) -> list[str]: ...
    @property
    def engines(self) -> list[str]: ...
    @property
    def walk_names(self) -> list[str]: ...
    @property
    def nodes(self) -> list[tuple[str, int, int, list[int], list[int], bool]]:
        """[(name, engine id, max_batch, input name ids, output name ids, on_stream_end)]"""
    def node_inputs(self, node: int, /) -> list[str]: ...
    def node_outputs(self, node: int, /) -> list[str]: ...

class GraphBuilder:
    """The graph compiler (mstar::GraphBuilder): declare inputs, nodes and walks, then compile() into a
    GraphSpec for the Conductor, or raise GraphError naming what to fix. mstar_rt.compile_model
    lowers the Python DSL into it; C++ models (mstar::Model) use the same one."""

    def __init__(self) -> None: ...
    def input(self, name: str) -> Self: ...
    def node(
        self,
        name: str,
        inputs: Sequence[str],
        outputs: Sequence[Edge],
        engine: str = "default",
        max_batch: int = 1,
        on_stream_end: bool = False,
        untimed: bool = False,
    ) -> Self: ...
    def walk(self, name: str, root: Section | str) -> Self: ...
    def elsewhere(self, name: str) -> Self:
        """Node ``name`` runs outside this graph's walks (placement: in a worker's segment), so
        compile() lets it sit in no walk; any other node in no walk is refused."""
    def compile(self) -> GraphSpec: ...

class NodeRunner:
    """The one batch path for Python nodes: prepare (stream chunks made into StreamChunk values,
    prepare_inputs with a WorkContext) -> forward (in split_batch's groups) -> check_stop, and
    end_stream for a stream's end. The Conductor's run_batch runs every node with it; a placement
    worker and the KV engine's prepare call it here."""

    def __init__(
        self, nodes: Sequence[Any], requests: Any, loop_ids: dict[str, int] | None = None
    ) -> None: ...
    def run(
        self, node: int, items: Sequence[WorkItem]
    ) -> tuple[list[int], list[Any], list[list[Any]] | None, list[tuple[int, str]]]:
        """(item ids, outputs per item, loop ids (or names) to stop per item, or None, failed), in
        one order: the chunks, then the stream ends; failed: [(item id, why)] for items whose
        check_stop raised after the batch's forward (not in the other three)."""
    def prepare(self, node: int, items: Sequence[WorkItem], call_prepare: bool = True) -> list[Any]:
        """Each item's inputs as forward() takes them: stream chunks made, prepare_inputs run."""
    def loop_id(self, name: Any) -> Any:
        """The DynamicLoop's name id (without loop_ids: the name); RuntimeError if unknown."""

class Conductor:
    """Runs requests through a compiled walk graph (see mstar_rt.compile_model) and holds the values
    its handles stand for. Engine workers pull batches with next_batch() (GIL released while
    waiting) and report complete(); each call that changes state returns its outcome
    (emits [(request, name, value)], walks_done [request], failed [(request, message)], expired
    [(request, node, refused, seconds late)])."""

    def __init__(self, graph: GraphSpec) -> None: ...
    def submit(
        self,
        walk: int,
        inputs: dict[int, Any],
        deadline_ns: int = 9223372036854775807,
        priority: int = 0,
        fail_late: bool = False,
    ) -> tuple[int, _Outcome]: ...
    def expire(self) -> _Outcome: ...
    def set_reporter(self, reporter: Any) -> None: ...
    def start_walk(self, request: int, walk: int, /) -> _Outcome: ...
    def choose_part(self, request: int, section: int, child: int) -> tuple[bool, _Outcome]: ...
    def finish(self, request: int, /) -> tuple[bool, _Outcome]: ...
    def cancel(self, request: int, /) -> tuple[bool, _Outcome]: ...
    def fail(self, request: int, message: str, /) -> _Outcome: ...
    def next_batch(self, engine: int, max_batch: int, timeout: float) -> _Batch | None: ...
    def bind_nodes(self, runner: NodeRunner | None, finish_walks: bool) -> None: ...
    def run_batch(
        self, engine: int, max_batch: int, timeout: float
    ) -> tuple[_Batch | None, _Outcome | bool | str | None, list[tuple[int, bytes, int]] | None]:
        """(batch handed back, None, None) for the caller to run; with True (the node raised on
        it) or, for a batch of one, the error text; or (None, outcome, walks finished)."""
    def complete(
        self,
        node: int,
        items: Sequence[int],
        outputs: list[dict[str, Any]],
        stops: Sequence[Sequence[int]] | None = None,
        failed: Sequence[tuple[int, str]] = (),
    ) -> _Outcome:
        """Completes the items; ``failed`` (item id, why): items of the batch that failed after
        its forward (NodeRunner.run's fourth answer), failed in the same outcome."""
    def push_stream(self, request: int, producer: int, name: int, value: Any
                    ) -> tuple[bool, _Outcome]:
        """Appends value to the stream ``name`` (id) of node ``producer`` (id), as one more
        execution of it would (placement: a stream leaving a worker's segment). (whether a
        stream took it, the outcome): False for a request not running or a stream ended."""
    def fail_items(self, items: Sequence[int], message: str, named: bool = False) -> _Outcome:
        """Fails the items' requests with the message, after "node '<node>' in walk '<walk>'
        failed: " unless named (the message says where)."""
    def running(self) -> list[tuple[int, float]]:
        """[(node id, seconds since its batch was taken)] for the batches not yet reported."""
    def emitted(self, request: int) -> int:
        """How many outputs the request has EMITted so far."""
    def set_spin(self, seconds: float) -> None:
        """How long an idle worker spins before it sleeps (0: never)."""
    def set_submitter_takes(self, engine: int, takes: bool) -> None:
        """submit() leaves this engine's worker asleep: the submitting thread takes the batch."""
    def take_inline(self, on: bool) -> None:
        """This thread alone takes the work of set_submitter_takes engines."""
    def wake(self, engine: int) -> None:
        """Wakes a worker of the engine if work waits there."""
    def shutdown(self) -> None: ...
    def values(self, request: int, /) -> dict[str, Any]: ...
    def timeline(self, request: int, /) -> list[tuple[int, int, int, int, int, int, int]]: ...
    def take_timeline(self, request: int, /) -> bytes: ...
    def forget(self, request: int, /) -> None: ...
    @property
    def live_requests(self) -> int: ...
    @property
    def live_handles(self) -> int: ...
    @property
    def queued_items(self) -> int: ...
    @property
    def inflight_items(self) -> int: ...
    @property
    def stored(self) -> int: ...


class ReadyQueue:
    """Work ready to run, per engine, in the Conductor's order: earliest deadline, then highest
    priority, then earliest arrival, then item id. next_batch() takes the most urgent item and the
    next most urgent of the same node and walk (waiting without the GIL)."""

    def __init__(self, engines: int, node_max_batch: list[int]) -> None: ...
    def put(
        self,
        engine: int,
        node: int,
        walk: int,
        request: int,
        deadline_ns: int,
        priority: int,
        arrival: int,
        item_id: int,
        item: object,
    ) -> None: ...
    def next_batch(
        self, engine: int, max_batch: int, timeout: float
    ) -> tuple[int, int, list[Any]] | None: ...
    def purge(self, request: int) -> int: ...
    def hold(self, held: bool) -> None: ...
    def shutdown(self) -> None: ...
    def __len__(self) -> int: ...

class ActionChunkBuffer:
    """Chunks of actions in (any thread), one action per control tick out (the loop's thread), lock-free.
    mode: 'latest' | 'weighted' (weight_new blend over the overlap) | 'rtc' (real-time chunking with
    schedule 'linear' | 'exp' | 'ones' | 'zeros' and execution_horizon s)."""

    def __init__(
        self,
        horizon: int,
        action_dim: int,
        mode: str = "latest",
        weight_new: float = 0.7,
        schedule: str = "exp",
        execution_horizon: int = 0,
        slots: int = 4,
    ) -> None: ...
    def publish(self, actions: npt.ArrayLike, obs_tick: int) -> bool: ...
    def pop(self, tick: int) -> tuple[npt.NDArray[np.float32], bool]:
        """Returns (action, fresh); fresh is False on starvation (the last action is held)."""
    def pop_into(self, tick: int, out: npt.NDArray[np.float32]) -> bool:
        """pop() into `out` (float32 [action_dim], C-contiguous): no array made per tick."""
    def remaining(self, tick: int) -> npt.NDArray[np.float32]:
        """The actions the plan still holds from `tick` on, shape (n, action_dim)."""
    def rtc_weight(self, k: int, d: int) -> float: ...
    @property
    def stats(self) -> dict[str, float]: ...
    @property
    def horizon(self) -> int: ...
    @property
    def action_dim(self) -> int: ...

class LatencyTracker:
    """Inference latency over the last `window` samples -> delay d in ticks."""

    def __init__(self, window: int, control_period_s: float) -> None: ...
    def record(self, latency_s: float) -> None: ...
    @property
    def max_s(self) -> float: ...
    @property
    def p95_s(self) -> float: ...
    @property
    def delay_ticks(self) -> int: ...
    def __len__(self) -> int: ...

class Clock: ...

class SimulatedClock(Clock):
    """Deterministic time for closed-loop tests: sleeping jumps to the deadline."""

    def __init__(self) -> None: ...
    @property
    def now_ns(self) -> int: ...
    def advance(self, ns: int) -> None: ...

class TickInfo:
    @property
    def tick(self) -> int: ...
    @property
    def deadline_ns(self) -> int: ...
    @property
    def woke_ns(self) -> int: ...
    @property
    def missed(self) -> int: ...
    def __repr__(self) -> str: ...

class ControlLoop:
    """A fixed-rate loop on absolute deadlines (clock_nanosleep TIMER_ABSTIME). The tick is a Python
    callable(tick_info) — called with the GIL — or, with no callable, a C++ tick that pops one action
    per tick from `action_buffer` without touching Python. run() blocks (GIL released while it
    sleeps); start()/stop() run it on its own thread."""

    def __init__(
        self,
        rate_hz: float,
        callback: Callable[[TickInfo], object] | None = None,
        action_buffer: ActionChunkBuffer | None = None,
        realtime: bool = False,
        priority: int = 80,
        cpu: int = -1,
        lock_memory: bool = False,
        clock: Clock | None = None,
        histogram_max_ms: float = 20.0,
        histogram_bins: int = 2000,
    ) -> None: ...
    def run(self, ticks: int = 0) -> None: ...
    def start(self, ticks: int = 0) -> None: ...
    def stop(self) -> None: ...
    @property
    def running(self) -> bool: ...
    @property
    def mode(self) -> str: ...
    @property
    def period_s(self) -> float: ...
    @property
    def starved_ticks(self) -> int: ...
    @property
    def last_action(self) -> npt.NDArray[np.float32]:
        """The action the C++ tick last popped (read it after stop()/run())."""
    @property
    def lateness_bins_ms(self) -> tuple[npt.NDArray[np.int64], float]: ...
    @property
    def stats(self) -> dict[str, Any]: ...

def spin_until_changed(addresses: list[int], values: list[int], budget_s: float) -> int:
    """Index of the first 64-bit word (by address) that no longer holds its value, or -1 after
    ``budget_s`` seconds (GIL released); the words must stay mapped meanwhile."""

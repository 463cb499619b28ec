"""What the parent does with a worker's results and with its death: complete or fail the items
and requests in its Conductor."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from mstar_rt.placement.codec import scalar_items
from mstar_rt.placement.protocol import ProtocolError, field, int_list
from mstar_rt.placement.stream_in import window_lasts

if TYPE_CHECKING:
    from mstar_rt.placement.config import RankPlan
    from mstar_rt.placement.runtime import PlacedRuntime


def open_entry(rt: "PlacedRuntime", plan: "RankPlan", rid: int) -> dict:
    """What a worker learns of a request with its first item: its inputs (when the rank's
    nodes read them), its scalar state and its order in the ready queue."""
    handle = rt.requests.get(rid)
    if handle is None:
        return {"inputs": None, "state": {}}
    ctx = handle.context
    return {"inputs": dict(ctx.inputs) if plan.request_inputs else None,
            "state": scalar_items(ctx.state), "order": list(rt.order_of(ctx))}


def complete_from_reply(rt: "PlacedRuntime", msg: dict,
                        take: Callable[[list[int]], set[int]]) -> None:
    """Completes, in the parent's Conductor, the items of a worker's ``done`` reply that
    ``take`` still finds in flight (each is reported once); the worker's copy of the request
    state comes first, since the next walk may read it. ProtocolError for a malformed reply."""
    node = field(msg, "node", int)
    ids = int_list(msg, "items")
    outputs = field(msg, "outputs", list)
    stops = field(msg, "stops", list, optional=True)
    states = field(msg, "states", dict)
    if len(outputs) != len(ids) or (stops is not None and len(stops) != len(ids)):
        raise ProtocolError("'done' needs one output map (and stop list) per item")
    if not 0 <= node < len(rt.node_names):
        raise ProtocolError(f"node id {node} is out of range")
    if "emits" in msg:  # a segment's last outputs, folded in: they reach the handles first
        deliver_emits(rt, msg)
    taken = take(ids)
    if not taken:
        return
    for rid, state in states.items():  # before complete(): next_walk may read it
        handle = rt.requests.get(rid)
        if handle is not None and isinstance(state, dict):
            handle.context.state.update(state)
    keep_ids, keep_out, keep_stops = [], [], []
    for i, item in enumerate(ids):
        if item not in taken:
            continue
        try:
            stop_ids = [] if stops is None else [rt.loop_id(s) for s in stops[i]]
        except Exception as e:
            rt.report(rt.conductor.fail_items([item], str(e)))
            continue
        keep_ids.append(item)
        keep_out.append(outputs[i])
        keep_stops.append(stop_ids)
    if not keep_ids:
        return
    try:
        outcome = rt.conductor.complete(node, keep_ids, keep_out,
                                        None if stops is None else keep_stops)
    except Exception as e:  # e.g. outputs the node does not declare: fail those items
        outcome = rt.conductor.fail_items(keep_ids, f"{type(e).__name__}: {e}")
    rt.report(outcome)


def answer_windows(rt: "PlacedRuntime", node: int, items: list,
                   take: Callable[[list[int]], set[int]]) -> None:
    """Completes, as sent, the windows of stand-in ``node`` (it takes streams entering its
    segment, placement/stream_in.py) that are not their streams' last: the worker has nothing to
    say about them, and the next window may leave at once. The last one waits for the run."""
    ids = [it.id for it in items if not all(window_lasts(it.chunk))]
    taken = sorted(take(ids)) if ids else []
    if taken:
        rt.report(rt.conductor.complete(node, taken, [{}] * len(taken)))


def deliver_emits(rt: "PlacedRuntime", msg: dict) -> None:
    """A segment's EMITted outputs, as it made them (``[[request, name, value]]``), to their
    requests' handles (one that ended meanwhile drops them); ``[request, name, value, node]``:
    an item of stand-in ``node``'s stream ``name`` (a stream leaving the segment), in order."""
    emits: list = []
    for e in field(msg, "emits", list):
        if not (isinstance(e, list) and 3 <= len(e) <= 4 and type(e[0]) is int
                and isinstance(e[1], str)):
            continue
        if len(e) == 3:  # forwarded: not among the parent Conductor's EMITs that _end counts
            emits.append((e[0], e[1], e[2], True))
            continue
        if emits:
            rt.report((emits, (), (), (), ()))
            emits = []
        name = rt.graph.name_ids.get(e[1])
        try:
            if e[0] < 0 or type(e[3]) is not int or e[3] < 0 or name is None:
                raise ValueError("unknown node or name")
            outcome = rt.conductor.push_stream(e[0], e[3], name, e[2])[1]
        except ValueError as x:
            raise ProtocolError(f"stream item [{e[0]}, {e[1]!r}, ..., {e[3]!r}]: {x}") from None
        rt.report(outcome)
    if emits:
        rt.report((emits, (), (), (), ()))


def fail_for_death(rt: "PlacedRuntime", who: str, fix: str, inflight: dict, known: dict) -> None:
    """A worker died (``who``: "worker process rank R (pid P) <how>"): fails the items it was
    running (the Conductor names their node) and then the other requests it held state for
    (naming that node), each once."""
    failed = set()
    for item, (rid, _node, _holds) in inflight.items():
        failed.add(rid)
        rt.report(rt.conductor.fail_items([item], f"{who} while running it; {fix}"))
    for rid, node in known.items():
        if rid not in failed:
            rt.report(rt.conductor.fail(
                rid, f"{who}; it held this request's state of node '{node}'; {fix}"))

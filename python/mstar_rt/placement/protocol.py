"""The messages between the parent and a worker, and their validation.

Every message is two frames: a fixed binary header (the sender's generation, its rank when it
is a worker, and ``span``: where its arena allocations for this message end), then a msgpack
map ``{"v": 1, "kind": ..., ...}`` whose tensors are arena references (codec.py). A receiver
checks every field it reads before acting, so a malformed or foreign message gets an error reply
and changes nothing; a malformed batch from the parent also gets a ``failed`` for every item it
names.

A local worker and its parent exchange the frames through two mailboxes in shared memory
(mailbox.py); the worker's ROUTER socket then serves only its peers, and a peer claiming the
parent's routing id is a peer. A Ray actor's parent uses the actor's ROUTER (ZeroMQ keeps the
first peer with an identity, so a second one claiming the parent's is never heard) and the
parent's PULL socket.

parent -> worker (worker's mailbox, or its ROUTER socket)::

    batch    gen node walk items=[[item, request, iteration, {input: value}, chunk|None]]
             (a segment's stand-in taking streams: one window per item, only the last of
             them answered: stream_in.py)
             open={request: {"inputs": {..}|None, "state": {..},
                             "order": [deadline_ns, priority]}}
             release=[request]   (requests that ended since: released before the batch)
             unexport=[key]      (exports whose last handle died: direct.py)
    release  gen requests=[request]
    unexport gen keys=[key]
    stats    gen token
    shutdown gen
    kv_send  gen request engine peer key port timeout_s   (export the request's K/V to rank
    kv_recv  gen request engine peer key port timeout_s    peer / expect them: kv_moves.py)

worker -> parent (its mailbox, or the parent's PULL socket)::

    ready    rank gen pid nodes=[name] walks=[name]
    fatal    rank gen message                 (the worker could not start)
    done     rank gen node items=[item] outputs=[{name: value}] stops=[[loop]]|None
             states={request: {key: scalar}} [emits=[[request, name, value]]]
                                              (a segment's last EMITs, delivered first)
    failed   rank gen items=[item] message [named=true] [request=id]
                                              (named: the message says which node failed;
                                              request: a segment run fed by streams failed
                                              before its last window: stream_in.py; a
                                              request whose K/V cannot move: kv_moves.py)
    emit     rank gen emits=[[request, name, value]] items=[item]   (a segment's EMITs)
    read     rank gen items=[item]            (windows into a segment whose tensors from other
                                              workers were copied out: their handles may go)
    stats    rank gen token stats={..}
    error    rank gen message                 (it got a malformed message)
"""

from __future__ import annotations

import reprlib
import struct
from typing import Any

VERSION = 1
PARENT_ID = b"parent"                        # the parent's routing id at a worker's ROUTER
TO_WORKER_HEADER = struct.Struct("<IQ")     # generation, span end of the parent's arena
TO_PARENT_HEADER = struct.Struct("<IIQ")    # rank, generation, span end of the worker's arena

TO_WORKER = ("batch", "release", "unexport", "stats", "shutdown", "kv_send", "kv_recv")
TO_PARENT = ("ready", "fatal", "done", "failed", "stats", "error", "heartbeat", "emit",
             "read")


class ProtocolError(ValueError):
    """A message that does not follow the protocol; the text says which field is wrong."""


def check_header(msg: Any, kinds: tuple[str, ...]) -> str:
    """The message's kind, after checking it is a map of this protocol version."""
    if not isinstance(msg, dict):
        raise ProtocolError(f"a message must be a msgpack map, not {type(msg).__name__}")
    # Exact types: True, 1.0 or an array would compare equal (or ambiguously) to a number or str.
    version = msg.get("v")
    if type(version) is not int or version != VERSION:
        raise ProtocolError(f"protocol version {reprlib.repr(version)} is not {VERSION}")
    kind = msg.get("kind")
    if type(kind) is not str or kind not in kinds:
        raise ProtocolError(f"unknown message kind {reprlib.repr(kind)}; expected one of "
                            f"{list(kinds)}")
    return kind


def field(msg: dict, name: str, types: Any, optional: bool = False) -> Any:
    """``msg[name]`` checked against ``types`` (bool never passes for int)."""
    if name not in msg:
        if optional:
            return None
        raise ProtocolError(f"'{msg.get('kind')}' message lacks field '{name}'")
    value = msg[name]
    if value is None and optional:
        return None
    if not isinstance(value, types) or (isinstance(value, bool) and bool not in _as_tuple(types)):
        raise ProtocolError(f"field '{name}' of a '{msg.get('kind')}' message is "
                            f"{type(value).__name__}, expected {_names(types)}")
    return value


def int_list(msg: dict, name: str) -> list[int]:
    values = field(msg, name, list)
    if not all(type(v) is int and v >= 0 for v in values):
        raise ProtocolError(f"field '{name}' of a '{msg.get('kind')}' message must list "
                            "non-negative integers")
    return values


def check_opens(opens: dict) -> dict:
    """A batch's ``open`` map (request -> {inputs, state, order}), checked."""
    for rid, o in opens.items():
        if type(rid) is not int or not isinstance(o, dict):
            raise ProtocolError("'open' maps request ids to {inputs, state}")
        inputs, state = o.get("inputs"), o.get("state") or {}
        order = o.get("order", [2**63 - 1, 0])
        if not isinstance(inputs, (dict, type(None))) or not isinstance(state, dict):
            raise ProtocolError("'open' entries hold inputs (a map or nil) and state")
        # the ready queue orders by a 64-bit deadline and a 32-bit priority
        if not (isinstance(order, list) and len(order) == 2 and all(type(v) is int for v in order)
                and -2**63 <= order[0] < 2**63 and -2**31 <= order[1] < 2**31):
            raise ProtocolError("'open' order must be [deadline_ns, priority], a 64-bit and a "
                                "32-bit signed integer")
    return opens


def _as_tuple(types: Any) -> tuple:
    return types if isinstance(types, tuple) else (types,)


def _names(types: Any) -> str:
    return " or ".join(t.__name__ for t in _as_tuple(types))

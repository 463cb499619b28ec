"""Whether a KV work may run on a label its request does not hold, and the error when not.

A work that reads a label without persisting attends over that label's cached K/V; when the
label is missing (never written, or freed already) it would attend over nothing and return
numbers that look fine. The engine fails such a request instead, naming the node, the label and
the labels the request does hold (docs/engines.md, *Labels*).
"""

from __future__ import annotations

from typing import Optional


def needs_label(must_exist: Optional[bool], persist: bool) -> bool:
    """Whether a work on a label its request does not hold must fail (no fork, nothing
    imported). ``must_exist`` as the work gives it; None: a persisting work creates the label,
    a read needs it. A read that means to see nothing says so with ``must_exist=False`` (the
    Qwen3-Omni talker's step skipped when the thinker said nothing)."""
    if must_exist is not None:
        return must_exist
    return not persist


def missing_label(node: str, engine: str, label: str, persist: bool,
                  held: list[str], dropped: list[str]) -> str:
    """The failure message of a work on ``label``, which its request does not hold."""
    does = "appends to" if persist else "reads (without persisting)"
    holds = f"it holds {sorted(held)}" if held else "it holds no label on this engine"
    if label in dropped:
        return (f"node '{node}' {does} KV label '{label}' on engine '{engine}', but the request "
                f"freed that label earlier (dropped, or exported with free=True) and {holds}; "
                f"keep '{label}' until every node reading it has run (drop or export it after "
                "them), or write it again with a node whose output persists under that label")
    if dropped:
        holds += f"; freed earlier: {dropped}"
    return (f"node '{node}' {does} KV label '{label}' on engine '{engine}', which the request "
            f"does not hold ({holds}): write it first with a node whose output persists under "
            f"that label (KVWork(label='{label}'), run before '{node}' on the same engine), or "
            "read a label the request holds; KVWork(must_exist=False) reads a missing label as "
            "empty")

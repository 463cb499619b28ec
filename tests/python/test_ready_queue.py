"""The C++ ready queue a placement worker uses (`_core.ReadyQueue`): the Conductor's order --
earliest deadline, then highest priority, then earliest arrival, then item id -- batches of one
node and walk up to the node's limit, purge by request, waits that end on shutdown."""

import threading
import time

import pytest

from mstar_rt import _core

NONE = 2**63 - 1


def put(q, item, node=0, walk=0, request=1, deadline=NONE, priority=0, engine=0):
    q.put(engine, node, walk, request, deadline, priority, request, item, ("item", item))


def test_order_is_deadline_then_priority_then_arrival_then_item():
    q = _core.ReadyQueue(1, [1])
    put(q, 5, request=3)
    put(q, 4, request=2)
    put(q, 9, request=9, priority=7)
    put(q, 1, request=4, deadline=100)
    put(q, 2, request=5, deadline=100, priority=1)
    put(q, 3, request=2)  # same request as item 4, earlier id: first of the two
    order = [q.next_batch(0, 8, 0)[2][0][1] for _ in range(6)]
    assert order == [2, 1, 9, 3, 4, 5]
    assert len(q) == 0 and q.next_batch(0, 8, 0) is None


def test_a_batch_is_one_node_and_walk_up_to_the_nodes_limit_most_urgent_first():
    q = _core.ReadyQueue(2, [2, 8])
    for i in range(5):
        put(q, i, node=0, request=10 + i)
    put(q, 50, node=1, request=1)  # the most urgent: its node goes first
    put(q, 51, node=1, walk=1, request=2)  # another walk: another batch
    put(q, 60, node=0, engine=1, request=3)  # another engine
    assert q.next_batch(0, 8, 0) == (1, 0, [("item", 50)])
    assert q.next_batch(0, 8, 0) == (1, 1, [("item", 51)])
    assert q.next_batch(0, 8, 0) == (0, 0, [("item", 0), ("item", 1)])  # node 0's limit is 2
    assert q.next_batch(0, 1, 0) == (0, 0, [("item", 2)])  # and the caller's
    assert q.next_batch(1, 8, 0) == (0, 0, [("item", 60)])
    assert len(q) == 2


def test_purge_drops_one_requests_items_only():
    q = _core.ReadyQueue(2, [8])
    put(q, 1, request=7)
    put(q, 2, request=8)
    put(q, 3, request=7, engine=1)
    assert q.purge(7) == 2
    assert q.next_batch(0, 8, 0) == (0, 0, [("item", 2)])
    assert q.next_batch(1, 8, 0) is None


def test_a_waiting_next_batch_wakes_for_work_and_for_shutdown():
    q = _core.ReadyQueue(1, [8])
    got = []
    t = threading.Thread(target=lambda: got.append(q.next_batch(0, 8, 5.0)))
    t.start()
    time.sleep(0.05)
    put(q, 1)
    t.join(5)
    assert got == [(0, 0, [("item", 1)])]
    t0 = time.monotonic()
    assert q.next_batch(0, 8, 0.05) is None and time.monotonic() - t0 >= 0.04
    t = threading.Thread(target=lambda: got.append(q.next_batch(0, 8, 30.0)))
    t.start()
    time.sleep(0.05)
    q.shutdown()
    t.join(5)
    assert not t.is_alive() and got[-1] is None


def test_bad_engine_or_node_is_refused():
    q = _core.ReadyQueue(1, [8])
    with pytest.raises(ValueError, match="unknown engine"):
        put(q, 1, engine=3)
    with pytest.raises(ValueError, match="unknown node"):
        put(q, 1, node=4)


DEADLOCK = r"""
import sys, threading, time
from mstar_rt import _core

sys.setswitchinterval(1.0)  # the GIL changes hands only where the scenario says


class Slow:
    def __del__(self):
        time.sleep(0.05)  # Python that drops the GIL, run when purge drops the item


q = _core.ReadyQueue(2, [8])
q.put(1, 0, 0, 1, 2**63 - 1, 0, 1, 1, Slow())  # request 1, engine 1: purged below
got = []
engine = threading.Thread(target=lambda: got.append(q.next_batch(0, 8, 5.0)))
engine.start()
time.sleep(0.1)  # waiting in next_batch, without the GIL
q.put(0, 0, 0, 2, 2**63 - 1, 0, 2, 2, "work")  # wakes it: it now wants the GIL back
t0 = time.perf_counter()
while time.perf_counter() - t0 < 0.05:  # keep the GIL meanwhile
    pass
assert q.purge(1) == 1
engine.join()
assert got == [(0, 0, ["work"])], got
print("ok")
"""


def test_purge_running_python_while_a_batch_is_taken_does_not_deadlock():
    """A worker hung here: purge dropped an item (its __del__ released the GIL) while holding
    the queue's mutex, and the engine thread, given the GIL, waited for that mutex."""
    import subprocess
    import sys

    from child_env import child_env

    done = subprocess.run([sys.executable, "-c", DEADLOCK], capture_output=True, text=True,
                          timeout=30, env=child_env())
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


def test_while_held_no_batch_is_taken_and_release_gives_the_most_urgent():
    q = _core.ReadyQueue(1, [8])
    got = []
    q.hold(True)
    t = threading.Thread(target=lambda: got.append(q.next_batch(0, 1, 5.0)))
    t.start()
    put(q, 1, request=1)  # a burst's first item: it must not leave alone
    time.sleep(0.1)
    assert got == []
    put(q, 2, request=2, deadline=10)  # the burst's urgent one
    q.hold(False)
    t.join(5.0)
    assert got == [(0, 0, [("item", 2)])]
    assert q.next_batch(0, 8, 0) == (0, 0, [("item", 1)])

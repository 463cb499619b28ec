"""Ring: zero-copy views, overflow policies, blocking waits and clear errors."""

import threading
import time

import numpy as np
import pytest

import mstar_rt


def _inside(view: np.ndarray, owner) -> bool:
    start, nbytes = owner.storage_range
    addr = view.__array_interface__["data"][0]
    return start <= addr and addr + view.nbytes <= start + nbytes


def test_peek_is_a_read_only_view_into_ring_memory():
    ring = mstar_rt.Ring(np.float32, 16, item_shape=(4,))
    ring.push(np.arange(12, dtype=np.float32).reshape(3, 4))
    view = ring.peek(8)
    assert view.shape == (3, 4)
    assert _inside(view, ring)
    assert not view.flags.writeable
    with pytest.raises(ValueError):
        view[0, 0] = 1.0
    np.testing.assert_array_equal(view.ravel(), np.arange(12, dtype=np.float32))
    ring.release(3)
    assert len(ring) == 0


def test_reserve_fills_in_place_and_commit_publishes():
    ring = mstar_rt.Ring(np.int16, 8)
    region = ring.reserve(5)
    assert _inside(region, ring) and region.flags.writeable
    region[:] = np.arange(5, dtype=np.int16) * 3
    ring.commit(5)
    np.testing.assert_array_equal(ring.pop(8), np.arange(5) * 3)


def test_push_of_a_single_item_and_of_a_batch():
    ring = mstar_rt.Ring(np.float64, 8, item_shape=(2,))
    assert ring.push(np.array([1.0, 2.0])) == 1
    assert ring.push(np.ones((3, 2))) == 3
    assert len(ring) == 4


def test_non_contiguous_input_is_accepted():
    ring = mstar_rt.Ring(np.int32, 8)
    data = np.arange(10, dtype=np.int32)[::2]
    assert ring.push(data) == 5
    np.testing.assert_array_equal(ring.pop(8), data)


def test_reject_policy_returns_zero_and_counts():
    ring = mstar_rt.Ring(np.int32, 4, overflow="reject")
    assert ring.push(np.arange(4, dtype=np.int32)) == 4
    assert ring.push(np.arange(2, dtype=np.int32)) == 0
    assert ring.stats["rejected"] == 2
    np.testing.assert_array_equal(ring.pop(4), np.arange(4))


def test_drop_oldest_keeps_the_newest_items():
    ring = mstar_rt.Ring(np.int32, 4, overflow="drop_oldest")
    for i in range(10):
        assert ring.push(np.array(i, dtype=np.int32)) == 1
    np.testing.assert_array_equal(ring.pop(4), [6, 7, 8, 9])
    assert ring.stats["dropped"] == 6


def test_held_view_blocks_overwrite_until_released():
    ring = mstar_rt.Ring(np.int32, 4, overflow="drop_oldest")
    ring.push(np.arange(4, dtype=np.int32))
    view = ring.peek(4)
    # The producer may not drop what the consumer is reading: the push is refused instead.
    assert ring.push(np.array(99, dtype=np.int32)) == 0
    np.testing.assert_array_equal(view, [0, 1, 2, 3])
    ring.release(1)
    assert ring.push(np.array(99, dtype=np.int32)) == 1
    np.testing.assert_array_equal(ring.pop(4), [1, 2, 3, 99])


def test_block_policy_times_out_when_full():
    ring = mstar_rt.Ring(np.int32, 4)
    ring.push(np.arange(4, dtype=np.int32))
    start = time.monotonic()
    assert ring.push(np.arange(2, dtype=np.int32), timeout=0.05) == 0
    assert time.monotonic() - start >= 0.04


def test_blocked_push_resumes_when_the_consumer_pops():
    ring = mstar_rt.Ring(np.int64, 4)
    received = []

    def consume():
        while (items := ring.pop(4, timeout=5)) is not None:
            received.extend(items.tolist())

    consumer = threading.Thread(target=consume)
    consumer.start()
    for start in range(0, 1000, 10):
        assert ring.push(np.arange(start, start + 10, dtype=np.int64), timeout=5) == 10
    ring.close()
    consumer.join(5)
    assert received == list(range(1000))


def test_pop_waits_with_the_gil_released():
    ring = mstar_rt.Ring(np.int32, 8)
    ticks = []
    stop = threading.Event()

    def ticker():  # runs only if pop() lets go of the GIL while it waits
        while not stop.is_set():
            ticks.append(1)
            time.sleep(0.001)

    t = threading.Thread(target=ticker)
    t.start()
    with pytest.raises(TimeoutError):
        ring.pop(timeout=0.2)
    stop.set()
    t.join()
    assert len(ticks) > 20


def test_misuse_gets_clear_errors():
    with pytest.raises(ValueError, match="power of two"):
        mstar_rt.Ring(np.float32, 1000)
    with pytest.raises(ValueError, match="overflow must be"):
        mstar_rt.Ring(np.float32, 8, overflow="spill")
    with pytest.raises(TypeError, match="Python objects"):
        mstar_rt.Ring(object, 8)
    ring = mstar_rt.Ring(np.float32, 8, item_shape=(2,))
    with pytest.raises(TypeError, match="dtype float64"):
        ring.push(np.zeros((1, 2)))
    with pytest.raises(ValueError, match=r"items have shape \(2,\)"):
        ring.push(np.zeros((1, 3), np.float32))
    with pytest.raises(ValueError, match=r"batch of shape \(n, 2\)"):
        ring.push(np.zeros((1, 1, 2), np.float32))
    with pytest.raises(ValueError, match="only 0 items were peeked"):
        ring.release(1)
    with pytest.raises(ValueError, match="timeout"):
        ring.pop(timeout=-1)
    reject = mstar_rt.Ring(np.float32, 4, overflow="reject")
    with pytest.raises(ValueError, match="do not fit"):
        reject.push(np.zeros(5, np.float32))
    ring.close()
    with pytest.raises(mstar_rt.StreamClosedError, match="closed"):
        ring.push(np.zeros(2, np.float32))


def test_close_ends_a_waiting_consumer():
    ring = mstar_rt.Ring(np.int32, 8)
    result = []
    t = threading.Thread(target=lambda: result.append(ring.pop(timeout=5)))
    t.start()
    time.sleep(0.05)
    ring.close()
    t.join(5)
    assert result == [None]


def test_a_zero_timeout_polls_and_still_sees_the_end_of_stream():
    ring = mstar_rt.Ring(np.int32, 8)
    with pytest.raises(TimeoutError):
        ring.pop(timeout=0)
    ring.push(np.array([7], np.int32))
    assert ring.pop(timeout=0).tolist() == [7]
    ring.close()
    assert ring.pop(timeout=0) is None

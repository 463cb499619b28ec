"""StreamBuffer: each chunk policy delivers exactly its windows, zero-copy, with the tail flushed."""

import threading

import numpy as np
import pytest

import mstar_rt


def _windows(policy, n_items, capacity=64):
    buf = mstar_rt.StreamBuffer(np.int64, capacity, policy)
    buf.push(np.arange(n_items, dtype=np.int64))
    buf.close()
    out = []
    for chunk in buf:
        np.testing.assert_array_equal(chunk.data, np.arange(chunk.begin, chunk.end))
        np.testing.assert_array_equal(chunk.new, np.arange(chunk.new_begin, chunk.end))
        out.append((chunk.begin, chunk.new_begin, chunk.end, chunk.last))
    return out


def test_fixed():
    assert _windows(mstar_rt.Fixed(3), 7) == [(0, 0, 3, False), (3, 3, 6, False), (6, 6, 7, True)]


def test_fixed_ending_on_a_boundary_adds_no_empty_chunk():
    assert _windows(mstar_rt.Fixed(3), 6) == [(0, 0, 3, False), (3, 3, 6, True)]


def test_sliding_window_matches_the_orpheus_schedule_and_flushes_the_tail():
    # Orpheus: decode the last 28 tokens every 7 once 28 are buffered.
    got = _windows(mstar_rt.SlidingWindow(28, 7), 45)
    assert got == [(0, 0, 28, False), (7, 28, 35, False), (14, 35, 42, False), (21, 42, 45, True)]


def test_sliding_window_shorter_than_one_window_flushes_once():
    assert _windows(mstar_rt.SlidingWindow(28, 7), 10) == [(0, 0, 10, True)]


def test_left_context():
    got = _windows(mstar_rt.LeftContext(2, 3), 7)
    assert got == [(0, 0, 3, False), (1, 3, 6, False), (4, 6, 7, True)]


def test_ramp_with_context():
    got = _windows(mstar_rt.Ramp([1, 2], 4, context=1), 12)
    assert got == [(0, 0, 1, False), (0, 1, 3, False), (2, 3, 7, False), (6, 7, 11, False),
                   (10, 11, 12, True)]


def test_every_item_is_new_in_exactly_one_chunk():
    for policy in [mstar_rt.Fixed(5), mstar_rt.SlidingWindow(9, 4), mstar_rt.LeftContext(6, 5),
                   mstar_rt.Ramp([2, 3], 7, context=3)]:
        for n in [0, 1, 13, 50]:
            fresh = [i for b, nb, e, _ in _windows(policy, n) for i in range(nb, e)]
            assert fresh == list(range(n)), (policy, n)


def test_chunk_views_are_zero_copy_even_across_the_wrap():
    buf = mstar_rt.StreamBuffer(np.float32, 16, mstar_rt.SlidingWindow(6, 5), item_shape=(2,))
    start, nbytes = buf.storage_range
    buf.push(np.zeros((1, 2), np.float32))
    for step in range(20):  # 20 windows of 6 lap the 16-slot ring several times
        buf.push(np.tile(np.arange(5 * step + 1, 5 * step + 6, dtype=np.float32)[:, None], 2))
        with buf.next_chunk(timeout=1) as chunk:
            addr = chunk.data.__array_interface__["data"][0]
            assert start <= addr and addr + chunk.data.nbytes <= start + nbytes
            assert not chunk.data.flags.writeable
            np.testing.assert_array_equal(chunk.data[:, 0], np.arange(chunk.begin, chunk.end))
            np.testing.assert_array_equal(chunk.data[:, 1], np.arange(chunk.begin, chunk.end))


def test_a_window_after_drop_oldest_overflow_is_whole_and_holds_the_survivors():
    # See docs/chunk_policies.md "Drops": it was [5, 7), half a window, though 8 items were stored.
    buf = mstar_rt.StreamBuffer(np.int64, 8, mstar_rt.SlidingWindow(4, 2), overflow="drop_oldest")
    for i in range(4):
        buf.push(np.array(i, dtype=np.int64))
    with buf.next_chunk(timeout=1) as chunk:
        assert (chunk.begin, chunk.new_begin, chunk.end) == (0, 0, 4)
    for i in range(4, 13):  # one at a time, as a live producer: items 2..4 are dropped
        buf.push(np.array(i, dtype=np.int64))
    buf.close()
    got = []
    for chunk in buf:
        np.testing.assert_array_equal(chunk.data, np.arange(chunk.begin, chunk.end))
        got.append((chunk.begin, chunk.new_begin, chunk.end, chunk.last))
    assert got == [(5, 7, 9, False), (7, 9, 11, False), (9, 11, 13, True)]


def test_a_held_chunk_blocks_the_producer_until_released():
    buf = mstar_rt.StreamBuffer(np.int32, 8, mstar_rt.Fixed(4), overflow="reject")
    buf.push(np.arange(8, dtype=np.int32))
    chunk = buf.next_chunk()
    assert buf.push(np.array(8, dtype=np.int32)) == 0  # full, and chunk 0 is still held
    chunk.release()
    assert buf.push(np.array(8, dtype=np.int32)) == 1


def test_released_chunk_refuses_access_and_next_chunk_needs_a_release():
    buf = mstar_rt.StreamBuffer(np.int32, 8, mstar_rt.Fixed(2))
    buf.push(np.arange(4, dtype=np.int32))
    chunk = buf.next_chunk()
    with pytest.raises(RuntimeError, match="still held"):
        buf.next_chunk()
    chunk.release()
    with pytest.raises(RuntimeError, match="was released"):
        chunk.data
    with buf.next_chunk() as second:
        assert second.begin == 2
    assert not buf.holding


def test_a_chunk_dropped_unreleased_is_released_once_no_view_of_it_is_left():
    # A consumer that raised between next_chunk() and release() wedged the buffer for good:
    # nothing was left to release, and a blocking producer hung.
    buf = mstar_rt.StreamBuffer(np.int32, 8, mstar_rt.Fixed(4), overflow="reject")
    buf.push(np.arange(8, dtype=np.int32))

    def decode() -> None:
        chunk = buf.next_chunk()
        raise ValueError(f"decoder hiccup at {chunk.begin}")

    with pytest.raises(ValueError, match="hiccup at 0"):
        decode()
    assert not buf.holding
    new = buf.next_chunk().new  # the chunk object is gone at once; its view holds it
    assert buf.holding and new.tolist() == [4, 5, 6, 7]
    assert buf.push(np.arange(4, dtype=np.int32)) == 4  # chunk 0's slots came free
    del new
    assert not buf.holding


@pytest.mark.parametrize("make", [
    lambda: mstar_rt.Ring(np.float32, 2**62),
    lambda: mstar_rt.StreamBuffer(np.float32, 2**62, mstar_rt.Fixed(4)),
    lambda: mstar_rt.Ring(np.float32, 4, item_shape=(2**63 - 1, 2**63 - 1)),
    lambda: mstar_rt.Ring(np.float32, 4, item_shape=(1,) * 16),
], ids=["ring", "stream_buffer", "item_shape", "dims"])
def test_sizes_past_memory_are_refused_when_built(make):
    # each wrapped around: a 0-byte buffer (double free), 4-byte items (segfault at pop)
    with pytest.raises(ValueError, match="do not fit in memory|too large|at most 15 dimensions"):
        make()


def test_next_chunk_times_out_and_then_ends():
    buf = mstar_rt.StreamBuffer(np.int32, 8, mstar_rt.Fixed(4))
    buf.push(np.arange(3, dtype=np.int32))
    with pytest.raises(TimeoutError, match="Fixed\\(4\\)"):
        buf.next_chunk(timeout=0.05)
    buf.close()
    tail = buf.next_chunk()
    assert (tail.begin, tail.end, tail.last) == (0, 3, True)
    tail.release()
    assert buf.next_chunk() is None
    # NaN passed the "< 0" check and waited for good; huge values were an undefined cast
    open_buf = mstar_rt.StreamBuffer(np.int32, 8, mstar_rt.Fixed(4))
    with pytest.raises(ValueError, match="timeout must be None or a number >= 0"):
        open_buf.next_chunk(timeout=float("nan"))
    open_buf.push(np.arange(8, dtype=np.int32))
    for forever in (float("inf"), 1e300):
        chunk = open_buf.next_chunk(timeout=forever)
        chunk.release()


def test_bad_policies_and_windows_are_refused():
    with pytest.raises(ValueError, match="K must be at least 1"):
        mstar_rt.Fixed(0)
    with pytest.raises(ValueError, match="S \\(8\\) must not exceed W \\(4\\)"):
        mstar_rt.SlidingWindow(4, 8)
    with pytest.raises(ValueError, match="L must be at least 1"):
        mstar_rt.LeftContext(3, 0)
    with pytest.raises(ValueError, match="first\\[1\\]"):
        mstar_rt.Ramp([1, 0], 4)
    with pytest.raises(TypeError, match="first must be a list of the first chunks' sizes"):
        mstar_rt.Ramp(4, 8, 3)  # a bare "'int' object is not iterable" before
    with pytest.raises(ValueError, match="needs windows of up to 28"):
        mstar_rt.StreamBuffer(np.int32, 16, mstar_rt.SlidingWindow(28, 7))
    with pytest.raises(ValueError, match="left context of 16"):
        mstar_rt.StreamBuffer(np.int32, 16, mstar_rt.LeftContext(16, 1))
    with pytest.raises(ValueError, match="capacity must be a power of two, got 0"):
        mstar_rt.StreamBuffer(np.float32, 0, mstar_rt.Fixed(1))
    # max_chunk wrapped to 0: every item pushed was then lost without an error
    with pytest.raises(ValueError, match="at most 2\\^48 items"):
        mstar_rt.Ramp([2**64 - 1], 1, 1)
    with pytest.raises(ValueError, match="at most 2\\^48 items"):
        mstar_rt.LeftContext(1, 2**64 - 1)


def test_threads_stream_audio_chunks_in_order():
    buf = mstar_rt.StreamBuffer(np.float32, 64, mstar_rt.Fixed(1), item_shape=(320,))
    n_chunks = 2000
    seen = []

    def produce():
        frame = np.zeros(320, np.float32)
        for i in range(n_chunks):
            frame[0] = i
            buf.push(frame)
        buf.close()

    producer = threading.Thread(target=produce)
    producer.start()
    for chunk in buf:
        seen.append(int(chunk.data[0, 0]))
    producer.join()
    assert seen == list(range(n_chunks))

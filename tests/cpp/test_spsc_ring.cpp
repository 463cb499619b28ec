// SpscRing: construction, FIFO order across laps, overflow policies, close, waits, regions, stats.
#include "mstar/spsc_ring.hpp"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <random>
#include <stdexcept>
#include <thread>
#include <vector>

namespace {

using mstar::Overflow;
using mstar::ReadRegion;
using mstar::SpscRing;
using mstar::WaitStatus;
using mstar::WriteRegion;
using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;
using u64 = std::uint64_t;

SpscRing make_ring(std::size_t capacity, Overflow overflow = Overflow::block,
                   std::size_t mirror = 0) {
  return SpscRing(sizeof(u64), capacity, overflow, mirror);
}

void push_values(SpscRing& ring, u64 from, u64 to) {
  for (u64 v = from; v < to; ++v) ASSERT_TRUE(ring.try_push_as(v)) << "value " << v;
}

std::vector<u64> pop_all(SpscRing& ring) {
  std::vector<u64> out;
  u64 v = 0;
  while (ring.try_pop_as(v)) out.push_back(v);
  return out;
}

std::vector<u64> iota(u64 from, u64 to) {
  std::vector<u64> v;
  for (u64 x = from; x < to; ++x) v.push_back(x);
  return v;
}

u64 load(const std::byte* p) {
  u64 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

void store(std::byte* p, u64 v) { std::memcpy(p, &v, sizeof v); }

bool in_storage(const SpscRing& ring, const std::byte* p, std::size_t count) {
  const std::byte* lo = ring.storage();
  const std::byte* hi = lo + ring.storage_bytes();
  return p >= lo && p + count * ring.item_size() <= hi;
}

double ms_since(Clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
}

// ---- construction ---------------------------------------------------------------------------

TEST(SpscRingConstruction, RejectsZeroItemSize) {
  EXPECT_THROW(SpscRing(0, 8), std::invalid_argument);
}

TEST(SpscRingConstruction, RejectsCapacityThatIsNotAPowerOfTwo) {
  for (std::size_t bad : {0u, 3u, 6u, 12u, 100u, 1023u})
    EXPECT_THROW(SpscRing(8, bad), std::invalid_argument) << "capacity " << bad;
  for (std::size_t good : {1u, 2u, 4u, 64u, 1024u}) EXPECT_NO_THROW(SpscRing(8, good));
}

TEST(SpscRingConstruction, RejectsMirrorLargerThanCapacity) {
  EXPECT_THROW(SpscRing(8, 8, Overflow::block, 9), std::invalid_argument);
  EXPECT_THROW(SpscRing(8, 1, Overflow::reject, 2), std::invalid_argument);
  EXPECT_NO_THROW(SpscRing(8, 8, Overflow::block, 8));
}

TEST(SpscRingConstruction, RejectsASizeThatWrapsAround) {
  // 2^62 items of 4 bytes wrapped to a 0-byte buffer, and the first push corrupted the heap
  EXPECT_THROW(SpscRing(4, std::size_t{1} << 62), std::length_error);
  EXPECT_THROW(SpscRing(std::size_t{1} << 40, std::size_t{1} << 30), std::length_error);
}

TEST(SpscRingConstruction, ReportsItsParametersAndStorageSize) {
  SpscRing ring(12, 16, Overflow::drop_oldest, 5);
  EXPECT_EQ(ring.item_size(), 12u);
  EXPECT_EQ(ring.capacity(), 16u);
  EXPECT_EQ(ring.mirror(), 5u);
  EXPECT_EQ(ring.overflow(), Overflow::drop_oldest);
  EXPECT_EQ(ring.storage_bytes(), (16u + 5u) * 12u);
  EXPECT_NE(ring.storage(), nullptr);
  EXPECT_FALSE(ring.closed());
}

// ---- FIFO, full / empty, laps -----------------------------------------------------------------

TEST(SpscRing, NewRingIsEmpty) {
  SpscRing ring = make_ring(8);
  u64 v = 0;
  EXPECT_EQ(ring.size(), 0u);
  EXPECT_FALSE(ring.try_pop_as(v));
  EXPECT_EQ(ring.peek(4).count, 0u);
  EXPECT_EQ(ring.write_position(), 0u);
  EXPECT_EQ(ring.read_position(), 0u);
}

TEST(SpscRing, HoldsExactlyCapacityItemsWithNoSpareSlot) {
  SpscRing ring = make_ring(8);
  push_values(ring, 0, 8);
  EXPECT_EQ(ring.size(), 8u);
  EXPECT_FALSE(ring.try_push_as(u64{99}));
  EXPECT_EQ(ring.reserve(1).count, 0u);
  EXPECT_EQ(pop_all(ring), iota(0, 8));
  EXPECT_EQ(ring.size(), 0u);
}

TEST(SpscRing, CapacityOneRingAlternates) {
  SpscRing ring = make_ring(1);
  for (u64 i = 0; i < 100; ++i) {
    ASSERT_TRUE(ring.try_push_as(i));
    ASSERT_FALSE(ring.try_push_as(i));
    u64 v = 0;
    ASSERT_TRUE(ring.try_pop_as(v));
    ASSERT_EQ(v, i);
  }
}

TEST(SpscRing, WrapsAroundManyLapsWithValuesIntact) {
  SpscRing ring = make_ring(8);
  u64 next_in = 0, next_out = 0;
  for (int round = 0; round < 1000; ++round) {
    const u64 n = 1 + round % 8;  // batch sizes 1..8 put the wrap at every slot
    push_values(ring, next_in, next_in + n);
    next_in += n;
    for (u64 i = 0; i < n; ++i) {
      u64 v = 0;
      ASSERT_TRUE(ring.try_pop_as(v));
      ASSERT_EQ(v, next_out++);
    }
  }
  EXPECT_GT(next_in, 8u * 100u);  // many laps
  EXPECT_EQ(ring.write_position(), next_in);
  EXPECT_EQ(ring.read_position(), next_out);
  EXPECT_EQ(ring.size(), 0u);
}

TEST(SpscRing, UntypedPushAndPopCopyWholeItems) {
  SpscRing ring(3, 4);
  const char in[3] = {'a', 'b', 'c'};
  char out[3] = {};
  ASSERT_TRUE(ring.try_push(in));
  ASSERT_TRUE(ring.try_pop(out));
  EXPECT_EQ(std::memcmp(in, out, 3), 0);
}

TEST(SpscRing, TypedAccessRefusesAMismatchedItemSize) {
  SpscRing ring = make_ring(4);
  EXPECT_FALSE(ring.try_push_as(std::uint32_t{1}));
  ASSERT_TRUE(ring.try_push_as(u64{1}));
  std::uint32_t small = 0;
  EXPECT_FALSE(ring.try_pop_as(small));
  EXPECT_EQ(ring.size(), 1u);
}

TEST(SpscRing, MultiItemPushStoresInOrder) {
  SpscRing ring = make_ring(16);
  const std::vector<u64> in = iota(100, 110);
  EXPECT_EQ(ring.push(in.data(), in.size()), in.size());
  EXPECT_EQ(pop_all(ring), in);
}

// ---- overflow: block -------------------------------------------------------------------------

TEST(SpscRingBlock, TryPushFailsWhenFullWithoutCountingARejection) {
  SpscRing ring = make_ring(4, Overflow::block);
  push_values(ring, 0, 4);
  EXPECT_FALSE(ring.try_push_as(u64{4}));
  EXPECT_EQ(ring.stats().rejected, 0u);
  EXPECT_EQ(ring.stats().dropped, 0u);
  EXPECT_EQ(pop_all(ring), iota(0, 4));
}

TEST(SpscRingBlock, PushTimesOutAndReturnsThePartialCount) {
  SpscRing ring = make_ring(8, Overflow::block);
  const std::vector<u64> in = iota(0, 12);
  const auto t0 = Clock::now();
  EXPECT_EQ(ring.push(in.data(), in.size(), 50ms), 8u);
  const double ms = ms_since(t0);
  EXPECT_GE(ms, 45.0);
  EXPECT_LT(ms, 5000.0);
  EXPECT_EQ(ring.stats().rejected, 0u);
  EXPECT_EQ(pop_all(ring), iota(0, 8));
}

TEST(SpscRingBlock, PushWithZeroTimeoutStoresWhatFitsAndReturns) {
  SpscRing ring = make_ring(4, Overflow::block);
  const std::vector<u64> in = iota(0, 6);
  EXPECT_EQ(ring.push(in.data(), in.size(), 0ns), 4u);
  EXPECT_EQ(ring.push(in.data(), 1, 0ns), 0u);
}

TEST(SpscRingBlock, PushLargerThanCapacityCompletesWhileTheConsumerDrains) {
  SpscRing ring = make_ring(8, Overflow::block);
  const std::vector<u64> in = iota(0, 1000);
  std::size_t stored = 0;
  std::thread producer([&] { stored = ring.push(in.data(), in.size()); });
  std::vector<u64> out;
  while (out.size() < in.size()) {
    ASSERT_EQ(ring.wait_for_items(1, 5s), WaitStatus::ready);
    u64 v = 0;
    while (ring.try_pop_as(v)) out.push_back(v);
  }
  producer.join();
  EXPECT_EQ(stored, in.size());
  EXPECT_EQ(out, in);
}

// Core bug (see the report): push() waits for min(remaining, capacity) free slots at once, so a
// consumer that leaves a few items stored while it waits for a larger batch deadlocks with it.
TEST(SpscRingBlock, PushMakesProgressWhenTheConsumerLeavesItemsStored) {
  SpscRing ring = make_ring(64, Overflow::block);
  const std::vector<u64> in = iota(0, 200);
  std::size_t stored = 0;
  std::thread producer([&] {
    stored = ring.push(in.data(), in.size(), 2s);
    ring.close();
  });
  std::vector<u64> out;
  for (;;) {  // consume in tens; the ring can be left holding 1..9 items while we wait
    const WaitStatus st = ring.wait_for_items(10, 5s);
    if (st == WaitStatus::timeout) break;
    const std::size_t take = st == WaitStatus::ready ? 10 : ring.size();
    for (std::size_t i = 0; i < take; ++i) {
      u64 v = 0;
      ASSERT_TRUE(ring.try_pop_as(v));
      out.push_back(v);
    }
    if (st == WaitStatus::closed) break;
  }
  producer.join();
  EXPECT_EQ(stored, in.size());
  EXPECT_EQ(out, in);
}

// ---- overflow: reject ------------------------------------------------------------------------

TEST(SpscRingReject, TryPushReturnsFalseWhenFullAndCountsTheRejection) {
  SpscRing ring = make_ring(4, Overflow::reject);
  push_values(ring, 0, 4);
  EXPECT_FALSE(ring.try_push_as(u64{4}));
  EXPECT_FALSE(ring.try_push_as(u64{5}));
  EXPECT_EQ(ring.stats().rejected, 2u);
  EXPECT_EQ(ring.stats().pushed, 4u);
  EXPECT_EQ(pop_all(ring), iota(0, 4));  // what was stored is untouched
}

TEST(SpscRingReject, MultiItemPushIsAllOrNothing) {
  SpscRing ring = make_ring(8, Overflow::reject);
  const std::vector<u64> in = iota(0, 8);
  EXPECT_EQ(ring.push(in.data(), 5), 5u);
  EXPECT_EQ(ring.push(in.data() + 5, 4), 0u);  // 4 do not fit: none is stored
  EXPECT_EQ(ring.size(), 5u);
  EXPECT_EQ(ring.stats().rejected, 4u);
  EXPECT_EQ(ring.push(in.data() + 5, 3), 3u);  // exactly fills the ring
  EXPECT_EQ(pop_all(ring), in);
}

TEST(SpscRingReject, PushMoreThanCapacityAtOnceThrowsInvalidArgument) {
  SpscRing ring = make_ring(4, Overflow::reject);
  const std::vector<u64> in = iota(0, 5);
  EXPECT_THROW(ring.push(in.data(), in.size()), std::invalid_argument);
  EXPECT_EQ(ring.size(), 0u);
}

// ---- overflow: drop_oldest -------------------------------------------------------------------

TEST(SpscRingDropOldest, TryPushDiscardsTheOldestItemsAndCountsThem) {
  SpscRing ring = make_ring(4, Overflow::drop_oldest);
  push_values(ring, 0, 10);
  EXPECT_EQ(ring.stats().dropped, 6u);
  EXPECT_EQ(ring.stats().rejected, 0u);
  EXPECT_EQ(ring.size(), 4u);
  EXPECT_EQ(ring.read_position(), 6u);
  EXPECT_EQ(pop_all(ring), iota(6, 10));  // the consumer sees the newest items
}

TEST(SpscRingDropOldest, MultiItemPushDropsJustEnoughForTheWholeBatch) {
  SpscRing ring = make_ring(8, Overflow::drop_oldest);
  const std::vector<u64> in = iota(0, 11);
  EXPECT_EQ(ring.push(in.data(), 6), 6u);
  EXPECT_EQ(ring.push(in.data() + 6, 5), 5u);
  EXPECT_EQ(ring.stats().dropped, 3u);
  EXPECT_EQ(pop_all(ring), iota(3, 11));
}

TEST(SpscRingDropOldest, PushMoreThanCapacityAtOnceThrowsInvalidArgument) {
  SpscRing ring = make_ring(4, Overflow::drop_oldest);
  const std::vector<u64> in = iota(0, 5);
  EXPECT_THROW(ring.push(in.data(), in.size()), std::invalid_argument);
}

TEST(SpscRingDropOldest, NeverDropsAHeldRegionAndRejectsInstead) {
  SpscRing ring = make_ring(4, Overflow::drop_oldest);
  push_values(ring, 0, 4);
  const ReadRegion held = ring.peek(2);
  ASSERT_EQ(held.count, 2u);
  EXPECT_FALSE(ring.try_push_as(u64{4}));
  const u64 batch[2] = {4, 5};
  EXPECT_EQ(ring.push(batch, 2), 0u);
  EXPECT_EQ(ring.stats().dropped, 0u);
  EXPECT_EQ(ring.stats().rejected, 3u);
  EXPECT_EQ(ring.read_position(), 0u);
  EXPECT_EQ(load(held.data), 0u);  // the held items are intact
  EXPECT_EQ(load(held.data + sizeof(u64)), 1u);

  ring.release(0);  // end the hold without consuming: dropping is allowed again
  EXPECT_TRUE(ring.try_push_as(u64{4}));
  EXPECT_EQ(ring.stats().dropped, 1u);
  EXPECT_EQ(pop_all(ring), iota(1, 5));
}

TEST(SpscRingDropOldest, PushWorksAgainAfterTheHeldRegionIsReleased) {
  SpscRing ring = make_ring(4, Overflow::drop_oldest);
  push_values(ring, 0, 4);
  ASSERT_EQ(ring.peek(4).count, 4u);
  EXPECT_FALSE(ring.try_push_as(u64{4}));
  ring.release(2);
  EXPECT_TRUE(ring.try_push_as(u64{4}));
  EXPECT_TRUE(ring.try_push_as(u64{5}));
  EXPECT_EQ(ring.stats().dropped, 0u);  // the release made room: nothing had to go
  EXPECT_TRUE(ring.try_push_as(u64{6}));
  EXPECT_EQ(ring.stats().dropped, 1u);
  EXPECT_EQ(pop_all(ring), iota(3, 7));
}

TEST(SpscRingDropOldest, EmptyPeekHoldsNothing) {
  SpscRing ring = make_ring(4, Overflow::drop_oldest);
  EXPECT_EQ(ring.peek(4).count, 0u);
  push_values(ring, 0, 6);  // drops work: the empty peek left no hold behind
  EXPECT_EQ(ring.stats().dropped, 2u);
  EXPECT_EQ(ring.stats().rejected, 0u);
}

// Core bug (see the report): release() stores its private, stale read position even when the
// consumer holds nothing, undoing drops the producer made after an empty peek.
TEST(SpscRingDropOldest, ReleaseZeroAfterAnEmptyPeekKeepsTheProducersDrops) {
  SpscRing ring = make_ring(4, Overflow::drop_oldest);
  ASSERT_EQ(ring.peek(4).count, 0u);
  push_values(ring, 0, 6);  // drops 0 and 1
  ASSERT_EQ(ring.read_position(), 2u);
  ring.release(0);  // "count may be 0": must not move the read position
  EXPECT_EQ(ring.read_position(), 2u);
  EXPECT_EQ(ring.size(), 4u);
  EXPECT_EQ(pop_all(ring), iota(2, 6));
}

TEST(SpscRingDropOldest, PopWorksThroughTheHeldRegionPath) {
  SpscRing ring = make_ring(8, Overflow::drop_oldest);
  u64 next = 0, expected = 0;
  for (int round = 0; round < 200; ++round) {
    push_values(ring, next, next + 3 + round % 11);  // sometimes overflows
    next += 3 + round % 11;
    u64 v = 0;
    for (int i = 0; i < 5 && ring.try_pop_as(v); ++i) {
      ASSERT_GE(v, expected);
      expected = v + 1;
    }
  }
  const auto s = ring.stats();
  EXPECT_GT(s.dropped, 0u);
  EXPECT_EQ(s.pushed, s.popped + s.dropped + ring.size());
}

// ---- close -----------------------------------------------------------------------------------

TEST(SpscRingClose, PushAfterCloseThrowsLogicError) {
  SpscRing ring = make_ring(4);
  ring.close();
  const u64 v = 1;
  EXPECT_THROW(ring.push(&v, 1), std::logic_error);
  EXPECT_FALSE(ring.try_push(&v));
  EXPECT_FALSE(ring.try_push_as(v));
  EXPECT_EQ(ring.reserve(2).count, 0u);
  EXPECT_EQ(ring.stats().pushed, 0u);
}

TEST(SpscRingClose, PushAfterCloseThrowsForEveryPolicy) {
  for (Overflow o : {Overflow::block, Overflow::reject, Overflow::drop_oldest}) {
    SpscRing ring = make_ring(4, o);
    ring.close();
    const u64 v = 1;
    EXPECT_THROW(ring.push(&v, 1), std::logic_error);
  }
}

TEST(SpscRingClose, IsIdempotent) {
  SpscRing ring = make_ring(4);
  ring.close();
  ring.close();
  EXPECT_TRUE(ring.closed());
}

TEST(SpscRingClose, ConsumerDrainsStoredItemsThenWaitsReportClosed) {
  SpscRing ring = make_ring(8);
  push_values(ring, 0, 3);
  ring.close();
  EXPECT_EQ(ring.wait_for_items(3, 1s), WaitStatus::ready);
  EXPECT_EQ(ring.wait_for_items(4, 1s), WaitStatus::closed);  // 4 can never arrive
  EXPECT_EQ(pop_all(ring), iota(0, 3));
  EXPECT_EQ(ring.wait_for_items(1, 1s), WaitStatus::closed);
  EXPECT_EQ(ring.wait_for_items(1, mstar::kForever), WaitStatus::closed);
}

TEST(SpscRingClose, WakesAConsumerBlockedInWaitForItems) {
  SpscRing ring = make_ring(8);
  push_values(ring, 0, 1);
  std::atomic<bool> returned{false};
  WaitStatus status = WaitStatus::ready;
  std::thread consumer([&] {
    status = ring.wait_for_items(2, mstar::kForever);
    returned = true;
  });
  std::this_thread::sleep_for(50ms);
  EXPECT_FALSE(returned.load());
  const auto t0 = Clock::now();
  ring.close();
  consumer.join();
  EXPECT_LT(ms_since(t0), 2000.0);
  EXPECT_EQ(status, WaitStatus::closed);
  EXPECT_EQ(pop_all(ring), iota(0, 1));  // the stored item is still there to drain
}

TEST(SpscRingClose, WakesAProducerBlockedInWaitForSpace) {
  SpscRing ring = make_ring(4);
  push_values(ring, 0, 4);
  std::atomic<bool> returned{false};
  WaitStatus status = WaitStatus::ready;
  std::thread producer([&] {
    status = ring.wait_for_space(1, mstar::kForever);
    returned = true;
  });
  std::this_thread::sleep_for(50ms);
  EXPECT_FALSE(returned.load());
  ring.close();
  producer.join();
  EXPECT_EQ(status, WaitStatus::closed);
}

TEST(SpscRingClose, WakesAProducerBlockedInPushWhichReturnsThePartialCount) {
  SpscRing ring = make_ring(4);
  const std::vector<u64> in = iota(0, 6);
  std::size_t stored = 99;
  std::thread producer([&] { stored = ring.push(in.data(), in.size()); });
  while (ring.size() < 4) std::this_thread::yield();
  std::this_thread::sleep_for(20ms);
  ring.close();
  producer.join();
  EXPECT_EQ(stored, 4u);
  EXPECT_EQ(pop_all(ring), iota(0, 4));
}

// ---- waits -----------------------------------------------------------------------------------

TEST(SpscRingWait, WaitForItemsTimesOutInRoughlyTheRequestedTime) {
  SpscRing ring = make_ring(8);
  push_values(ring, 0, 2);
  const auto t0 = Clock::now();
  EXPECT_EQ(ring.wait_for_items(3, 100ms), WaitStatus::timeout);
  const double ms = ms_since(t0);
  EXPECT_GE(ms, 95.0);
  EXPECT_LT(ms, 2000.0);
}

TEST(SpscRingWait, WaitForSpaceTimesOutInRoughlyTheRequestedTime) {
  SpscRing ring = make_ring(4);
  push_values(ring, 0, 3);
  const auto t0 = Clock::now();
  EXPECT_EQ(ring.wait_for_space(2, 60ms), WaitStatus::timeout);
  const double ms = ms_since(t0);
  EXPECT_GE(ms, 55.0);
  EXPECT_LT(ms, 2000.0);
  EXPECT_EQ(ring.wait_for_space(1, 0ns), WaitStatus::ready);
}

TEST(SpscRingWait, ZeroTimeoutReturnsAtOnce) {
  SpscRing ring = make_ring(4);
  const auto t0 = Clock::now();
  EXPECT_EQ(ring.wait_for_items(1, 0ns), WaitStatus::timeout);
  EXPECT_LT(ms_since(t0), 50.0);
}

TEST(SpscRingWait, ReadyAtOnceWhenTheConditionAlreadyHolds) {
  SpscRing ring = make_ring(4);
  EXPECT_EQ(ring.wait_for_items(0, 0ns), WaitStatus::ready);
  EXPECT_EQ(ring.wait_for_space(4, 0ns), WaitStatus::ready);
  push_values(ring, 0, 2);
  EXPECT_EQ(ring.wait_for_items(2, 0ns), WaitStatus::ready);
  EXPECT_EQ(ring.wait_for_space(2, 0ns), WaitStatus::ready);
  EXPECT_EQ(ring.wait_for_space(3, 0ns), WaitStatus::timeout);
}

TEST(SpscRingWait, SleepingConsumerWakesWhenEnoughItemsArrive) {
  SpscRing ring = make_ring(8);
  WaitStatus status = WaitStatus::timeout;
  std::thread consumer([&] { status = ring.wait_for_items(3, 10s); });
  for (u64 i = 0; i < 3; ++i) {
    std::this_thread::sleep_for(20ms);  // long enough for the consumer to reach the futex
    ASSERT_TRUE(ring.try_push_as(i));
  }
  consumer.join();
  EXPECT_EQ(status, WaitStatus::ready);
}

TEST(SpscRingWait, SleepingProducerWakesWhenEnoughSpaceIsFreed) {
  SpscRing ring = make_ring(4);
  push_values(ring, 0, 4);
  WaitStatus status = WaitStatus::timeout;
  std::thread producer([&] { status = ring.wait_for_space(2, 10s); });
  u64 v = 0;
  for (int i = 0; i < 2; ++i) {
    std::this_thread::sleep_for(20ms);
    ASSERT_TRUE(ring.try_pop_as(v));
  }
  producer.join();
  EXPECT_EQ(status, WaitStatus::ready);
}

// ---- regions ---------------------------------------------------------------------------------

TEST(SpscRingRegion, ReserveAndCommitWriteInPlace) {
  SpscRing ring = make_ring(8);
  const WriteRegion w = ring.reserve(3);
  ASSERT_EQ(w.count, 3u);
  EXPECT_EQ(w.position, 0u);
  EXPECT_EQ(static_cast<const std::byte*>(w.data), ring.storage());
  for (u64 i = 0; i < 3; ++i) store(w.data + i * sizeof(u64), 10 + i);
  EXPECT_EQ(ring.size(), 0u);  // nothing is published before commit
  ring.commit(2);              // publish a prefix only
  EXPECT_EQ(ring.size(), 2u);
  EXPECT_EQ(ring.stats().pushed, 2u);
  EXPECT_EQ(ring.reserve(8).position, 2u);
  EXPECT_EQ(pop_all(ring), (std::vector<u64>{10, 11}));
}

TEST(SpscRingRegion, ReserveIsLimitedByFreeSpaceAndNeverDrops) {
  SpscRing ring = make_ring(8, Overflow::drop_oldest);
  push_values(ring, 0, 6);
  EXPECT_EQ(ring.reserve(5).count, 2u);
  push_values(ring, 6, 8);
  EXPECT_EQ(ring.reserve(1).count, 0u);
  EXPECT_EQ(ring.stats().dropped, 0u);
  ring.commit(0);  // a no-op
  EXPECT_EQ(ring.stats().pushed, 8u);
}

TEST(SpscRingRegion, PeekAndReleaseReadInPlace) {
  SpscRing ring = make_ring(8);
  push_values(ring, 0, 5);
  const ReadRegion r = ring.peek(3);
  ASSERT_EQ(r.count, 3u);
  EXPECT_EQ(r.position, 0u);
  EXPECT_EQ(r.data, ring.storage());
  for (u64 i = 0; i < 3; ++i) EXPECT_EQ(load(r.data + i * sizeof(u64)), i);
  EXPECT_EQ(ring.size(), 5u);  // peek consumes nothing
  EXPECT_EQ(ring.peek(8).count, 5u);
  ring.release(2);
  EXPECT_EQ(ring.read_position(), 2u);
  EXPECT_EQ(ring.stats().popped, 2u);
  const ReadRegion rest = ring.peek(8);
  EXPECT_EQ(rest.position, 2u);
  EXPECT_EQ(rest.count, 3u);
  EXPECT_EQ(load(rest.data), 2u);
  ring.release(0);
  EXPECT_EQ(ring.size(), 3u);
}

// Puts the ring's read and write positions at `pos` (an empty ring whose next slot is pos & mask).
void advance_to(SpscRing& ring, u64 pos) {
  for (u64 i = 0; i < pos; ++i) {
    ASSERT_TRUE(ring.try_push_as(u64{0}));
    u64 v;
    ASSERT_TRUE(ring.try_pop_as(v));
  }
}

TEST(SpscRingRegion, RegionsAcrossTheWrapAreContiguousWithAMirror) {
  SpscRing ring = make_ring(8, Overflow::block, 4);
  advance_to(ring, 6);
  const WriteRegion w = ring.reserve(5);  // slots 6, 7 and the band copies of 0, 1, 2
  ASSERT_EQ(w.count, 5u);
  EXPECT_EQ(static_cast<const std::byte*>(w.data), ring.storage() + 6 * sizeof(u64));
  EXPECT_TRUE(in_storage(ring, w.data, 5));
  for (u64 i = 0; i < 5; ++i) store(w.data + i * sizeof(u64), 100 + i);
  ring.commit(5);

  const ReadRegion r = ring.peek(5);
  ASSERT_EQ(r.count, 5u);
  EXPECT_EQ(r.position, 6u);
  EXPECT_EQ(r.data, ring.storage() + 6 * sizeof(u64));
  EXPECT_TRUE(in_storage(ring, r.data, 5));
  for (u64 i = 0; i < 5; ++i) EXPECT_EQ(load(r.data + i * sizeof(u64)), 100 + i);
  ring.release(0);
  // The band part was copied back to the head: single pops see the same values.
  EXPECT_EQ(pop_all(ring), iota(100, 105));
}

TEST(SpscRingRegion, ItemsPushedOneByOneAcrossTheWrapArePeekedAsOneSpan) {
  SpscRing ring = make_ring(8, Overflow::block, 4);
  advance_to(ring, 5);
  push_values(ring, 50, 57);  // slots 5, 6, 7, 0, 1, 2, 3
  const ReadRegion r = ring.peek(7);
  ASSERT_EQ(r.count, 7u);
  EXPECT_TRUE(in_storage(ring, r.data, 7));
  for (u64 i = 0; i < 7; ++i) EXPECT_EQ(load(r.data + i * sizeof(u64)), 50 + i);
  ring.release(7);
}

TEST(SpscRingRegion, RegionsAreCappedAtTheEndOfTheMirrorBand) {
  SpscRing ring = make_ring(8, Overflow::block, 2);
  advance_to(ring, 6);
  const WriteRegion w = ring.reserve(8);
  EXPECT_EQ(w.count, 4u);  // slots 6, 7 and a 2-slot band
  for (u64 i = 0; i < w.count; ++i) store(w.data + i * sizeof(u64), i);
  ring.commit(w.count);
  push_values(ring, 4, 8);
  const ReadRegion r = ring.peek(8);
  EXPECT_EQ(r.count, 4u);
  ring.release(r.count);
  EXPECT_EQ(pop_all(ring), iota(4, 8));
}

TEST(SpscRingRegion, WithoutAMirrorARegionStopsAtTheEndOfStorage) {
  SpscRing ring = make_ring(8, Overflow::block, 0);
  advance_to(ring, 6);
  WriteRegion w = ring.reserve(5);
  ASSERT_EQ(w.count, 2u);  // slots 6, 7
  store(w.data, 1);
  store(w.data + sizeof(u64), 2);
  ring.commit(2);
  w = ring.reserve(3);  // the rest in a second call, from slot 0
  ASSERT_EQ(w.count, 3u);
  EXPECT_EQ(static_cast<const std::byte*>(w.data), ring.storage());
  for (u64 i = 0; i < 3; ++i) store(w.data + i * sizeof(u64), 3 + i);
  ring.commit(3);

  ReadRegion r = ring.peek(5);
  ASSERT_EQ(r.count, 2u);
  EXPECT_EQ(r.data, ring.storage() + 6 * sizeof(u64));
  EXPECT_EQ(load(r.data), 1u);
  EXPECT_EQ(load(r.data + sizeof(u64)), 2u);
  ring.release(2);
  r = ring.peek(5);
  ASSERT_EQ(r.count, 3u);
  EXPECT_EQ(r.data, ring.storage());
  for (u64 i = 0; i < 3; ++i) EXPECT_EQ(load(r.data + i * sizeof(u64)), 3 + i);
  ring.release(3);
}

// Every mix of the item and region APIs, on both sides, over many laps and every alignment.
TEST(SpscRingRegion, MixedApisKeepHeadAndMirrorBandConsistentOverManyLaps) {
  for (std::size_t mirror : {0u, 1u, 3u, 8u}) {
    SpscRing ring = make_ring(8, Overflow::block, mirror);
    std::mt19937 rng(static_cast<unsigned>(mirror) + 7);
    u64 next_in = 0, next_out = 0;
    for (int step = 0; step < 5000; ++step) {
      if (rng() % 2) {  // produce
        const std::size_t want = 1 + rng() % 8;
        if (rng() % 2) {
          const WriteRegion w = ring.reserve(want);
          ASSERT_TRUE(in_storage(ring, w.data, w.count));
          for (std::size_t i = 0; i < w.count; ++i) store(w.data + i * sizeof(u64), next_in + i);
          ring.commit(w.count);
          next_in += w.count;
        } else {
          for (std::size_t i = 0; i < want && ring.try_push_as(next_in); ++i) ++next_in;
        }
      } else {  // consume
        const std::size_t want = 1 + rng() % 8;
        if (rng() % 2) {
          const ReadRegion r = ring.peek(want);
          ASSERT_TRUE(in_storage(ring, r.data, r.count));
          ASSERT_LE(r.count, mirror + 1 + (8 - 1 - (r.position & 7)));
          for (std::size_t i = 0; i < r.count; ++i)
            ASSERT_EQ(load(r.data + i * sizeof(u64)), next_out + i) << "mirror " << mirror;
          const std::size_t used = r.count ? rng() % (r.count + 1) : 0;
          ring.release(used);
          next_out += used;
        } else {
          u64 v;
          for (std::size_t i = 0; i < want && ring.try_pop_as(v); ++i)
            ASSERT_EQ(v, next_out++) << "mirror " << mirror;
        }
      }
      ASSERT_EQ(ring.size(), next_in - next_out);
    }
    EXPECT_GT(next_out, 8u * 200u);
  }
}

TEST(SpscRingRegion, AnyWindowUpToMirrorPlusOneIsOneSpan) {
  const std::size_t mirror = 5;
  SpscRing ring = make_ring(8, Overflow::block, mirror);
  u64 next = 0;
  for (int round = 0; round < 16; ++round) {  // windows of 6 plus one item: every slot, twice
    push_values(ring, next, next + mirror + 1);
    const ReadRegion r = ring.peek(mirror + 1);
    ASSERT_EQ(r.count, mirror + 1) << "start slot " << (r.position & 7);
    ASSERT_TRUE(in_storage(ring, r.data, r.count));
    for (std::size_t i = 0; i < r.count; ++i) ASSERT_EQ(load(r.data + i * sizeof(u64)), next + i);
    ring.release(r.count);
    next += mirror + 1;
    advance_to(ring, 1);  // shift the alignment by one more slot
  }
}

// ---- stats and accounting --------------------------------------------------------------------

TEST(SpscRingStats, EverySlotIsAccountedFor) {
  {
    SpscRing ring = make_ring(8, Overflow::reject);
    push_values(ring, 0, 6);
    u64 v;
    ASSERT_TRUE(ring.try_pop_as(v));
    const u64 batch[4] = {};
    EXPECT_EQ(ring.push(batch, 4), 0u);  // 5 stored + 4 > 8
    const auto s = ring.stats();
    EXPECT_EQ(s.pushed, 6u);
    EXPECT_EQ(s.popped, 1u);
    EXPECT_EQ(s.rejected, 4u);
    EXPECT_EQ(s.dropped, 0u);
    EXPECT_EQ(s.pushed, s.popped + ring.size());
    EXPECT_EQ(ring.write_position() - ring.read_position(), ring.size());
  }
  {
    SpscRing ring = make_ring(8, Overflow::drop_oldest);
    push_values(ring, 0, 20);
    u64 v;
    ASSERT_TRUE(ring.try_pop_as(v));
    ASSERT_EQ(ring.peek(3).count, 3u);
    ring.release(2);
    const auto s = ring.stats();
    EXPECT_EQ(s.pushed, 20u);
    EXPECT_EQ(s.dropped, 12u);
    EXPECT_EQ(s.popped, 3u);
    EXPECT_EQ(s.pushed, s.popped + s.dropped + ring.size());
    EXPECT_EQ(ring.write_position(), s.pushed);
    EXPECT_EQ(ring.read_position(), s.popped + s.dropped);
  }
}

TEST(SpscRingStats, EveryItemPushedIsPoppedExactlyOnce) {
  constexpr u64 kItems = 200000;
  SpscRing ring = make_ring(64, Overflow::block, 16);
  std::vector<std::uint8_t> seen(kItems, 0);
  std::thread producer([&] {  // rotates through the three producer APIs
    std::mt19937 rng(1);
    u64 next = 0;
    std::vector<u64> batch;
    while (next < kItems) {
      const u64 want = std::min<u64>(1 + rng() % 40, kItems - next);
      switch (rng() % 3) {
        case 0:
          while (!ring.try_push_as(next)) std::this_thread::yield();
          ++next;
          break;
        case 1:
          batch = iota(next, next + want);
          next += ring.push(batch.data(), batch.size());
          break;
        default: {
          const WriteRegion w = ring.reserve(want);
          for (std::size_t i = 0; i < w.count; ++i) store(w.data + i * sizeof(u64), next + i);
          ring.commit(w.count);
          next += w.count;
          if (w.count == 0) std::this_thread::yield();
        }
      }
    }
    ring.close();
  });
  std::mt19937 rng(2);
  u64 popped = 0;
  for (;;) {
    if (rng() % 2) {
      u64 v;
      if (ring.try_pop_as(v)) {
        ASSERT_LT(v, kItems);
        ++seen[v];
        ++popped;
        continue;
      }
    } else {
      const ReadRegion r = ring.peek(1 + rng() % 32);
      for (std::size_t i = 0; i < r.count; ++i) {
        const u64 v = load(r.data + i * sizeof(u64));
        ASSERT_LT(v, kItems);
        ++seen[v];
      }
      ring.release(r.count);
      popped += r.count;
      if (r.count) continue;
    }
    if (ring.wait_for_items(1, 5s) == WaitStatus::closed && ring.size() == 0) break;
  }
  producer.join();
  EXPECT_EQ(popped, kItems);
  for (u64 i = 0; i < kItems; ++i) ASSERT_EQ(seen[i], 1) << "item " << i;
  const auto s = ring.stats();
  EXPECT_EQ(s.pushed, kItems);
  EXPECT_EQ(s.popped, kItems);
  EXPECT_EQ(s.dropped + s.rejected, 0u);
}

}  // namespace

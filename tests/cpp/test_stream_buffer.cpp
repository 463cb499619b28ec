// StreamBuffer: capacity checks, in-place chunks across the wrap, holds, end-of-stream flush, drops.
#include "mstar/stream_buffer.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <thread>
#include <vector>

namespace {

using mstar::ChunkPolicy;
using mstar::ChunkView;
using mstar::Overflow;
using mstar::StreamBuffer;
using mstar::WaitStatus;
using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;
using u32 = std::uint32_t;
using u64 = std::uint64_t;

// Items are their own stream positions, so a chunk is correct when item i holds begin + i.
// One push per item, so that drop_oldest drops exactly as a live producer would.
void push_positions(StreamBuffer& sb, u64 from, u64 to) {
  for (u64 p = from; p < to; ++p) {
    const u32 x = static_cast<u32>(p);
    ASSERT_EQ(sb.push(&x, 1, 0ns), 1u) << "position " << p;
  }
}

u32 item(const ChunkView& v, std::size_t i) {
  u32 x;
  std::memcpy(&x, v.data + i * sizeof(u32), sizeof x);
  return x;
}

void expect_positions(const ChunkView& v) {
  for (std::size_t i = 0; i < v.chunk.size(); ++i)
    ASSERT_EQ(item(v, i), v.chunk.begin + i) << "chunk " << v.chunk.index << " item " << i;
}

bool in_storage(const StreamBuffer& sb, const ChunkView& v) {
  const std::byte* lo = sb.ring().storage();
  const std::byte* hi = lo + sb.ring().storage_bytes();
  return v.data >= lo && v.data + v.chunk.size() * sb.item_size() <= hi;
}

struct Span {
  u64 begin, new_begin, end;
  bool last;
};

// Takes every chunk until the stream reports closed, checking contents; returns the positions.
std::vector<Span> drain(StreamBuffer& sb) {
  std::vector<Span> out;
  ChunkView v;
  WaitStatus st;
  while ((st = sb.next_chunk(&v, 1s)) == WaitStatus::ready) {
    expect_positions(v);
    out.push_back({v.chunk.begin, v.chunk.new_begin, v.chunk.end, v.chunk.last});
    sb.release_chunk();
  }
  EXPECT_EQ(st, WaitStatus::closed);
  return out;
}

// ---- construction ---------------------------------------------------------------------------

TEST(StreamBufferConstruction, WindowLargerThanCapacityThrows) {
  EXPECT_THROW(StreamBuffer(4, 32, ChunkPolicy::sliding_window(40, 8)), std::invalid_argument);
  EXPECT_THROW(StreamBuffer(4, 32, ChunkPolicy::fixed(33)), std::invalid_argument);
  EXPECT_THROW(StreamBuffer(4, 32, ChunkPolicy::left_context(20, 13)), std::invalid_argument);
  EXPECT_THROW(StreamBuffer(4, 16, ChunkPolicy::ramp({1, 17}, 4)), std::invalid_argument);
}

TEST(StreamBufferConstruction, ContextFillingTheCapacityThrows) {
  EXPECT_THROW(StreamBuffer(4, 32, ChunkPolicy::left_context(32, 1)), std::invalid_argument);
  EXPECT_THROW(StreamBuffer(4, 32, ChunkPolicy::ramp({}, 1, 40)), std::invalid_argument);
  try {
    StreamBuffer(4, 32, ChunkPolicy::left_context(32, 1));
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("context"), std::string::npos) << e.what();
  }
}

TEST(StreamBufferConstruction, CapacityNotAPowerOfTwoThrows) {
  EXPECT_THROW(StreamBuffer(4, 48, ChunkPolicy::fixed(4)), std::invalid_argument);
}

TEST(StreamBufferConstruction, WindowEqualToCapacityIsAcceptedAndSizesTheMirror) {
  StreamBuffer sb(4, 32, ChunkPolicy::sliding_window(32, 8));
  EXPECT_EQ(sb.ring().capacity(), 32u);
  EXPECT_EQ(sb.ring().mirror(), 32u);
  EXPECT_EQ(sb.item_size(), 4u);
  EXPECT_EQ(sb.policy().describe(), "SlidingWindow(32, 8)");
  StreamBuffer lc(4, 64, ChunkPolicy::left_context(25, 25));
  EXPECT_EQ(lc.ring().mirror(), 50u);
}

// ---- chunks ----------------------------------------------------------------------------------

TEST(StreamBuffer, DeliversTheHeaderTableForSlidingWindow4x2) {
  StreamBuffer sb(sizeof(u32), 8, ChunkPolicy::sliding_window(4, 2));
  ChunkView v;
  EXPECT_EQ(sb.try_next_chunk(&v), WaitStatus::timeout);
  push_positions(sb, 0, 3);
  EXPECT_EQ(sb.try_next_chunk(&v), WaitStatus::timeout);
  push_positions(sb, 3, 4);
  ASSERT_EQ(sb.try_next_chunk(&v), WaitStatus::ready);
  EXPECT_EQ(v.chunk.begin, 0u);
  EXPECT_EQ(v.chunk.new_begin, 0u);
  EXPECT_EQ(v.chunk.end, 4u);
  EXPECT_FALSE(v.chunk.last);
  expect_positions(v);
  sb.release_chunk();
  EXPECT_EQ(sb.ring().read_position(), 2u);  // keeps items 2.. as context
  push_positions(sb, 4, 9);
  ASSERT_EQ(sb.try_next_chunk(&v), WaitStatus::ready);
  EXPECT_EQ(v.chunk.begin, 2u);
  EXPECT_EQ(v.chunk.new_begin, 4u);
  EXPECT_EQ(v.chunk.end, 6u);
  sb.release_chunk();
  ASSERT_EQ(sb.try_next_chunk(&v), WaitStatus::ready);
  EXPECT_EQ(v.chunk.end, 8u);
  sb.release_chunk();
  EXPECT_EQ(sb.try_next_chunk(&v), WaitStatus::timeout);  // item 8 alone is not a chunk yet
  sb.close();
  ASSERT_EQ(sb.try_next_chunk(&v), WaitStatus::ready);  // ...until the end of stream
  EXPECT_EQ(v.chunk.begin, 6u);
  EXPECT_EQ(v.chunk.new_begin, 8u);
  EXPECT_EQ(v.chunk.end, 9u);
  EXPECT_EQ(v.chunk.size(), 3u);
  EXPECT_TRUE(v.chunk.last);
  expect_positions(v);
  sb.release_chunk();
  EXPECT_EQ(sb.try_next_chunk(&v), WaitStatus::closed);
  EXPECT_EQ(sb.next_chunk(&v), WaitStatus::closed);
}

TEST(StreamBuffer, ChunksAreInPlaceAndCorrectAcrossTheWrap) {
  const std::size_t capacity = 8;
  StreamBuffer sb(sizeof(u32), capacity, ChunkPolicy::sliding_window(6, 2));
  u64 written = 0;
  int wrapped = 0;
  ChunkView v;
  for (int i = 0; i < 100; ++i) {
    while (sb.try_next_chunk(&v) != WaitStatus::ready) {
      push_positions(sb, written, written + 1);  // one at a time: every alignment occurs
      ++written;
    }
    ASSERT_TRUE(in_storage(sb, v));
    EXPECT_EQ(v.data, sb.ring().storage() + (v.chunk.begin % capacity) * sizeof(u32));
    EXPECT_EQ(v.chunk.size(), 6u);
    expect_positions(v);
    if (v.chunk.begin % capacity + v.chunk.size() > capacity) ++wrapped;
    sb.release_chunk();
  }
  EXPECT_GT(wrapped, 10);  // many chunks straddled the end of the storage
}

TEST(StreamBuffer, RampWithContextChunksAcrossTheWrap) {
  StreamBuffer sb(sizeof(u32), 16, ChunkPolicy::ramp({1, 3, 5}, 6, 4));
  EXPECT_EQ(sb.ring().mirror(), 10u);
  u64 written = 0;
  u64 expected_new_begin = 0;
  ChunkView v;
  for (int i = 0; i < 200; ++i) {
    while (sb.try_next_chunk(&v) != WaitStatus::ready) {
      push_positions(sb, written, written + 3);
      written += 3;
    }
    ASSERT_TRUE(in_storage(sb, v));
    EXPECT_EQ(v.chunk.new_begin, expected_new_begin);
    EXPECT_EQ(v.chunk.begin, v.chunk.new_begin > 4 ? v.chunk.new_begin - 4 : 0);
    expect_positions(v);
    expected_new_begin = v.chunk.end;
    sb.release_chunk();
  }
}

TEST(StreamBuffer, ProducerCanWriteInPlaceWithReserveAndCommit) {
  StreamBuffer sb(sizeof(u32), 16, ChunkPolicy::fixed(4));
  u64 next = 0, delivered = 0;
  for (int round = 0; round < 20; ++round) {
    const mstar::WriteRegion w = sb.reserve(5);
    for (std::size_t i = 0; i < w.count; ++i) {
      const u32 x = static_cast<u32>(next + i);
      std::memcpy(w.data + i * sizeof(u32), &x, sizeof x);
    }
    sb.commit(w.count);
    next += w.count;
    ChunkView v;
    while (sb.try_next_chunk(&v) == WaitStatus::ready) {
      EXPECT_EQ(v.chunk.new_begin, delivered);
      expect_positions(v);
      delivered = v.chunk.end;
      sb.release_chunk();
    }
  }
  sb.close();
  for (const Span& s : drain(sb)) delivered = s.end;
  EXPECT_GT(next, 80u);
  EXPECT_EQ(delivered, next);
}

// ---- holds -----------------------------------------------------------------------------------

TEST(StreamBufferHold, HeldChunkBlocksARejectProducerUntilReleased) {
  StreamBuffer sb(sizeof(u32), 8, ChunkPolicy::fixed(4), Overflow::reject);
  push_positions(sb, 0, 8);
  ChunkView v;
  ASSERT_EQ(sb.try_next_chunk(&v), WaitStatus::ready);
  EXPECT_TRUE(sb.holding());
  const u32 x = 8;
  EXPECT_EQ(sb.push(&x, 1), 0u);
  EXPECT_EQ(sb.ring().stats().rejected, 1u);
  expect_positions(v);  // the held items are untouched
  sb.release_chunk();
  EXPECT_FALSE(sb.holding());
  push_positions(sb, 8, 12);
  sb.close();
  const std::vector<Span> rest = drain(sb);
  ASSERT_EQ(rest.size(), 2u);
  EXPECT_EQ(rest[1].end, 12u);
}

TEST(StreamBufferHold, HeldChunkBlocksABlockingProducerUntilReleased) {
  StreamBuffer sb(sizeof(u32), 8, ChunkPolicy::fixed(4), Overflow::block);
  push_positions(sb, 0, 8);
  ChunkView v;
  ASSERT_EQ(sb.try_next_chunk(&v), WaitStatus::ready);
  const u32 x = 8;
  const auto t0 = Clock::now();
  EXPECT_EQ(sb.push(&x, 1, 30ms), 0u);  // times out
  EXPECT_GE(Clock::now() - t0, 25ms);

  std::atomic<std::size_t> stored{99};
  std::thread producer([&] { stored = sb.push(&x, 1); });  // sleeps until the release
  std::this_thread::sleep_for(30ms);
  EXPECT_EQ(stored.load(), 99u);
  sb.release_chunk();
  producer.join();
  EXPECT_EQ(stored.load(), 1u);
}

TEST(StreamBufferHold, HeldChunkIsNeverDroppedByADropOldestProducer) {
  StreamBuffer sb(sizeof(u32), 8, ChunkPolicy::fixed(4), Overflow::drop_oldest);
  push_positions(sb, 0, 8);
  ChunkView v;
  ASSERT_EQ(sb.try_next_chunk(&v), WaitStatus::ready);
  const u32 x = 8;
  EXPECT_EQ(sb.push(&x, 1), 0u);  // would have to drop item 0, which is held
  EXPECT_EQ(sb.ring().stats().dropped, 0u);
  EXPECT_EQ(sb.ring().stats().rejected, 1u);
  expect_positions(v);
  sb.release_chunk();
  push_positions(sb, 8, 12);  // the release made room for 4
  EXPECT_EQ(sb.ring().stats().dropped, 0u);
}

TEST(StreamBufferHold, NextChunkWhileHoldingThrowsLogicError) {
  StreamBuffer sb(sizeof(u32), 8, ChunkPolicy::fixed(2));
  push_positions(sb, 0, 4);
  ChunkView v;
  ASSERT_EQ(sb.next_chunk(&v), WaitStatus::ready);
  EXPECT_THROW(sb.next_chunk(&v), std::logic_error);
  EXPECT_THROW(sb.try_next_chunk(&v), std::logic_error);
  sb.release_chunk();
  EXPECT_THROW(sb.release_chunk(), std::logic_error);  // nothing held any more
  ASSERT_EQ(sb.next_chunk(&v), WaitStatus::ready);
  EXPECT_EQ(v.chunk.begin, 2u);
  sb.release_chunk();
}

TEST(StreamBufferHold, ReleaseWithoutAHeldChunkThrowsLogicError) {
  StreamBuffer sb(sizeof(u32), 8, ChunkPolicy::fixed(2));
  EXPECT_THROW(sb.release_chunk(), std::logic_error);
}

// ---- end of stream ---------------------------------------------------------------------------

TEST(StreamBufferEnd, FlushDeliversTheTail) {
  StreamBuffer sb(sizeof(u32), 16, ChunkPolicy::left_context(2, 3));
  push_positions(sb, 0, 7);
  sb.close();
  const std::vector<Span> got = drain(sb);
  ASSERT_EQ(got.size(), 3u);
  EXPECT_EQ(got[0].end, 3u);
  EXPECT_EQ(got[1].begin, 1u);
  EXPECT_EQ(got[1].end, 6u);
  EXPECT_EQ(got[2].begin, 4u);
  EXPECT_EQ(got[2].new_begin, 6u);
  EXPECT_EQ(got[2].end, 7u);
  EXPECT_FALSE(got[1].last);
  EXPECT_TRUE(got[2].last);
}

TEST(StreamBufferEnd, StreamEndingOnAChunkBoundaryHasNoExtraChunk) {
  StreamBuffer sb(sizeof(u32), 16, ChunkPolicy::sliding_window(4, 2));
  push_positions(sb, 0, 8);
  sb.close();
  const std::vector<Span> got = drain(sb);
  ASSERT_EQ(got.size(), 3u);
  EXPECT_EQ(got.back().end, 8u);
  EXPECT_TRUE(got.back().last);  // the end was known when it was taken
}

TEST(StreamBufferEnd, StreamShorterThanTheFirstWindowIsOneFlushedChunk) {
  StreamBuffer sb(sizeof(u32), 16, ChunkPolicy::sliding_window(8, 2));
  push_positions(sb, 0, 5);
  sb.close();
  const std::vector<Span> got = drain(sb);
  ASSERT_EQ(got.size(), 1u);
  EXPECT_EQ(got[0].begin, 0u);
  EXPECT_EQ(got[0].end, 5u);
  EXPECT_TRUE(got[0].last);
}

TEST(StreamBufferEnd, EmptyStreamReportsClosedAtOnce) {
  StreamBuffer sb(sizeof(u32), 8, ChunkPolicy::fixed(2));
  sb.close();
  ChunkView v;
  EXPECT_EQ(sb.next_chunk(&v), WaitStatus::closed);
  EXPECT_FALSE(sb.holding());
}

TEST(StreamBufferEnd, PushAfterCloseThrowsLogicError) {
  StreamBuffer sb(sizeof(u32), 8, ChunkPolicy::fixed(2));
  sb.close();
  const u32 x = 0;
  EXPECT_THROW(sb.push(&x, 1), std::logic_error);
}

// ---- waiting ---------------------------------------------------------------------------------

TEST(StreamBufferWait, NextChunkTimesOutWhenTheChunkIsIncomplete) {
  StreamBuffer sb(sizeof(u32), 8, ChunkPolicy::fixed(4));
  push_positions(sb, 0, 3);
  ChunkView v;
  const auto t0 = Clock::now();
  EXPECT_EQ(sb.next_chunk(&v, 50ms), WaitStatus::timeout);
  const auto waited = Clock::now() - t0;
  EXPECT_GE(waited, 45ms);
  EXPECT_LT(waited, 2s);
  EXPECT_FALSE(sb.holding());
}

TEST(StreamBufferWait, SleepingConsumerWakesWhenItsChunkIsComplete) {
  StreamBuffer sb(sizeof(u32), 8, ChunkPolicy::fixed(4));
  WaitStatus status = WaitStatus::timeout;
  ChunkView v;
  std::thread consumer([&] { status = sb.next_chunk(&v, 10s); });
  for (u64 p = 0; p < 4; ++p) {
    std::this_thread::sleep_for(10ms);
    push_positions(sb, p, p + 1);
  }
  consumer.join();
  ASSERT_EQ(status, WaitStatus::ready);
  EXPECT_EQ(v.chunk.end, 4u);
  expect_positions(v);
  sb.release_chunk();
}

TEST(StreamBufferWait, SleepingConsumerWakesOnCloseAndGetsTheFlushedTail) {
  StreamBuffer sb(sizeof(u32), 8, ChunkPolicy::fixed(4));
  push_positions(sb, 0, 2);
  WaitStatus status = WaitStatus::timeout;
  ChunkView v;
  std::thread consumer([&] { status = sb.next_chunk(&v); });
  std::this_thread::sleep_for(30ms);
  sb.close();
  consumer.join();
  ASSERT_EQ(status, WaitStatus::ready);
  EXPECT_EQ(v.chunk.end, 2u);
  EXPECT_TRUE(v.chunk.last);
  sb.release_chunk();
  EXPECT_EQ(sb.next_chunk(&v), WaitStatus::closed);
}

// Core bug (see the report): one push() of more items than the ring has free waits for
// min(remaining, capacity) free slots at once, which a consumer that keeps W - S items of left
// context never frees, so producer and consumer both wait until the timeout.
TEST(StreamBufferWait, OneLargePushStreamsThroughASlidingWindow) {
  StreamBuffer sb(sizeof(u32), 64, ChunkPolicy::sliding_window(28, 7));
  std::vector<u32> items(500);
  for (u32 i = 0; i < items.size(); ++i) items[i] = i;
  std::size_t stored = 0;
  std::thread producer([&] {
    stored = sb.push(items.data(), items.size(), 2s);
    sb.close();
  });
  u64 delivered = 0;
  ChunkView v;
  while (sb.next_chunk(&v, 5s) == WaitStatus::ready) {
    EXPECT_EQ(v.chunk.new_begin, delivered);
    expect_positions(v);
    delivered = v.chunk.end;
    sb.release_chunk();
  }
  producer.join();
  EXPECT_EQ(stored, items.size());
  EXPECT_EQ(delivered, items.size());
}

// ---- drop_oldest -----------------------------------------------------------------------------

TEST(StreamBufferDropOldest, StreamSkipsAheadAfterDrops) {
  StreamBuffer sb(sizeof(u32), 8, ChunkPolicy::fixed(2), Overflow::drop_oldest);
  push_positions(sb, 0, 20);  // nobody reads: items 0..11 are dropped
  EXPECT_EQ(sb.ring().stats().dropped, 12u);
  ChunkView v;
  ASSERT_EQ(sb.try_next_chunk(&v), WaitStatus::ready);
  EXPECT_EQ(v.chunk.begin, 12u);
  EXPECT_EQ(v.chunk.new_begin, 12u);
  EXPECT_EQ(v.chunk.end, 14u);
  expect_positions(v);
  sb.release_chunk();
  push_positions(sb, 20, 25);  // 6 stored + 5 > 8: items 14..16 go
  EXPECT_EQ(sb.ring().stats().dropped, 15u);
  sb.close();
  const std::vector<Span> rest = drain(sb);
  ASSERT_EQ(rest.size(), 4u);
  EXPECT_EQ(rest[0].new_begin, 17u);
  EXPECT_EQ(rest[0].end, 19u);
  EXPECT_EQ(rest.back().new_begin, 23u);
  EXPECT_EQ(rest.back().end, 25u);
  EXPECT_TRUE(rest.back().last);
}

// The window after a drop used to be [5, 7): two items of a four-item window.
TEST(StreamBufferDropOldest, AWindowAfterADropIsWholeAndBeginsAtTheOldestSurvivor) {
  StreamBuffer sb(sizeof(u32), 8, ChunkPolicy::sliding_window(4, 2), Overflow::drop_oldest);
  push_positions(sb, 0, 4);
  ChunkView v;
  ASSERT_EQ(sb.try_next_chunk(&v), WaitStatus::ready);
  sb.release_chunk();  // keeps 2, 3 as context
  push_positions(sb, 4, 13);  // 2 + 9 > 8: items 2..4 are dropped
  EXPECT_EQ(sb.ring().stats().dropped, 3u);
  ASSERT_EQ(sb.try_next_chunk(&v), WaitStatus::ready);
  EXPECT_EQ(v.chunk.begin, 5u);
  EXPECT_EQ(v.chunk.new_begin, 7u);
  EXPECT_EQ(v.chunk.end, 9u);
  EXPECT_EQ(v.chunk.size(), 4u);
  expect_positions(v);
  EXPECT_TRUE(in_storage(sb, v));
  sb.release_chunk();
  sb.close();
  const std::vector<Span> rest = drain(sb);
  ASSERT_EQ(rest.size(), 2u);
  EXPECT_EQ(rest[0].begin, 7u);
  EXPECT_EQ(rest[0].new_begin, 9u);
  EXPECT_EQ(rest[0].end, 11u);
  EXPECT_EQ(rest[1].begin, 9u);
  EXPECT_EQ(rest[1].end, 13u);
  EXPECT_TRUE(rest[1].last);
}

// Windows that moved up after drops, lap after lap: whole, in place, one span across the wrap.
TEST(StreamBufferDropOldest, WindowsAfterRepeatedDropsAreWholeAcrossTheWrap) {
  StreamBuffer sb(sizeof(u32), 8, ChunkPolicy::left_context(3, 2), Overflow::drop_oldest);
  u64 end = 0;
  for (u64 lap = 0; lap < 6; ++lap) {
    push_positions(sb, end, end + 7 + lap);  // overruns the ring on most laps
    end += 7 + lap;
    ChunkView v;
    ASSERT_EQ(sb.try_next_chunk(&v), WaitStatus::ready);
    EXPECT_EQ(v.chunk.size(), std::min<u64>(3, 2 * v.chunk.index) + 2);  // context, then 2 new
    EXPECT_EQ(v.chunk.new_size(), 2u);
    expect_positions(v);
    EXPECT_TRUE(in_storage(sb, v));
    sb.release_chunk();
  }
  EXPECT_GT(sb.ring().stats().dropped, 0u);
}

}  // namespace

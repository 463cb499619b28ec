// Two-thread stress: a producer and a consumer move MSTAR_STRESS_ITEMS (default 10^7) sequence
// numbers through a ring or a StreamBuffer; the consumer checks order, contents and a checksum.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <random>
#include <thread>
#include <vector>

#include "mstar/spsc_ring.hpp"
#include "mstar/stream_buffer.hpp"

namespace {

using mstar::ChunkPolicy;
using mstar::ChunkView;
using mstar::Overflow;
using mstar::ReadRegion;
using mstar::SpscRing;
using mstar::StreamBuffer;
using mstar::WaitStatus;
using mstar::WriteRegion;
using u64 = std::uint64_t;

u64 stress_items() {
  if (const char* s = std::getenv("MSTAR_STRESS_ITEMS")) {
    char* end = nullptr;
    const unsigned long long v = std::strtoull(s, &end, 10);
    if (end != s && *end == '\0' && v > 0) return v;
  }
  return 10'000'000;
}

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#endif
}

// Spin politely: with two threads on two cores (or fewer) a pure spin can starve the other side.
struct Backoff {
  unsigned fails = 0;
  void operator()() {
    if (++fails % 64 == 0)
      std::this_thread::yield();
    else
      cpu_relax();
  }
};

u64 load(const std::byte* p) {
  u64 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

void store(std::byte* p, u64 v) { std::memcpy(p, &v, sizeof v); }

// What the consumer saw. The hot loops record, and the test asserts afterwards.
struct Tally {
  u64 count = 0;
  u64 sum = 0;
  u64 mismatches = 0;
  u64 first_bad_position = 0, first_bad_value = 0;
  void see(u64 position, u64 value) {
    if (value != position && mismatches++ == 0) {
      first_bad_position = position;
      first_bad_value = value;
    }
    sum += value;
    ++count;
  }
};

void expect_complete(const Tally& t, u64 n) {
  EXPECT_EQ(t.mismatches, 0u) << "first: position " << t.first_bad_position << " held "
                              << t.first_bad_value;
  EXPECT_EQ(t.count, n);
  EXPECT_EQ(t.sum, n * (n - 1) / 2);  // every sequence number exactly once (with the order check)
}

void expect_ring_accounting(const SpscRing& ring, u64 n) {
  const mstar::RingStats s = ring.stats();
  EXPECT_EQ(s.pushed, n);
  EXPECT_EQ(s.popped, n);
  EXPECT_EQ(s.dropped, 0u);
  EXPECT_EQ(s.rejected, 0u);
  EXPECT_EQ(ring.size(), 0u);
}

TEST(RingStress, TryPushTryPopPerItemWithSpinning) {
  const u64 n = stress_items();
  SpscRing ring(sizeof(u64), 1024);
  std::thread producer([&] {
    Backoff backoff;
    for (u64 i = 0; i < n; ++i)
      while (!ring.try_push_as(i)) backoff();
  });
  Tally t;
  Backoff backoff;
  for (u64 expected = 0; expected < n;) {
    u64 v;
    if (ring.try_pop_as(v))
      t.see(expected++, v);
    else
      backoff();
  }
  producer.join();
  expect_complete(t, n);
  expect_ring_accounting(ring, n);
}

TEST(RingStress, RegionBatchesAcrossTheMirrorBand) {
  const u64 n = stress_items();
  SpscRing ring(sizeof(u64), 4096, Overflow::block, 512);
  const std::byte* lo = ring.storage();
  const std::byte* hi = lo + ring.storage_bytes();
  std::thread producer([&] {
    std::mt19937 rng(11);
    Backoff backoff;
    for (u64 next = 0; next < n;) {
      const WriteRegion w = ring.reserve(std::min<u64>(1 + rng() % 512, n - next));
      for (std::size_t i = 0; i < w.count; ++i) store(w.data + i * sizeof(u64), next + i);
      ring.commit(w.count);
      next += w.count;
      if (w.count == 0) backoff();
    }
  });
  Tally t;
  u64 out_of_storage = 0;
  std::mt19937 rng(12);
  Backoff backoff;
  while (t.count < n) {
    const ReadRegion r = ring.peek(1 + rng() % 512);
    if (r.count == 0) {
      backoff();
      continue;
    }
    if (r.position != t.count || r.data < lo || r.data + r.count * sizeof(u64) > hi)
      ++out_of_storage;
    for (std::size_t i = 0; i < r.count; ++i) t.see(t.count, load(r.data + i * sizeof(u64)));
    ring.release(r.count);
  }
  producer.join();
  EXPECT_EQ(out_of_storage, 0u);
  expect_complete(t, n);
  expect_ring_accounting(ring, n);
}

TEST(RingStress, BlockingPushAndWaitForItemsOnASmallRing) {
  const u64 n = stress_items();
  SpscRing ring(sizeof(u64), 64);  // small: both sides keep running into a full / empty ring
  std::size_t short_pushes = 0;
  std::thread producer([&] {
    std::mt19937 rng(21);
    std::vector<u64> batch;
    for (u64 next = 0; next < n;) {
      const u64 count = std::min<u64>(1 + rng() % 100, n - next);  // sometimes > capacity
      batch.resize(count);
      for (u64 i = 0; i < count; ++i) batch[i] = next + i;
      const std::size_t stored = ring.push(batch.data(), count);
      if (stored != count) ++short_pushes;
      next += stored;
    }
    ring.close();
  });
  Tally t;
  std::mt19937 rng(22);
  u64 waits = 0;
  for (;;) {
    u64 v;
    while (ring.try_pop_as(v)) t.see(t.count, v);  // drain all, so the producer always gets room
    ++waits;
    const WaitStatus st = ring.wait_for_items(1 + rng() % 16, mstar::kForever);
    if (st == WaitStatus::closed) {
      while (ring.try_pop_as(v)) t.see(t.count, v);
      break;
    }
  }
  producer.join();
  EXPECT_EQ(short_pushes, 0u);
  // the consumer really had to wait, over and over (how often depends on scheduling: 91 in a
  // CI run under ThreadSanitizer, thousands natively)
  EXPECT_GT(waits, 20u);
  expect_complete(t, n);
  expect_ring_accounting(ring, n);
}

TEST(StreamBufferStress, SlidingWindowChunksMatchTheirPositions) {
  const u64 n = stress_items();
  constexpr std::size_t kW = 28, kS = 7;  // Orpheus / SNAC windows
  StreamBuffer sb(sizeof(u64), 64, ChunkPolicy::sliding_window(kW, kS));
  const std::byte* lo = sb.ring().storage();
  const std::byte* hi = lo + sb.ring().storage_bytes();
  std::thread producer([&] {
    std::mt19937 rng(31);
    std::vector<u64> batch;
    for (u64 next = 0; next < n;) {
      // Batches up to twice the ring: push() must stream them through while the consumer keeps
      // a window's worth of items stored.
      const u64 count = std::min<u64>(1 + rng() % 128, n - next);
      batch.resize(count);
      for (u64 i = 0; i < count; ++i) batch[i] = next + i;
      next += sb.push(batch.data(), count);
    }
    sb.close();
  });
  Tally fresh;  // new items, each exactly once
  u64 bad_chunks = 0, bad_items = 0, chunks = 0, lasts = 0;
  mstar::Chunk final_chunk;
  ChunkView v;
  while (sb.next_chunk(&v) == WaitStatus::ready) {
    const mstar::Chunk& c = v.chunk;
    const u64 want_begin = c.new_begin > kW - kS ? c.new_begin - (kW - kS) : 0;
    const bool full = c.end - c.new_begin == (c.index == 0 ? kW : kS);
    if (c.index != chunks || c.new_begin != fresh.count || c.begin != want_begin ||
        (!full && !c.last) || v.data < lo || v.data + c.size() * sizeof(u64) > hi)
      ++bad_chunks;
    for (std::size_t i = 0; i < c.size(); ++i) {
      const u64 item = load(v.data + i * sizeof(u64));
      if (item != c.begin + i) ++bad_items;
      if (c.begin + i >= c.new_begin) fresh.see(fresh.count, item);
    }
    lasts += c.last;
    ++chunks;
    final_chunk = c;
    sb.release_chunk();
  }
  producer.join();
  EXPECT_EQ(bad_chunks, 0u);
  EXPECT_EQ(bad_items, 0u);
  // The final chunk is `last` unless the stream ended on a chunk boundary after it was taken.
  const bool on_boundary = n >= kW && (n - kW) % kS == 0;
  EXPECT_EQ(lasts, on_boundary ? final_chunk.last : 1u);
  EXPECT_TRUE(final_chunk.last || on_boundary);
  EXPECT_EQ(final_chunk.end, n);
  expect_complete(fresh, n);
  EXPECT_EQ(chunks, n <= kW ? 1 : 1 + (n - kW + kS - 1) / kS);
}

// A producer that never waits, a small drop_oldest buffer and a consumer that cannot keep up:
// chunks must still hold exactly their positions, and positions only move forward.
// Disabled until two core bugs are fixed (see the report): SpscRing::release(0) after an empty
// peek rewinds the read position over the producer's drops, and StreamBuffer::poll() builds a
// chunk from items that arrived after an empty peek, so the chunk is not pinned against drops.
TEST(StreamBufferStress, DropOldestChunksMatchTheirPositions) {
  const u64 n = stress_items() / 4;
  StreamBuffer sb(sizeof(u64), 4, ChunkPolicy::fixed(1), Overflow::drop_oldest);
  std::thread producer([&] {
    for (u64 i = 0; i < n; ++i) {
      const u64 x = i;
      if (sb.push(&x, 1) != 1) {
        // Rejected: the consumer holds the oldest item. Retry the same one.
        --i;
        std::this_thread::yield();
      }
    }
    sb.close();
  });
  u64 bad_items = 0, backwards = 0, chunks = 0, next_new = 0;
  ChunkView v;
  while (sb.next_chunk(&v) == WaitStatus::ready) {
    const mstar::Chunk& c = v.chunk;
    if (c.new_begin < next_new) ++backwards;
    for (std::size_t i = 0; i < c.size(); ++i)
      if (load(v.data + i * sizeof(u64)) != c.begin + i) ++bad_items;
    next_new = c.end;
    ++chunks;
    sb.release_chunk();
  }
  producer.join();
  EXPECT_EQ(bad_items, 0u);
  EXPECT_EQ(backwards, 0u);
  EXPECT_EQ(next_new, n);  // the newest item always survives
  const mstar::RingStats s = sb.ring().stats();
  EXPECT_EQ(s.pushed, n);
  EXPECT_EQ(s.popped + s.dropped, n);
  EXPECT_EQ(s.popped, chunks);
}

}  // namespace

// ChunkPolicy / ChunkCursor: hand-computed position tables, the tiling invariant, bad parameters.
#include "mstar/chunk_policy.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <ostream>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

using mstar::Chunk;
using mstar::ChunkCursor;
using mstar::ChunkPolicy;
using u64 = std::uint64_t;

constexpr u64 kEnd = ~u64{0};  // "ready when": made by the end-of-stream flush

// One row of a position table, as in the header comment.
struct Row {
  u64 ready_when;  // the item count at which the chunk became ready, or kEnd
  u64 begin, new_begin, end;
  bool last;
  bool operator==(const Row& o) const {
    return ready_when == o.ready_when && begin == o.begin && new_begin == o.new_begin &&
           end == o.end && last == o.last;
  }
};

std::ostream& operator<<(std::ostream& os, const Row& r) {
  os << "{ready ";
  if (r.ready_when == kEnd)
    os << "end";
  else
    os << "n>=" << r.ready_when;
  return os << ", " << r.begin << ", " << r.new_begin << ", " << r.end
            << (r.last ? ", last}" : "}");
}

// Runs a cursor as a consumer would: items arrive one at a time, every ready chunk is taken and
// released at once (the consumer keeps only what advance() says), then the stream ends.
std::vector<Row> simulate(const ChunkPolicy& policy, u64 items) {
  ChunkCursor cursor(policy);
  std::vector<Row> rows;
  u64 oldest = 0;
  Chunk c;
  for (u64 n = 0; n <= items; ++n) {
    while (cursor.next(oldest, n, false, &c) == ChunkCursor::Next::ready) {
      EXPECT_EQ(c.index, rows.size());
      rows.push_back({n, c.begin, c.new_begin, c.end, c.last});
      oldest = cursor.advance(c);
    }
  }
  for (;;) {
    const ChunkCursor::Next r = cursor.next(oldest, items, true, &c);
    if (r == ChunkCursor::Next::finished) break;
    EXPECT_EQ(r, ChunkCursor::Next::ready);
    if (r != ChunkCursor::Next::ready || rows.size() > items + 1) break;
    EXPECT_EQ(c.index, rows.size());
    rows.push_back({kEnd, c.begin, c.new_begin, c.end, c.last});
    oldest = cursor.advance(c);
  }
  // Once finished, the cursor stays finished.
  EXPECT_EQ(cursor.next(oldest, items, true, &c), ChunkCursor::Next::finished);
  return rows;
}

// ---- the worked tables from chunk_policy.hpp, and more ----------------------------------------

TEST(ChunkTable, SlidingWindow4x2With9ItemsMatchesTheHeaderTable) {
  const std::vector<Row> expected = {
      {4, 0, 0, 4, false},
      {6, 2, 4, 6, false},
      {8, 4, 6, 8, false},
      {kEnd, 6, 8, 9, true},  // the flushed tail: 3 items, not 4
  };
  EXPECT_EQ(simulate(ChunkPolicy::sliding_window(4, 2), 9), expected);
}

TEST(ChunkTable, SlidingWindowEndingExactlyOnAChunkBoundaryMakesNoExtraChunk) {
  const std::vector<Row> expected = {
      {4, 0, 0, 4, false},
      {6, 2, 4, 6, false},
      {8, 4, 6, 8, false},
  };
  EXPECT_EQ(simulate(ChunkPolicy::sliding_window(4, 2), 8), expected);
}

TEST(ChunkTable, SlidingWindowStreamShorterThanTheFirstWindowIsOneFlushedChunk) {
  const std::vector<Row> expected = {{kEnd, 0, 0, 3, true}};
  EXPECT_EQ(simulate(ChunkPolicy::sliding_window(4, 2), 3), expected);
}

TEST(ChunkTable, SlidingWindow28x7OrpheusWindows) {
  const std::vector<Row> expected = {
      {28, 0, 0, 28, false},
      {35, 7, 28, 35, false},
      {42, 14, 35, 42, false},
      {kEnd, 21, 42, 45, true},
  };
  EXPECT_EQ(simulate(ChunkPolicy::sliding_window(28, 7), 45), expected);
}

TEST(ChunkTable, SlidingWindowWithStrideEqualToWindowHasNoOverlap) {
  const std::vector<Row> expected = {
      {3, 0, 0, 3, false},
      {6, 3, 3, 6, false},
      {kEnd, 6, 6, 7, true},
  };
  EXPECT_EQ(simulate(ChunkPolicy::sliding_window(3, 3), 7), expected);
}

TEST(ChunkTable, SlidingWindowOfStrideOneAdvancesOneItemAtATime) {
  const std::vector<Row> expected = {
      {3, 0, 0, 3, false},
      {4, 1, 3, 4, false},
      {5, 2, 4, 5, false},
  };
  EXPECT_EQ(simulate(ChunkPolicy::sliding_window(3, 1), 5), expected);
}

TEST(ChunkTable, FixedOneFiresOnEveryItem) {
  const std::vector<Row> expected = {
      {1, 0, 0, 1, false},
      {2, 1, 1, 2, false},
      {3, 2, 2, 3, false},
  };
  EXPECT_EQ(simulate(ChunkPolicy::fixed(1), 3), expected);
}

TEST(ChunkTable, FixedThreeFlushesAShortTail) {
  const std::vector<Row> expected = {
      {3, 0, 0, 3, false},
      {6, 3, 3, 6, false},
      {kEnd, 6, 6, 7, true},
  };
  EXPECT_EQ(simulate(ChunkPolicy::fixed(3), 7), expected);
}

TEST(ChunkTable, FixedEndingOnABoundaryMakesNoExtraChunk) {
  const std::vector<Row> expected = {
      {3, 0, 0, 3, false},
      {6, 3, 3, 6, false},
  };
  EXPECT_EQ(simulate(ChunkPolicy::fixed(3), 6), expected);
}

TEST(ChunkTable, EmptyStreamMakesNoChunk) {
  EXPECT_TRUE(simulate(ChunkPolicy::fixed(3), 0).empty());
  EXPECT_TRUE(simulate(ChunkPolicy::sliding_window(4, 2), 0).empty());
  EXPECT_TRUE(simulate(ChunkPolicy::ramp({1, 2}, 4, 2), 0).empty());
}

TEST(ChunkTable, LeftContext2x3With7ItemsMatchesTheHeaderTable) {
  const std::vector<Row> expected = {
      {3, 0, 0, 3, false},
      {6, 1, 3, 6, false},
      {kEnd, 4, 6, 7, true},
  };
  EXPECT_EQ(simulate(ChunkPolicy::left_context(2, 3), 7), expected);
}

TEST(ChunkTable, LeftContext25x25Code2Wav) {
  const std::vector<Row> expected = {
      {25, 0, 0, 25, false},
      {50, 0, 25, 50, false},
      {75, 25, 50, 75, false},
      {kEnd, 50, 75, 80, true},
  };
  EXPECT_EQ(simulate(ChunkPolicy::left_context(25, 25), 80), expected);
}

TEST(ChunkTable, LeftContextLargerThanTheChunkReachesBackSeveralChunks) {
  const std::vector<Row> expected = {
      {2, 0, 0, 2, false},
      {4, 0, 2, 4, false},
      {6, 0, 4, 6, false},  // max(0, 4 - 5)
      {8, 1, 6, 8, false},
  };
  EXPECT_EQ(simulate(ChunkPolicy::left_context(5, 2), 8), expected);
}

TEST(ChunkTable, LeftContextZeroIsFixed) {
  EXPECT_EQ(simulate(ChunkPolicy::left_context(0, 2), 5), simulate(ChunkPolicy::fixed(2), 5));
}

TEST(ChunkTable, LeftContextStreamShorterThanTheFirstChunkIsOneFlushedChunk) {
  const std::vector<Row> expected = {{kEnd, 0, 0, 2, true}};
  EXPECT_EQ(simulate(ChunkPolicy::left_context(5, 3), 2), expected);
}

TEST(ChunkTable, Ramp12Then4With12ItemsMatchesTheHeaderTable) {
  const std::vector<Row> expected = {
      {1, 0, 0, 1, false},
      {3, 1, 1, 3, false},
      {7, 3, 3, 7, false},
      {11, 7, 7, 11, false},
      {kEnd, 11, 11, 12, true},
  };
  EXPECT_EQ(simulate(ChunkPolicy::ramp({1, 2}, 4, 0), 12), expected);
}

TEST(ChunkTable, RampWithContextClampsAtTheStartOfTheStream) {
  const std::vector<Row> expected = {
      {1, 0, 0, 1, false},
      {3, 0, 1, 3, false},  // max(0, 1 - 2)
      {7, 1, 3, 7, false},
      {11, 5, 7, 11, false},
      {kEnd, 9, 11, 12, true},
  };
  EXPECT_EQ(simulate(ChunkPolicy::ramp({1, 2}, 4, 2), 12), expected);
}

TEST(ChunkTable, RampEndingExactlyOnABoundaryMakesNoExtraChunk) {
  const std::vector<Row> expected = {
      {1, 0, 0, 1, false},
      {3, 1, 1, 3, false},
      {7, 3, 3, 7, false},
  };
  EXPECT_EQ(simulate(ChunkPolicy::ramp({1, 2}, 4, 0), 7), expected);
}

TEST(ChunkTable, RampStreamShorterThanTheFirstChunkIsOneFlushedChunk) {
  const std::vector<Row> expected = {{kEnd, 0, 0, 1, true}};
  EXPECT_EQ(simulate(ChunkPolicy::ramp({2}, 5, 0), 1), expected);
}

TEST(ChunkTable, RampWithoutFirstSizesIsSteadyWithContext) {
  const std::vector<Row> expected = {
      {3, 0, 0, 3, false},
      {6, 2, 3, 6, false},
      {kEnd, 5, 6, 7, true},
  };
  EXPECT_EQ(simulate(ChunkPolicy::ramp({}, 3, 1), 7), expected);
}

TEST(ChunkTable, ChunkEndingExactlyAtTheEndIsLastWhenTheEndIsAlreadyKnown) {
  ChunkPolicy policy = ChunkPolicy::fixed(3);
  ChunkCursor cursor(policy);
  Chunk c;
  ASSERT_EQ(cursor.next(0, 6, true, &c), ChunkCursor::Next::ready);
  EXPECT_FALSE(c.last);
  EXPECT_EQ(c.end, 3u);
  cursor.advance(c);
  ASSERT_EQ(cursor.next(3, 6, true, &c), ChunkCursor::Next::ready);
  EXPECT_TRUE(c.last);  // "ends exactly at it"
  EXPECT_EQ(c.end, 6u);
  EXPECT_EQ(c.new_size(), 3u);
  cursor.advance(c);
  EXPECT_EQ(cursor.next(6, 6, true, &c), ChunkCursor::Next::finished);
}

// ---- invariants over many policies and stream lengths -----------------------------------------

std::vector<ChunkPolicy> sample_policies() {
  return {ChunkPolicy::fixed(1),           ChunkPolicy::fixed(5),
          ChunkPolicy::sliding_window(4, 2), ChunkPolicy::sliding_window(28, 7),
          ChunkPolicy::sliding_window(5, 5), ChunkPolicy::sliding_window(6, 1),
          ChunkPolicy::left_context(2, 3), ChunkPolicy::left_context(25, 25),
          ChunkPolicy::left_context(7, 2), ChunkPolicy::ramp({1, 2}, 4, 0),
          ChunkPolicy::ramp({1, 2}, 4, 2), ChunkPolicy::ramp({3, 1, 6}, 2, 5),
          ChunkPolicy::ramp({}, 3, 0)};
}

TEST(ChunkInvariant, EveryItemIsNewInExactlyOneChunk) {
  for (const ChunkPolicy& policy : sample_policies()) {
    for (u64 n = 0; n <= 90; ++n) {
      SCOPED_TRACE(policy.describe() + " with " + std::to_string(n) + " items");
      const std::vector<Row> rows = simulate(policy, n);
      std::vector<int> fresh(n, 0);
      u64 expected_new_begin = 0;
      for (std::size_t i = 0; i < rows.size(); ++i) {
        const Row& r = rows[i];
        ASSERT_EQ(r.new_begin, expected_new_begin);  // fresh parts tile the stream
        ASSERT_LT(r.new_begin, r.end);
        ASSERT_LE(r.begin, r.new_begin);
        const u64 ctx = policy.context();
        ASSERT_EQ(r.begin, r.new_begin > ctx ? r.new_begin - ctx : 0);
        ASSERT_LE(r.end - r.begin, policy.max_chunk());
        if (r.ready_when != kEnd) {
          ASSERT_EQ(r.ready_when, r.end);  // ready as soon as `end` items exist
          ASSERT_EQ(r.end - r.new_begin, policy.new_size(i));
        }
        ASSERT_EQ(r.last, r.ready_when == kEnd);
        ASSERT_TRUE(r.ready_when != kEnd || i + 1 == rows.size());  // only the tail is flushed
        for (u64 p = r.new_begin; p < r.end; ++p) ++fresh[p];
        expected_new_begin = r.end;
      }
      ASSERT_EQ(expected_new_begin, n);  // nothing dropped, nothing past the end
      for (u64 p = 0; p < n; ++p) ASSERT_EQ(fresh[p], 1) << "item " << p;
    }
  }
}

// A drop_oldest ring of `capacity` under a producer that overruns a slow consumer: a window
// (other than the end-of-stream flush) always has the shape of the same chunk in an undisturbed
// stream, and never reaches below the oldest stored item.
TEST(ChunkInvariant, DropsNeverShortenAWindow) {
  u64 seed = 0x9e3779b97f4a7c15u;
  const auto random_below = [&seed](u64 n) {
    seed = seed * 6364136223846793005u + 1442695040888963407u;
    return (seed >> 33) % n;
  };
  const u64 total = 400;
  for (const ChunkPolicy& policy : sample_policies()) {
    const std::vector<Row> plain = simulate(policy, total + policy.max_chunk());
    for (u64 spare : {0u, 3u}) {
      const u64 capacity = policy.max_chunk() + spare;
      SCOPED_TRACE(policy.describe() + " in a ring of " + std::to_string(capacity));
      ChunkCursor cursor(policy);
      Chunk c;
      u64 written = 0, kept = 0, prev_end = 0, chunks = 0, drops_seen = 0;
      bool ended = false, done = false;
      while (!done) {
        if (!ended) {
          written = std::min(total, written + 1 + random_below(2 * capacity));
          ended = written == total;
        }
        if (written > kept + capacity) ++drops_seen;
        for (u64 takes = ended ? total + 1 : random_below(3); takes > 0 && !done; --takes) {
          const u64 oldest = std::max(kept, written > capacity ? written - capacity : 0);
          const ChunkCursor::Next r = cursor.next(oldest, written, ended, &c);
          if (r == ChunkCursor::Next::wait) {
            ASSERT_FALSE(ended);
            ASSERT_LT(written - oldest, policy.max_chunk());  // a full ring always has a window
            ASSERT_GT(cursor.needed_end(), written);
            break;
          }
          if (r == ChunkCursor::Next::finished) {
            ASSERT_TRUE(ended);
            ASSERT_EQ(std::max(prev_end, oldest), written);  // every survivor was delivered
            done = true;
            break;
          }
          ASSERT_EQ(c.index, chunks++);
          ASSERT_LT(c.index, plain.size());
          ASSERT_GE(c.begin, oldest);
          ASSERT_LE(c.end, written);
          ASSERT_GE(c.new_begin, prev_end);
          ASSERT_TRUE(c.new_begin == prev_end || oldest > kept) << "a gap without a drop";
          ASSERT_LT(c.new_begin, c.end);
          ASSERT_LE(c.size(), policy.max_chunk());
          if (!c.last) {
            const Row& undisturbed = plain[c.index];
            ASSERT_EQ(c.new_begin - c.begin, undisturbed.new_begin - undisturbed.begin)
                << "chunk " << c.index << " [" << c.begin << ", " << c.new_begin << ", "
                << c.end << ")";
            ASSERT_EQ(c.end - c.new_begin, undisturbed.end - undisturbed.new_begin);
          }
          prev_end = c.end;
          kept = std::max(kept, cursor.advance(c));
          done = c.last;
        }
      }
      EXPECT_GT(drops_seen, 0u);
    }
  }
}

// ---- cursor details --------------------------------------------------------------------------

TEST(ChunkCursorTest, WaitReportsHowManyItemsTheNextChunkNeeds) {
  ChunkPolicy policy = ChunkPolicy::ramp({1, 2}, 4, 2);
  ChunkCursor cursor(policy);
  Chunk c;
  EXPECT_EQ(cursor.next(0, 0, false, &c), ChunkCursor::Next::wait);
  EXPECT_EQ(cursor.needed_end(), 1u);
  ASSERT_EQ(cursor.next(0, 1, false, &c), ChunkCursor::Next::ready);
  EXPECT_EQ(cursor.advance(c), 0u);  // keep from max(0, 1 - 2)
  EXPECT_EQ(cursor.next(0, 2, false, &c), ChunkCursor::Next::wait);
  EXPECT_EQ(cursor.needed_end(), 3u);
  EXPECT_EQ(cursor.index(), 1u);
  ASSERT_EQ(cursor.next(0, 3, false, &c), ChunkCursor::Next::ready);
  EXPECT_EQ(cursor.advance(c), 1u);
  EXPECT_EQ(cursor.needed_end(), 7u);
}

TEST(ChunkCursorTest, SkipsAheadToTheOldestStoredItemAfterDrops) {
  ChunkPolicy fixed = ChunkPolicy::fixed(4);
  ChunkCursor cursor(fixed);
  Chunk c;
  ASSERT_EQ(cursor.next(6, 10, false, &c), ChunkCursor::Next::ready);  // items 0..5 were dropped
  EXPECT_EQ(c.begin, 6u);
  EXPECT_EQ(c.new_begin, 6u);
  EXPECT_EQ(c.end, 10u);
}

// A drop once handed out [5, 7): half a window, though items 5..12 were stored.
TEST(ChunkCursorTest, AWindowAfterADropHasThePolicysSizeAndStartsAtTheOldestSurvivor) {
  ChunkPolicy policy = ChunkPolicy::sliding_window(4, 2);
  ChunkCursor cursor(policy);
  Chunk c;
  ASSERT_EQ(cursor.next(0, 4, false, &c), ChunkCursor::Next::ready);
  EXPECT_EQ(cursor.advance(c), 2u);
  ASSERT_EQ(cursor.next(5, 13, false, &c), ChunkCursor::Next::ready);  // items 2..4 were dropped
  EXPECT_EQ(c.begin, 5u);
  EXPECT_EQ(c.new_begin, 7u);  // 5 and 6 are the window's context, as in any later window
  EXPECT_EQ(c.end, 9u);
  EXPECT_EQ(c.index, 1u);
  EXPECT_FALSE(c.last);
  EXPECT_EQ(cursor.advance(c), 7u);
  ASSERT_EQ(cursor.next(7, 13, false, &c), ChunkCursor::Next::ready);  // back on the stride
  EXPECT_EQ(c.begin, 7u);
  EXPECT_EQ(c.new_begin, 9u);
  EXPECT_EQ(c.end, 11u);

  // Before the first window: it moves up whole and every item in it is new, as at the start.
  ChunkCursor fresh(policy);
  ASSERT_EQ(fresh.next(9, 13, false, &c), ChunkCursor::Next::ready);
  EXPECT_EQ(c.begin, 9u);
  EXPECT_EQ(c.new_begin, 9u);
  EXPECT_EQ(c.end, 13u);
}

TEST(ChunkCursorTest, AfterADropTheCursorWaitsForAWholeWindow) {
  ChunkPolicy lc = ChunkPolicy::left_context(4, 2);
  ChunkCursor cursor(lc);
  Chunk c;
  ASSERT_EQ(cursor.next(0, 2, false, &c), ChunkCursor::Next::ready);
  EXPECT_EQ(cursor.advance(c), 0u);
  // Chunk 1 is [0, 4) new from 2 undisturbed; item 0..2 are gone, so it moves up to [3, 7).
  EXPECT_EQ(cursor.next(3, 5, false, &c), ChunkCursor::Next::wait);
  EXPECT_EQ(cursor.needed_end(), 7u);
  ASSERT_EQ(cursor.next(3, 7, false, &c), ChunkCursor::Next::ready);
  EXPECT_EQ(c.begin, 3u);
  EXPECT_EQ(c.new_begin, 5u);
  EXPECT_EQ(c.end, 7u);
  EXPECT_EQ(cursor.advance(c), 3u);
  EXPECT_EQ(cursor.needed_end(), 9u);
  ASSERT_EQ(cursor.next(3, 9, false, &c), ChunkCursor::Next::ready);
  EXPECT_EQ(c.begin, 3u);  // the full context of 4 again
  EXPECT_EQ(c.new_begin, 7u);
}

TEST(ChunkCursorTest, TheFlushAfterADropDeliversEverySurvivorAsNew) {
  ChunkPolicy lc = ChunkPolicy::left_context(4, 2);
  ChunkCursor cursor(lc);
  Chunk c;
  ASSERT_EQ(cursor.next(0, 2, false, &c), ChunkCursor::Next::ready);
  cursor.advance(c);
  EXPECT_EQ(cursor.next(3, 5, false, &c), ChunkCursor::Next::wait);
  // The stream ends before a whole window survives: nothing to wait for, so no item is withheld.
  ASSERT_EQ(cursor.next(3, 5, true, &c), ChunkCursor::Next::ready);
  EXPECT_EQ(c.begin, 3u);
  EXPECT_EQ(c.new_begin, 3u);
  EXPECT_EQ(c.end, 5u);
  EXPECT_TRUE(c.last);
  cursor.advance(c);
  EXPECT_EQ(cursor.next(3, 5, true, &c), ChunkCursor::Next::finished);
}

TEST(ChunkCursorTest, ResetStartsTheStreamOver) {
  ChunkPolicy policy = ChunkPolicy::sliding_window(4, 2);
  ChunkCursor cursor(policy);
  Chunk c;
  ASSERT_EQ(cursor.next(0, 4, false, &c), ChunkCursor::Next::ready);
  cursor.advance(c);
  cursor.reset();
  EXPECT_EQ(cursor.index(), 0u);
  EXPECT_EQ(cursor.needed_end(), 4u);
}

TEST(ChunkCursorTest, CursorsSharingAPolicyAreIndependent) {
  const ChunkPolicy policy = ChunkPolicy::fixed(2);
  ChunkCursor a(policy), b(policy);
  Chunk c;
  ASSERT_EQ(a.next(0, 2, false, &c), ChunkCursor::Next::ready);
  a.advance(c);
  EXPECT_EQ(a.index(), 1u);
  EXPECT_EQ(b.index(), 0u);
  EXPECT_EQ(b.needed_end(), 2u);
}

// ---- parameters ------------------------------------------------------------------------------

template <class F>
std::string invalid_argument_message(F make) {
  try {
    make();
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  ADD_FAILURE() << "no std::invalid_argument";
  return {};
}

bool mentions(const std::string& message, const std::string& name) {
  return message.find(name) != std::string::npos;
}

TEST(ChunkPolicyParams, NonsenseParametersThrowInvalidArgumentNamingTheParameter) {
  EXPECT_PRED2(mentions, invalid_argument_message([] { ChunkPolicy::fixed(0); }), "K must");
  EXPECT_PRED2(mentions, invalid_argument_message([] { ChunkPolicy::sliding_window(0, 1); }),
               "W must");
  EXPECT_PRED2(mentions, invalid_argument_message([] { ChunkPolicy::sliding_window(0, 0); }),
               "must be at least 1");
  EXPECT_PRED2(mentions, invalid_argument_message([] { ChunkPolicy::sliding_window(4, 0); }),
               "S must");
  EXPECT_PRED2(mentions, invalid_argument_message([] { ChunkPolicy::sliding_window(3, 4); }),
               "S (4) must not exceed W (3)");
  EXPECT_PRED2(mentions, invalid_argument_message([] { ChunkPolicy::left_context(2, 0); }),
               "L must");
  EXPECT_PRED2(mentions, invalid_argument_message([] { ChunkPolicy::ramp({1, 2}, 0); }),
               "steady must");
  EXPECT_PRED2(mentions, invalid_argument_message([] { ChunkPolicy::ramp({1, 0, 2}, 4); }),
               "first[1]");
  EXPECT_PRED2(mentions, invalid_argument_message([] { ChunkPolicy::ramp({0}, 4, 1); }),
               "first[0]");
  // max_chunk() wrapped to 0: a buffer of any size accepted it and no chunk was ever ready
  constexpr std::size_t huge = ~std::size_t{0};
  EXPECT_PRED2(mentions, invalid_argument_message([] { ChunkPolicy::ramp({huge}, 1, 1); }),
               "at most 2^48 items");
  EXPECT_PRED2(mentions, invalid_argument_message([] { ChunkPolicy::left_context(1, huge); }),
               "at most 2^48 items");
  EXPECT_PRED2(mentions, invalid_argument_message([] { ChunkPolicy::left_context(huge, 1); }),
               "at most 2^48 items");
}

TEST(ChunkPolicyParams, BoundaryParametersAreAccepted) {
  EXPECT_NO_THROW(ChunkPolicy::fixed(1));
  EXPECT_NO_THROW(ChunkPolicy::sliding_window(1, 1));
  EXPECT_NO_THROW(ChunkPolicy::sliding_window(5, 5));
  EXPECT_NO_THROW(ChunkPolicy::left_context(0, 1));
  EXPECT_NO_THROW(ChunkPolicy::ramp({}, 1));
}

TEST(ChunkPolicyParams, AccessorsReflectTheSizeAndContextRule) {
  const ChunkPolicy sw = ChunkPolicy::sliding_window(28, 7);
  EXPECT_EQ(sw.kind(), ChunkPolicy::Kind::sliding_window);
  EXPECT_EQ(sw.new_size(0), 28u);
  EXPECT_EQ(sw.new_size(1), 7u);
  EXPECT_EQ(sw.new_size(1000), 7u);
  EXPECT_EQ(sw.context(), 21u);
  EXPECT_EQ(sw.max_chunk(), 28u);

  const ChunkPolicy ramp = ChunkPolicy::ramp({1, 8, 2}, 4, 3);
  EXPECT_EQ(ramp.kind(), ChunkPolicy::Kind::ramp);
  EXPECT_EQ(ramp.first_sizes(), (std::vector<std::size_t>{1, 8, 2}));
  EXPECT_EQ(ramp.steady_size(), 4u);
  EXPECT_EQ(ramp.new_size(1), 8u);
  EXPECT_EQ(ramp.new_size(3), 4u);
  EXPECT_EQ(ramp.max_chunk(), 11u);

  EXPECT_EQ(ChunkPolicy::fixed(3).kind(), ChunkPolicy::Kind::fixed);
  EXPECT_EQ(ChunkPolicy::fixed(3).context(), 0u);
  EXPECT_EQ(ChunkPolicy::fixed(3).max_chunk(), 3u);
  EXPECT_EQ(ChunkPolicy::left_context(25, 25).kind(), ChunkPolicy::Kind::left_context);
  EXPECT_EQ(ChunkPolicy::left_context(25, 25).max_chunk(), 50u);
  EXPECT_EQ(ChunkPolicy::sliding_window(4, 4).context(), 0u);
}

TEST(ChunkPolicyParams, DescribeGivesTheConstructorCall) {
  EXPECT_EQ(ChunkPolicy::fixed(1).describe(), "Fixed(1)");
  EXPECT_EQ(ChunkPolicy::sliding_window(28, 7).describe(), "SlidingWindow(28, 7)");
  EXPECT_EQ(ChunkPolicy::left_context(25, 25).describe(), "LeftContext(25, 25)");
  EXPECT_EQ(ChunkPolicy::left_context(0, 4).describe(), "LeftContext(0, 4)");
  EXPECT_EQ(ChunkPolicy::ramp({1, 2}, 4).describe(), "Ramp([1, 2], 4, 0)");
  EXPECT_EQ(ChunkPolicy::ramp({3}, 5, 2).describe(), "Ramp([3], 5, 2)");
  EXPECT_EQ(ChunkPolicy::ramp({}, 3, 1).describe(), "Ramp([], 3, 1)");
}

}  // namespace

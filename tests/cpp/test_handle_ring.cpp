// detail::HandleRing, the store of a stream's items in the Conductor: FIFO order across growth
// and wrap-around, and no allocation once it has grown to the widest window it holds (the
// std::deque it replaced took and freed a block every few hundred items).
#include <gtest/gtest.h>

#include <deque>
#include <random>

#include "alloc_counter.hpp"
#include "scheduler/handle_ring.hpp"

namespace {

using mstar::Handle;
using mstar::detail::HandleRing;

void expect_same(const HandleRing& ring, const std::deque<Handle>& model) {
  ASSERT_EQ(ring.size(), model.size());
  for (std::size_t i = 0; i < model.size(); ++i) ASSERT_EQ(ring[i], model[i]) << "at " << i;
  if (!model.empty()) EXPECT_EQ(ring.front(), model.front());
}

TEST(HandleRing, MatchesADequeUnderRandomPushesAndPops) {
  std::mt19937 rng(7);
  HandleRing ring;
  std::deque<Handle> model;
  Handle next = 1;
  for (int step = 0; step < 20000; ++step) {
    // Windows widen and narrow: growth happens with the head anywhere in the array.
    const int widest = step < 10000 ? 300 : 40;
    if (!model.empty() && (model.size() >= static_cast<std::size_t>(widest) || rng() % 2)) {
      ring.pop_front();
      model.pop_front();
    } else {
      ring.push_back(next);
      model.push_back(next++);
    }
    if (step % 97 == 0) expect_same(ring, model);
  }
  expect_same(ring, model);
  ring.clear();
  EXPECT_TRUE(ring.empty());
}

TEST(HandleRing, ASlidingWindowAllocatesNothingOnceGrown) {
  HandleRing ring;
  for (Handle h = 1; h <= 24; ++h) ring.push_back(h);  // the widest window: 24 items
  while (!ring.empty()) ring.pop_front();
  const std::uint64_t before = g_allocations.load();
  Handle next = 100;
  for (int i = 0; i < 100000; ++i) {  // a long stream read 8 at a time, 24 at most held
    for (int k = 0; k < 8; ++k) ring.push_back(next++);
    if (ring.size() >= 24)
      for (int k = 0; k < 8; ++k) ring.pop_front();
  }
  EXPECT_EQ(g_allocations.load(), before);
  EXPECT_EQ(ring.capacity(), 32u);
}

TEST(HandleRing, AMoveHandsOverTheStorageAndLeavesAnEmptyRing) {
  HandleRing a;
  for (Handle h = 1; h <= 20; ++h) a.push_back(h);
  const std::uint64_t before = g_allocations.load();
  HandleRing b(std::move(a));
  EXPECT_TRUE(a.empty());
  ASSERT_EQ(b.size(), 20u);
  EXPECT_EQ(b[19], 20u);
  b.clear();
  HandleRing c;
  c = std::move(b);  // a recycled stream takes a finished one's storage
  for (Handle h = 1; h <= 32; ++h) c.push_back(h);
  EXPECT_EQ(g_allocations.load(), before);
}

}  // namespace

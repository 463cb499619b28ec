// mstar::ReadyQueue (mstar/ready_queue.hpp): the order work runs in -- earliest deadline, then
// highest priority, then earliest arrival, then item id -- batches of one node and walk up to a
// limit with the rest kept in order, removal by predicate, and no allocation once grown.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "alloc_counter.hpp"
#include "mstar/ready_queue.hpp"

namespace {

using mstar::ReadyQueue;
using mstar::WorkOrder;
using Queue = ReadyQueue<int>;

Queue::Entry entry(int value, std::int64_t deadline, std::int32_t priority, std::uint64_t arrival,
                   std::uint32_t node = 0, std::uint32_t walk = 0) {
  return {{deadline, priority, arrival, static_cast<std::uint64_t>(value)}, node, walk, value};
}

std::vector<int> drain(Queue& q, std::size_t limit) {
  std::vector<int> out;
  while (!q.empty()) q.take_batch(limit, [&](Queue::Entry& e) { out.push_back(e.value); });
  return out;
}

TEST(ReadyQueue, OrdersByDeadlineThenPriorityThenArrivalThenId) {
  Queue q;
  q.push(entry(5, INT64_MAX, 0, 3));
  q.push(entry(4, INT64_MAX, 0, 2));
  q.push(entry(9, INT64_MAX, 7, 9));
  q.push(entry(1, 100, 0, 4));
  q.push(entry(2, 100, 1, 5));
  q.push(entry(3, INT64_MAX, 0, 2));  // same arrival as 4, smaller id: first
  EXPECT_EQ(drain(q, 1), (std::vector<int>{2, 1, 9, 3, 4, 5}));
}

TEST(ReadyQueue, ABatchTakesTheFrontsNodeAndWalkUpToTheLimitAndKeepsTheRestInOrder) {
  Queue q;
  for (int i = 0; i < 6; ++i) q.push(entry(i, INT64_MAX, 0, static_cast<std::uint64_t>(i), i % 2));
  q.push(entry(10, INT64_MAX, 0, 10, 0, 1));  // node 0, another walk
  std::vector<int> got;
  q.take_batch(2, [&](Queue::Entry& e) { got.push_back(e.value); });
  EXPECT_EQ(got, (std::vector<int>{0, 2}));  // node 0, walk 0, the two most urgent
  got.clear();
  q.take_batch(8, [&](Queue::Entry& e) { got.push_back(e.value); });
  EXPECT_EQ(got, (std::vector<int>{1, 3, 5}));  // now node 1 is at the front
  EXPECT_EQ(drain(q, 8), (std::vector<int>{4, 10}));
}

TEST(ReadyQueue, RemoveIfDropsMatchingEntriesOnly) {
  Queue q;
  for (int i = 0; i < 8; ++i) q.push(entry(i, INT64_MAX, 0, static_cast<std::uint64_t>(i)));
  EXPECT_EQ(q.remove_if([](const Queue::Entry& e) { return e.value % 3 == 0; }), 3u);
  EXPECT_EQ(drain(q, 8), (std::vector<int>{1, 2, 4, 5, 7}));
}

TEST(ReadyQueue, ExtractIfMovesMatchingEntriesOutInOrderAndKeepsTheRest) {
  Queue q;
  for (int i = 0; i < 8; ++i) q.push(entry(i, INT64_MAX, 0, static_cast<std::uint64_t>(i)));
  std::vector<int> out;
  EXPECT_EQ(q.extract_if([](const Queue::Entry& e) { return e.value % 3 == 0; },
                         [&](Queue::Entry& e) { out.push_back(e.value); }),
            3u);
  EXPECT_EQ(out, (std::vector<int>{0, 3, 6}));
  EXPECT_EQ(drain(q, 8), (std::vector<int>{1, 2, 4, 5, 7}));
}

TEST(ReadyQueue, NothingIsAllocatedOnceGrown) {
  Queue q;
  for (int round = 0; round < 2; ++round) {
    const auto before = g_allocations.load();
    for (int i = 0; i < 64; ++i) q.push(entry(i, INT64_MAX, 0, static_cast<std::uint64_t>(i)));
    int sum = 0;
    while (!q.empty()) q.take_batch(8, [&](Queue::Entry& e) { sum += e.value; });
    EXPECT_EQ(sum, 64 * 63 / 2);
    if (round == 1) {
      EXPECT_EQ(g_allocations.load(), before);
    }
  }
}

}  // namespace

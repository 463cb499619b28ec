// Conductor tests: next_batch (ordering, batching, timeouts, shutdown), cancellation and failure,
// stale and duplicate item ids, the reserved handle, no allocation on the warm dispatch path, and
// a multi-threaded stress test
// (MSTAR_STRESS_ITEMS sets its size). The shared IR builders and the fake application are in
// conductor_test_app.hpp.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <mutex>
#include <new>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "alloc_counter.hpp"
#include "conductor_test_app.hpp"

namespace {

using namespace conductor_test;

std::uint64_t stress_items() {
  if (const char* s = std::getenv("MSTAR_STRESS_ITEMS")) {
    char* end = nullptr;
    const unsigned long long v = std::strtoull(s, &end, 10);
    if (end != s && *end == '\0' && v > 0) return v;
  }
  return 10'000'000;
}

// ---- next_batch ---------------------------------------------------------------------------------

TEST(Conductor, NextBatchOrdersByDeadlineThenPriorityThenArrival) {
  IR ir;
  ir.node("n", "e0", {"x"}, {"y"}, 8);
  WalkB w(ir, "main");
  const WalkId main = w.build(w.node("n"));
  App app(ir.g);
  const std::int64_t now = std::chrono::duration_cast<std::chrono::nanoseconds>(
                               std::chrono::steady_clock::now().time_since_epoch())
                               .count();
  auto opt = [](std::int64_t deadline, std::int32_t prio) {
    SubmitOptions o;
    o.deadline_ns = deadline;
    o.priority = prio;
    return o;
  };
  const NameId x = ir.name("x");
  const RequestId a = app.submit(main, {{x, 1}}, opt(INT64_MAX, 0));
  const RequestId b = app.submit(main, {{x, 2}}, opt(INT64_MAX, 5));
  const RequestId c = app.submit(main, {{x, 3}}, opt(now + 1'000'000'000, 0));
  const RequestId d = app.submit(main, {{x, 4}}, opt(now + 500'000'000, -3));
  const RequestId e = app.submit(main, {{x, 5}}, opt(INT64_MAX, 5));
  const RequestId f = app.submit(main, {{x, 6}}, opt(INT64_MAX, 0));
  const RequestId g = app.submit(main, {{x, 7}}, opt(now + 1'000'000'000, 9));
  std::vector<RequestId> order;
  for (;;) {
    const auto batch = app.c.next_batch(0, 1, 0ns);
    if (batch.empty()) break;
    ASSERT_EQ(batch.size(), 1u);
    order.push_back(batch[0]->request);
    Outcome o;
    app.c.complete(app.run(batch), &o);
    app.handle(o);
  }
  EXPECT_EQ(order, (std::vector<RequestId>{d, g, c, b, e, a, f}));
  // In one batch the same order holds.
  std::vector<RequestId> rs;
  for (long k = 0; k < 4; ++k) rs.push_back(app.submit(main, {{x, k}}, opt(INT64_MAX, static_cast<std::int32_t>(k % 2))));
  const auto batch = app.c.next_batch(0, 8, 0ns);
  ASSERT_EQ(batch.size(), 4u);
  EXPECT_EQ(batch[0]->request, rs[1]);
  EXPECT_EQ(batch[1]->request, rs[3]);
  EXPECT_EQ(batch[2]->request, rs[0]);
  EXPECT_EQ(batch[3]->request, rs[2]);
  Outcome o;
  app.c.complete(app.run(batch), &o);
  app.handle(o);
  app.expect_all_released();
}

TEST(Conductor, BatchesHoldOneNodeAndWalkUpToTheSmallerLimit) {
  IR ir;
  ir.node("a", "e0", {"x"}, {"y"}, 4);
  ir.node("b", "e0", {"x"}, {"y"}, 16);
  WalkB w0(ir, "w0");
  const WalkId wa0 = w0.build(w0.node("a"));
  WalkB w1(ir, "w1");
  const WalkId wa1 = w1.build(w1.node("a"));
  WalkB w2(ir, "w2");
  const WalkId wb = w2.build(w2.node("b"));
  App app(ir.g);
  const NameId x = ir.name("x");
  // Interleaved: a/w0 x6, a/w1 x3, b/w2 x7.
  std::map<std::pair<NodeId, WalkId>, std::size_t> left;
  const WalkId pattern[] = {wa0, wa1, wb, wa0, wb, wa0, wa1, wb, wb, wa0, wb, wa0, wa1, wb, wa0, wb};
  for (WalkId wk : pattern) {
    app.submit(wk, {{x, 1}});
    ++left[{wk == wb ? ir.node_id("b") : ir.node_id("a"), wk}];
  }
  EXPECT_EQ(app.c.queued_items(), 16u);
  // The first request is a/w0: a batch of min(8, 4) = 4 of a/w0 only.
  const std::size_t caps[] = {8, 8, 3, 8, 8, 8, 8, 8};
  std::size_t pulled = 0;
  for (std::size_t cap : caps) {
    const auto batch = app.c.next_batch(0, cap, 0ns);
    if (batch.empty()) break;
    const NodeId node = batch[0]->node;
    const WalkId walk = batch[0]->walk;
    const std::size_t limit = std::min<std::size_t>(cap, app.c.graph().nodes[node].max_batch);
    for (const WorkItem* it : batch) {
      EXPECT_EQ(it->node, node);
      EXPECT_EQ(it->walk, walk);
    }
    // Greedy: as many as the limit allows of what is queued for this node and walk.
    auto& n = left[{node, walk}];
    EXPECT_EQ(batch.size(), std::min(limit, n));
    n -= batch.size();
    pulled += batch.size();
    if (pulled == batch.size()) {
      EXPECT_EQ(node, ir.node_id("a"));
      EXPECT_EQ(walk, wa0);
      EXPECT_EQ(batch.size(), 4u);
    }
    Outcome o;
    app.c.complete(app.run(batch), &o);
    app.handle(o);
  }
  EXPECT_EQ(pulled, 16u);
  // max_batch 0 is treated as 1.
  app.submit(wb, {{x, 1}});
  app.submit(wb, {{x, 1}});
  EXPECT_EQ(app.step(0, 0), 1u);
  app.drain();
  app.expect_all_released();
}

TEST(Conductor, NextBatchTimesOutEmpty) {
  IR ir;
  ir.node("n", "e0", {"x"}, {"y"});
  WalkB w(ir, "main");
  w.build(w.node("n"));
  Conductor c(ir.g);
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_TRUE(c.next_batch(0, 4, 50ms).empty());
  EXPECT_GE(std::chrono::steady_clock::now() - t0, 45ms);
  EXPECT_TRUE(c.next_batch(0, 4, 0ns).empty());
  EXPECT_THROW(c.next_batch(1, 4, 0ns), std::invalid_argument);
}

TEST(Conductor, WaitReadyLeavesTheWorkForALargerBatch) {
  IR ir;
  ir.node("n", "e0", {"x"}, {"y"}, 8);
  WalkB w(ir, "main");
  const WalkId main = w.build(w.node("n"));
  App app(ir.g);
  const NameId x = ir.name("x");
  EXPECT_FALSE(app.c.wait_ready(0, 20ms));  // nothing queued: times out
  EXPECT_THROW(app.c.wait_ready(1, 0ns), std::invalid_argument);
  std::thread waiter([&] { EXPECT_TRUE(app.c.wait_ready(0, std::chrono::seconds(10))); });
  std::this_thread::sleep_for(10ms);
  app.submit(main, {{x, 1}});
  waiter.join();
  // What arrives between the wake-up and the take joins the batch: nothing was taken yet.
  app.submit(main, {{x, 2}});
  app.submit(main, {{x, 3}});
  EXPECT_TRUE(app.c.wait_ready(0, 0ns));
  EXPECT_EQ(app.c.next_batch(0, 8, 0ns).size(), 3u);
  app.c.shutdown();
  EXPECT_FALSE(app.c.wait_ready(0, std::chrono::seconds(10)));  // returns at once
}

TEST(Conductor, ASubmitterThatTakesTheWorkLeavesTheWorkerAsleep) {
  IR ir;
  ir.node("n", "e0", {"x"}, {"y"}, 1);
  WalkB w(ir, "main");
  const WalkId main = w.build(w.node("n"));
  App app(ir.g);
  const NameId x = ir.name("x");
  app.c.set_spin(0ns);  // a spinning worker would see the insert without any wake-up
  app.c.set_submitter_takes(0, true);
  EXPECT_THROW(app.c.set_submitter_takes(1, true), std::invalid_argument);
  EXPECT_THROW(app.c.wake(1), std::invalid_argument);
  std::atomic<bool> woke{false};
  std::thread worker([&] {
    EXPECT_TRUE(app.c.wait_ready(0, 10s));
    woke = true;
  });
  std::this_thread::sleep_for(20ms);
  app.submit(main, {{x, 1}});
  app.submit(main, {{x, 2}});
  std::this_thread::sleep_for(100ms);
  EXPECT_FALSE(woke.load());  // submit woke nobody
  EXPECT_EQ(app.c.next_batch(0, 1, 0ns).size(), 1u);  // the submitter takes one batch
  app.c.wake(0);  // and wakes the worker for what it left
  worker.join();
  EXPECT_TRUE(woke.load());
  EXPECT_EQ(app.c.next_batch(0, 1, 0ns).size(), 1u);
  app.c.wake(0);  // nothing waits: no effect
  EXPECT_TRUE(app.c.next_batch(0, 1, 0ns).empty());
}

TEST(Conductor, AnInlineTakerAloneGetsTheWorkUntilItStops) {
  IR ir;
  ir.node("n", "e0", {"x"}, {"y"}, 1);
  ir.node("m", "e1", {"x"}, {"y"}, 1);
  WalkB w(ir, "main");
  const WalkId main = w.build(w.node("n"));
  WalkB w2(ir, "other");
  const WalkId other = w2.build(w2.node("m"));
  App app(ir.g);
  const NameId x = ir.name("x");
  app.c.set_submitter_takes(0, true);  // e1 is not: its worker is not kept from its work
  app.c.take_inline(true);
  app.submit(main, {{x, 1}});
  app.submit(main, {{x, 2}});
  app.submit(other, {{x, 3}});
  std::atomic<bool> got{false};
  std::thread worker([&] {
    EXPECT_TRUE(app.c.next_batch(0, 1, 0ns).empty());  // work waits, but not for this thread
    EXPECT_EQ(app.c.next_batch(0, 1, 10s).size(), 1u);
    got = true;
  });
  std::thread other_worker([&] { EXPECT_EQ(app.c.next_batch(1, 1, 10s).size(), 1u); });
  other_worker.join();
  std::this_thread::sleep_for(100ms);
  EXPECT_FALSE(got.load());
  EXPECT_EQ(app.c.next_batch(0, 1, 0ns).size(), 1u);  // the taker's
  app.c.take_inline(false);  // wakes the worker for what is left
  worker.join();
  EXPECT_TRUE(got.load());
}

TEST(Conductor, ShutdownWakesABlockedNextBatch) {
  IR ir;
  ir.node("n", "e0", {"x"}, {"y"});
  ir.node("m", "e1", {"x"}, {"y"});
  WalkB w(ir, "main");
  const WalkId main = w.build(w.node("n"));
  App app(ir.g);
  std::atomic<int> returned{0};
  std::vector<std::thread> ts;
  for (EngineId e : {0u, 1u, 1u})
    ts.emplace_back([&, e] {
      const auto batch = app.c.next_batch(e, 4, std::chrono::nanoseconds::max());  // "forever"
      EXPECT_TRUE(batch.empty());
      returned.fetch_add(1);
    });
  std::this_thread::sleep_for(50ms);
  EXPECT_EQ(returned.load(), 0);
  const auto t0 = std::chrono::steady_clock::now();
  app.c.shutdown();
  for (auto& t : ts) t.join();
  EXPECT_EQ(returned.load(), 3);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 5s);
  // Later calls return at once, even with work queued.
  const RequestId r = app.submit(main, {{ir.name("x"), 1}});
  const auto t1 = std::chrono::steady_clock::now();
  EXPECT_TRUE(app.c.next_batch(0, 4, 10s).empty());
  EXPECT_LT(std::chrono::steady_clock::now() - t1, 5s);
  EXPECT_TRUE(app.cancel(r));
  app.expect_all_released();
}

// ---- cancellation and failure -------------------------------------------------------------------

TEST(Conductor, CancelMidLoopAndWithItemsInFlight) {
  IR ir;
  ir.node("init", "e0", {"x"}, {"h"}, 8);
  ir.node("step", "e0", {"h"}, {"h"}, 8);
  ir.node("fin", "e0", {"h"}, {"out"}, 8);
  WalkB w(ir, "main");
  const std::uint32_t loop = w.loop(w.node("step"), 5, {"h"});
  const WalkId main =
      w.emit("step", "h").emit("fin", "out").build(w.seq({w.node("init"), loop, w.node("fin")}));
  App app(ir.g);
  const NameId x = ir.name("x"), h = ir.name("h");
  std::vector<RequestId> rs;
  for (long k = 0; k < 4; ++k) rs.push_back(app.submit(main, {{x, k * 100}}));
  ASSERT_EQ(app.step(0), 4u);  // init
  ASSERT_EQ(app.step(0), 4u);  // step, iteration 0
  EXPECT_EQ(app.c.queued_items(), 4u);

  // rs[0]: cancelled while its iteration-1 item is queued.
  {
    Outcome o;
    ASSERT_TRUE(app.c.cancel(rs[0], &o));
    EXPECT_TRUE(o.failed.empty());
    EXPECT_TRUE(o.emits.empty());
    EXPECT_FALSE(o.released.empty());
    app.handle(o);
    EXPECT_EQ(app.c.queued_items(), 3u);
    EXPECT_EQ(app.c.live_requests(), 3u);  // gone at once: nothing in flight
    EXPECT_FALSE(app.cancel(rs[0]));
  }
  // rs[1]: cancelled with its item in flight; completing it later is ignored.
  const auto batch = app.c.next_batch(0, 8, 0ns);
  ASSERT_EQ(batch.size(), 3u);
  const auto done = app.run(batch);
  ASSERT_TRUE(app.cancel(rs[1]));
  EXPECT_FALSE(app.cancel(rs[1]));
  EXPECT_FALSE(app.cancel(12345));
  EXPECT_EQ(app.c.inflight_items(), 3u);
  EXPECT_EQ(app.c.live_requests(), 3u);  // rs[1] waits for its item
  EXPECT_TRUE(app.c.values(rs[1]).empty());
  Handle r1_output = 0;
  for (std::size_t k = 0; k < batch.size(); ++k)
    if (app.seen[app.seen.size() - batch.size() + k].request == rs[1]) r1_output = done[k].outputs[0];
  ASSERT_NE(r1_output, 0u);
  Outcome o;
  app.c.complete(done, &o);
  for (const auto& e : o.emits) EXPECT_NE(e.request, rs[1]);
  EXPECT_EQ(o.emits.size(), 2u);
  EXPECT_NE(std::find(o.released.begin(), o.released.end(), r1_output), o.released.end());
  app.handle(o);
  EXPECT_EQ(app.c.live_requests(), 2u);
  EXPECT_EQ(app.c.queued_items(), 2u);  // only rs[2] and rs[3] go on
  app.drain();
  EXPECT_EQ(app.emitted(rs[0], h).size(), 1u);
  EXPECT_EQ(app.emitted(rs[1], h).size(), 1u);
  EXPECT_EQ(app.emitted(rs[2], h).size(), 5u);
  EXPECT_EQ(app.emitted(rs[3], ir.name("out")).size(), 1u);
  EXPECT_TRUE(app.finished.count(rs[2]) && app.finished.count(rs[3]));
  EXPECT_FALSE(app.finished.count(rs[0]) || app.finished.count(rs[1]));
  EXPECT_TRUE(app.failed.empty());
  // The cancelled request's timeline is kept until forget().
  EXPECT_EQ(app.c.timeline(rs[1]).size(), 2u);
  app.c.forget(rs[1]);
  EXPECT_TRUE(app.c.timeline(rs[1]).empty());
  app.expect_all_released();
}

TEST(Conductor, CancelBetweenWalksFreesPersistedValues) {
  IR ir;
  ir.node("a", "e0", {"x"}, {"kv"});
  ir.node("b", "e0", {"kv"}, {"y"});
  WalkB w0(ir, "first");
  const WalkId first = w0.persist("kv").build(w0.node("a"));
  WalkB w1(ir, "second");
  const WalkId second = w1.build(w1.node("b"));
  App app(ir.g);
  app.next_walk = [](RequestId, WalkId) { return kLeave; };
  const RequestId r = app.submit(first, {{ir.name("x"), 1}});
  app.drain();
  EXPECT_EQ(app.values(r).size(), 2u);  // x and kv
  EXPECT_EQ(app.c.live_requests(), 1u);
  ASSERT_TRUE(app.cancel(r));
  EXPECT_FALSE(app.cancel(r));
  EXPECT_TRUE(app.values(r).empty());
  // What a worker holding the walks_done report then sees: finish and start_walk both say the
  // request is over; neither changes anything.
  Outcome o;
  EXPECT_FALSE(app.c.finish(r, &o));
  EXPECT_FALSE(app.c.start_walk(r, second, &o));
  EXPECT_TRUE(o.released.empty() && o.walks_done.empty() && o.failed.empty());
  EXPECT_EQ(app.c.queued_items(), 0u);
  app.expect_all_released();
}

TEST(Conductor, FailItemsFailsOnlyThatRequest) {
  IR ir;
  ir.node("S", "e0", {"x"}, {"s"}, 4);
  ir.node("L", "e0", {"s"}, {"l"}, 4);
  ir.node("R", "e0", {"s"}, {"r"}, 4);
  ir.node("J", "e0", {"l", "r"}, {"y"}, 4);
  WalkB w(ir, "main");
  const WalkId main = w.emit("J", "y").build(
      w.seq({w.node("S"), w.par({w.node("L"), w.node("R")}), w.node("J")}));
  App app(ir.g);
  std::vector<RequestId> rs;
  for (long k = 0; k < 3; ++k) rs.push_back(app.submit(main, {{ir.name("x"), k}}));
  ASSERT_EQ(app.step(0), 3u);  // S
  // Both branches of every request in flight at once.
  const auto b1 = app.c.next_batch(0, 8, 0ns);
  const auto b2 = app.c.next_batch(0, 8, 0ns);
  ASSERT_EQ(b1.size(), 3u);
  ASSERT_EQ(b2.size(), 3u);
  EXPECT_NE(b1[0]->node, b2[0]->node);
  EXPECT_EQ(app.c.inflight_items(), 6u);
  auto d1 = app.run(b1);
  const auto d2 = app.run(b2);
  // b1's item of rs[1] fails.
  ASSERT_EQ(b1[1]->request, rs[1]);
  const std::uint64_t bad = b1[1]->id;
  Outcome of;
  app.c.fail_items({bad, 987654321}, "boom", &of);  // unknown ids are skipped
  ASSERT_EQ(of.failed.size(), 1u);
  EXPECT_EQ(of.failed[0].first, rs[1]);
  EXPECT_NE(of.failed[0].second.find("boom"), std::string::npos);
  EXPECT_NE(of.failed[0].second.find(app.c.graph().nodes[b1[1]->node].name), std::string::npos);
  app.handle(of);
  EXPECT_EQ(app.c.inflight_items(), 5u);
  // Its completion was never reported: it is no longer the Conductor's.
  const Completion failed_completion = d1[1];
  d1.erase(d1.begin() + 1);
  Outcome o;
  app.c.complete(d1, &o);
  app.c.complete(d2, &o);  // includes rs[1]'s other branch: ignored
  app.handle(o);
  // The failed item's outputs were never handed in; free them by hand.
  {
    std::lock_guard<std::mutex> lock(app.mu);
    for (Handle hd : failed_completion.outputs) {
      app.created.erase(hd);
      app.store.erase(hd);
    }
  }
  Outcome again;
  EXPECT_THROW(app.c.complete({failed_completion}, &again), std::invalid_argument);
  app.drain();
  EXPECT_TRUE(app.finished.count(rs[0]) && app.finished.count(rs[2]));
  EXPECT_FALSE(app.finished.count(rs[1]));
  EXPECT_EQ(app.failed.size(), 1u);
  EXPECT_EQ(app.emitted(rs[0], ir.name("y")).size(), 1u);
  EXPECT_TRUE(app.emitted(rs[1], ir.name("y")).empty());
  // Conductor::fail ends a request with a message too, once.
  app.next_walk = [](RequestId, WalkId) { return kLeave; };
  const RequestId r = app.submit(main, {{ir.name("x"), 7}});
  app.drain();
  Outcome of2;
  app.c.fail(r, "next_walk raised", &of2);
  app.c.fail(r, "again", &of2);
  ASSERT_EQ(of2.failed.size(), 1u);
  EXPECT_EQ(of2.failed[0], (std::make_pair(r, std::string("next_walk raised"))));
  app.handle(of2);
  app.expect_all_released();
}

TEST(Conductor, WrongNumberOfOutputsFailsTheRequest) {
  IR ir;
  ir.node("n", "e0", {"x"}, {"a", "b"});
  WalkB w(ir, "main");
  const WalkId main = w.build(w.node("n"));
  App app(ir.g);
  const RequestId r = app.submit(main, {{ir.name("x"), 1}});
  const auto batch = app.c.next_batch(0, 1, 0ns);
  ASSERT_EQ(batch.size(), 1u);
  auto done = app.run(batch);
  ASSERT_EQ(done[0].outputs.size(), 2u);
  {
    std::lock_guard<std::mutex> lock(app.mu);
    app.created.erase(done[0].outputs[1]);
    app.store.erase(done[0].outputs[1]);
  }
  done[0].outputs.pop_back();
  Outcome o;
  app.c.complete(done, &o);
  ASSERT_EQ(o.failed.size(), 1u);
  EXPECT_EQ(o.failed[0].first, r);
  app.handle(o);
  app.expect_all_released();
}

TEST(Conductor, RunningListsTakenBatchesAndANamedFailureKeepsItsMessage) {
  IR ir;
  ir.node("a", "e0", {"x"}, {"y"}, 4);
  ir.node("b", "e1", {"x"}, {"z"}, 4);
  WalkB w(ir, "main");
  const WalkId main = w.build(w.par({w.node("a"), w.node("b")}));
  App app(ir.g);
  const RequestId r1 = app.submit(main, {{ir.name("x"), 1}});
  app.submit(main, {{ir.name("x"), 2}});
  EXPECT_TRUE(app.c.running().empty());  // queued is not running
  const auto before = std::chrono::steady_clock::now().time_since_epoch();
  const auto batch_a = app.c.next_batch(0, 8, 0ns);
  const auto batch_b = app.c.next_batch(1, 8, 0ns);
  ASSERT_EQ(batch_a.size(), 2u);
  const auto running = app.c.running();
  ASSERT_EQ(running.size(), 2u);  // one entry per node, however many items
  for (const auto& [node, since] : running) {
    EXPECT_TRUE(node == batch_a[0]->node || node == batch_b[0]->node);
    EXPECT_GE(since, std::chrono::duration_cast<std::chrono::nanoseconds>(before).count());
  }
  Outcome o;
  app.c.complete(app.run(batch_b), &o);
  app.handle(o);
  ASSERT_EQ(app.c.running().size(), 1u);
  EXPECT_EQ(app.c.running()[0].first, batch_a[0]->node);
  // named: the message says where (a placement worker's segment), so nothing is prefixed
  Outcome of;
  app.c.fail_items({batch_a[0]->id}, "node 'inner' in walk 'main' failed: boom", &of, true);
  ASSERT_EQ(of.failed.size(), 1u);
  EXPECT_EQ(of.failed[0].first, r1);
  EXPECT_EQ(of.failed[0].second, "node 'inner' in walk 'main' failed: boom");
  app.handle(of);
  Outcome rest;
  auto done = app.run(batch_a);
  done.erase(done.begin());  // the failed item's outputs are never handed in
  app.c.complete(done, &rest);
  app.handle(rest);
  EXPECT_TRUE(app.c.running().empty());
}

TEST(Conductor, StaleAndDuplicateItemIdsAreRejected) {
  IR ir;
  ir.node("n", "e0", {"x"}, {"y"});
  WalkB w(ir, "main");
  const WalkId main = w.build(w.node("n"));
  App app(ir.g);
  app.submit(main, {{ir.name("x"), 1}});
  const auto first = app.c.next_batch(0, 1, 0ns);
  ASSERT_EQ(first.size(), 1u);
  const std::uint64_t stale = first[0]->id;
  {
    Outcome o;
    app.c.complete(app.run(first), &o);
    app.handle(o);
  }
  // A new item may reuse the finished item's storage; the old id must not reach it.
  app.submit(main, {{ir.name("x"), 2}});
  EXPECT_EQ(app.c.queued_items(), 1u);
  Outcome o;
  EXPECT_THROW(app.c.complete({Completion{stale, {0}, {}}}, &o), std::invalid_argument);
  app.c.fail_items({stale}, "stale", &o);
  EXPECT_TRUE(o.failed.empty());
  EXPECT_TRUE(o.released.empty());
  EXPECT_EQ(app.c.queued_items(), 1u);
  EXPECT_EQ(app.c.inflight_items(), 0u);
  // Reported twice in one call: the second report throws, the first took effect.
  const auto second = app.c.next_batch(0, 1, 0ns);
  ASSERT_EQ(second.size(), 1u);
  auto done = app.run(second);
  done.push_back(Completion{done[0].item, {0}, {}});
  Outcome o2;
  EXPECT_THROW(app.c.complete(done, &o2), std::invalid_argument);
  app.handle(o2);
  EXPECT_EQ(app.finished.size(), 2u);
  app.expect_all_released();
}

// ~0 is the handle counts' tombstone, so it is reserved: submit and complete refuse it instead of
// miscounting it.
TEST(Conductor, ReservedHandleIsRefused) {
  App app(valid_ir());
  Outcome o;
  EXPECT_THROW(app.c.submit(0, {{0, mstar::kReservedHandle}}, {}, &o), std::invalid_argument);
  EXPECT_EQ(app.c.live_handles(), 0u);
  EXPECT_EQ(app.c.live_requests(), 0u);
}

// ---- the dispatch path allocates nothing once warm ----------------------------------------------

TEST(Conductor, WarmDynamicLoopDispatchAllocatesNothing) {
  // 16 requests decoding in a DynamicLoop of a two-node chain, driven the way an engine worker
  // drives it (reused batch, completion and outcome buffers): after warm-up, next_batch + complete
  // must not allocate (activations, items and handle counts are pooled).
  IR ir;
  ir.node("embed", "e0", {"h"}, {"x"}, 16);
  ir.node("step", "e0", {"x"}, {"h"}, 16);
  WalkB w(ir, "main");
  const WalkId main = w.build(w.dynamic_loop("gen", w.seq({w.node("embed"), w.node("step")}),
                                             1'000'000, {"h"}));
  Conductor c(ir.g);
  Outcome out;
  Handle next = 1;
  std::vector<RequestId> ids;
  for (int r = 0; r < 16; ++r) ids.push_back(c.submit(main, {{ir.name("h"), next++}}, {}, &out));
  std::vector<const WorkItem*> batch;
  std::vector<Completion> done;
  std::uint64_t items = 0;
  auto step = [&] {
    c.next_batch(0, 16, 10ms, &batch);
    done.resize(batch.size());
    for (std::size_t i = 0; i < batch.size(); ++i) {
      done[i].item = batch[i]->id;
      done[i].outputs.assign(1, next++);
      done[i].stop_loops.clear();
    }
    out.emits.clear();
    out.released.clear();
    out.walks_done.clear();
    out.failed.clear();
    c.complete(done, &out);
    items += batch.size();
  };
  // Each request's timeline grows by doubling (log n allocations over its life): warm up past the
  // 2048-event doubling so that the measured stretch stays below the next one (4096).
  for (int i = 0; i < 2 * 1100; ++i) step();
  const std::uint64_t before = g_allocations.load();
  const std::uint64_t items_before = items;
  for (int i = 0; i < 2 * 900; ++i) step();
  EXPECT_EQ(g_allocations.load() - before, 0u);
  EXPECT_EQ(items - items_before, 16u * 2 * 900);  // every step was a full batch
  EXPECT_EQ(c.live_handles(), 32u);  // per request: its input (visible to the end) and the current h
  for (RequestId r : ids) EXPECT_TRUE(c.cancel(r, &out));
  EXPECT_EQ(c.live_handles(), 0u);
}

// ---- multi-threaded stress ----------------------------------------------------------------------

TEST(ConductorStress, TwoEngineWorkersAndASubmitterWithRandomCancels) {
  const std::uint64_t items = stress_items();
  const std::size_t n_requests =
      static_cast<std::size_t>(std::clamp<std::uint64_t>(items / 2000, 500, 5000));
  // gen: Sequential(enc, Parallel(DynamicLoop "gen"(dec, 8), voc)) with dec --tok--> voc as a
  // SlidingWindow(3, 1) stream; a third of the requests then run post (h persisted).
  IR ir;
  ir.node("enc", "llm", {"x"}, {"h"}, 8);
  ir.node("dec", "llm", {"h"}, {"h", "tok"}, 16);
  ir.node("voc", "codec", {"tok"}, {"audio"}, 8);
  ir.node("post", "codec", {"h"}, {"state"}, 8);
  ir.g.nodes[ir.node_id("voc")].on_stream_end = true;  // every stream's end is heard once
  WalkB w0(ir, "gen");
  const std::uint32_t loop = w0.dynamic_loop("gen", w0.node("dec"), 8, {"h"}, {}, {"tok"});
  w0.stream("dec", "tok", "voc", ChunkPolicy::sliding_window(3, 1), loop)
      .emit("voc", "audio")
      .persist("h");
  const WalkId gen = w0.build(w0.seq({w0.node("enc"), w0.par({loop, w0.node("voc")})}));
  WalkB w1(ir, "post");
  const WalkId post = w1.emit("post", "state").build(w1.node("post"));

  App app(ir.g);
  app.record = false;
  app.tolerate_refused_start_walk = true;
  const NameId gen_name = ir.name("gen");
  auto iters_of = [](RequestId r) -> long { return std::min<long>(static_cast<long>(r % 9) + 1, 8); };
  auto fails = [&](RequestId r) { return r % 97 == 0 && iters_of(r) >= 6; };
  app.fns[ir.node_id("enc")] = [](const WorkItem&, const auto& in, auto& out, auto&) {
    out[0] = in[0][0];
    return true;
  };
  app.fns[ir.node_id("dec")] = [&](const WorkItem& it, const auto& in, auto& out, auto& stop) {
    if (fails(it.request) && it.iteration == 5) return false;
    out[0] = in[0][0] + 1;
    out[1] = in[0][0] + 1;
    if (static_cast<long>(it.iteration) + 1 == iters_of(it.request)) stop.push_back(gen_name);
    return true;
  };
  std::unordered_map<RequestId, std::pair<int, bool>> lasts;  // (last windows, last came last)
  app.fns[ir.node_id("voc")] = [&](const WorkItem& it, const auto& in, auto& out, auto&) {
    if (it.chunked == it.stream_end) return false;  // exactly one of the two
    if (it.chunked && in[0].empty()) return false;  // a window is never empty
    auto& l = lasts[it.request];  // fns run under app.mu
    if (l.first > 0) l.second = false;  // something after the end
    if (it.chunk.last) {
      ++l.first;
      l.second = true;
    }
    if (it.stream_end) return true;  // the end after a full window: nothing to say
    long s = 0;
    for (long v : in[0]) s += v;
    out[0] = s;
    return true;
  };
  app.fns[ir.node_id("post")] = [](const WorkItem&, const auto& in, auto& out, auto&) {
    out[0] = in[0][0] * 2;
    return true;
  };
  app.next_walk = [&](RequestId r, WalkId done) -> std::int64_t {
    return done == gen && r % 3 == 0 ? static_cast<std::int64_t>(post) : kFinish;
  };

  const auto t0 = std::chrono::steady_clock::now();
  std::atomic<bool> stop{false};
  std::vector<std::thread> workers;
  for (EngineId e : {0u, 1u})
    workers.emplace_back([&, e] {
      while (!stop.load(std::memory_order_acquire)) app.step(e, 16, 5ms);
    });
  std::thread submitter([&] {
    std::mt19937_64 rng(20240611);
    std::vector<RequestId> recent;
    const std::int64_t base = std::chrono::duration_cast<std::chrono::nanoseconds>(
                                  std::chrono::steady_clock::now().time_since_epoch())
                                  .count();
    for (std::size_t i = 0; i < n_requests; ++i) {
      for (;;) {  // keep at most 256 requests under way
        std::size_t open;
        {
          std::lock_guard<std::mutex> lock(app.mu);
          open = i - app.terminal.size();
        }
        if (open < 256) break;
        std::this_thread::sleep_for(100us);
      }
      SubmitOptions opt;
      opt.priority = static_cast<std::int32_t>(rng() % 5) - 2;
      if (rng() % 10 < 3) opt.deadline_ns = base + static_cast<std::int64_t>(rng() % 1'000'000'000);
      recent.push_back(app.submit(gen, {{ir.name("x"), static_cast<long>(i) * 100}}, opt));
      if (recent.size() > 64) recent.erase(recent.begin());
      if (rng() % 100 < 15) app.cancel(recent[rng() % recent.size()]);
      if (rng() % 64 == 0) std::this_thread::yield();
    }
  });
  submitter.join();
  const auto limit = std::chrono::steady_clock::now() + 120s;
  for (;;) {
    std::size_t n;
    {
      std::lock_guard<std::mutex> lock(app.mu);
      n = app.terminal.size();
    }
    if (n >= n_requests) break;
    if (std::chrono::steady_clock::now() > limit) {
      ADD_FAILURE() << "only " << n << " of " << n_requests << " requests ended";
      break;
    }
    std::this_thread::sleep_for(1ms);
  }
  stop.store(true, std::memory_order_release);
  app.c.shutdown();
  for (auto& t : workers) t.join();
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();

  // Every request ended exactly one way, and finished ones carry the right values.
  std::size_t n_finished = 0, n_failed = 0, n_cancelled = app.cancelled.size(), n_post = 0;
  for (RequestId r : app.finished) EXPECT_FALSE(app.cancelled.count(r)) << r;
  for (const auto& [r, msg] : app.failed) {
    EXPECT_FALSE(app.cancelled.count(r)) << r;
    EXPECT_TRUE(fails(r)) << r << ": " << msg;
    EXPECT_NE(msg.find("injected failure"), std::string::npos) << msg;
    ++n_failed;
  }
  std::map<RequestId, std::vector<long>> audio, state;
  for (const auto& e : app.emits) {
    if (e.name == ir.name("audio")) audio[e.request].push_back(e.value);
    if (e.name == ir.name("state")) state[e.request].push_back(e.value);
  }
  EXPECT_EQ(app.terminal.size(), n_requests);
  for (const auto& [r, ins] : app.inputs_of) {
    if (app.cancelled.count(r) || app.failed.count(r)) continue;
    ASSERT_TRUE(app.finished.count(r)) << "request " << r << " never ended";
    EXPECT_FALSE(fails(r)) << r;
    ++n_finished;
    const long x = ins.at(0), n = iters_of(r);
    // tok at position p is x + 1 + p; SlidingWindow(3, 1) windows: [0,3), [1,4), ... or [0,n).
    std::vector<long> want;
    if (n < 3) {
      want.push_back(n == 1 ? x + 1 : 2 * x + 3);
    } else {
      for (long b = 0; b + 3 <= n; ++b) want.push_back(3 * x + 3 * b + 6);
    }
    EXPECT_EQ(audio[r], want) << "request " << r;
    EXPECT_EQ(lasts[r].first, 1) << "request " << r << ": one end (a last window or a stream-end item)";
    EXPECT_TRUE(lasts[r].second) << "request " << r << ": the end came last";
    if (r % 3 == 0) {
      ++n_post;
      EXPECT_EQ(state[r], (std::vector<long>{2 * (x + n)})) << "request " << r;
    } else {
      EXPECT_TRUE(state[r].empty());
    }
  }
  EXPECT_EQ(n_finished + n_failed + n_cancelled, n_requests);
  EXPECT_GT(n_cancelled, 0u);
  EXPECT_GT(n_finished, n_requests / 2);
  app.expect_all_released();
  std::printf(
      "[ stress   ] %zu requests in %.2f s: %zu finished (%zu with post), %zu failed, %zu "
      "cancelled; %zu handles; emits whose handle another call had already freed: %ld; "
      "start_walk/finish refused after a cancel: %ld/%ld\n",
      n_requests, secs, n_finished, n_post, n_failed, n_cancelled, app.created.size(),
      app.emit_after_free, app.refused_start_walk, app.refused_finish);
}

}  // namespace

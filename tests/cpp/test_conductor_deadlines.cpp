// Deadlines that are kept (SubmitOptions::fail_late): late work fails its request naming the node,
// expire() clears late work before a worker takes it, submit refuses a request the queue ahead
// cannot serve in time (estimated from nodes' run times, which an untimed node's hold is not),
// and requests without the option only use the deadline for ordering.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>
#include <string>
#include <thread>
#include <vector>

#include "conductor_test_app.hpp"

namespace {

using namespace conductor_test;

std::int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

SubmitOptions kept(std::int64_t deadline_ns) {
  SubmitOptions o;
  o.deadline_ns = deadline_ns;
  o.fail_late = true;
  return o;
}

// Two nodes in a row on one engine; each run is one batch, taken and completed by hand.
struct TwoSteps : ::testing::Test {
  IR ir;
  WalkId main = 0;
  NodeId a = 0, b = 0;
  void SetUp() override {
    a = ir.node("a", "e0", {"x"}, {"y"}, 8);
    b = ir.node("b", "e0", {"y"}, {"z"}, 8);
    WalkB w(ir, "main");
    main = w.emit("b", "z").build(w.seq({w.node("a"), w.node("b")}));
  }
  // Takes one batch and completes it `hold` later.
  static void run_slowly(App& app, std::chrono::milliseconds hold) {
    const auto batch = app.c.next_batch(0, 8, 0ns);
    ASSERT_FALSE(batch.empty());
    std::this_thread::sleep_for(hold);
    Outcome o;
    app.c.complete(app.run(batch), &o);
    app.handle(o);
  }
};

TEST_F(TwoSteps, WorkThatWouldStartLateFailsTheRequestAndNamesTheNode) {
  App app(ir.g);
  const RequestId r = app.submit(main, {{ir.name("x"), 1}}, kept(now_ns() + 30'000'000));
  run_slowly(app, 60ms);  // a finishes after the deadline: b would start late
  ASSERT_EQ(app.failed.count(r), 1u);
  EXPECT_NE(app.failed[r].find("deadline exceeded: node 'b' in walk 'main'"), std::string::npos)
      << app.failed[r];
  ASSERT_EQ(app.expired.count(r), 1u);
  EXPECT_EQ(app.expired[r].node, b);
  EXPECT_FALSE(app.expired[r].refused);
  EXPECT_GE(app.expired[r].late_ns, 20'000'000);
  EXPECT_TRUE(app.c.next_batch(0, 8, 0ns).empty());  // b never runs
  EXPECT_TRUE(app.emitted(r, ir.name("z")).empty());
  app.expect_all_released();
}

TEST_F(TwoSteps, WithoutTheOptionADeadlineOnlyOrdersWork) {
  App app(ir.g);
  SubmitOptions late;
  late.deadline_ns = now_ns() + 30'000'000;
  const RequestId r = app.submit(main, {{ir.name("x"), 1}}, late);
  run_slowly(app, 60ms);
  app.drain();
  EXPECT_EQ(app.finished.count(r), 1u);
  EXPECT_EQ(app.emitted(r, ir.name("z")).size(), 1u);
  EXPECT_TRUE(app.expired.empty());
  app.expect_all_released();
}

TEST_F(TwoSteps, ExpireClearsLateQueuedWorkAndLeavesTheRestRunning) {
  App app(ir.g);
  const std::int64_t deadline = now_ns() + 20'000'000;
  const RequestId doomed = app.submit(main, {{ir.name("x"), 1}}, kept(deadline));
  SubmitOptions ordered;
  ordered.deadline_ns = deadline;
  const RequestId patient = app.submit(main, {{ir.name("x"), 2}}, ordered);
  const RequestId in_time = app.submit(main, {{ir.name("x"), 3}}, kept(now_ns() + 60'000'000'000));
  std::this_thread::sleep_for(40ms);
  Outcome o;
  app.c.expire(&o);
  app.handle(o);
  ASSERT_EQ(o.expired.size(), 1u);
  EXPECT_EQ(o.expired[0].request, doomed);
  EXPECT_EQ(o.expired[0].node, a);
  app.drain();
  EXPECT_EQ(app.finished.count(patient), 1u);
  EXPECT_EQ(app.finished.count(in_time), 1u);
  app.expect_all_released();
}

TEST_F(TwoSteps, SubmitRefusesARequestTheQueueAheadCannotServeInTime) {
  App app(ir.g);
  // Teach the Conductor that node a takes ~20 ms per item.
  app.submit(main, {{ir.name("x"), 0}});
  run_slowly(app, 20ms);
  app.drain();
  // Ten requests due in 100 ms are queued: ~200 ms of work for a.
  const std::int64_t due = now_ns() + 100'000'000;
  SubmitOptions ordered;
  ordered.deadline_ns = due;
  std::vector<RequestId> ahead;
  for (long k = 0; k < 10; ++k) ahead.push_back(app.submit(main, {{ir.name("x"), k}}, ordered));
  const RequestId refused = app.submit(main, {{ir.name("x"), 7}}, kept(due + 1));
  ASSERT_EQ(app.expired.count(refused), 1u);
  EXPECT_TRUE(app.expired[refused].refused);
  EXPECT_EQ(app.expired[refused].node, a);
  EXPECT_GT(app.expired[refused].late_ns, 50'000'000);
  EXPECT_NE(app.failed[refused].find("deadline cannot be met"), std::string::npos)
      << app.failed[refused];
  EXPECT_NE(app.failed[refused].find("engine 'e0'"), std::string::npos);
  // One whose deadline leaves room, or that goes ahead of the queue, is admitted.
  const RequestId later = app.submit(main, {{ir.name("x"), 8}}, kept(due + 10'000'000'000));
  const RequestId urgent = app.submit(main, {{ir.name("x"), 9}}, kept(due - 50'000'000));
  EXPECT_EQ(app.failed.count(later), 0u);
  EXPECT_EQ(app.failed.count(urgent), 0u);
  // A deadline already past is refused at once, even on an idle node.
  const RequestId past = app.submit(main, {{ir.name("x"), 9}}, kept(now_ns() - 1));
  EXPECT_TRUE(app.expired.count(past) == 1u && app.expired[past].refused);
  app.drain();
  for (RequestId r : ahead) EXPECT_EQ(app.finished.count(r), 1u);
  EXPECT_EQ(app.finished.count(later), 1u);
  app.expect_all_released();
}

TEST_F(TwoSteps, AnUntimedNodesTimeInFlightTeachesNothing) {
  // a held open for 40 ms (a source the caller feeds, NodeSpec::untimed): not a run time, so a
  // request due in 10 ms is admitted; timed, the same hold refuses it.
  for (bool untimed : {true, false}) {
    ir.g.nodes[a].untimed = untimed;
    App app(ir.g);
    app.submit(main, {{ir.name("x"), 0}});
    run_slowly(app, 40ms);
    app.drain();
    const RequestId r = app.submit(main, {{ir.name("x"), 1}}, kept(now_ns() + 10'000'000));
    EXPECT_EQ(app.expired.count(r), untimed ? 0u : 1u) << "untimed=" << untimed;
    app.drain();
    app.expect_all_released();
  }
}

TEST_F(TwoSteps, AFreshConductorAdmitsEverythingItHasNoTimesFor) {
  App app(ir.g);
  std::vector<RequestId> rs;
  for (long k = 0; k < 50; ++k)
    rs.push_back(app.submit(main, {{ir.name("x"), k}}, kept(now_ns() + 60'000'000'000)));
  EXPECT_TRUE(app.failed.empty());
  app.drain();
  for (RequestId r : rs) EXPECT_EQ(app.finished.count(r), 1u);
  app.expect_all_released();
}

TEST(ConductorDeadlines, LateStreamChunksFailTheRequestToo) {
  IR ir;
  ir.node("P", "e0", {"h"}, {"h", "s"});
  const NodeId consumer = ir.node("C", "e1", {"s"}, {"o"});
  WalkB w(ir, "main");
  const std::uint32_t loop = w.dynamic_loop("gen", w.node("P"), 6, {"h"}, {}, {"s"});
  w.stream("P", "s", "C", ChunkPolicy::fixed(2), loop).emit("C", "o");
  const WalkId main = w.build(w.par({loop, w.node("C")}));
  App app(ir.g);
  const RequestId r = app.submit(main, {{ir.name("h"), 1}}, kept(now_ns() + 20'000'000));
  app.step(0);
  app.step(0);  // two items: a chunk for C is queued on e1
  ASSERT_EQ(app.c.queued_items(), 2u);  // P's next iteration and C's chunk
  std::this_thread::sleep_for(40ms);
  Outcome o;
  app.c.expire(&o);
  app.handle(o);
  ASSERT_EQ(app.expired.count(r), 1u);
  EXPECT_TRUE(app.expired[r].node == consumer || app.expired[r].node == 0);
  EXPECT_EQ(app.c.queued_items(), 0u);
  app.drain();
  app.expect_all_released();
}

}  // namespace

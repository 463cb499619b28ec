// Conductor tests for Parts (SectionKind::part): sub-walks chosen at run time through
// Outcome::part_choices and Conductor::choose_part, per Part and per loop iteration; the graph
// compiler's rules for them; cancel and failure while a choice is pending leak nothing.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <deque>
#include <mutex>
#include <set>
#include <stdexcept>
#include <thread>
#include <string>
#include <vector>

#include "mstar/conductor.hpp"
#include "mstar/graph_builder.hpp"

namespace {

using namespace mstar;

NameId id_of(const GraphSpec& g, const std::string& n) {
  for (NameId i = 0; i < g.names.size(); ++i)
    if (g.names[i] == n) return i;
  throw std::out_of_range(n);
}

// Runs every queued item on engine 0, giving each output a fresh handle; returns the nodes run.
std::vector<std::string> run_all(Conductor& c, Outcome* out, Handle* next) {
  std::vector<std::string> ran;
  std::vector<const WorkItem*> batch;
  for (;;) {
    c.next_batch(0, 16, std::chrono::nanoseconds(0), &batch);
    if (batch.empty()) return ran;
    std::vector<Completion> done;
    for (const WorkItem* w : batch) {
      ran.push_back(c.graph().nodes[w->node].name);
      done.push_back({w->id, std::vector<Handle>(c.graph().nodes[w->node].outputs.size(), (*next)++), {}});
    }
    c.complete(done, out);
  }
}

GraphSpec two_parts() {
  GraphBuilder b;
  b.input("x");
  b.node("a", {"x"}, {Edge::output("ya")});
  b.node("b", {"ya"}, {Edge::output("yb")});
  b.node("c", {"x"}, {Edge::output("yc")});
  b.node("after", {"yb", "yc"}, {Edge::emit("z")});
  b.walk("main", Section::seq({Section::par({Section::part("p", {{"first", "a"}, {"second", "b"}}),
                                             Section::part("q", {{"only", "c"}})}),
                               "after"}));
  return b.compile();
}

TEST(ConductorParts, EachPartAdvancesByTheChoicesMadeForIt) {
  Conductor c(two_parts());
  const GraphSpec& g = c.graph();
  Handle next = 100;
  Outcome out;
  const RequestId r = c.submit(0, {{id_of(g, "x"), 1}}, {}, &out);
  ASSERT_EQ(out.part_choices.size(), 2u);  // both Parts wait for the model at once
  EXPECT_EQ(c.queued_items(), 0u);
  std::uint32_t sp = 0, sq = 0;
  for (const PartChoice& pc : out.part_choices) {
    EXPECT_EQ(pc.request, r);
    EXPECT_EQ(pc.finished, -1);
    EXPECT_EQ(g.walks[0].sections[pc.section].kind, SectionKind::part);
    (g.names[pc.part] == "p" ? sp : sq) = pc.section;
  }
  EXPECT_EQ(g.walks[0].sections[sp].part_walks, (std::vector<std::string>{"first", "second"}));
  out = {};
  EXPECT_TRUE(c.choose_part(r, sp, 0, &out));
  EXPECT_TRUE(c.choose_part(r, sq, 0, &out));
  EXPECT_THROW(c.choose_part(r, sq, 0, &out), std::logic_error);  // q runs: no choice pending
  EXPECT_EQ(run_all(c, &out, &next), (std::vector<std::string>{"a", "c"}));
  ASSERT_EQ(out.part_choices.size(), 2u);
  for (const PartChoice& pc : out.part_choices) EXPECT_EQ(pc.finished, 0);
  out = {};
  EXPECT_THROW(c.choose_part(r, sp, 2, &out), std::invalid_argument);
  EXPECT_TRUE(c.choose_part(r, sq, -1, &out));  // q is over; the Parallel waits for p
  EXPECT_TRUE(c.choose_part(r, sp, 1, &out));
  EXPECT_EQ(run_all(c, &out, &next), (std::vector<std::string>{"b"}));
  ASSERT_EQ(out.part_choices.size(), 1u);
  EXPECT_EQ(out.part_choices[0].finished, 1);
  EXPECT_TRUE(c.choose_part(r, sp, 0, &out));  // a sub-walk may run again
  EXPECT_EQ(run_all(c, &out, &next), (std::vector<std::string>{"a"}));
  out = {};
  EXPECT_TRUE(c.choose_part(r, sp, -1, &out));
  EXPECT_EQ(run_all(c, &out, &next), (std::vector<std::string>{"after"}));
  ASSERT_EQ(out.emits.size(), 1u);
  ASSERT_EQ(out.walks_done, (std::vector<RequestId>{r}));
  EXPECT_TRUE(c.finish(r, &out));
  EXPECT_EQ(c.live_handles(), 0u);
  EXPECT_EQ(c.live_requests(), 0u);
}

TEST(ConductorParts, AWrongOrderFailsTheRequestNamingTheName) {
  Conductor c(two_parts());
  Outcome out;
  const RequestId r = c.submit(0, {{id_of(c.graph(), "x"), 1}}, {}, &out);
  const std::uint32_t sp = out.part_choices[0].section;
  EXPECT_TRUE(c.choose_part(r, sp, 1, &out));  // b before a: ya has no value yet
  ASSERT_EQ(out.failed.size(), 1u);
  EXPECT_NE(out.failed[0].second.find("reads 'ya', which has no value"), std::string::npos);
  EXPECT_FALSE(c.choose_part(r, out.part_choices[1].section, 0, &out));  // over
  EXPECT_EQ(c.live_handles(), 0u);
  EXPECT_EQ(c.live_requests(), 0u);
}

TEST(ConductorParts, CancelOrFailWhileAChoiceIsPendingLeaksNothing) {
  Conductor c(two_parts());
  Handle next = 100;
  for (int how = 0; how < 2; ++how) {
    Outcome out;
    const RequestId r = c.submit(0, {{id_of(c.graph(), "x"), 1}}, {}, &out);
    const std::uint32_t sp = out.part_choices[0].section, sq = out.part_choices[1].section;
    EXPECT_TRUE(c.choose_part(r, sp, 0, &out));
    run_all(c, &out, &next);  // p waits for its next choice, q for its first
    if (how == 0) {
      EXPECT_TRUE(c.cancel(r, &out));
    } else {
      c.fail(r, "the state machine raised", &out);
    }
    EXPECT_FALSE(c.choose_part(r, sp, 1, &out));
    EXPECT_FALSE(c.choose_part(r, sq, -1, &out));
    EXPECT_EQ(c.live_handles(), 0u);
    EXPECT_EQ(c.live_requests(), 0u);
    EXPECT_EQ(c.queued_items(), 0u);
  }
}

TEST(ConductorParts, APartInsideALoopIsChosenAfreshEachIteration) {
  GraphBuilder b;
  b.input("x");
  b.node("a", {"x"}, {Edge::emit("ya")});
  b.node("b", {"x"}, {Edge::emit("yb")});
  b.walk("main", Section::loop(Section::part("p", {{"a", "a"}, {"b", "b"}}), 3));
  Conductor c(b.compile());
  Handle next = 100;
  Outcome out;
  const RequestId r = c.submit(0, {{id_of(c.graph(), "x"), 1}}, {}, &out);
  std::vector<std::string> ran;
  int choices = 0;
  while (out.walks_done.empty()) {
    ASSERT_EQ(out.part_choices.size(), 1u);
    const PartChoice pc = out.part_choices[0];
    ++choices;
    out = {};
    // each iteration: b, then a, then end
    const int child = pc.finished == -1 ? 1 : pc.finished == 1 ? 0 : -1;
    ASSERT_TRUE(c.choose_part(r, pc.section, child, &out));
    for (const auto& n : run_all(c, &out, &next)) ran.push_back(n);
  }
  EXPECT_EQ(choices, 9);
  EXPECT_EQ(ran, (std::vector<std::string>{"b", "a", "b", "a", "b", "a"}));
  EXPECT_TRUE(c.finish(r, &out));
  EXPECT_EQ(c.live_handles(), 0u);
}

TEST(ConductorParts, ChoicesMadeOnAnotherThreadWhileAWorkerRunsAndCancels) {
  Conductor c(two_parts());
  const NameId x = id_of(c.graph(), "x");
  std::mutex mu;
  std::deque<PartChoice> choices;
  std::deque<RequestId> walks_done;
  auto absorb = [&](const Outcome& o) {
    std::lock_guard<std::mutex> lock(mu);
    choices.insert(choices.end(), o.part_choices.begin(), o.part_choices.end());
    walks_done.insert(walks_done.end(), o.walks_done.begin(), o.walks_done.end());
  };
  std::atomic<bool> stop{false};
  std::thread worker([&] {
    std::vector<const WorkItem*> batch;
    std::vector<Completion> done;
    Handle next = 1000;
    while (!stop.load()) {
      c.next_batch(0, 8, std::chrono::milliseconds(1), &batch);
      done.clear();
      for (const WorkItem* w : batch)
        done.push_back({w->id, std::vector<Handle>(c.graph().nodes[w->node].outputs.size(), next++), {}});
      Outcome out;
      c.complete(done, &out);
      absorb(out);
    }
  });
  std::set<RequestId> live;
  for (int k = 0; k < 60; ++k) {
    Outcome out;
    live.insert(c.submit(0, {{x, 1}}, {}, &out));
    absorb(out);
  }
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  int cancelled = 0;
  while (!live.empty() && std::chrono::steady_clock::now() < until) {
    std::deque<PartChoice> mine;
    std::deque<RequestId> ended;
    {
      std::lock_guard<std::mutex> lock(mu);
      mine.swap(choices);
      ended.swap(walks_done);
    }
    for (RequestId r : ended) {
      Outcome out;
      EXPECT_TRUE(c.finish(r, &out));
      live.erase(r);
    }
    for (const PartChoice& pc : mine) {
      Outcome out;
      if (pc.request % 7 == 0 && pc.finished == 0) {  // cancel while the other Part runs
        if (c.cancel(pc.request, &out)) ++cancelled;
        live.erase(pc.request);
        continue;
      }
      const bool p = c.graph().names[pc.part] == "p";
      const int child = pc.finished == -1 ? 0 : (p && pc.finished == 0) ? 1 : -1;
      const bool ok = c.choose_part(pc.request, pc.section, child, &out);
      EXPECT_EQ(ok, live.count(pc.request) == 1);
      absorb(out);
    }
    if (mine.empty() && ended.empty()) std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  stop = true;
  worker.join();
  EXPECT_TRUE(live.empty());
  EXPECT_GT(cancelled, 0);
  EXPECT_EQ(c.live_requests(), 0u);
  EXPECT_EQ(c.live_handles(), 0u);
}

TEST(ConductorParts, TheCompilerNamesThePartAndWalk) {
  auto error_of = [](Section root) {
    GraphBuilder b;
    b.input("x");
    b.node("a", {"x"}, {Edge::output("ya")});
    b.node("d", {"x"}, {Edge::output("yd")});
    b.node("b", {"x"}, {Edge::stream("c", "s", ChunkPolicy::fixed(1))});
    b.node("c", {"s"}, {Edge::output("yc")});
    b.walk("w", std::move(root));
    try {
      (void)b.compile();
    } catch (const GraphError& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  EXPECT_EQ(error_of(Section::part("p", {})), "Part 'p' in walk 'w' has no walks; give it at least one");
  EXPECT_NE(error_of(Section::par({Section::part("p", {{"x", "a"}}), Section::part("p", {{"y", "d"}})}))
                .find("two Parts are named 'p' in walk 'w'"),
            std::string::npos);
  EXPECT_NE(error_of(Section::part("p", {{"k", "a"}, {"k", "d"}})).find("two walks named 'k'"),
            std::string::npos);
  EXPECT_NE(error_of(Section::part("", {{"k", "a"}})).find("needs a name"), std::string::npos);
  EXPECT_NE(error_of(Section::part("p", {{"k", "b"}, {"l", "c"}})).find("another walk of Part 'p'"),
            std::string::npos);
  EXPECT_EQ(error_of(Section::par({Section::part("p", {{"k", "b"}}), Section::part("q", {{"l", "c"}}),
                                   "a", "d"})),
            "");  // a stream between two Parts is a stream within the walk
}

}  // namespace

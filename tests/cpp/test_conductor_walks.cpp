// Conductor tests: values through sections (sequential, parallel, loops, dynamic loops, scoped
// names), persisted names across walks, emits, and IR validation (the constructor's and submit's
// checks). The shared IR builders and the fake application are in conductor_test_app.hpp.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <map>
#include <set>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "conductor_test_app.hpp"

namespace {

using namespace conductor_test;

// ---- values through sections --------------------------------------------------------------------

TEST(Conductor, SequentialChainPassesValuesNodeToNode) {
  IR ir;
  ir.node("n0", "e0", {"x"}, {"a"});
  ir.node("n1", "e0", {"a"}, {"b"});
  ir.node("n2", "e0", {"b"}, {"c"});
  WalkB w(ir, "main");
  const WalkId main = w.emit("n2", "c").build(w.seq({w.node("n0"), w.node("n1"), w.node("n2")}));
  App app(ir.g);
  const RequestId r = app.submit(main, {{ir.name("x"), 10}});
  EXPECT_EQ(app.c.live_requests(), 1u);
  // One node at a time, in order; each sees the previous one's value.
  for (NodeId k = 0; k < 3; ++k) {
    EXPECT_EQ(app.c.queued_items(), 1u);
    ASSERT_EQ(app.step(0), 1u);
    EXPECT_EQ(app.seen.back().node, k);
  }
  EXPECT_EQ(app.drain(), 0u);
  for (const WorkItem& it : app.seen) {
    EXPECT_EQ(it.request, r);
    EXPECT_EQ(it.walk, main);
    EXPECT_EQ(it.iteration, 0u);
    EXPECT_FALSE(it.chunked);
    EXPECT_EQ(it.offsets, (std::vector<std::uint32_t>{0, 1}));
    EXPECT_EQ(it.list_input, (std::vector<std::uint8_t>{0}));
  }
  // a = 10 + 1, b = a + 2, c = b + 3
  EXPECT_EQ(app.emitted(r, ir.name("c")), (std::vector<long>{16}));
  ASSERT_EQ(app.emits.size(), 1u);
  EXPECT_EQ(app.emits[0].node, ir.node_id("n2"));
  EXPECT_TRUE(app.finished.count(r));
  // At the walk's end only the request input is left visible.
  ASSERT_EQ(app.walk_ends[r].size(), 1u);
  EXPECT_EQ(app.walk_ends[r][0].second, (std::map<NameId, long>{{ir.name("x"), 10}}));
  EXPECT_EQ(app.c.timeline(r).size(), 3u);
  app.expect_all_released();
}

TEST(Conductor, ParallelBranchesFanOutAndJoinFansIn) {
  IR ir;
  ir.node("split", "e0", {"x"}, {"s"});
  ir.node("left", "e0", {"s"}, {"l"});
  ir.node("right", "e1", {"s"}, {"r"});
  ir.node("join", "e0", {"l", "r"}, {"y"});
  WalkB w(ir, "main");
  const WalkId main = w.emit("join", "y").build(
      w.seq({w.node("split"), w.par({w.node("left"), w.node("right")}), w.node("join")}));
  App app(ir.g);
  const RequestId r = app.submit(main, {{ir.name("x"), 5}});
  ASSERT_EQ(app.step(0), 1u);  // split: s = 6
  EXPECT_EQ(app.c.queued_items(), 2u);  // both branches are ready at once
  ASSERT_EQ(app.step(1), 1u);  // right first: r = 6 + 3
  EXPECT_EQ(app.c.queued_items(), 1u);  // join waits for left
  EXPECT_EQ(app.seen.back().node, ir.node_id("right"));
  ASSERT_EQ(app.step(0), 1u);  // left: l = 6 + 2
  EXPECT_EQ(app.seen.back().node, ir.node_id("left"));
  EXPECT_EQ(app.c.queued_items(), 1u);
  ASSERT_EQ(app.step(0), 1u);  // join: 8 + 9 + 4
  const WorkItem& join = app.seen.back();
  EXPECT_EQ(join.node, ir.node_id("join"));
  EXPECT_EQ(join.offsets, (std::vector<std::uint32_t>{0, 1, 2}));
  EXPECT_EQ(app.emitted(r, ir.name("y")), (std::vector<long>{21}));
  EXPECT_EQ(app.drain(), 0u);
  app.expect_all_released();
}

TEST(Conductor, LoopKeepsLastValueAndAccumulatesEveryIteration) {
  IR ir;
  ir.node("init", "e0", {"x"}, {"h"});
  ir.node("step", "e0", {"h"}, {"h", "y"});
  ir.node("sum", "e0", {"h", "y"}, {"z"});
  WalkB w(ir, "main");
  const std::uint32_t loop = w.loop(w.node("step"), 3, {"h"}, {"y"});
  const WalkId main = w.emit("sum", "z").build(w.seq({w.node("init"), loop, w.node("sum")}));
  App app(ir.g);
  app.fns[ir.node_id("init")] = [](const WorkItem&, const auto& in, auto& out, auto&) {
    out[0] = in[0][0];
    return true;
  };
  app.fns[ir.node_id("step")] = [](const WorkItem&, const auto& in, auto& out, auto&) {
    out[0] = in[0][0] + 1;   // h' = h + 1
    out[1] = in[0][0] * 10;  // y = h * 10
    return true;
  };
  app.fns[ir.node_id("sum")] = [](const WorkItem&, const auto& in, auto& out, auto&) {
    long s = in[0][0];
    for (long v : in[1]) s += v;
    out[0] = s;
    return true;
  };
  const RequestId r = app.submit(main, {{ir.name("x"), 5}});
  for (int k = 0; k < 4; ++k) ASSERT_EQ(app.step(0), 1u);  // init, step x3
  // After the loop: h has its last value; y is a list (not in values()).
  EXPECT_EQ(app.values(r), (std::map<NameId, long>{{ir.name("x"), 5}, {ir.name("h"), 8}}));
  ASSERT_EQ(app.step(0), 1u);
  const auto steps = app.items_of(ir.node_id("step"));
  ASSERT_EQ(steps.size(), 3u);
  for (std::uint32_t i = 0; i < 3; ++i) EXPECT_EQ(steps[i].iteration, i);
  const auto sums = app.items_of(ir.node_id("sum"));
  ASSERT_EQ(sums.size(), 1u);
  EXPECT_EQ(sums[0].offsets, (std::vector<std::uint32_t>{0, 1, 4}));
  EXPECT_EQ(sums[0].list_input, (std::vector<std::uint8_t>{0, 1}));
  EXPECT_EQ(sums[0].iteration, 0u);
  EXPECT_FALSE(sums[0].chunked);
  EXPECT_EQ(app.emitted(r, ir.name("z")), (std::vector<long>{8 + 50 + 60 + 70}));
  app.expect_all_released();
}

TEST(Conductor, DynamicLoopStopsAtADifferentIterationPerRequest) {
  IR ir;
  ir.node("init", "e0", {"x"}, {"h"}, 8);
  ir.node("tok", "e0", {"h"}, {"h"}, 8);
  ir.node("fin", "e0", {"h"}, {"out"}, 8);
  WalkB w(ir, "main");
  const std::uint32_t loop = w.dynamic_loop("gen", w.node("tok"), 10, {"h"});
  const WalkId main =
      w.emit("tok", "h").emit("fin", "out").build(w.seq({w.node("init"), loop, w.node("fin")}));
  App app(ir.g);
  const NameId gen = ir.name("gen");
  app.fns[ir.node_id("init")] = [](const WorkItem&, const auto& in, auto& out, auto&) {
    out[0] = in[0][0];
    return true;
  };
  std::map<RequestId, std::uint32_t> stop_at;
  app.fns[ir.node_id("tok")] = [&](const WorkItem& it, const auto& in, auto& out, auto& stop) {
    out[0] = in[0][0] + 1;
    if (it.iteration == stop_at.at(it.request)) {
      stop.push_back(999);  // unknown loop names are ignored
      stop.push_back(gen);
    }
    return true;
  };
  const std::vector<std::uint32_t> stops = {0, 3, 9, 100};
  std::vector<RequestId> rs;
  for (std::uint32_t s : stops) {
    rs.push_back(app.submit(main, {{ir.name("x"), 0}}));
    stop_at[rs.back()] = s;
  }
  app.drain();
  for (std::size_t i = 0; i < rs.size(); ++i) {
    const long iters = std::min<long>(stops[i] + 1, 10);
    std::vector<long> hs;
    for (long k = 1; k <= iters; ++k) hs.push_back(k);
    EXPECT_EQ(app.emitted(rs[i], ir.name("h")), hs) << "request stopping at " << stops[i];
    EXPECT_EQ(app.emitted(rs[i], ir.name("out")), (std::vector<long>{iters + 3}));
    EXPECT_EQ(app.items_of(ir.node_id("tok"), rs[i]).size(), static_cast<std::size_t>(iters));
  }
  // The first iteration ran as one batch of four.
  const auto toks = app.items_of(ir.node_id("tok"));
  ASSERT_GE(toks.size(), 4u);
  for (int k = 0; k < 4; ++k) EXPECT_EQ(toks[k].iteration, 0u);
  EXPECT_EQ(app.c.timeline(rs[1])[1].batch_size, 4u);
  app.expect_all_released();
}

TEST(Conductor, NestedLoopsDropScopedNamesAfterTheirLoop) {
  IR ir;
  ir.node("init", "e0", {"x"}, {"h"});
  ir.node("a", "e0", {"h"}, {"h", "t"});
  ir.node("b", "e0", {"h"}, {"g"});
  ir.node("fin", "e0", {"h"}, {"out"});
  WalkB w(ir, "main");
  const std::uint32_t inner = w.loop(w.node("a"), 3, {"h"}, {}, {"t"});
  const std::uint32_t outer = w.loop(w.seq({inner, w.node("b")}), 2, {"h"}, {}, {"g", "t"});
  const WalkId main = w.emit("fin", "out").build(w.seq({w.node("init"), outer, w.node("fin")}));
  App app(ir.g);
  const RequestId r = app.submit(main, {{ir.name("x"), 0}});
  const NameId x = ir.name("x"), h = ir.name("h"), t = ir.name("t"), g = ir.name("g");
  auto names = [&] {
    std::set<NameId> s;
    for (const auto& [n, v] : app.values(r)) s.insert(n);
    return s;
  };
  ASSERT_EQ(app.step(0), 1u);  // init
  EXPECT_EQ(names(), (std::set<NameId>{x, h}));
  for (int outer_it = 0; outer_it < 2; ++outer_it) {
    ASSERT_EQ(app.step(0), 1u);  // a, inner iteration 0
    EXPECT_EQ(names(), (outer_it == 0 ? std::set<NameId>{x, h, t} : std::set<NameId>{x, h, t, g}));
    ASSERT_EQ(app.step(0), 1u);
    ASSERT_EQ(app.step(0), 1u);  // a, inner iteration 2: the inner loop ends, t is dropped
    EXPECT_EQ(names(), (outer_it == 0 ? std::set<NameId>{x, h} : std::set<NameId>{x, h, g}));
    ASSERT_EQ(app.step(0), 1u);  // b
    EXPECT_EQ(app.seen.back().node, ir.node_id("b"));
    if (outer_it == 0) {
      EXPECT_EQ(names(), (std::set<NameId>{x, h, g}));
    }
  }
  // The outer loop ended: g is dropped, h kept.
  EXPECT_EQ(names(), (std::set<NameId>{x, h}));
  ASSERT_EQ(app.step(0), 1u);  // fin
  std::vector<std::uint32_t> a_iters, b_iters;
  for (const auto& it : app.items_of(ir.node_id("a"))) a_iters.push_back(it.iteration);
  for (const auto& it : app.items_of(ir.node_id("b"))) b_iters.push_back(it.iteration);
  EXPECT_EQ(a_iters, (std::vector<std::uint32_t>{0, 1, 2, 0, 1, 2}));
  EXPECT_EQ(b_iters, (std::vector<std::uint32_t>{0, 1}));
  // h: +2 per a (node 1), six times
  EXPECT_EQ(app.emitted(r, ir.name("out")), (std::vector<long>{1 + 12 + 4}));
  app.expect_all_released();
}

TEST(Conductor, ReadingAScopedNameAfterItsLoopFailsTheRequest) {
  IR ir;
  ir.node("a", "e0", {"x"}, {"t"});
  ir.node("c", "e0", {"t"}, {"out"});
  WalkB w(ir, "main");
  const WalkId main = w.build(w.seq({w.loop(w.node("a"), 2, {}, {}, {"t"}), w.node("c")}));
  App app(ir.g);
  const RequestId r = app.submit(main, {{ir.name("x"), 1}});
  app.drain();
  ASSERT_TRUE(app.failed.count(r));
  EXPECT_NE(app.failed[r].find("'t'"), std::string::npos) << app.failed[r];
  EXPECT_NE(app.failed[r].find("'c'"), std::string::npos) << app.failed[r];
  EXPECT_TRUE(app.items_of(ir.node_id("c")).empty());
  app.expect_all_released();
}

TEST(Conductor, PersistedNamesSurviveIntoTheNextWalk) {
  IR ir;
  ir.node("prefill", "e0", {"x"}, {"kv", "tmp"});
  ir.node("decode", "e0", {"kv", "x"}, {"kv", "tok"});
  ir.node("final", "e0", {"kv"}, {"out"});
  WalkB w0(ir, "prefill");
  const WalkId prefill = w0.persist("kv").build(w0.node("prefill"));
  WalkB w1(ir, "decode");
  const WalkId decode = w1.persist("kv").emit("decode", "tok").build(w1.node("decode"));
  WalkB w2(ir, "final");
  const WalkId final_walk = w2.emit("final", "out").build(w2.node("final"));
  App app(ir.g);
  app.fns[ir.node_id("prefill")] = [](const WorkItem&, const auto& in, auto& out, auto&) {
    out[0] = in[0][0] * 100;
    out[1] = -1;
    return true;
  };
  app.fns[ir.node_id("decode")] = [](const WorkItem&, const auto& in, auto& out, auto&) {
    out[0] = in[0][0] + 1;
    out[1] = in[0][0] + 1 + in[1][0];
    return true;
  };
  std::map<RequestId, int> decodes;
  app.next_walk = [&](RequestId r, WalkId done) -> std::int64_t {
    if (done == prefill) return decode;
    if (done == decode) return ++decodes[r] < 2 ? decode : final_walk;
    return kFinish;
  };
  const RequestId r1 = app.submit(prefill, {{ir.name("x"), 1}});
  const RequestId r2 = app.submit(prefill, {{ir.name("x"), 2}});
  app.drain();
  const NameId x = ir.name("x"), kv = ir.name("kv");
  EXPECT_EQ(app.emitted(r1, ir.name("tok")), (std::vector<long>{102, 103}));
  EXPECT_EQ(app.emitted(r2, ir.name("tok")), (std::vector<long>{203, 204}));
  EXPECT_EQ(app.emitted(r1, ir.name("out")), (std::vector<long>{102 + 3}));
  const auto& ends = app.walk_ends[r1];
  ASSERT_EQ(ends.size(), 4u);
  EXPECT_EQ(ends[0], (std::make_pair(prefill, std::map<NameId, long>{{x, 1}, {kv, 100}})));
  EXPECT_EQ(ends[1], (std::make_pair(decode, std::map<NameId, long>{{x, 1}, {kv, 101}})));
  EXPECT_EQ(ends[2], (std::make_pair(decode, std::map<NameId, long>{{x, 1}, {kv, 102}})));
  // A name some walk persists stays visible between walks until the request ends, even after a
  // walk that does not persist it (a later walk may read it); tmp never outlives its walk.
  EXPECT_EQ(ends[3], (std::make_pair(final_walk, std::map<NameId, long>{{x, 1}, {kv, 102}})));
  EXPECT_TRUE(app.finished.count(r1) && app.finished.count(r2));
  app.expect_all_released();
}

TEST(Conductor, EmitsArriveInCompletionOrder) {
  IR ir;
  ir.node("A", "e0", {"x"}, {"a1", "a2"}, 4);
  ir.node("B", "e0", {"a1"}, {"b"}, 4);
  WalkB w(ir, "main");
  const WalkId main =
      w.emit("A", "a1").emit("A", "a2").emit("B", "b").build(w.seq({w.node("A"), w.node("B")}));
  App app(ir.g);
  std::vector<RequestId> rs;
  for (long x : {10, 20, 30}) rs.push_back(app.submit(main, {{ir.name("x"), x}}));
  const auto batch = app.c.next_batch(0, 8, 0ns);
  ASSERT_EQ(batch.size(), 3u);
  auto done = app.run(batch);
  std::reverse(done.begin(), done.end());  // report the last request first
  Outcome o;
  app.c.complete(done, &o);
  ASSERT_EQ(o.emits.size(), 6u);
  for (std::size_t k = 0; k < 3; ++k) {
    EXPECT_EQ(o.emits[2 * k].request, rs[2 - k]);
    EXPECT_EQ(o.emits[2 * k].name, ir.name("a1"));
    EXPECT_EQ(o.emits[2 * k + 1].request, rs[2 - k]);
    EXPECT_EQ(o.emits[2 * k + 1].name, ir.name("a2"));
    EXPECT_EQ(o.emits[2 * k].handle, done[k].outputs[0]);
    EXPECT_EQ(o.emits[2 * k + 1].handle, done[k].outputs[1]);
  }
  app.handle(o);
  // B ends the walk: its emitted value is released by the same call, after the emit.
  const auto batch2 = app.c.next_batch(0, 8, 0ns);
  ASSERT_EQ(batch2.size(), 3u);
  const auto done2 = app.run(batch2);
  Outcome o2;
  app.c.complete(done2, &o2);
  ASSERT_EQ(o2.emits.size(), 3u);
  for (std::size_t k = 0; k < 3; ++k) {
    EXPECT_EQ(o2.emits[k].request, rs[k]);
    EXPECT_NE(std::find(o2.released.begin(), o2.released.end(), o2.emits[k].handle), o2.released.end());
  }
  app.handle(o2);
  EXPECT_EQ(app.emitted(rs[0], ir.name("b")), (std::vector<long>{11 + 2}));
  EXPECT_EQ(app.finished.size(), 3u);
  app.expect_all_released();
}

TEST(Conductor, AccumulatesOnlyValuesAnIterationProduced) {
  IR ir;
  ir.node("step", "e0", {"h"}, {"h", "y"});
  ir.node("sum", "e0", {"y"}, {"z"});
  WalkB w(ir, "main");
  const WalkId main =
      w.emit("sum", "z").build(w.seq({w.loop(w.node("step"), 5, {"h"}, {"y"}), w.node("sum")}));
  App app(ir.g);
  app.fns[ir.node_id("step")] = [](const WorkItem& it, const auto& in, auto& out, auto&) {
    out[0] = in[0][0] + 1;
    if (it.iteration % 2 == 0) out[1] = 100 + it.iteration;  // odd iterations make no y
    return true;
  };
  app.fns[ir.node_id("sum")] = [](const WorkItem& it, const auto& in, auto& out, auto&) {
    EXPECT_EQ(it.list_input, (std::vector<std::uint8_t>{1}));
    long s = 0;
    for (long v : in[0]) s = s * 1000 + v;
    out[0] = s;
    return true;
  };
  const RequestId r = app.submit(main, {{ir.name("h"), 0}});
  app.drain();
  ASSERT_EQ(app.items_of(ir.node_id("sum")).size(), 1u);
  EXPECT_EQ(app.items_of(ir.node_id("sum"))[0].handles.size(), 3u);
  EXPECT_EQ(app.emitted(r, ir.name("z")), (std::vector<long>{100'102'104}));
  app.expect_all_released();
}

// ---- IR validation ------------------------------------------------------------------------------

TEST(Conductor, ValidIRConstructsAndRuns) {
  App app(valid_ir());
  const RequestId r = app.submit(0, {{0, 1}});
  app.drain();
  EXPECT_TRUE(app.finished.count(r));
  // 4 items, Fixed(2): [0,2) [2,4) and nothing more, whenever [2,4) was cut (C does not ask to
  // hear the end of its stream).
  const auto windows = app.items_of(2, r);
  ASSERT_EQ(windows.size(), 2u);
  EXPECT_EQ(windows[1].chunk.end, 4u);
  for (const auto& w : windows) EXPECT_TRUE(w.chunked && !w.stream_end);
  EXPECT_EQ(app.emitted(r, 3).size(), windows.size());
  app.expect_all_released();
}

TEST(Conductor, ConstructorRejectsBadIds) {
  std::vector<std::pair<std::string, std::function<void(GraphSpec&)>>> cases = {
      {"no engines", [](GraphSpec& g) { g.engines.clear(); }},
      {"unknown engine", [](GraphSpec& g) { g.nodes[1].engine = 2; }},
      {"max_batch 0", [](GraphSpec& g) { g.nodes[0].max_batch = 0; }},
      {"unknown input name", [](GraphSpec& g) { g.nodes[1].inputs.push_back(99); }},
      {"unknown output name", [](GraphSpec& g) { g.nodes[2].outputs[0] = 5; }},
      {"root out of range", [](GraphSpec& g) { g.walks[0].root = 99; }},
      {"unknown child section", [](GraphSpec& g) { g.walks[0].sections.back().children.push_back(99); }},
      {"unknown node in a section", [](GraphSpec& g) { g.walks[0].sections[0].node = 3; }},
      {"node twice in a walk",
       [](GraphSpec& g) {
         for (auto& s : g.walks[0].sections)
           if (s.kind == SectionKind::node && s.node == 0) s.node = 1;
       }},
      {"loop with two bodies",
       [](GraphSpec& g) {
         for (auto& s : g.walks[0].sections)
           if (s.kind == SectionKind::loop) s.children.push_back(0);
       }},
      {"loop without a body",
       [](GraphSpec& g) {
         for (auto& s : g.walks[0].sections)
           if (s.kind == SectionKind::loop) s.children.clear();
       }},
      {"loop with max_iters 0",
       [](GraphSpec& g) {
         for (auto& s : g.walks[0].sections)
           if (s.kind == SectionKind::loop) s.max_iters = 0;
       }},
      {"emit of an unknown node", [](GraphSpec& g) { g.walks[0].emits.push_back({7, 0}); }},
      {"emit of an unknown name", [](GraphSpec& g) { g.walks[0].emits.push_back({0, 70}); }},
      {"persist of an unknown name", [](GraphSpec& g) { g.walks[0].persist.push_back(70); }},
      {"stream producer unknown", [](GraphSpec& g) { g.walks[0].streams[0].producer = 9; }},
      {"stream consumer unknown", [](GraphSpec& g) { g.walks[0].streams[0].consumer = 9; }},
      {"stream name unknown", [](GraphSpec& g) { g.walks[0].streams[0].name = 90; }},
      {"stream scope unknown", [](GraphSpec& g) { g.walks[0].streams[0].producer_scope = 90; }},
      {"consumer of two streams", [](GraphSpec& g) { g.walks[0].streams.push_back(g.walks[0].streams[0]); }},
  };
  for (auto& [what, mutate] : cases) {
    GraphSpec g = valid_ir();
    mutate(g);
    EXPECT_THROW(Conductor{g}, std::invalid_argument) << what;
  }
  // Bad ids at run time.
  App app(valid_ir());
  Outcome o;
  EXPECT_THROW(app.c.submit(5, {}, {}, &o), std::invalid_argument);
  EXPECT_THROW(app.c.complete({Completion{424242, {}, {}}}, &o), std::invalid_argument);
  EXPECT_FALSE(app.c.start_walk(77, 0, &o));  // unknown request: nothing to start
  app.next_walk = [](RequestId, WalkId) { return kLeave; };
  const RequestId r = app.submit(0, {{0, 1}});
  app.drain();
  EXPECT_THROW(app.c.start_walk(r, 9, &o), std::invalid_argument);
  EXPECT_TRUE(o.released.empty());
  EXPECT_TRUE(app.cancel(r));
  app.expect_all_released();
}

// Was a bug: validate_and_index checks node, section, engine and stream ids but not the name ids inside
// loop sections (loop_name, outputs, accumulated, scoped), nor that sections form a tree, nor that
// a stream's producer and consumer run in the walk. A bad loop_name is written out of bounds at
// the loop's start (r.stop[s.loop_name] = 0 in Impl::start); bad accumulated/scoped ids index
// r.env out of bounds (Impl::done, Impl::end_loop); a section that is its own child recurses
// forever in Impl::start; a consumer whose producer is not in the walk never finishes.
TEST(Conductor, ConstructorRejectsBadIdsInsideLoopsAndMalformedTrees) {
  auto loop_of = [](GraphSpec& g) -> SectionSpec& {
    for (auto& s : g.walks[0].sections)
      if (s.kind == SectionKind::loop) return s;
    throw std::logic_error("no loop");
  };
  std::vector<std::pair<std::string, std::function<void(GraphSpec&)>>> cases = {
      {"dynamic loop name unknown", [&](GraphSpec& g) { loop_of(g).loop_name = 500; }},
      {"loop output unknown", [&](GraphSpec& g) { loop_of(g).outputs.push_back(500); }},
      {"accumulated output unknown", [&](GraphSpec& g) { loop_of(g).accumulated.push_back(500); }},
      {"scoped name unknown", [&](GraphSpec& g) { loop_of(g).scoped.push_back(500); }},
      {"section is its own child",
       [](GraphSpec& g) {
         auto& root = g.walks[0].sections[g.walks[0].root];
         root.children.push_back(g.walks[0].root);
       }},
      {"stream producer not in the walk",
       [](GraphSpec& g) {
         g.nodes.push_back(g.nodes[1]);
         g.nodes.back().name = "P2";
         g.walks[0].streams[0].producer = static_cast<NodeId>(g.nodes.size() - 1);
       }},
  };
  for (auto& [what, mutate] : cases) {
    GraphSpec g = valid_ir();
    mutate(g);
    EXPECT_THROW(Conductor{g}, std::invalid_argument) << what;
  }
}

// Was a bug: Conductor::submit retains each input (set_single) before checking the next input's name
// id; an unknown id then throws with the earlier inputs' references still counted, so they are
// never released (live_handles() stays > 0). Fix: check every input name before the first retain.
TEST(Conductor, SubmitWithAnUnknownInputNameKeepsNoReference) {
  App app(valid_ir());
  Outcome o;
  EXPECT_THROW(app.c.submit(0, {{0, 11}, {999, 12}}, {}, &o), std::invalid_argument);
  EXPECT_EQ(app.c.live_handles(), 0u);
  EXPECT_EQ(app.c.live_requests(), 0u);
}

}  // namespace

namespace {

// A request that runs for hours (a voice session's listening loop) keeps a bounded timeline:
// its first 65536 node executions.
TEST(Conductor, ALongRunningRequestKeepsABoundedTimeline) {
  IR ir;
  ir.node("tick", "e0", {"h"}, {"h"});
  WalkB w(ir, "main");
  const WalkId main = w.build(w.loop(w.node("tick"), 70000, {"h"}));
  App app(ir.g);
  app.record = false;
  const RequestId r = app.submit(main, {{ir.name("h"), 0}});
  std::size_t runs = 0;
  for (std::size_t n; (n = app.step(0)) != 0;) runs += n;
  EXPECT_EQ(runs, 70000u);
  EXPECT_EQ(app.c.timeline(r).size(), 65536u);
  app.expect_all_released();
}

}  // namespace

// Conductor tests: streaming edges (chunk policies, the flushed tail, dynamic loops that stop
// early, windows on a chunk boundary, a producer loop inside an outer loop). The shared IR builders
// and the fake application are in conductor_test_app.hpp.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "conductor_test_app.hpp"

namespace {

using namespace conductor_test;

// ---- streaming edges ----------------------------------------------------------------------------

std::vector<long> window_values(long first, const Chunk& ch) {
  std::vector<long> v;
  for (std::uint64_t p = ch.begin; p < ch.end; ++p) v.push_back(first + static_cast<long>(p));
  return v;
}

struct StreamCase {
  ChunkPolicy policy;
  bool consumer_in_parallel;  // Parallel(Loop(P), C) or Sequential(Loop(P), C)
  std::uint32_t items;        // iterations the producer runs
  bool dynamic;               // a DynamicLoop stopped after `items` iterations (max 20)
  std::vector<Chunk> expected;
};

Chunk chunk(std::uint64_t b, std::uint64_t nb, std::uint64_t e, std::uint64_t i, bool last) {
  Chunk c;
  c.begin = b;
  c.new_begin = nb;
  c.end = e;
  c.index = i;
  c.last = last;
  return c;
}

void run_stream_case(const StreamCase& sc) {
  IR ir;
  ir.node("init", "e0", {"x"}, {"h"}, 4);
  ir.node("P", "e0", {"h"}, {"h", "s"}, 4);
  ir.node("C", "e1", {"x", "s"}, {"o"}, 4);
  WalkB w(ir, "main");
  const std::uint32_t loop = sc.dynamic ? w.dynamic_loop("gen", w.node("P"), 20, {"h"}, {}, {"s"})
                                        : w.loop(w.node("P"), sc.items, {"h"}, {}, {"s"});
  const std::uint32_t c = w.node("C");
  const std::uint32_t body = sc.consumer_in_parallel ? w.par({loop, c}) : w.seq({loop, c});
  w.stream("P", "s", "C", sc.policy, loop).emit("C", "o");
  const WalkId main = w.build(w.seq({w.node("init"), body}));
  App app(ir.g);
  const NameId gen = ir.name("gen");
  app.fns[ir.node_id("init")] = [](const WorkItem&, const auto& in, auto& out, auto&) {
    out[0] = in[0][0];
    return true;
  };
  app.fns[ir.node_id("P")] = [&](const WorkItem& it, const auto& in, auto& out, auto& stop) {
    out[0] = in[0][0] + 1;
    out[1] = in[0][0] + 1;  // stream position p carries x + 1 + p
    if (sc.dynamic && it.iteration + 1 == sc.items) stop.push_back(gen);
    return true;
  };
  app.fns[ir.node_id("C")] = sum_input(1);
  // Two requests with different inputs, interleaved by the engines.
  const long xs[2] = {1000, 5000};
  RequestId rs[2];
  for (int k = 0; k < 2; ++k) rs[k] = app.submit(main, {{ir.name("x"), xs[k]}});
  app.drain();
  for (int k = 0; k < 2; ++k) {
    SCOPED_TRACE("request " + std::to_string(k));
    const auto windows = app.items_of(ir.node_id("C"), rs[k]);
    ASSERT_EQ(windows.size(), sc.expected.size());
    std::vector<long> sums;
    for (std::size_t i = 0; i < windows.size(); ++i) {
      const WorkItem& it = windows[i];
      const Chunk& want = sc.expected[i];
      SCOPED_TRACE("window " + std::to_string(i));
      EXPECT_TRUE(it.chunked);
      EXPECT_EQ(it.chunk.begin, want.begin);
      EXPECT_EQ(it.chunk.new_begin, want.new_begin);
      EXPECT_EQ(it.chunk.end, want.end);
      EXPECT_EQ(it.chunk.index, want.index);
      EXPECT_EQ(it.chunk.last, want.last);
      EXPECT_EQ(it.list_input, (std::vector<std::uint8_t>{0, 1}));
      EXPECT_EQ(it.offsets, (std::vector<std::uint32_t>{0, 1, static_cast<std::uint32_t>(1 + want.size())}));
      const auto want_vals = window_values(xs[k] + 1, want);
      long sum = 0;
      for (long v : want_vals) sum += v;
      sums.push_back(sum);
    }
    EXPECT_EQ(app.emitted(rs[k], ir.name("o")), sums);
    EXPECT_EQ(app.items_of(ir.node_id("P"), rs[k]).size(), sc.items);
    EXPECT_TRUE(app.finished.count(rs[k]));
  }
  for (const WorkItem& it : app.items_of(ir.node_id("C")))
    EXPECT_EQ(it.handles.size(), 1 + it.chunk.size());
  // Windows go out only once the walk reaches the consumer: after the loop, when it follows it.
  if (!sc.consumer_in_parallel) {
    for (int k = 0; k < 2; ++k) {
      std::size_t last_p = 0, first_c = SIZE_MAX;
      for (std::size_t i = 0; i < app.seen.size(); ++i) {
        if (app.seen[i].request != rs[k]) continue;
        if (app.seen[i].node == ir.node_id("P")) last_p = i;
        if (app.seen[i].node == ir.node_id("C")) first_c = std::min(first_c, i);
      }
      EXPECT_LT(last_p, first_c);
    }
  }
  app.expect_all_released();
}

TEST(Conductor, StreamSlidingWindowChunksIncludingTheFlushedTail) {
  // SlidingWindow(4, 2) over 9 items: the worked table in chunk_policy.hpp.
  const std::vector<Chunk> want = {chunk(0, 0, 4, 0, false), chunk(2, 4, 6, 1, false),
                                   chunk(4, 6, 8, 2, false), chunk(6, 8, 9, 3, true)};
  for (bool parallel : {true, false}) {
    SCOPED_TRACE(parallel ? "consumer in parallel" : "consumer after the loop");
    run_stream_case({ChunkPolicy::sliding_window(4, 2), parallel, 9, false, want});
  }
}

TEST(Conductor, StreamFixedChunksIncludingTheFlushedTail) {
  const std::vector<Chunk> want = {chunk(0, 0, 3, 0, false), chunk(3, 3, 6, 1, false),
                                   chunk(6, 6, 7, 2, true)};
  for (bool parallel : {true, false}) {
    SCOPED_TRACE(parallel ? "consumer in parallel" : "consumer after the loop");
    run_stream_case({ChunkPolicy::fixed(3), parallel, 7, false, want});
  }
}

TEST(Conductor, StreamEndsWhenADynamicLoopStopsEarly) {
  // Stopped after 5 of 20 iterations: SlidingWindow(4, 2) flushes [2, 5) as the last window.
  const std::vector<Chunk> want = {chunk(0, 0, 4, 0, false), chunk(2, 4, 5, 1, true)};
  for (bool parallel : {true, false}) {
    SCOPED_TRACE(parallel ? "consumer in parallel" : "consumer after the loop");
    run_stream_case({ChunkPolicy::sliding_window(4, 2), parallel, 5, true, want});
  }
  // Stopped after 1 item: one short window.
  run_stream_case({ChunkPolicy::sliding_window(4, 2), true, 1, true, {chunk(0, 0, 1, 0, true)}});
}

TEST(Conductor, StreamEndingOnAChunkBoundaryMakesNoEmptyWindow) {
  // Fixed(3) over 6 items. With the consumer in a Parallel and run eagerly, [3,6) is cut before
  // the loop ends (not last); with the consumer after the loop it is cut after the end and is
  // itself last. Either way the windows are the policy's two, never an empty third. A consumer
  // with on_stream_end hears the end once: from the last window, or else from one stream-end
  // item (no window, no items) after it.
  for (bool on_end : {false, true}) {
    for (bool parallel : {true, false}) {
      SCOPED_TRACE(std::string(parallel ? "consumer in parallel" : "consumer after the loop") +
                   (on_end ? ", on_stream_end" : ""));
      IR ir;
      ir.node("P", "e0", {"h"}, {"h", "s"});
      ir.node("C", "e1", {"s"}, {"o"});
      ir.g.nodes[ir.node_id("C")].on_stream_end = on_end;
      WalkB w(ir, "main");
      const std::uint32_t loop = w.loop(w.node("P"), 6, {"h"}, {}, {"s"});
      w.stream("P", "s", "C", ChunkPolicy::fixed(3), loop).emit("C", "o");
      const WalkId main = w.build(parallel ? w.par({loop, w.node("C")}) : w.seq({loop, w.node("C")}));
      App app(ir.g);
      app.fns[ir.node_id("C")] = [](const WorkItem& it, const auto& in, auto& out, auto&) {
        out[0] = it.stream_end ? -1 : static_cast<long>(in[0].size());
        return true;
      };
      const RequestId r = app.submit(main, {{ir.name("h"), 0}});
      while (app.step(1) + app.step(0) > 0) {
      }
      auto calls = app.items_of(ir.node_id("C"), r);
      const bool told_by_item = on_end && parallel;
      ASSERT_EQ(calls.size(), told_by_item ? 3u : 2u);
      if (told_by_item) {
        EXPECT_TRUE(calls.back().stream_end);
        EXPECT_FALSE(calls.back().chunked);
        EXPECT_EQ(calls.back().handles.size(), 0u);
        calls.pop_back();
      }
      const std::vector<Chunk> want = {chunk(0, 0, 3, 0, false), chunk(3, 3, 6, 1, !parallel)};
      for (std::size_t i = 0; i < want.size(); ++i) {
        EXPECT_TRUE(calls[i].chunked);
        EXPECT_FALSE(calls[i].stream_end);
        EXPECT_EQ(calls[i].chunk.begin, want[i].begin) << i;
        EXPECT_EQ(calls[i].chunk.new_begin, want[i].new_begin) << i;
        EXPECT_EQ(calls[i].chunk.end, want[i].end) << i;
        EXPECT_EQ(calls[i].chunk.index, want[i].index) << i;
        EXPECT_EQ(calls[i].chunk.last, want[i].last) << i;
        EXPECT_EQ(calls[i].offsets,
                  (std::vector<std::uint32_t>{0, static_cast<std::uint32_t>(want[i].size())}));
      }
      const std::vector<long> want_out =
          told_by_item ? std::vector<long>{3, 3, -1} : std::vector<long>{3, 3};
      EXPECT_EQ(app.emitted(r, ir.name("o")), want_out);
      EXPECT_TRUE(app.finished.count(r));
      app.expect_all_released();
    }
  }
}

TEST(Conductor, AnEmptyStreamTellsOnlyAConsumerThatAsked) {
  // A producer that never produces its streamed output: no window at all; on_stream_end gets
  // one stream-end item, else the consumer is never called.
  for (bool on_end : {false, true}) {
    IR ir;
    ir.node("P", "e0", {"h"}, {"h", "s"});
    ir.node("C", "e1", {"s"}, {"o"});
    ir.g.nodes[ir.node_id("C")].on_stream_end = on_end;
    WalkB w(ir, "main");
    const std::uint32_t loop = w.loop(w.node("P"), 3, {"h"}, {}, {"s"});
    w.stream("P", "s", "C", ChunkPolicy::fixed(2), loop).emit("C", "o");
    const WalkId main = w.build(w.par({loop, w.node("C")}));
    App app(ir.g);
    app.fns[ir.node_id("P")] = [](const WorkItem&, const auto& in, auto& out, auto&) {
      out[0] = in[0][0];
      out[1] = kAbsent;
      return true;
    };
    app.fns[ir.node_id("C")] = [](const WorkItem& it, const auto&, auto& out, auto&) {
      out[0] = it.stream_end ? -1 : 1;
      return true;
    };
    const RequestId r = app.submit(main, {{ir.name("h"), 0}});
    while (app.step(1) + app.step(0) > 0) {
    }
    const auto calls = app.items_of(ir.node_id("C"), r);
    ASSERT_EQ(calls.size(), on_end ? 1u : 0u);
    if (on_end) {
      EXPECT_TRUE(calls[0].stream_end && calls[0].chunk.last);
    }
    EXPECT_TRUE(app.finished.count(r));
    app.expect_all_released();
  }
}

// Was a bug: a streaming edge whose producer loop sits inside an outer loop, the consumer in a Parallel
// with that inner loop (the Python compiler accepts this placement). producer_scope is the inner
// loop, so the stream ends when the inner loop ends -- but StreamState (items, base, written,
// ended, cursor, any_sent/last_sent, consumer) lives per walk and is never reset when the inner
// loop starts again. In the outer loop's second iteration the consumer starts against the already
// finished stream and ends at once: the new items are never delivered (they sit in the stream
// until the walk ends), and the windows it does get report iteration 0. Fix: reset the streams
// whose producer_scope is a loop when that loop starts (Impl::start, SectionKind::loop; the ring's
// leftover items released, cursor.reset(), ended/any_sent/last_sent/inflight cleared), and give
// window items the consumer activation's iteration (innermost_iteration(r, s.consumer)).
TEST(Conductor, StreamInsideAnOuterLoopRestartsEachIteration) {
  IR ir;
  ir.node("init", "e0", {"x"}, {"h"});
  ir.node("P", "e0", {"h"}, {"h", "s"});
  ir.node("C", "e1", {"s"}, {"o"});
  WalkB w(ir, "main");
  const std::uint32_t inner = w.loop(w.node("P"), 3, {"h"}, {}, {"s"});
  const std::uint32_t outer = w.loop(w.par({inner, w.node("C")}), 2, {"h"}, {}, {"o", "s"});
  w.stream("P", "s", "C", ChunkPolicy::fixed(2), inner).emit("C", "o");
  const WalkId main = w.build(w.seq({w.node("init"), outer}));
  App app(ir.g);
  app.fns[ir.node_id("init")] = [](const WorkItem&, const auto& in, auto& out, auto&) {
    out[0] = in[0][0];
    return true;
  };
  app.fns[ir.node_id("P")] = [](const WorkItem&, const auto& in, auto& out, auto&) {
    out[0] = in[0][0] + 1;
    out[1] = in[0][0] + 1;
    return true;
  };
  app.fns[ir.node_id("C")] = sum_input(0);
  const RequestId r = app.submit(main, {{ir.name("x"), 0}});
  app.drain();
  // Each outer iteration streams 3 items (values 1,2,3 then 4,5,6) as Fixed(2): [0,2) [2,3).
  const auto windows = app.items_of(ir.node_id("C"), r);
  ASSERT_EQ(windows.size(), 4u);
  const std::uint64_t begins[] = {0, 2, 0, 2}, ends[] = {2, 3, 2, 3};
  for (std::size_t i = 0; i < 4; ++i) {
    EXPECT_EQ(windows[i].chunk.begin, begins[i]) << i;
    EXPECT_EQ(windows[i].chunk.end, ends[i]) << i;
    EXPECT_EQ(windows[i].chunk.last, i % 2 == 1) << i;
    EXPECT_EQ(windows[i].iteration, i / 2) << "the consumer runs in outer iteration " << i / 2;
  }
  EXPECT_EQ(app.emitted(r, ir.name("o")), (std::vector<long>{1 + 2, 3, 4 + 5, 6}));
  EXPECT_TRUE(app.finished.count(r));
  app.expect_all_released();
}

// push_stream: a node standing for a section another process runs (placement's segment
// stand-in) appends its stream's items while in flight; the consumer gets them in windows as
// it would a producer's; the stand-in's end ends the stream. A push for a request no longer
// running is released and answered false; an unknown node is refused.
TEST(Conductor, PushStreamFeedsTheConsumerWhileTheProducerIsInFlight) {
  IR ir;
  ir.node("S", "e0", {"x"}, {"s", "y"});
  ir.node("C", "e1", {"s"}, {"o"});
  WalkB w(ir, "main");
  const std::uint32_t stand_in = w.node("S");
  w.stream("S", "s", "C", ChunkPolicy::fixed(2), stand_in).emit("C", "o");
  const WalkId main = w.build(w.par({stand_in, w.node("C")}));
  App app(ir.g);
  app.fns[ir.node_id("C")] = sum_input(0);
  const RequestId r = app.submit(main, {{ir.name("x"), 0}});
  const auto batch = app.c.next_batch(0, 8, 0ns);  // S, in flight while the items arrive
  ASSERT_EQ(batch.size(), 1u);
  const std::uint64_t s_item = batch.front()->id;
  for (long v : {10, 20, 30}) {
    Outcome o;
    Handle h;
    {
      std::lock_guard<std::mutex> lock(app.mu);
      h = app.put_locked(v);
    }
    EXPECT_TRUE(app.c.push_stream(r, ir.node_id("S"), ir.name("s"), h, &o));
    app.handle(o);
    app.step(1);  // the consumer runs each window as it fills
  }
  EXPECT_EQ(app.emitted(r, ir.name("o")), (std::vector<long>{10 + 20}));
  Completion done;  // the stand-in's end: its stream output absent, the stream ends
  done.item = s_item;
  {
    std::lock_guard<std::mutex> lock(app.mu);
    done.outputs = {0, app.put_locked(7)};
  }
  Outcome o;
  app.c.complete({done}, &o);
  app.handle(o);
  {
    Outcome after_end;  // the stream has ended: not taken, said so, not read
    Handle h;
    {
      std::lock_guard<std::mutex> lock(app.mu);
      h = app.put_locked(99);
    }
    EXPECT_FALSE(app.c.push_stream(r, ir.node_id("S"), ir.name("s"), h, &after_end));
    app.handle(after_end);
  }
  app.drain();
  EXPECT_EQ(app.emitted(r, ir.name("o")), (std::vector<long>{10 + 20, 30}));
  const auto windows = app.items_of(ir.node_id("C"), r);
  ASSERT_EQ(windows.size(), 2u);
  EXPECT_TRUE(windows[1].chunk.last);
  EXPECT_TRUE(app.finished.count(r));
  Outcome late;  // the request is over: the value is only released
  Handle h;
  {
    std::lock_guard<std::mutex> lock(app.mu);
    h = app.put_locked(40);
  }
  EXPECT_FALSE(app.c.push_stream(r, ir.node_id("S"), ir.name("s"), h, &late));  // said so
  app.handle(late);
  EXPECT_THROW(app.c.push_stream(r, 99, ir.name("s"), h, &late), std::invalid_argument);
  app.expect_all_released();
}

}  // namespace

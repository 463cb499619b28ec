// Conductor tests: a node reading several streams (one window per stream, each under its own
// policy), a consumer in a loop its producer is not in (one window per execution), and
// continue_after_done -- graphs built with mstar::GraphBuilder, run by the fake engines of
// conductor_test_app.hpp (tests/python/test_multi_stream.py checks the same through Python).
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <random>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "alloc_counter.hpp"
#include "conductor_test_app.hpp"
#include "mstar/graph_builder.hpp"

namespace {

using namespace conductor_test;
using mstar::Edge;
using mstar::GraphBuilder;
using mstar::GraphError;
using mstar::Section;

const std::string& label(const std::string& s) { return s; }
const std::string& label(const NodeSpec& n) { return n.name; }
template <class T>
std::uint32_t id_in(const std::vector<T>& v, const std::string& n) {
  for (std::size_t i = 0; i < v.size(); ++i)
    if (label(v[i]) == n) return static_cast<std::uint32_t>(i);
  throw std::logic_error("no " + n);
}
NameId name_of(const GraphSpec& g, const std::string& n) { return id_in(g.names, n); }
NodeId node_of(const GraphSpec& g, const std::string& n) { return id_in(g.nodes, n); }
EngineId engine_of(const GraphSpec& g, const std::string& e) { return id_in(g.engines, e); }

/// What f throws (an E), or "no error".
template <class E, class F>
std::string error_of(F f) {
  try {
    f();
  } catch (const E& e) {
    return e.what();
  }
  return "no error";
}

/// A window as a consumer sees it: positions, and the values less the producer's base.
using Win = std::tuple<std::uint64_t, std::uint64_t, std::uint64_t, std::vector<long>>;
/// Stream k of a run (the node's k-th input, here always a stream) as a Win.
Win win(const App& app, const WorkItem& it, std::size_t k, long base) {
  std::vector<long> v;
  for (std::uint32_t j = it.offsets[k]; j < it.offsets[k + 1]; ++j)
    v.push_back(app.created.at(it.handles[j]) - base);
  const Chunk& c = it.chunks.at(k);
  return {c.begin, c.new_begin, c.end, v};
}

/// Iteration i of a producer loop makes `base + per_n * n + i` on each output (output j adds
/// 1000 * j) while i < n = in[0]; it stops `loop` after max(n, 1) iterations.
App::NodeFn counter(long base, NameId loop, long per_n = 0) {
  return [=](const WorkItem& it, const auto& in, auto& out, auto& stop) {
    const long n = in[0][0], i = static_cast<long>(it.iteration), first = base + per_n * n;
    for (std::size_t j = 0; j < out.size(); ++j)
      out[j] = i < n ? first + i + 1000 * static_cast<long>(j) : kAbsent;
    if (i + 1 >= std::max(n, 1L)) stop.push_back(loop);
    return true;
  };
}

/// Steps the engines in `pattern` (one item at a time) until none has work.
void run_pattern(App& app, const std::vector<EngineId>& pattern) {
  for (std::size_t n = 1; n > 0;) {
    n = 0;
    for (EngineId e : pattern) n += app.step(e, 1);
  }
}

// ---- (1) a node reading two streams -------------------------------------------------------------

// pa --ta (policy a)--> c <--tb (policy b)-- pb, both producers in DynamicLoops beside c.
GraphSpec two_streams(const ChunkPolicy& a, const ChunkPolicy& b) {
  GraphBuilder g;
  g.input("na").input("nb");
  g.node("pa", {"na"}, {Edge::stream("c", "ta", a)}, "a", 4);
  g.node("pb", {"nb"}, {Edge::stream("c", "tb", b)}, "b", 4);
  g.node("c", {"ta", "tb"}, {Edge::emit("win")}, "c", 2);
  g.walk("w", Section::par({Section::dynamic_loop("loop_a", "pa", 64),
                            Section::dynamic_loop("loop_b", "pb", 64), "c"}));
  return g.compile();
}

/// The windows one consumer of one stream gets under `p` over n items (the single-stream path).
std::vector<Win> single_windows(const ChunkPolicy& p, long n) {
  GraphBuilder g;
  g.input("n").node("p", {"n"}, {Edge::stream("c", "t", p)}, "a", 4);
  g.node("c", {"t"}, {Edge::emit("o")}, "c");
  g.walk("w", Section::par({Section::dynamic_loop("loop", "p", 64), "c"}));
  App app(g.compile());
  app.fns[0] = counter(0, name_of(app.c.graph(), "loop"));
  const RequestId r = app.submit(0, {{name_of(app.c.graph(), "n"), n}});
  app.drain();
  std::vector<Win> v;
  for (const WorkItem& it : app.items_of(1, r)) v.push_back(win(app, it, 0, 0));
  return v;
}

TEST(ConductorMultiStream, ANodeReadsTwoStreamsEachUnderItsPolicy) {
  const std::vector<ChunkPolicy> policies = {
      ChunkPolicy::fixed(1), ChunkPolicy::fixed(3), ChunkPolicy::sliding_window(4, 2),
      ChunkPolicy::left_context(2, 3), ChunkPolicy::ramp({1, 2}, 4, 1)};
  const std::vector<std::pair<long, long>> lengths = {{7, 3}, {2, 9}, {0, 5}, {4, 0}, {6, 6}};
  for (const ChunkPolicy& pa : policies) {
    for (const ChunkPolicy& pb : {policies[0], policies[1], policies[2]}) {
      const GraphSpec ir = two_streams(pa, pb);
      const EngineId a = engine_of(ir, "a"), b = engine_of(ir, "b"), c = engine_of(ir, "c");
      // Engine orders: one stream ends while the other still flows; the consumer eager or late.
      const std::vector<std::vector<EngineId>> patterns = {
          {a, b, c}, {c, a, a, a, b}, {b, b, b, c, a}, {a, a, a, a, a, a, a, a, a, a, b, c}};
      for (std::size_t ip = 0; ip < patterns.size(); ++ip) {
        SCOPED_TRACE(pa.describe() + " + " + pb.describe() + ", pattern " + std::to_string(ip));
        App app(ir);
        app.fns[node_of(ir, "pa")] = counter(100000, name_of(ir, "loop_a"));
        app.fns[node_of(ir, "pb")] = counter(200000, name_of(ir, "loop_b"));
        std::vector<RequestId> rs;
        for (auto [na, nb] : lengths)
          rs.push_back(app.submit(0, {{name_of(ir, "na"), na}, {name_of(ir, "nb"), nb}}));
        run_pattern(app, patterns[ip]);
        for (std::size_t k = 0; k < rs.size(); ++k) {
          SCOPED_TRACE("lengths " + std::to_string(k));
          const std::vector<Win> want[2] = {single_windows(pa, lengths[k].first),
                                            single_windows(pb, lengths[k].second)};
          std::vector<Win> got[2];
          bool over[2] = {false, false};
          const auto items = app.items_of(node_of(ir, "c"), rs[k]);
          // Each run takes the next window of every stream not yet over.
          EXPECT_EQ(items.size(), std::max(want[0].size(), want[1].size()));
          for (const WorkItem& it : items) {
            ASSERT_EQ(it.chunks.size(), 2u);
            EXPECT_TRUE(it.chunked && !it.stream_end);
            EXPECT_TRUE(it.chunk.begin == it.chunks[0].begin && it.chunk.end == it.chunks[0].end);
            EXPECT_EQ(it.list_input, (std::vector<std::uint8_t>{1, 1}));
            const auto sa = static_cast<std::uint32_t>(it.chunks[0].size());
            const auto sb = static_cast<std::uint32_t>(it.chunks[1].size());
            ASSERT_EQ(it.offsets, (std::vector<std::uint32_t>{0, sa, sa + sb}));
            EXPECT_GT(sa + sb, 0u) << "a run with no window";
            for (std::size_t s = 0; s < 2; ++s) {
              const Chunk& ch = it.chunks[s];
              if (ch.begin == ch.end) {  // this stream is over: an empty window marked last
                EXPECT_TRUE(ch.last);
                over[s] = true;
                continue;
              }
              EXPECT_FALSE(over[s]) << "a window after the stream was over";
              EXPECT_EQ(ch.index, got[s].size());
              got[s].push_back(win(app, it, s, s == 0 ? 100000 : 200000));
              over[s] = over[s] || ch.last;
            }
          }
          EXPECT_EQ(got[0], want[0]);
          EXPECT_EQ(got[1], want[1]);
          EXPECT_TRUE(app.finished.count(rs[k]));
        }
        app.expect_all_released();
      }
    }
  }
}

// ---- (2), (3) a consumer reading one window per iteration ---------------------------------------

// Qwen3-Omni's shape in miniature: a "think" loop streams tok and emb into a "talk" loop beside
// it, whose every iteration reads the next window of each.
GraphSpec talker_shape(bool cad_tok, bool cad_emb, ChunkPolicy tok = ChunkPolicy::fixed(1),
                       ChunkPolicy emb = ChunkPolicy::fixed(1), std::int64_t max_iters = 64) {
  GraphBuilder g;
  g.input("n").input("steps");
  g.node("think", {"n"},
         {Edge::stream("talk", "tok", tok, cad_tok), Edge::stream("talk", "emb", emb, cad_emb)},
         "thinker", 4);
  g.node("talk", {"tok", "emb", "steps"}, {Edge::emit("step")}, "talker", 4);
  g.walk("speak", Section::par({Section::dynamic_loop("think", "think", max_iters),
                                Section::dynamic_loop("talk", "talk", max_iters)}));
  return g.compile();
}

/// talker_shape run by App: think makes 100 n + i (tok) and 100 n + 1000 + i (emb) for i < n;
/// talk emits its iteration and stops after `steps`.
struct Talker {
  GraphSpec ir;
  App app;
  EngineId thinker, talker;
  NameId step_name;
  explicit Talker(GraphSpec g)
      : ir(g), app(std::move(g)), thinker(engine_of(ir, "thinker")),
        talker(engine_of(ir, "talker")), step_name(name_of(ir, "step")) {
    const NameId talk = name_of(ir, "talk");
    app.fns[node_of(ir, "think")] = counter(0, name_of(ir, "think"), 100);
    app.fns[node_of(ir, "talk")] = [talk](const WorkItem& it, const auto& in, auto& out,
                                          auto& stop) {
      out[0] = static_cast<long>(it.iteration);
      if (out[0] + 1 >= in[2][0]) stop.push_back(talk);
      return true;
    };
  }
  RequestId submit(long n, long steps) {
    return app.submit(0, {{name_of(ir, "n"), n}, {name_of(ir, "steps"), steps}});
  }
  /// talk's windows for request r, iteration by iteration: {tok, emb} each.
  std::vector<std::array<Win, 2>> windows(RequestId r, long n, bool check_last = true) {
    std::vector<std::array<Win, 2>> v;
    for (const WorkItem& it : app.items_of(node_of(ir, "talk"), r)) {
      EXPECT_EQ(it.iteration, v.size());
      EXPECT_TRUE(it.chunked && !it.stream_end);
      for (const Chunk& ch : it.chunks) {
        EXPECT_TRUE(ch.last || ch.begin < ch.end) << "an empty window is marked last";
        EXPECT_TRUE(!check_last || !ch.last || ch.end >= std::uint64_t(n)) << "last too early";
      }
      v.push_back({win(app, it, 0, 100 * n), win(app, it, 1, 100 * n + 1000)});
    }
    return v;
  }
};

/// Fixed(1)'s window for iteration k over n items: item k, or empty at n once they are all read.
Win fixed1(long k, long n) {
  const auto p = static_cast<std::uint64_t>(std::min(k, n));
  return k < n ? Win{p, p, p + 1, {k}} : Win{p, p, p, {}};
}

TEST(ConductorMultiStream, ALoopReadsOneWindowPerIterationAndGoesOnAfterTheProducer) {
  // The thinker first (all its items there), or slower than the talker (each window waited for).
  for (bool thinker_first : {true, false}) {
    SCOPED_TRACE(thinker_first ? "thinker first" : "thinker slower");
    Talker t(talker_shape(true, true));
    const RequestId r = t.submit(5, 9);
    if (thinker_first) run_pattern(t.app, {t.thinker});
    for (int k = 0; k < 5 && !thinker_first; ++k) {
      EXPECT_EQ(t.app.step(t.talker), 0u) << "iteration " << k << " waits for its window";
      EXPECT_EQ(t.app.step(t.thinker, 1), 1u);
      EXPECT_EQ(t.app.step(t.talker), 1u) << "window " << k << " is there";
    }
    run_pattern(t.app, {t.talker});
    const auto w = t.windows(r, 5);
    ASSERT_EQ(w.size(), 9u);
    for (long k = 0; k < 9; ++k)
      EXPECT_EQ(w[k], (std::array<Win, 2>{fixed1(k, 5), fixed1(k, 5)})) << k;
    // Window 4 is marked last only if the end was known when it was cut.
    EXPECT_EQ(t.app.items_of(node_of(t.ir, "talk"), r)[4].chunks[0].last, thinker_first);
    EXPECT_EQ(t.app.emitted(r, t.step_name), (std::vector<long>{0, 1, 2, 3, 4, 5, 6, 7, 8}));
    EXPECT_TRUE(t.app.finished.count(r));
    t.app.expect_all_released();
  }
}

TEST(ConductorMultiStream, PerIterationWindowsFollowEachPolicy) {
  // tok Fixed(2), emb LeftContext(1, 2) over 5 items, 4 iterations; the thinker one item at a
  // time: iteration 0 waits for two items.
  Talker t(talker_shape(true, true, ChunkPolicy::fixed(2), ChunkPolicy::left_context(1, 2)));
  const RequestId r = t.submit(5, 4);
  EXPECT_EQ(t.app.step(t.thinker, 1), 1u);
  EXPECT_EQ(t.app.step(t.talker), 0u);
  run_pattern(t.app, {t.thinker, t.talker});
  const auto w = t.windows(r, 5, false);
  ASSERT_EQ(w.size(), 4u);
  const Win tok[] = {{0, 0, 2, {0, 1}}, {2, 2, 4, {2, 3}}, {4, 4, 5, {4}}, {5, 5, 5, {}}};
  const Win emb[] = {{0, 0, 2, {0, 1}}, {1, 2, 4, {1, 2, 3}}, {3, 4, 5, {3, 4}}, {5, 5, 5, {}}};
  for (std::size_t k = 0; k < 4; ++k) EXPECT_EQ(w[k], (std::array<Win, 2>{tok[k], emb[k]})) << k;
  t.app.expect_all_released();
}

TEST(ConductorMultiStream, ReadingPastTheEndWithoutContinueAfterDoneFailsOnlyThatRequest) {
  // Neither flag, or only tok's: the message names the stream without it.
  for (bool cad_tok : {false, true}) {
    for (bool thinker_first : {true, false}) {
      Talker t(talker_shape(cad_tok, false));
      const RequestId ok = t.submit(5, 5), bad = t.submit(2, 4), early = t.submit(6, 3);
      if (thinker_first) run_pattern(t.app, {t.thinker});
      run_pattern(t.app, {t.talker, t.thinker});
      EXPECT_TRUE(t.app.finished.count(ok) && t.app.finished.count(early));
      EXPECT_EQ(t.app.emitted(ok, t.step_name).size(), 5u);
      EXPECT_EQ(t.app.emitted(early, t.step_name).size(), 3u);
      EXPECT_EQ(t.app.emitted(bad, t.step_name), (std::vector<long>{0, 1}));
      ASSERT_EQ(t.app.failed.size(), 1u);
      EXPECT_EQ(t.app.failed.begin()->first, bad);
      EXPECT_EQ(t.app.failed.begin()->second,
                std::string("node 'talk' in walk 'speak' runs again after the stream '") +
                    (cad_tok ? "emb" : "tok") + "' of 'think' is over; stop its loop when the "
                    "stream ends, or set continue_after_done=True on the StreamingGraphEdge to "
                    "read empty windows");
      t.app.expect_all_released();
    }
  }
}

// Was a bug: a Parallel inside an outer loop with the consumer placed before its producer's loop,
// Loop(Parallel(C, Loop(P)), 2). A stream was reset only when its producer scope (the inner loop)
// started again, which in the Parallel is after C has started: in the outer loop's second
// iteration a stream-driven C saw the first iteration's finished stream and ended at once (the
// new windows never delivered); a per-execution C read a stale empty window (or failed the
// request without continue_after_done), then a second window went out for the same activation
// while the first was in flight. Fix: a stream also starts afresh when the innermost section
// holding both its producer scope and its consumer starts (WalkIndex::restarts_streams).
TEST(ConductorMultiStream, AConsumerBeforeItsProducerInAnOuterLoopSeesAFreshStream) {
  for (bool per_execution : {false, true}) {
    for (bool cad : {false, true}) {
      SCOPED_TRACE(std::string(per_execution ? "per execution" : "stream-driven") +
                   (cad ? ", continue_after_done" : ""));
      GraphBuilder g;
      g.input("n").node("p", {"n"}, {Edge::stream("c", "t", ChunkPolicy::fixed(1), cad)}, "a");
      g.node("c", {"t"}, {Edge::emit("o")}, "c");
      const Section consumer = per_execution ? Section::loop("c", 3) : Section("c");
      g.walk("w", Section::loop(Section::par({consumer, Section::loop("p", 3)}), 2));
      App app(g.compile());
      app.fns[0] = [](const WorkItem& it, const auto&, auto& out, auto&) {
        out[0] = static_cast<long>(it.iteration);
        return true;
      };
      const RequestId r = app.submit(0, {{name_of(app.c.graph(), "n"), 0}});
      app.drain();
      const auto items = app.items_of(1, r);
      EXPECT_EQ(items.size(), 6u);
      EXPECT_TRUE(app.failed.empty());
      for (std::size_t i = 0; i < std::min<std::size_t>(items.size(), 6); ++i) {
        EXPECT_EQ(win(app, items[i], 0, 0), fixed1(long(i % 3), 3)) << i;
        EXPECT_EQ(items[i].iteration, per_execution ? i % 3 : i / 3) << i;
      }
      EXPECT_TRUE(app.finished.count(r));
      app.expect_all_released();
    }
  }
}

// ---- (4) the builder ----------------------------------------------------------------------------

TEST(ConductorMultiStream, BuilderChecksAndComputesTheStreamSpecs) {
  GraphBuilder twice;
  twice.input("n").node("p", {"n"}, {Edge::stream("c", "t", ChunkPolicy::fixed(1)),
                                     Edge::stream("c", "t", ChunkPolicy::fixed(2))});
  twice.node("c", {"t"}, {Edge::emit("o")}).walk("w", Section::par({Section::loop("p", 3), "c"}));
  EXPECT_EQ(error_of<GraphError>([&] { (void)twice.compile(); }),
            "node 'c' receives two streams named 't' in walk 'w'; rename one of them");

  const GraphSpec talker = talker_shape(true, false);
  ASSERT_EQ(talker.walks[0].streams.size(), 2u);
  for (const StreamSpec& s : talker.walks[0].streams) {
    EXPECT_TRUE(s.per_execution) << "talk sits in its own loop";
    EXPECT_EQ(s.continue_after_done, s.name == name_of(talker, "tok"));
  }
  const GraphSpec plain = two_streams(ChunkPolicy::fixed(1), ChunkPolicy::fixed(2));
  for (const StreamSpec& s : plain.walks[0].streams)
    EXPECT_FALSE(s.per_execution || s.continue_after_done) << "a plain consumer in a Parallel";
  // Consumer placements: after the loop, in its own Loop after it, in a Parallel inside an outer
  // loop both share (not per execution), in its own loop there (per execution).
  const std::vector<std::pair<Section, bool>> places = {
      {Section::seq({Section::loop("p", 3), "c"}), false},
      {Section::seq({Section::loop("p", 3), Section::loop("c", 3)}), true},
      {Section::loop(Section::par({Section::loop("p", 3), "c"}), 2), false},
      {Section::loop(Section::par({Section::loop("p", 3), Section::loop("c", 2)}), 2), true}};
  for (const auto& [root, per_execution] : places) {
    GraphBuilder b;
    b.input("n").node("p", {"n"}, {Edge::stream("c", "t", ChunkPolicy::fixed(1), true)});
    b.node("c", {"t"}, {Edge::emit("o")}).walk("w", root);
    const GraphSpec g = b.compile();
    EXPECT_EQ(g.walks[0].streams.at(0).per_execution, per_execution);
    EXPECT_TRUE(g.walks[0].streams.at(0).continue_after_done);
    EXPECT_NO_THROW(Conductor{g});
  }
  // The Conductor's own checks of a hand-made IR: one consumer's streams in two modes, and a
  // stream the consumer does not read.
  GraphSpec modes = talker, unread = talker;
  modes.walks[0].streams[1].per_execution = false;
  unread.walks[0].streams[1].name = name_of(talker, "step");
  EXPECT_EQ(error_of<std::invalid_argument>([&] { Conductor{modes}; }),
            "graph IR: node 'talk' consumes streams in two modes");
  EXPECT_EQ(error_of<std::invalid_argument>([&] { Conductor{unread}; }),
            "graph IR: node 'talk' consumes a stream it does not read");
}

// ---- (5) cancel in the middle -------------------------------------------------------------------

TEST(ConductorMultiStream, CancelInTheMiddleFreesEverything) {
  // 0: talker windows in flight; 1: thinker items in flight; 2: a two-stream consumer's.
  for (int where = 0; where < 3; ++where) {
    SCOPED_TRACE("case " + std::to_string(where));
    const GraphSpec ir = where < 2 ? talker_shape(true, true)
                                   : two_streams(ChunkPolicy::sliding_window(4, 2),
                                                 ChunkPolicy::fixed(3));
    App app(ir);
    std::vector<RequestId> rs;
    const EngineId busy = engine_of(ir, where == 0 ? "talker" : where == 1 ? "thinker" : "c");
    if (where < 2) {
      app.fns[0] = counter(0, name_of(ir, "think"));
      for (long n : {3L, 7L, 12L})
        rs.push_back(app.submit(0, {{name_of(ir, "n"), n}, {name_of(ir, "steps"), 20}}));
      for (int i = 0; i < 4; ++i) app.step(engine_of(ir, "thinker"), 1);
      app.step(engine_of(ir, "talker"));
    } else {
      app.fns[0] = counter(0, name_of(ir, "loop_a"));
      app.fns[1] = counter(0, name_of(ir, "loop_b"));
      for (long n : {9L, 20L, 30L})
        rs.push_back(app.submit(0, {{name_of(ir, "na"), n}, {name_of(ir, "nb"), n + 5}}));
      for (int i = 0; i < 12; ++i) app.step(engine_of(ir, i % 2 ? "a" : "b"), 3);
      app.step(busy, 1);
    }
    const auto batch = app.c.next_batch(busy, 64, 0ns);
    EXPECT_FALSE(batch.empty());
    for (RequestId r : rs) EXPECT_TRUE(app.cancel(r));
    Outcome o;
    app.c.complete(app.run(batch), &o);  // the engine finishes what it held
    app.handle(o);
    app.drain();
    EXPECT_TRUE(app.failed.empty());
    app.expect_all_released();
  }
}

TEST(ConductorMultiStream, TwoEngineThreadsAndCancelsKeepEachRequestsWindows) {
  // The thinker and the talker on their own threads, the test thread submitting and cancelling
  // (a check for ThreadSanitizer too); every request that finishes got exactly its own windows,
  // whether its talker stops before, at or after the end of its thinker's stream.
  Talker t(talker_shape(true, true, ChunkPolicy::fixed(1), ChunkPolicy::left_context(1, 2)));
  std::atomic<bool> stop{false};
  std::vector<std::thread> workers;
  for (EngineId e : {t.thinker, t.talker})
    workers.emplace_back([&t, &stop, e] {
      while (!stop.load(std::memory_order_acquire)) t.app.step(e, 4, 2ms);
    });
  std::mt19937 rng(11);
  std::vector<std::pair<RequestId, std::pair<long, long>>> rs;
  for (long i = 0; i < 300; ++i) {
    rs.push_back({t.submit(i % 7, i % 9 + 1), {i % 7, i % 9 + 1}});
    if (rng() % 100 < 20) t.app.cancel(rs[rng() % rs.size()].first);
  }
  for (const auto limit = std::chrono::steady_clock::now() + 120s;;) {
    {
      std::lock_guard<std::mutex> lock(t.app.mu);
      if (t.app.terminal.size() == rs.size()) break;
    }
    if (std::chrono::steady_clock::now() > limit) {  // join the workers before failing
      ADD_FAILURE() << "requests left unfinished";
      break;
    }
    std::this_thread::sleep_for(1ms);
  }
  stop.store(true, std::memory_order_release);
  for (auto& w : workers) w.join();
  EXPECT_TRUE(t.app.failed.empty());
  EXPECT_GT(t.app.finished.size(), 0u);
  for (const auto& [r, ns] : rs) {
    if (!t.app.finished.count(r)) continue;
    const auto w = t.windows(r, ns.first);
    ASSERT_EQ(w.size(), static_cast<std::size_t>(ns.second)) << r;
    for (long k = 0; k < ns.second; ++k) EXPECT_EQ(w[k][0], fixed1(k, ns.first)) << r << " " << k;
  }
  t.app.expect_all_released();
}

// ---- (6) no allocation per window once warm -----------------------------------------------------

TEST(ConductorMultiStream, WarmPerIterationWindowsAllocateNothingPerWindow) {
  // 4 requests (one batch of each engine): the thinker and the talker (two Fixed(1) streams) in
  // lockstep, driven as an engine worker drives them (reused batch, completion, outcome buffers).
  const GraphSpec ir =
      talker_shape(true, true, ChunkPolicy::fixed(1), ChunkPolicy::fixed(1), 1'000'000);
  const EngineId thinker = engine_of(ir, "thinker"), talker = engine_of(ir, "talker");
  const NameId ir_n = name_of(ir, "n"), ir_steps = name_of(ir, "steps");
  Conductor c(ir);
  Outcome out;
  Handle next = 1;
  std::vector<RequestId> ids;
  for (int r = 0; r < 4; ++r, next += 2)
    ids.push_back(c.submit(0, {{ir_n, next}, {ir_steps, next + 1}}, {}, &out));
  std::vector<const WorkItem*> batch;
  std::vector<Completion> done;
  std::uint64_t windows = 0;
  const auto lockstep = [&](int times) {
    for (int i = 0; i < 2 * times; ++i) {
      const EngineId e = i % 2 ? talker : thinker;
      c.next_batch(e, 16, 10ms, &batch);
      done.resize(batch.size());
      for (std::size_t k = 0; k < batch.size(); ++k) {
        done[k].item = batch[k]->id;
        done[k].outputs.resize(c.graph().nodes[batch[k]->node].outputs.size());
        for (Handle& h : done[k].outputs) h = next++;
        if (e == talker) windows += batch[k]->chunks.size();
      }
      out.emits.clear(), out.released.clear(), out.walks_done.clear(), out.failed.clear();
      c.complete(done, &out);
    }
  };
  // A request's timeline (two events a step) doubles to 2048 during the warm-up, and the measured
  // stretch ends before 2048.
  lockstep(600);
  const std::uint64_t before = g_allocations.load(), windows_before = windows;
  lockstep(400);
  const std::uint64_t allocations = g_allocations.load() - before, read = windows - windows_before;
  EXPECT_EQ(read, 4u * 2 * 400);  // every talker step read both windows of every request
  // The only allocations left: each stream's std::deque of items takes a 512-byte node every 64
  // items (StreamState, older than multi-stream consumers). One per window (an item's chunks
  // not pooled, say) would be 3200.
  EXPECT_LE(allocations, read / 32) << allocations << " allocations over " << read << " windows";
  for (RequestId r : ids) EXPECT_TRUE(c.cancel(r, &out));
  EXPECT_EQ(c.live_handles(), 0u);
}

}  // namespace

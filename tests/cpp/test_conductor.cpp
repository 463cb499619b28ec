// Conductor tests: graph IRs built by hand, run by a fake engine loop.
//
// The fake application (`App`) keeps a tensor store (handle -> long), pulls batches with
// next_batch, computes each node's outputs as new handles (by default: the sum of every input
// value plus node id + 1, plus 1000 per further output), reports them with complete() and acts on
// every Outcome: emits are recorded with their values, walks_done goes to a next-walk policy
// (start_walk or finish), failures are recorded and released handles are erased from the store.
// It remembers every handle it ever handed to the Conductor (request inputs and node outputs), so
// that a test can check at the end that each was released exactly once.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <map>
#include <mutex>
#include <random>
#include <set>
#include <stdexcept>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "mstar/conductor.hpp"
#include "mstar/graph.hpp"

namespace {

using namespace std::chrono_literals;
using mstar::Chunk;
using mstar::ChunkPolicy;
using mstar::Completion;
using mstar::Conductor;
using mstar::EngineId;
using mstar::GraphSpec;
using mstar::Handle;
using mstar::NamedHandle;
using mstar::NameId;
using mstar::NodeId;
using mstar::NodeSpec;
using mstar::Outcome;
using mstar::RequestId;
using mstar::SectionKind;
using mstar::SectionSpec;
using mstar::StreamSpec;
using mstar::SubmitOptions;
using mstar::WalkId;
using mstar::WalkSpec;
using mstar::WorkItem;

std::uint64_t stress_items() {
  if (const char* s = std::getenv("MSTAR_STRESS_ITEMS")) {
    char* end = nullptr;
    const unsigned long long v = std::strtoull(s, &end, 10);
    if (end != s && *end == '\0' && v > 0) return v;
  }
  return 10'000'000;
}

// ---- IR builder ---------------------------------------------------------------------------------

struct IR {
  GraphSpec g;

  NameId name(const std::string& n) {
    for (std::size_t i = 0; i < g.names.size(); ++i)
      if (g.names[i] == n) return static_cast<NameId>(i);
    g.names.push_back(n);
    return static_cast<NameId>(g.names.size() - 1);
  }
  EngineId engine(const std::string& e) {
    for (std::size_t i = 0; i < g.engines.size(); ++i)
      if (g.engines[i] == e) return static_cast<EngineId>(i);
    g.engines.push_back(e);
    return static_cast<EngineId>(g.engines.size() - 1);
  }
  NodeId node(const std::string& n, const std::string& eng, const std::vector<std::string>& in,
              const std::vector<std::string>& out, std::uint32_t max_batch = 1) {
    NodeSpec s;
    s.name = n;
    s.engine = engine(eng);
    s.max_batch = max_batch;
    for (const auto& x : in) s.inputs.push_back(name(x));
    for (const auto& x : out) s.outputs.push_back(name(x));
    g.nodes.push_back(s);
    return static_cast<NodeId>(g.nodes.size() - 1);
  }
  NodeId node_id(const std::string& n) const {
    for (std::size_t i = 0; i < g.nodes.size(); ++i)
      if (g.nodes[i].name == n) return static_cast<NodeId>(i);
    throw std::logic_error("test IR: no node " + n);
  }
};

struct WalkB {
  IR& ir;
  WalkSpec w;
  WalkB(IR& i, std::string name) : ir(i) { w.name = std::move(name); }

  std::uint32_t add(SectionSpec s) {
    w.sections.push_back(std::move(s));
    return static_cast<std::uint32_t>(w.sections.size() - 1);
  }
  std::uint32_t node(const std::string& n) {
    SectionSpec s;
    s.kind = SectionKind::node;
    s.node = ir.node_id(n);
    return add(s);
  }
  std::uint32_t seq(std::vector<std::uint32_t> children) {
    SectionSpec s;
    s.kind = SectionKind::sequential;
    s.children = std::move(children);
    return add(s);
  }
  std::uint32_t par(std::vector<std::uint32_t> children) {
    SectionSpec s;
    s.kind = SectionKind::parallel;
    s.children = std::move(children);
    return add(s);
  }
  std::vector<NameId> ids(const std::vector<std::string>& names) {
    std::vector<NameId> v;
    for (const auto& n : names) v.push_back(ir.name(n));
    return v;
  }
  std::uint32_t loop(std::uint32_t body, std::uint32_t iters, const std::vector<std::string>& outputs = {},
                     const std::vector<std::string>& accumulated = {},
                     const std::vector<std::string>& scoped = {}) {
    SectionSpec s;
    s.kind = SectionKind::loop;
    s.children = {body};
    s.max_iters = iters;
    s.outputs = ids(outputs);
    s.accumulated = ids(accumulated);
    s.scoped = ids(scoped);
    return add(s);
  }
  std::uint32_t dynamic_loop(const std::string& loop_name, std::uint32_t body, std::uint32_t iters,
                             const std::vector<std::string>& outputs = {},
                             const std::vector<std::string>& accumulated = {},
                             const std::vector<std::string>& scoped = {}) {
    const std::uint32_t s = loop(body, iters, outputs, accumulated, scoped);
    w.sections[s].dynamic = true;
    w.sections[s].loop_name = ir.name(loop_name);
    return s;
  }
  WalkB& emit(const std::string& node, const std::string& name) {
    w.emits.emplace_back(ir.node_id(node), ir.name(name));
    return *this;
  }
  WalkB& persist(const std::string& name) {
    w.persist.push_back(ir.name(name));
    return *this;
  }
  WalkB& stream(const std::string& producer, const std::string& name, const std::string& consumer,
                ChunkPolicy policy, std::uint32_t producer_scope) {
    StreamSpec s;
    s.producer = ir.node_id(producer);
    s.name = ir.name(name);
    s.consumer = ir.node_id(consumer);
    s.policy = policy;
    s.producer_scope = producer_scope;
    w.streams.push_back(s);
    return *this;
  }
  WalkId build(std::uint32_t root) {
    w.root = root;
    ir.g.walks.push_back(w);
    return static_cast<WalkId>(ir.g.walks.size() - 1);
  }
};

// ---- fake application and engine ----------------------------------------------------------------

constexpr long kAbsent = LONG_MIN;  // a node leaves an output at kAbsent: "not produced" (handle 0)
constexpr std::int64_t kFinish = -1;  // next-walk policy: finish the request
constexpr std::int64_t kLeave = -2;   // next-walk policy: leave it between walks (the test acts)

struct App {
  /// in[k] holds input k's values (one, or the list); returns false to fail the item instead.
  using NodeFn = std::function<bool(const WorkItem& item, const std::vector<std::vector<long>>& in,
                                    std::vector<long>& out, std::vector<NameId>& stop)>;
  /// Called on walks_done with the walk that ended: a walk id to start, kFinish or kLeave.
  using NextWalk = std::function<std::int64_t(RequestId, WalkId)>;

  struct Emitted {
    RequestId request;
    NodeId node;
    NameId name;
    long value;
  };

  explicit App(GraphSpec g) : c(std::move(g)), fns(c.graph().nodes.size()) {}

  Conductor c;
  std::vector<NodeFn> fns;  // by node; empty = the default sum
  NextWalk next_walk;       // empty = finish after the first walk
  bool record = true;       // keep copies of items and values at walk ends (off in the stress test)
  bool tolerate_refused_start_walk = false;  // stress: a concurrent cancel beats start_walk

  mutable std::mutex mu;
  Handle next_handle = 1;
  std::unordered_map<Handle, long> store;    // live values
  std::unordered_map<Handle, long> created;  // every handle ever handed to the Conductor
  std::unordered_map<Handle, int> released;  // handle -> times it came back in Outcome::released
  std::unordered_map<RequestId, WalkId> walk_of;
  std::unordered_map<RequestId, std::vector<long>> inputs_of;
  std::vector<Emitted> emits;
  std::map<RequestId, std::string> failed;
  std::set<RequestId> finished, cancelled, terminal;
  std::vector<WorkItem> seen;  // copies of every item run (record)
  std::map<RequestId, std::vector<std::pair<WalkId, std::map<NameId, long>>>> walk_ends;
  long emit_after_free = 0;  // emits whose handle a concurrent call had already released
  long input_missing = 0;    // item inputs not in the store (must stay 0)
  long refused_start_walk = 0;
  long refused_finish = 0;

  Handle put_locked(long v) {
    const Handle h = next_handle++;
    store.emplace(h, v);
    created.emplace(h, v);
    return h;
  }

  RequestId submit(WalkId w, const std::vector<std::pair<NameId, long>>& inputs,
                   SubmitOptions opt = {}) {
    Outcome o;
    RequestId r;
    {
      // Held across submit: a worker may report walks_done for r before submit returns.
      std::lock_guard<std::mutex> lock(mu);
      std::vector<NamedHandle> hs;
      std::vector<long> vals;
      for (auto [n, v] : inputs) {
        hs.push_back({n, put_locked(v)});
        vals.push_back(v);
      }
      r = c.submit(w, hs, opt, &o);
      walk_of[r] = w;
      inputs_of[r] = vals;
    }
    handle(o);
    return r;
  }

  bool cancel(RequestId r) {
    Outcome o;
    const bool ok = c.cancel(r, &o);
    if (ok) {
      std::lock_guard<std::mutex> lock(mu);
      cancelled.insert(r);
      terminal.insert(r);
    }
    handle(o);
    return ok;
  }

  void handle(const Outcome& o) {
    {
      std::lock_guard<std::mutex> lock(mu);
      for (const auto& e : o.emits) {
        auto it = created.find(e.handle);
        EXPECT_NE(it, created.end()) << "emit of a handle never handed in: " << e.handle;
        if (it == created.end()) continue;
        if (store.count(e.handle) == 0) ++emit_after_free;
        emits.push_back({e.request, e.node, e.name, it->second});
      }
      for (const auto& [r, msg] : o.failed) {
        failed[r] = msg;
        terminal.insert(r);
      }
      for (Handle h : o.released) {
        store.erase(h);
        ++released[h];
      }
    }
    for (RequestId r : o.walks_done) {
      WalkId w;
      {
        std::lock_guard<std::mutex> lock(mu);
        w = walk_of.at(r);
        if (record) {
          std::map<NameId, long> vals;
          for (const NamedHandle& nh : c.values(r)) vals[nh.name] = created.at(nh.handle);
          walk_ends[r].emplace_back(w, std::move(vals));
        }
      }
      const std::int64_t next = next_walk ? next_walk(r, w) : kFinish;
      if (next == kLeave) continue;
      Outcome o2;
      if (next == kFinish) {
        const bool ended = c.finish(r, &o2);  // false: cancelled meanwhile (cancel ended it)
        std::lock_guard<std::mutex> lock(mu);
        if (ended) {
          finished.insert(r);
          terminal.insert(r);
        } else {
          ++refused_finish;
        }
      } else {
        {
          std::lock_guard<std::mutex> lock(mu);
          walk_of[r] = static_cast<WalkId>(next);
        }
        try {
          c.start_walk(r, static_cast<WalkId>(next), &o2);
        } catch (const std::logic_error&) {
          if (!tolerate_refused_start_walk) throw;
          std::lock_guard<std::mutex> lock(mu);
          ++refused_start_walk;
        }
      }
      handle(o2);
    }
  }

  /// Computes a batch: completions for the items that succeed, ids of those that fail.
  std::vector<Completion> run(const std::vector<const WorkItem*>& batch,
                              std::vector<std::uint64_t>* failures = nullptr) {
    std::vector<Completion> done;
    std::lock_guard<std::mutex> lock(mu);
    for (const WorkItem* it : batch) {
      if (record) seen.push_back(*it);
      std::vector<std::vector<long>> in;
      for (std::size_t k = 0; k + 1 < it->offsets.size(); ++k) {
        in.emplace_back();
        for (std::uint32_t j = it->offsets[k]; j < it->offsets[k + 1]; ++j) {
          auto s = store.find(it->handles[j]);
          if (s == store.end()) {
            ++input_missing;
            in.back().push_back(kAbsent);
          } else {
            in.back().push_back(s->second);
          }
        }
      }
      const NodeSpec& n = c.graph().nodes[it->node];
      std::vector<long> out(n.outputs.size(), kAbsent);
      std::vector<NameId> stop;
      bool ok = true;
      if (fns[it->node]) {
        ok = fns[it->node](*it, in, out, stop);
      } else {
        long sum = 0;
        for (const auto& v : in)
          for (long x : v) sum += x;
        for (std::size_t j = 0; j < out.size(); ++j)
          out[j] = sum + static_cast<long>(it->node) + 1 + 1000 * static_cast<long>(j);
      }
      if (!ok) {
        if (failures != nullptr) failures->push_back(it->id);
        continue;
      }
      Completion comp;
      comp.item = it->id;
      for (long v : out) comp.outputs.push_back(v == kAbsent ? 0 : put_locked(v));
      comp.stop_loops = stop;
      done.push_back(std::move(comp));
    }
    return done;
  }

  /// Runs one batch of `e` (waiting up to `timeout`); returns how many items it held.
  std::size_t step(EngineId e, std::size_t max_batch = 64, std::chrono::nanoseconds timeout = 0ns) {
    const auto batch = c.next_batch(e, max_batch, timeout);
    if (batch.empty()) return 0;
    std::vector<std::uint64_t> failures;
    const auto done = run(batch, &failures);
    if (!failures.empty()) {
      Outcome o;
      c.fail_items(failures, "injected failure", &o);
      handle(o);
    }
    Outcome o;
    c.complete(done, &o);
    handle(o);
    return batch.size();
  }

  /// Runs every engine until no work is left; returns the number of items run.
  std::size_t drain(std::size_t max_batch = 64) {
    std::size_t total = 0;
    for (;;) {
      std::size_t n = 0;
      for (EngineId e = 0; e < c.graph().engines.size(); ++e) n += step(e, max_batch);
      if (n == 0) return total;
      total += n;
    }
  }

  std::vector<long> emitted(RequestId r, NameId name) const {
    std::lock_guard<std::mutex> lock(mu);
    std::vector<long> v;
    for (const auto& e : emits)
      if (e.request == r && e.name == name) v.push_back(e.value);
    return v;
  }
  std::vector<WorkItem> items_of(NodeId node, RequestId r = 0) const {
    std::lock_guard<std::mutex> lock(mu);
    std::vector<WorkItem> v;
    for (const auto& it : seen)
      if (it.node == node && (r == 0 || it.request == r)) v.push_back(it);
    return v;
  }
  std::map<NameId, long> values(RequestId r) const {
    std::lock_guard<std::mutex> lock(mu);
    std::map<NameId, long> m;
    for (const NamedHandle& nh : c.values(r)) m[nh.name] = created.at(nh.handle);
    return m;
  }

  /// Nothing is left anywhere and every handle handed in came back exactly once.
  void expect_all_released() const {
    EXPECT_EQ(c.live_requests(), 0u);
    EXPECT_EQ(c.live_handles(), 0u);
    EXPECT_EQ(c.queued_items(), 0u);
    EXPECT_EQ(c.inflight_items(), 0u);
    std::lock_guard<std::mutex> lock(mu);
    std::size_t bad = 0;
    for (const auto& [h, v] : created) {
      auto it = released.find(h);
      const int n = it == released.end() ? 0 : it->second;
      if (n != 1 && bad++ < 5)
        ADD_FAILURE() << "handle " << h << " (value " << v << ") released " << n << " times";
    }
    for (const auto& [h, n] : released)
      if (created.count(h) == 0 && bad++ < 5) ADD_FAILURE() << "released unknown handle " << h;
    EXPECT_EQ(bad, 0u);
    EXPECT_TRUE(store.empty()) << store.size() << " values left in the store";
    EXPECT_EQ(input_missing, 0);
  }
};

std::vector<long> window_values(long first, const Chunk& ch) {
  std::vector<long> v;
  for (std::uint64_t p = ch.begin; p < ch.end; ++p) v.push_back(first + static_cast<long>(p));
  return v;
}

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
    EXPECT_FALSE(it.windowed);
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
  EXPECT_FALSE(sums[0].windowed);
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

// ---- streaming edges ----------------------------------------------------------------------------

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
  app.fns[ir.node_id("C")] = [](const WorkItem&, const auto& in, auto& out, auto&) {
    long s = 0;
    for (long v : in[1]) s += v;
    out[0] = s;
    return true;
  };
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
      EXPECT_TRUE(it.windowed);
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

TEST(Conductor, StreamEndingOnAChunkBoundaryEndsWithOneLastWindow) {
  // Fixed(3) over 6 items. With the consumer in a Parallel and run eagerly, [3,6) is cut before
  // the loop ends (not last), so the end of stream sends an empty last window [6,6). With the
  // consumer after the loop, [3,6) is cut after the end and is itself the last window.
  for (bool parallel : {true, false}) {
    SCOPED_TRACE(parallel ? "consumer in parallel" : "consumer after the loop");
    IR ir;
    ir.node("P", "e0", {"h"}, {"h", "s"});
    ir.node("C", "e1", {"s"}, {"o"});
    WalkB w(ir, "main");
    const std::uint32_t loop = w.loop(w.node("P"), 6, {"h"}, {}, {"s"});
    w.stream("P", "s", "C", ChunkPolicy::fixed(3), loop).emit("C", "o");
    const WalkId main = w.build(parallel ? w.par({loop, w.node("C")}) : w.seq({loop, w.node("C")}));
    App app(ir.g);
    app.fns[ir.node_id("C")] = [](const WorkItem&, const auto& in, auto& out, auto&) {
      out[0] = static_cast<long>(in[0].size());
      return true;
    };
    const RequestId r = app.submit(main, {{ir.name("h"), 0}});
    while (app.step(1) + app.step(0) > 0) {
    }
    const auto windows = app.items_of(ir.node_id("C"), r);
    std::vector<Chunk> want = {chunk(0, 0, 3, 0, false), chunk(3, 3, 6, 1, !parallel)};
    if (parallel) want.push_back(chunk(6, 6, 6, 2, true));
    ASSERT_EQ(windows.size(), want.size());
    for (std::size_t i = 0; i < want.size(); ++i) {
      EXPECT_TRUE(windows[i].windowed);
      EXPECT_EQ(windows[i].chunk.begin, want[i].begin) << i;
      EXPECT_EQ(windows[i].chunk.new_begin, want[i].new_begin) << i;
      EXPECT_EQ(windows[i].chunk.end, want[i].end) << i;
      EXPECT_EQ(windows[i].chunk.index, want[i].index) << i;
      EXPECT_EQ(windows[i].chunk.last, want[i].last) << i;
      EXPECT_EQ(windows[i].offsets,
                (std::vector<std::uint32_t>{0, static_cast<std::uint32_t>(want[i].size())}));
    }
    EXPECT_EQ(app.emitted(r, ir.name("o")), parallel ? (std::vector<long>{3, 3, 0}) : (std::vector<long>{3, 3}));
    EXPECT_TRUE(app.finished.count(r));
    app.expect_all_released();
  }
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

// ---- IR validation ------------------------------------------------------------------------------

/// A valid IR using every kind of id: names x h s o gen; engines e0 e1; nodes init P C.
GraphSpec valid_ir() {
  IR ir;
  ir.node("init", "e0", {"x"}, {"h"});
  ir.node("P", "e0", {"h"}, {"h", "s"});
  ir.node("C", "e1", {"s"}, {"o"});
  WalkB w(ir, "main");
  const std::uint32_t loop = w.dynamic_loop("gen", w.node("P"), 4, {"h"}, {}, {"s"});
  w.stream("P", "s", "C", ChunkPolicy::fixed(2), loop).emit("C", "o").persist("h");
  w.build(w.seq({w.node("init"), w.par({loop, w.node("C")})}));
  return ir.g;
}

TEST(Conductor, ValidIRConstructsAndRuns) {
  App app(valid_ir());
  const RequestId r = app.submit(0, {{0, 1}});
  app.drain();
  EXPECT_TRUE(app.finished.count(r));
  // 4 items, Fixed(2): [0,2) [2,4), and an empty last window if [2,4) was cut before the end.
  const auto windows = app.items_of(2, r);
  ASSERT_GE(windows.size(), 2u);
  ASSERT_LE(windows.size(), 3u);
  EXPECT_EQ(windows[1].chunk.end, 4u);
  EXPECT_TRUE(windows.back().chunk.last);
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

// ---- known bugs (: they fail, or crash, against the current Conductor) ---------------

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
  app.fns[ir.node_id("C")] = [](const WorkItem&, const auto& in, auto& out, auto&) {
    long s = 0;
    for (long v : in[0]) s += v;
    out[0] = s;
    return true;
  };
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

// ~0 is the handle counts' tombstone, so it is reserved: submit and complete refuse it instead of
// miscounting it.
TEST(Conductor, ReservedHandleIsRefused) {
  App app(valid_ir());
  Outcome o;
  EXPECT_THROW(app.c.submit(0, {{0, mstar::kReservedHandle}}, {}, &o), std::invalid_argument);
  EXPECT_EQ(app.c.live_handles(), 0u);
  EXPECT_EQ(app.c.live_requests(), 0u);
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
    if (!it.windowed) return false;
    auto& l = lasts[it.request];  // fns run under app.mu
    if (l.first > 0) l.second = false;  // a window after the last one
    if (it.chunk.last) {
      ++l.first;
      l.second = true;
    }
    if (in[0].empty()) return true;  // the empty last window after a full one: nothing to say
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
    EXPECT_EQ(lasts[r].first, 1) << "request " << r << ": one window marked last";
    EXPECT_TRUE(lasts[r].second) << "request " << r << ": the last window came last";
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

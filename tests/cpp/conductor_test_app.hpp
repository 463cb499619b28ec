// Shared helpers for the Conductor tests (test_conductor_*.cpp): graph IRs built by hand, run by
// a fake engine loop.
//
// IR and WalkB build a GraphSpec (names, engines, nodes; a walk's sections, emits, persisted names
// and streams). The fake application (`App`) keeps a tensor store (handle -> long), pulls batches
// with next_batch, computes each node's outputs as new handles (by default: the sum of every input
// value plus node id + 1, plus 1000 per further output), reports them with complete() and acts on
// every Outcome: emits are recorded with their values, walks_done goes to a next-walk policy
// (start_walk or finish), failures are recorded and released handles are erased from the store.
// It remembers every handle it ever handed to the Conductor (request inputs and node outputs), so
// that a test can check at the end that each was released exactly once. valid_ir() is a small
// valid IR that uses every kind of id.
#pragma once

#include <gtest/gtest.h>

#include <chrono>
#include <climits>
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <set>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "mstar/conductor.hpp"
#include "mstar/graph.hpp"

namespace conductor_test {

using namespace std::chrono_literals;
using mstar::Chunk;
using mstar::ChunkPolicy;
using mstar::Completion;
using mstar::Conductor;
using mstar::EngineId;
using mstar::Expired;
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
  std::map<RequestId, Expired> expired;  // of `failed`: by their deadline
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
      for (const Expired& x : o.expired) expired[x.request] = x;
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

/// A node function writing the sum of input k's values (a stream window's items) to output 0.
inline App::NodeFn sum_input(std::size_t k) {
  return [k](const WorkItem&, const std::vector<std::vector<long>>& in, std::vector<long>& out,
             std::vector<NameId>&) {
    long s = 0;
    for (long v : in[k]) s += v;
    out[0] = s;
    return true;
  };
}

/// A valid IR using every kind of id: names x h s o gen; engines e0 e1; nodes init P C.
inline GraphSpec valid_ir() {
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

}  // namespace conductor_test

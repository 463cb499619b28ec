// The C++ application API: a Model of C++ nodes served by a Runtime — walks, loops, streaming
// outputs (pull and callback), cancel, bad input, node errors, stats — and the control-side
// access (action buffer + control loop + chunk feeder).
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <functional>
#include <limits>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "alloc_counter.hpp"
#include "mstar/chunk_feeder.hpp"
#include "mstar/runtime.hpp"

namespace {

using namespace std::chrono_literals;
using mstar::DType;
using mstar::Edge;
using mstar::Model;
using mstar::NodeCall;
using mstar::Output;
using mstar::Request;
using mstar::RequestStatus;
using mstar::Runtime;
using mstar::Section;
using mstar::Tensor;
using mstar::TensorSpec;

float first(const Tensor& t) { return t.data<float>()[0]; }

// x (float32 [n]) -> y = 2x, EMITted.
Model doubler() {
  Model m;
  m.input("x", TensorSpec::of(DType::float32, {-1}));
  m.node("double", {"x"}, {Edge::emit("y")}, [](NodeCall& c) {
    const Tensor& x = c.input("x");
    Tensor y = Tensor::empty(DType::float32, x.shape());
    for (std::size_t i = 0; i < x.numel(); ++i) y.data<float>()[i] = 2 * x.data<float>()[i];
    c.output("y", y);
  });
  m.walk("main", "double");
  return m;
}

TEST(Tensor, KeepsDtypeAndShapeAndRefusesTheWrongType) {
  Tensor t = Tensor::from<std::int64_t>({1, 2, 3, 4, 5, 6}, {2, 3});
  EXPECT_EQ(t.describe(), "int64[2, 3]");
  EXPECT_EQ(t.numel(), 6u);
  EXPECT_EQ(t.nbytes(), 48u);
  EXPECT_EQ(t.data<std::int64_t>()[5], 6);
  EXPECT_THROW(t.data<float>(), std::invalid_argument);
  EXPECT_THROW(Tensor::from<float>({1, 2, 3}, {2, 2}), std::invalid_argument);
  Tensor c = t.clone();
  c.data<std::int64_t>()[0] = 42;
  EXPECT_EQ(t.data<std::int64_t>()[0], 1);  // clone copies the bytes; copies of t share them
  float buf[2] = {1, 2};
  Tensor v = Tensor::view(buf, DType::float32, {2});
  buf[1] = 7;
  EXPECT_EQ(v.data<float>()[1], 7);
  EXPECT_FALSE(Tensor().defined());
  EXPECT_EQ(TensorSpec::of(DType::float32, {-1, 2}).mismatch(Tensor::empty(DType::float32, {5, 2})), "");
  EXPECT_EQ(TensorSpec::of(DType::float32, {8}).mismatch(Tensor::empty(DType::float32, {7})),
            "expected float32[8], got float32[7]");
}

TEST(Tensor, AShapeWhoseBytesOverflowOrWithANegativeDimensionIsRefused) {
  // The byte count wrapped to 0: a 1-byte buffer behind numel() = 2^62 (a heap overflow).
  try {
    Tensor::empty(DType::float32, {std::int64_t{1} << 62});
    FAIL() << "a 2^64-byte tensor was made";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("[4611686018427387904] is too large"), std::string::npos)
        << e.what();
  }
  EXPECT_THROW(Tensor::empty(DType::uint8, {std::int64_t{1} << 32, std::int64_t{1} << 32}),
               std::invalid_argument);
  float buf[1] = {0};
  EXPECT_THROW(Tensor::view(buf, DType::float64, {std::int64_t{1} << 61, 4}), std::invalid_argument);
  try {
    Tensor::empty(DType::float32, {3, -2});
    FAIL();
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("[3, -2] has a negative dimension"), std::string::npos) << e.what();
  }
  EXPECT_EQ(Tensor::empty(DType::float32, {0, std::int64_t{1} << 62}).numel(), 0u);
}

TEST(RuntimeApi, RunsAnodeAndReturnsItsOutput) {
  Runtime rt(doubler());
  auto out = rt.submit({{"x", Tensor::from<float>({1, 2, 3}, {3})}}).result();
  ASSERT_EQ(out.count("y"), 1u);
  const Tensor& y = out["y"].front();
  EXPECT_EQ(y.describe(), "float32[3]");
  EXPECT_EQ(y.data<float>()[2], 6);
  const auto s = rt.stats();
  EXPECT_EQ(s.finished, 1u);
  EXPECT_EQ(s.node_runs, 1u);
}

TEST(RuntimeApi, StreamsLoopOutputsInOrderThroughNextAndACallback) {
  // count: a DynamicLoop that EMITs i = 0, 1, 2, ... and stops itself after `n` values.
  Model m;
  m.input("n", TensorSpec::of(DType::int32, {}));
  m.input("i", TensorSpec::of(DType::int32, {}));
  m.node("step", {"i", "n"}, {Edge::emit("value"), Edge::to_node("step", "i")}, [](NodeCall& c) {
    const int i = c.input("i").data<std::int32_t>()[0];
    c.output("value", Tensor::scalar<std::int32_t>(i));
    c.output("i", Tensor::scalar<std::int32_t>(i + 1));
    if (i + 1 >= c.input("n").data<std::int32_t>()[0]) c.stop("count");
  });
  m.walk("main", Section::dynamic_loop("count", "step", 100, {"i"}));
  Runtime rt(std::move(m));
  Request r = rt.submit({{"n", Tensor::scalar<std::int32_t>(7)}, {"i", Tensor::scalar<std::int32_t>(0)}});
  Output out;
  std::vector<int> seen;
  while (r.next(&out)) seen.push_back(out.value.data<std::int32_t>()[0]);
  EXPECT_EQ(seen, (std::vector<int>{0, 1, 2, 3, 4, 5, 6}));
  EXPECT_EQ(r.status(), RequestStatus::finished);
  EXPECT_EQ(r.timeline().size(), 7u);
  EXPECT_EQ(out.name, "value");

  std::mutex mu;
  std::vector<int> called;
  mstar::RequestOptions opt;
  opt.on_output = [&](mstar::RequestId, const Output& o) {
    std::lock_guard<std::mutex> lock(mu);
    called.push_back(o.value.data<std::int32_t>()[0]);
  };
  Request r2 = rt.submit({{"n", Tensor::scalar<std::int32_t>(3)}, {"i", Tensor::scalar<std::int32_t>(10)}}, opt);
  EXPECT_EQ(r2.wait(), RequestStatus::finished);
  std::lock_guard<std::mutex> lock(mu);
  EXPECT_EQ(called, (std::vector<int>{10}));  // 10 + 1 >= 3: stops after the first value
}

TEST(RuntimeApi, TwoWalksPersistValuesAndStreamWindowsToAConsumer) {
  // prefill: embed(text) -> h (persisted). decode: a fixed Loop of lm making tokens streamed in
  // windows of 2 to codec, which EMITs the sum of each window's new items.
  Model m;
  m.input("text", TensorSpec::of(DType::float32, {}));
  m.node("embed", {"text"}, {Edge::persisted("lm", "h")}, [](NodeCall& c) {
    c.output("h", Tensor::scalar<float>(first(c.input("text")) * 10));
  });
  m.node("lm", {"h"}, {Edge::to_node("lm", "h"), Edge::stream("codec", "tok", mstar::ChunkPolicy::fixed(2))},
         [](NodeCall& c) {
           const float h = first(c.input("h"));
           c.output("h", Tensor::scalar<float>(h + 1));
           c.output("tok", Tensor::scalar<float>(h));
         });
  m.node("codec", {"tok"}, {Edge::emit("audio")}, [](NodeCall& c) {
    ASSERT_NE(c.chunk(), nullptr);
    float sum = 0;
    for (const Tensor& t : c.list("tok")) sum += first(t);
    c.output("audio", Tensor::scalar<float>(sum));
  });
  m.walk("prefill", "embed");
  m.walk("decode", Section::par({Section::loop("lm", 5, {"h"}), "codec"}));
  m.next_walk([](mstar::RequestId, const std::string& done, const std::map<std::string, Tensor>& visible) {
    if (done != "prefill") return std::string();
    EXPECT_EQ(first(visible.at("h")), 10.0f);  // persisted across the walk boundary
    return std::string("decode");
  });
  Runtime rt(std::move(m));
  auto out = rt.submit({{"text", Tensor::scalar<float>(1)}}).result();
  std::vector<float> audio;
  for (const Tensor& t : out["audio"]) audio.push_back(first(t));
  // tokens 10..14 in windows [10, 11], [12, 13], [14] (the tail is flushed)
  EXPECT_EQ(audio, (std::vector<float>{21, 25, 14}));
  EXPECT_EQ(rt.stats().stored_tensors, 0u);
  EXPECT_EQ(rt.stats().live_handles, 0u);
}

TEST(RuntimeApi, BadInputIsRefusedWithAMessageNamingIt) {
  Runtime rt(doubler());
  try {
    rt.submit({{"x", Tensor::from<std::int64_t>({1}, {1})}});
    FAIL() << "an int64 input was accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("input 'x': expected float32[*], got int64[1]"), std::string::npos)
        << e.what();
  }
  try {
    rt.submit({{"z", Tensor::scalar<float>(1)}});
    FAIL();
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("['z'] are not declared"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("['x'] are missing"), std::string::npos) << e.what();
  }
  // The runtime still serves good requests.
  EXPECT_EQ(first(rt.submit({{"x", Tensor::from<float>({4}, {1})}}).result()["y"][0]), 8);
}

TEST(RuntimeApi, RefusesAPartItHasNoStateMachineFor) {
  Model m;
  m.input("x", TensorSpec::of(DType::float32, {-1}));
  m.node("double", {"x"}, {Edge::emit("y")}, [](NodeCall& c) { c.output("y", c.input("x")); });
  m.walk("main", Section::part("p", {{"only", "double"}}));
  try {
    Runtime rt(std::move(m));
    FAIL() << "a Part was accepted";
  } catch (const mstar::GraphError& e) {
    EXPECT_NE(std::string(e.what()).find("walk 'main' has Part 'p'"), std::string::npos) << e.what();
  }
}

TEST(RuntimeApi, ANodeThatThrowsFailsOnlyItsOwnRequest) {
  Model m;
  m.input("x", TensorSpec::of(DType::float32, {}));
  m.node("check", {"x"}, {Edge::emit("y")}, [](NodeCall& c) {
    if (first(c.input("x")) < 0) throw std::domain_error("x must be >= 0");
    c.output("y", c.input("x"));
  }, {"default", 8});
  m.walk("check", "check");
  Runtime rt(std::move(m));
  std::vector<Request> rs;
  for (int i = -2; i < 3; ++i) rs.push_back(rt.submit({{"x", Tensor::scalar<float>(static_cast<float>(i))}}));
  for (int i = 0; i < 5; ++i) {
    if (i < 2) {
      EXPECT_EQ(rs[i].wait(), RequestStatus::failed);
      EXPECT_EQ(rs[i].error(), "node 'check' in walk 'check' failed: x must be >= 0") << rs[i].error();
      EXPECT_THROW(rs[i].result(), mstar::RequestError);
    } else {
      EXPECT_EQ(first(rs[i].result()["y"][0]), static_cast<float>(i - 2));
    }
  }
  EXPECT_EQ(rt.stats().failed, 2u);
  EXPECT_EQ(rt.stats().stored_tensors, 0u);
}

TEST(RuntimeApi, AnUndeclaredOutputOrInputIsAnErrorNamingTheNode) {
  Model m;
  m.input("x");
  m.node("n", {"x"}, {Edge::emit("y")}, [](NodeCall& c) { c.output("nope", c.input("x")); });
  m.walk("w", "n");
  Runtime rt(std::move(m));
  Request r = rt.submit({{"x", Tensor::scalar<float>(1)}});
  EXPECT_EQ(r.wait(), RequestStatus::failed);
  EXPECT_NE(r.error().find("node 'n' has no output 'nope'; its outputs are 'y'"), std::string::npos)
      << r.error();
}

TEST(RuntimeApi, MalformedGraphsAreRefusedWithGraphError) {
  auto expect_graph_error = [](Model m, const std::string& part) {
    try {
      m.compile();
      FAIL() << "no GraphError; wanted: " << part;
    } catch (const mstar::GraphError& e) {
      EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
    }
  };
  auto noop = [](NodeCall&) {};
  {
    Model m;
    m.input("x").node("a", {"x"}, {Edge::emit("y")}, noop).walk("w", Section::seq({"a", "ghost"}));
    expect_graph_error(std::move(m), "walk 'w' runs node 'ghost', which is not in the graph");
  }
  {
    Model m;
    m.input("x").node("a", {"q"}, {Edge::emit("y")}, noop).walk("w", "a");
    expect_graph_error(std::move(m), "node 'a' in walk 'w' reads 'q', which no node produces");
  }
  {
    Model m;
    m.input("x").node("a", {"x"}, {Edge::to_node("b", "y")}, noop).walk("w", "a");
    expect_graph_error(std::move(m), "edge 'y' from 'a' goes to 'b', which is not a node");
  }
  {
    Model m;
    m.input("x").node("a", {"x"}, {Edge::emit("y")}, noop).walk("w", Section::seq({"a", "a"}));
    expect_graph_error(std::move(m), "node 'a' appears twice in walk 'w'");
  }
  {
    Model m;
    m.input("x")
        .node("p", {"x"}, {Edge::stream("c", "s", mstar::ChunkPolicy::fixed(1))}, noop)
        .node("c", {"s"}, {Edge::emit("y")}, noop)
        .walk("w", Section::loop(Section::seq({"p", "c"}), 3));
    expect_graph_error(std::move(m), "consumes the stream of 'p' inside the same Loop");
  }
  EXPECT_THROW(Runtime{Model{}}, mstar::GraphError);
}

TEST(RuntimeApi, CancelStopsALongRequestAndFreesEverything) {
  std::atomic<int> runs{0};
  Model m;
  m.input("i", TensorSpec::of(DType::int32, {}));
  m.node("slow", {"i"}, {Edge::emit("v"), Edge::to_node("slow", "i")}, [&](NodeCall& c) {
    ++runs;
    std::this_thread::sleep_for(1ms);
    c.output("v", c.input("i"));
    c.output("i", c.input("i"));
  });
  m.walk("main", Section::loop("slow", 100000, {"i"}));
  Runtime rt(std::move(m));
  Request r = rt.submit({{"i", Tensor::scalar<std::int32_t>(0)}});
  Output out;
  ASSERT_TRUE(r.next(&out));  // it is running
  EXPECT_TRUE(r.cancel());
  EXPECT_EQ(r.wait(), RequestStatus::cancelled);
  EXPECT_FALSE(r.cancel());  // already over
  while (r.next(&out, 0ns)) {
  }
  const int after = runs.load();
  std::this_thread::sleep_for(20ms);
  EXPECT_LE(runs.load(), after + 1);  // at most the execution in flight when it was cancelled
  rt.close();
  const auto s = rt.stats();
  EXPECT_EQ(s.cancelled, 1u);
  EXPECT_EQ(s.live_requests, 0u);
  EXPECT_EQ(s.live_handles, 0u);
  EXPECT_EQ(s.stored_tensors, 0u);
  EXPECT_THROW(rt.submit({{"i", Tensor::scalar<std::int32_t>(0)}}), std::logic_error);
}

// slow (20 ms) then fast, one execution per batch: a queue long enough to make deadlines matter.
Model slow_then_fast(std::atomic<int>* slow_runs) {
  Model m;
  m.input("x", TensorSpec::of(DType::float32, {}));
  m.node("slow", {"x"}, {Edge::to_node("fast", "x")}, [slow_runs](NodeCall& c) {
    ++*slow_runs;
    std::this_thread::sleep_for(20ms);
    c.output("x", c.input("x"));
  });
  m.node("fast", {"x"}, {Edge::emit("y")}, [](NodeCall& c) { c.output("y", c.input("x")); });
  m.walk("main", Section::seq({"slow", "fast"}));
  return m;
}

TEST(RuntimeApi, AKeptDeadlineFailsLateWorkAndRefusesWhatCannotStartInTime) {
  std::atomic<int> slow_runs{0};
  Runtime rt(slow_then_fast(&slow_runs));
  auto x = [] { return std::map<std::string, Tensor>{{"x", Tensor::scalar<float>(1)}}; };
  rt.submit(x()).wait();  // the runtime learns that "slow" takes ~20 ms
  // Queued behind a 20 ms execution, a request due in 5 ms fails instead of running late.
  Request busy = rt.submit(x());
  mstar::RequestOptions kept;
  kept.deadline = 5ms;
  kept.fail_late = true;
  while (slow_runs.load() < 2) std::this_thread::yield();  // busy's "slow" is running
  Request late = rt.submit(x(), kept);
  EXPECT_EQ(late.wait(), RequestStatus::failed);
  EXPECT_NE(late.error().find("deadline"), std::string::npos) << late.error();
  EXPECT_NE(late.error().find("'slow'"), std::string::npos) << late.error();
  // Ten requests due in 100 ms (~200 ms of work) are queued: one kept request due just after
  // them is refused at submit; without fail_late it would only have run late.
  std::vector<Request> queued;
  mstar::RequestOptions ordered;
  ordered.deadline = 100ms;
  for (int k = 0; k < 10; ++k) queued.push_back(rt.submit(x(), ordered));
  kept.deadline = 101ms;
  Request refused = rt.submit(x(), kept);
  EXPECT_EQ(refused.status(), RequestStatus::failed);  // at once, before anything ran
  EXPECT_NE(refused.error().find("deadline cannot be met"), std::string::npos) << refused.error();
  EXPECT_EQ(busy.wait(), RequestStatus::finished);
  for (Request& q : queued) EXPECT_EQ(q.wait(), RequestStatus::finished);
  rt.close();
  const auto s = rt.stats();
  EXPECT_EQ(s.expired, 2u);
  EXPECT_EQ(s.failed, 2u);
  EXPECT_EQ(s.live_requests, 0u);
  EXPECT_EQ(s.live_handles, 0u);
  EXPECT_EQ(s.stored_tensors, 0u);
}

TEST(RuntimeApi, ARequestOutlivesItsRuntime) {
  Request r = [] {
    Runtime rt(doubler());
    Request q = rt.submit({{"x", Tensor::from<float>({1}, {1})}});
    q.wait();
    return q;
  }();
  EXPECT_EQ(r.status(), RequestStatus::finished);
  EXPECT_FALSE(r.cancel());
  EXPECT_EQ(first(r.result()["y"][0]), 2);
}

TEST(RuntimeApi, BatchNodesSeeSeveralRequestsAtOnce) {
  std::atomic<std::size_t> largest{0};
  std::mutex gate_mu;
  std::condition_variable gate;
  bool open = false;
  Model m;
  m.input("x", TensorSpec::of(DType::float32, {}));
  m.node("first", {"x"}, {Edge::to_node("sum", "x1")}, [&](NodeCall& c) {
    std::unique_lock<std::mutex> lock(gate_mu);  // hold requests here until all are queued
    gate.wait(lock, [&] { return open; });
    c.output("x1", c.input("x"));
  }, {"front", 1});
  m.batch_node("sum", {"x1"}, {Edge::emit("y")}, [&](const std::vector<NodeCall*>& batch) {
    std::size_t seen = largest.load();
    while (batch.size() > seen && !largest.compare_exchange_weak(seen, batch.size())) {
    }
    for (NodeCall* c : batch) c->output("y", Tensor::scalar<float>(first(c->input("x1")) + 1));
  }, {"back", 8});
  m.walk("main", Section::seq({"first", "sum"}));
  Runtime rt(std::move(m));
  std::vector<Request> rs;
  for (int i = 0; i < 6; ++i) rs.push_back(rt.submit({{"x", Tensor::scalar<float>(static_cast<float>(i))}}));
  {
    std::lock_guard<std::mutex> lock(gate_mu);
    open = true;
  }
  gate.notify_all();
  for (int i = 0; i < 6; ++i) EXPECT_EQ(first(rs[i].result()["y"][0]), i + 1.0f);
  EXPECT_GE(largest.load(), 1u);
  EXPECT_EQ(rt.stats().node_runs, 12u);
}

TEST(RuntimeApi, LoadsAnIrCompiledElsewhereAndBindsItsNodes) {
  const mstar::GraphSpec ir = doubler().compile();
  Model m = Model::load(ir, {"x"});
  EXPECT_THROW(m.compile(), mstar::GraphError);  // the loaded nodes have no functions yet
  m.bind("double", [](NodeCall& c) {
    c.output("y", Tensor::scalar<float>(first(c.input("x")) + 100));
  });
  EXPECT_THROW(m.bind("ghost", [](NodeCall&) {}), mstar::GraphError);
  Runtime rt(std::move(m));
  EXPECT_EQ(first(rt.submit({{"x", Tensor::scalar<float>(1)}}).result()["y"][0]), 101);
}

TEST(RuntimeControl, ALoopDrainsTheBufferAPolicyRequestFills) {
  // A policy model: obs (float32 [1]) -> chunk of 4 actions (A = 1): obs, obs+1, obs+2, obs+3.
  Model m;
  m.input("obs", TensorSpec::of(DType::float32, {1}));
  m.node("policy", {"obs"}, {Edge::emit("actions")}, [](NodeCall& c) {
    const float o = first(c.input("obs"));
    c.output("actions", Tensor::from<float>({o, o + 1, o + 2, o + 3}, {4, 1}));
  });
  m.walk("act", "policy");
  Runtime rt(std::move(m));
  mstar::ActionChunkOptions ao;
  ao.horizon = 4;
  ao.action_dim = 1;
  auto actions = Runtime::make_action_buffer(ao);
  auto clock = std::make_shared<mstar::SimulatedClock>();
  mstar::ControlLoopOptions lo;
  lo.rate_hz = 100;
  std::vector<float> got;
  std::vector<bool> fresh;
  auto loop = Runtime::make_control_loop(lo, actions, [&](const mstar::TickInfo&, const float* a, bool f) {
    got.push_back(a[0]);
    fresh.push_back(f);
  }, clock);
  // One chunk for tick 0 from a request; the loop pops it over 4 ticks, then starves (holds).
  Tensor chunk = rt.submit({{"obs", Tensor::from<float>({10}, {1})}}).result()["actions"][0];
  ASSERT_TRUE(actions->publish(chunk.data<float>(), 4, 0));
  loop->run(6);
  EXPECT_EQ(got, (std::vector<float>{10, 11, 12, 13, 13, 13}));
  EXPECT_EQ(fresh, (std::vector<bool>{true, true, true, true, false, false}));
  EXPECT_EQ(actions->stats().starved_ticks, 2u);
}

TEST(RuntimeControl, TheTickPopsAndObservesWithoutAllocating) {
  mstar::ActionChunkOptions ao;
  ao.horizon = 64;
  ao.action_dim = 2;
  ao.mode = mstar::MergeMode::rtc;
  auto actions = Runtime::make_action_buffer(ao);
  mstar::ChunkFeederOptions fo;
  fo.obs_dim = 8;
  // Not started: only the tick side runs, so every allocation counted would be the tick's.
  mstar::ChunkFeeder feeder(actions, fo, [](const Tensor&, std::uint64_t) { return Tensor(); });
  std::vector<float> chunk(64 * 2, 1.0f);
  auto clock = std::make_shared<mstar::SimulatedClock>();
  mstar::ControlLoopOptions lo;
  lo.rate_hz = 1000;
  std::uint64_t at_first = 0, at_last = 0;
  float obs[8] = {};
  auto loop = Runtime::make_control_loop(lo, actions, [&](const mstar::TickInfo& t, const float* a, bool) {
    if (t.tick == 0) at_first = g_allocations.load();
    obs[0] = a[0];
    feeder.observe(obs, t.tick + 1);  // the plan runs short at times: the refill-due path too
    at_last = g_allocations.load();
  }, clock);
  ASSERT_TRUE(actions->publish(chunk.data(), 64, 0));
  loop->run(200);
  EXPECT_EQ(at_last, at_first);
  EXPECT_GT(actions->stats().starved_ticks, 0u);  // ran past the chunk: the starved path ran too
}

TEST(RuntimeApi, CloseFromInsideANodeIsRefusedAndAnotherThreadStillCloses) {
  Model m;
  m.input("x", TensorSpec::of(DType::float32, {1}));
  Runtime* self = nullptr;
  std::string refused;
  m.node("closer", {"x"}, {Edge::emit("y")}, [&](NodeCall& c) {
    try {
      self->close();  // joining its own thread used to abort the process
    } catch (const std::logic_error& e) {
      refused = e.what();
    }
    c.output("y", c.input("x"));
  });
  m.walk("main", "closer");
  Runtime rt(std::move(m));
  self = &rt;
  auto r = rt.submit({{"x", Tensor::from<float>({1}, {1})}});
  EXPECT_EQ(r.wait(std::chrono::seconds(30)), RequestStatus::finished) << r.error();
  EXPECT_NE(refused.find("own worker threads"), std::string::npos) << refused;
  rt.close();  // from this thread: closes
  EXPECT_THROW(rt.submit({{"x", Tensor::from<float>({1}, {1})}}), std::logic_error);
}

TEST(RuntimeControl, AChunkFeederRefusesBadChunksAndSurvivesAnyException) {
  mstar::ActionChunkOptions ao;
  ao.horizon = 4;
  ao.action_dim = 1;
  mstar::ChunkFeederOptions fo;
  fo.obs_dim = 1;
  const float inf = std::numeric_limits<float>::infinity();
  struct Case {
    std::function<Tensor()> make;
    const char* error;
    bool failure;
  };
  const std::vector<Case> cases = {
      {[] { return Tensor::from<float>({1, 2, std::nanf(""), 4}, {4, 1}); }, "NaN or infinite", false},
      {[&] { return Tensor::from<float>({inf, 2}, {2, 1}); }, "NaN or infinite", false},
      {[] { return Tensor::from<float>({1, 2, 3, 4, 5}, {5, 1}); }, "1 <= n <= 4", false},
      {[]() -> Tensor { throw 7; }, "not a std::exception", true},
  };
  for (const Case& c : cases) {
    auto actions = Runtime::make_action_buffer(ao);
    mstar::ChunkFeeder feeder(actions, fo, [&](const Tensor&, std::uint64_t) { return c.make(); });
    feeder.start();
    const float obs = 0;
    for (int i = 0; i < 200 && feeder.stats().rejected + feeder.stats().failures == 0; ++i) {
      feeder.observe(&obs, 0);
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    feeder.stop();
    const auto fs = feeder.stats();
    EXPECT_EQ(fs.chunks, 0u);
    EXPECT_EQ(c.failure ? fs.failures : fs.rejected, fs.failures + fs.rejected);
    EXPECT_GT(fs.failures + fs.rejected, 0u);
    EXPECT_NE(feeder.last_error().find(c.error), std::string::npos) << feeder.last_error();
    float out = -1;
    EXPECT_FALSE(actions->pop(0, &out)) << "nothing reached the loop";
  }
}

TEST(RuntimeControl, AChunkFeederKeepsAFixedRateLoopFed) {
  // The policy answers obs -> 8 actions equal to the observation's tick; the loop observes
  // every tick. On the simulated clock the loop runs as fast as it can, so the feeder has to
  // keep up in real time: pace the loop with a short real sleep per tick.
  Model m;
  m.input("obs", TensorSpec::of(DType::float32, {1}));
  m.node("policy", {"obs"}, {Edge::emit("actions")}, [](NodeCall& c) {
    std::vector<float> v(8, first(c.input("obs")));
    c.output("actions", Tensor::from<float>(v, {8, 1}));
  });
  m.walk("act", "policy");
  Runtime rt(std::move(m));
  mstar::ActionChunkOptions ao;
  ao.horizon = 8;
  ao.action_dim = 1;
  auto actions = Runtime::make_action_buffer(ao);
  mstar::ChunkFeederOptions fo;
  fo.obs_dim = 1;
  mstar::ChunkFeeder feeder(actions, fo, [&](const Tensor& obs, std::uint64_t) {
    return rt.submit({{"obs", obs}}).result().at("actions").front();
  });
  mstar::ControlLoopOptions lo;
  lo.rate_hz = 200;
  std::uint64_t starved_after_start = 0, applied_ticks = 0;
  auto loop = Runtime::make_control_loop(lo, actions, [&](const mstar::TickInfo& t, const float*, bool f) {
    if (f) ++applied_ticks;
    else if (applied_ticks > 0) ++starved_after_start;
    const float obs = static_cast<float>(t.tick + 1);
    feeder.observe(&obs, t.tick + 1);
  });
  feeder.start();
  loop->run(200);  // 1 s at 200 Hz
  feeder.stop();
  const auto fs = feeder.stats();
  EXPECT_GT(fs.chunks, 10u);
  EXPECT_EQ(fs.failures, 0u) << feeder.last_error();
  EXPECT_GT(applied_ticks, 150u);
  // No strict zero here: on a loaded 2-core machine a worker can be descheduled for longer than
  // the 4 ticks of slack; the example reports starvation at 100 Hz under its own test.
  EXPECT_LT(starved_after_start, 40u);
}

}  // namespace

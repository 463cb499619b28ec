// Stream conformance under any timing, through the C++ runtime API: for random chunk policies,
// stream lengths from 0 to several chunks and random sleeps in the producer and the consumer
// (so the consumer runs before, during and after the producer's last iterations), the windows a
// consumer sees are exactly the policy's table, never empty, and a consumer with on_stream_end()
// hears the end exactly once, last. (tests/python/test_stream_conformance.py does the same for
// the Python Runtime and a placement worker.)
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "mstar/runtime.hpp"

namespace {

using mstar::ChunkPolicy;
using mstar::DType;
using mstar::Edge;
using mstar::Model;
using mstar::NodeCall;
using mstar::NodeOptions;
using mstar::Runtime;
using mstar::Section;
using mstar::Tensor;
using mstar::TensorSpec;

constexpr float kItem0 = 100;  // stream position p carries kItem0 + p
constexpr float kEnd = -1;     // an on_stream_end call EMITs [kEnd]

struct Table {
  std::vector<std::size_t> first;
  std::size_t steady = 1, context = 0;
};

struct Case {
  ChunkPolicy policy = ChunkPolicy::fixed(1);
  Table table;
};

/// The policy's windows over n items, {begin, new_begin, end} each (see chunk_policy.hpp).
std::vector<std::vector<float>> windows_of(const Table& t, std::size_t n) {
  std::vector<std::vector<float>> out;
  for (std::size_t nb = 0, i = 0; nb < n; ++i) {
    const std::size_t size = i < t.first.size() ? t.first[i] : t.steady;
    out.push_back({static_cast<float>(nb > t.context ? nb - t.context : 0),
                   static_cast<float>(nb), static_cast<float>(std::min(nb + size, n))});
    nb += size;
  }
  return out;
}

Case random_case(std::mt19937& rng) {
  auto pick = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  Case c;
  switch (pick(0, 3)) {
    case 0: {
      const std::size_t k = pick(1, 5);
      c.policy = ChunkPolicy::fixed(k);
      c.table = {{}, k, 0};
      break;
    }
    case 1: {
      const std::size_t w = pick(1, 6), s = pick(1, static_cast<int>(w));
      c.policy = ChunkPolicy::sliding_window(w, s);
      c.table = {{w}, s, w - s};
      break;
    }
    case 2: {
      const std::size_t ctx = pick(0, 4), l = pick(1, 5);
      c.policy = ChunkPolicy::left_context(ctx, l);
      c.table = {{}, l, ctx};
      break;
    }
    default: {
      std::vector<std::size_t> first(pick(0, 3));
      for (auto& f : first) f = pick(1, 4);
      const std::size_t steady = pick(1, 5), ctx = pick(0, 3);
      c.policy = ChunkPolicy::ramp(first, steady, ctx);
      c.table = {first, steady, ctx};
    }
  }
  return c;
}

void sleep_at(const Tensor& delays_us, std::size_t k) {
  if (k < delays_us.numel() && delays_us.data<float>()[k] > 0)
    std::this_thread::sleep_for(std::chrono::microseconds(
        static_cast<long>(delays_us.data<float>()[k])));
}

/// gen (a DynamicLoop, producing n stream items, sleeping pd[i]) streams `tok` to `use`, which
/// sleeps cd[k] at its k-th window and EMITs [begin, new_begin, end, last, items...].
Model stream_model(const ChunkPolicy& policy, bool parallel, bool hears_end) {
  Model m;
  m.input("n", TensorSpec::of(DType::int32, {}));
  m.input("pd", TensorSpec::of(DType::float32, {-1}));
  m.input("cd", TensorSpec::of(DType::float32, {-1}));
  m.node("gen", {"n", "pd"}, {Edge::stream("use", "tok", policy)}, [](NodeCall& c) {
    const std::uint32_t i = c.iteration();
    const auto n = static_cast<std::uint32_t>(c.input("n").data<std::int32_t>()[0]);
    sleep_at(c.input("pd"), i);
    if (i < n) c.output("tok", Tensor::scalar<float>(kItem0 + static_cast<float>(i)));
    if (i + 1 >= std::max<std::uint32_t>(n, 1)) c.stop("gen");
  }, NodeOptions{"producer", 1});
  m.node("use", {"tok", "cd"}, {Edge::emit("win")}, [](NodeCall& c) {
    const mstar::Chunk* w = c.chunk();
    ASSERT_NE(w, nullptr);
    EXPECT_FALSE(c.stream_ended());
    // The k-th window of this stream is the one whose index is k.
    sleep_at(c.input("cd"), static_cast<std::size_t>(w->index));
    std::vector<float> v = {static_cast<float>(w->begin), static_cast<float>(w->new_begin),
                            static_cast<float>(w->end), w->last ? 1.0f : 0.0f};
    for (const Tensor& t : c.list("tok")) v.push_back(t.data<float>()[0]);
    const auto size = static_cast<std::int64_t>(v.size());
    c.output("win", Tensor::from<float>(v, {size}));
  }, NodeOptions{"consumer", 1});
  if (hears_end)
    m.on_stream_end("use", [](NodeCall& c) {
      EXPECT_EQ(c.chunk(), nullptr);
      EXPECT_TRUE(c.stream_ended());
      EXPECT_TRUE(c.list("tok").empty());
      c.output("win", Tensor::from<float>({kEnd}, {1}));
    });
  const Section loop = Section::dynamic_loop("gen", "gen", 1024);
  m.walk("main", parallel ? Section::par({loop, "use"}) : Section::seq({loop, "use"}));
  return m;
}

Tensor delays(std::mt19937& rng, std::size_t max_len) {
  static const float kChoices[] = {0, 0, 0, 0, 200, 1000, 3000};  // microseconds
  std::vector<float> v(std::uniform_int_distribution<std::size_t>(0, max_len)(rng));
  for (float& d : v) d = kChoices[std::uniform_int_distribution<int>(0, 6)(rng)];
  return Tensor::from<float>(v, {static_cast<std::int64_t>(v.size())});
}

TEST(StreamConformance, WindowsAreThePolicysUnderAnyTimingInTheCppRuntime) {
  std::mt19937 rng(20261201);
  int ended_by_item = 0, ended_by_window = 0;
  for (int trial = 0; trial < 48; ++trial) {
    const Case c = random_case(rng);
    const bool parallel = rng() % 3 != 0, hears_end = rng() % 4 != 0;
    SCOPED_TRACE(c.policy.describe() + (parallel ? " parallel" : " sequential") +
                 (hears_end ? " on_stream_end" : ""));
    Runtime rt(stream_model(c.policy, parallel, hears_end));
    std::vector<std::pair<std::size_t, mstar::Request>> requests;
    for (int k = 0, count = 1 + static_cast<int>(rng() % 3); k < count; ++k) {
      const std::size_t n = rng() % 17;
      requests.emplace_back(n, rt.submit({{"n", Tensor::scalar<std::int32_t>(static_cast<std::int32_t>(n))},
                                          {"pd", delays(rng, n + 1)},
                                          {"cd", delays(rng, n + 1)}}));
    }
    for (auto& [n, request] : requests) {
      SCOPED_TRACE("n = " + std::to_string(n));
      const auto out = request.result();
      const auto it = out.find("win");
      const std::vector<Tensor> none;
      const std::vector<Tensor>& got = it == out.end() ? none : it->second;
      const auto want = windows_of(c.table, n);
      std::size_t windows = 0, ends = 0;
      bool last_window_said_last = false;
      for (std::size_t k = 0; k < got.size(); ++k) {
        const float* v = got[k].data<float>();
        if (got[k].numel() == 1 && v[0] == kEnd) {
          ++ends;
          EXPECT_EQ(k + 1, got.size()) << "the end came last";
          continue;
        }
        ASSERT_LT(windows, want.size()) << "more windows than the policy makes";
        const auto& w = want[windows++];
        EXPECT_EQ(std::vector<float>(v, v + 3), w) << "window " << k;
        ASSERT_EQ(got[k].numel(), 4 + static_cast<std::size_t>(w[2] - w[0]));
        for (std::size_t p = 0; p < got[k].numel() - 4; ++p) EXPECT_EQ(v[4 + p], kItem0 + w[0] + p);
        last_window_said_last = v[3] == 1.0f;
        if (windows < want.size()) {
          EXPECT_FALSE(last_window_said_last) << "only the final window";
        }
      }
      EXPECT_EQ(windows, want.size());
      if (!parallel && n > 0) {
        EXPECT_TRUE(last_window_said_last);
      }
      if (hears_end) {
        EXPECT_EQ(ends + (last_window_said_last ? 1 : 0), 1u) << "the end is heard exactly once";
        ended_by_item += static_cast<int>(ends);
        ended_by_window += last_window_said_last ? 1 : 0;
      } else {
        EXPECT_EQ(ends, 0u);
      }
    }
    EXPECT_EQ(rt.stats().live_handles, 0u);
    EXPECT_EQ(rt.stats().stored_tensors, 0u);
  }
  // Both ways a stream ends were exercised.
  EXPECT_GT(ended_by_item, 0);
  EXPECT_GT(ended_by_window, 0);
}

}  // namespace

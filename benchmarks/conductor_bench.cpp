// The Conductor alone, with C++ no-op nodes: benchmarks/conductor.py's "cpp" cells.
//
//   conductor_bench WALK CONCURRENT ROUNDS      (WALK: chain10 | loop100 | dynamic256)
//
// Builds the walk with the C++ model builder, runs ROUNDS rounds of CONCURRENT requests through a
// Conductor whose one engine worker completes every item at once with fresh handles (what an
// engine of nodes that do nothing would report), and prints "us_per_node <µs per node execution>".
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "mstar/conductor.hpp"
#include "mstar/model.hpp"

namespace {

constexpr std::uint32_t kDynSteps = 256;

struct Walk {
  mstar::GraphSpec ir;
  std::uint32_t nodes_per_request;
  mstar::NameId input;
  int stop_loop = -1;  // DynamicLoop name id to stop at iteration kDynSteps - 1
};

mstar::NameId name_id(const mstar::GraphSpec& ir, const std::string& name) {
  for (std::size_t i = 0; i < ir.names.size(); ++i)
    if (ir.names[i] == name) return static_cast<mstar::NameId>(i);
  std::fprintf(stderr, "no name %s\n", name.c_str());
  std::exit(2);
}

Walk build(const std::string& walk) {
  mstar::Model m;
  const mstar::NodeOptions batched{"default", 64};
  const auto noop = [](mstar::NodeCall&) {};
  if (walk == "chain10") {
    m.input("x0");
    std::vector<mstar::Section> parts;
    for (int i = 0; i < 10; ++i) {
      const std::string n = "n" + std::to_string(i), next = "x" + std::to_string(i + 1);
      const std::string to = i < 9 ? "n" + std::to_string(i + 1) : mstar::kEmit;
      m.node(n, {"x" + std::to_string(i)}, {mstar::Edge::to_node(to, next)}, noop, batched);
      parts.emplace_back(n);
    }
    m.walk("chain", mstar::Section::seq(parts));
    mstar::GraphSpec ir = m.compile();
    return {ir, 10, name_id(ir, "x0")};
  }
  m.input("x");
  m.node("step", {"x"}, {mstar::Edge::to_node("step", "x")}, noop, batched);
  if (walk == "loop100") {
    m.walk("loop", mstar::Section::loop("step", 100, {"x"}));
    mstar::GraphSpec ir = m.compile();
    return {ir, 100, name_id(ir, "x")};
  }
  if (walk == "dynamic256") {
    m.walk("decode", mstar::Section::dynamic_loop("gen", "step", 10 * kDynSteps, {"x"}));
    mstar::GraphSpec ir = m.compile();
    Walk w{ir, kDynSteps, name_id(ir, "x")};
    w.stop_loop = static_cast<int>(name_id(ir, "gen"));
    return w;
  }
  std::fprintf(stderr, "unknown walk %s (chain10 | loop100 | dynamic256)\n", walk.c_str());
  std::exit(2);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 4) {
    std::fprintf(stderr, "usage: conductor_bench WALK CONCURRENT ROUNDS\n");
    return 2;
  }
  const Walk walk = build(argv[1]);
  const int concurrent = std::atoi(argv[2]), rounds = std::atoi(argv[3]);
  mstar::Conductor conductor(walk.ir);

  std::mutex mu;
  std::condition_variable cv;
  std::uint64_t finished = 0;
  bool stop = false;
  std::thread worker([&] {
    std::vector<const mstar::WorkItem*> batch;
    std::vector<mstar::Completion> done;
    mstar::Outcome out;
    mstar::Handle next_handle = 1;
    while (true) {
      {
        std::lock_guard<std::mutex> lock(mu);
        if (stop) return;
      }
      conductor.next_batch(0, 64, std::chrono::milliseconds(20), &batch);
      if (batch.empty()) continue;
      done.resize(batch.size());
      for (std::size_t i = 0; i < batch.size(); ++i) {
        const mstar::WorkItem* w = batch[i];
        done[i].item = w->id;
        done[i].outputs.assign(walk.ir.nodes[w->node].outputs.size(), 0);
        for (mstar::Handle& h : done[i].outputs) h = next_handle++;
        done[i].stop_loops.clear();
        if (walk.stop_loop >= 0 && w->iteration + 1 >= kDynSteps)
          done[i].stop_loops.push_back(static_cast<mstar::NameId>(walk.stop_loop));
      }
      out = mstar::Outcome{};
      conductor.complete(done, &out);
      std::uint64_t ended = out.failed.size();
      for (mstar::RequestId r : out.walks_done) {
        conductor.finish(r, &out);
        conductor.forget(r);
        ++ended;
      }
      if (ended) {
        std::lock_guard<std::mutex> lock(mu);
        finished += ended;
        cv.notify_all();
      }
    }
  });

  const auto t0 = std::chrono::steady_clock::now();
  std::uint64_t submitted = 0;
  for (int round = 0; round < rounds; ++round) {
    for (int k = 0; k < concurrent; ++k) {
      mstar::Outcome out;
      conductor.submit(0, {{walk.input, static_cast<mstar::Handle>(1) << 62}}, {}, &out);
    }
    submitted += static_cast<std::uint64_t>(concurrent);
    std::unique_lock<std::mutex> lock(mu);
    if (!cv.wait_for(lock, std::chrono::seconds(60), [&] { return finished >= submitted; })) {
      std::fprintf(stderr, "conductor_bench: requests did not finish\n");
      std::_Exit(1);
    }
  }
  const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  {
    std::lock_guard<std::mutex> lock(mu);
    stop = true;
  }
  conductor.shutdown();
  worker.join();
  std::printf("us_per_node %.6f\n",
              elapsed * 1e6 / (static_cast<double>(rounds) * concurrent * walk.nodes_per_request));
  return 0;
}

// ChunkFeeder against the rules of its header: one policy call per plan the loop has not taken
// in yet, and a stop() from several threads at once.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "mstar/chunk_feeder.hpp"

namespace {

using namespace std::chrono_literals;
using mstar::ActionChunkBuffer;
using mstar::ActionChunkOptions;
using mstar::ChunkFeeder;
using mstar::ChunkFeederOptions;
using mstar::Tensor;

std::shared_ptr<ActionChunkBuffer> buffer_of(std::size_t horizon) {
  ActionChunkOptions ao;
  ao.horizon = horizon;
  ao.action_dim = 1;
  return std::make_shared<ActionChunkBuffer>(ao);
}

ChunkFeederOptions feeder_options(std::size_t refill_below) {
  ChunkFeederOptions fo;
  fo.obs_dim = 1;
  fo.refill_below = refill_below;
  return fo;
}

template <class F>
bool eventually(F done, std::chrono::milliseconds within = 5000ms) {
  const auto end = std::chrono::steady_clock::now() + within;
  while (!done()) {
    if (std::chrono::steady_clock::now() > end) return false;
    std::this_thread::sleep_for(1ms);
  }
  return true;
}

TEST(ChunkFeeder, AChunkPublishedBetweenPopAndObserveIsNotAskedForAgain) {
  // A chunk published while the tick ran (after its pop, before its observe) made the feeder
  // ask again: the observation still saw the old plan run short.
  auto buffer = buffer_of(10);
  const ChunkFeederOptions fo = feeder_options(5);
  std::mutex mu;
  std::condition_variable cv;
  bool gate = true;  // infer may return
  std::atomic<int> calls{0};
  ChunkFeeder feeder(buffer, fo, [&](const Tensor&, std::uint64_t t) {
    ++calls;
    std::unique_lock<std::mutex> lock(mu);
    cv.wait(lock, [&] { return gate; });
    std::vector<float> v(10);
    for (int i = 0; i < 10; ++i) v[i] = static_cast<float>(t + i);
    return Tensor::from<float>(v, {10, 1});
  });
  feeder.start();
  float obs = 0, action = 0;
  feeder.observe(&obs, 0);
  ASSERT_TRUE(eventually([&] { return buffer->stats().published == 1; }));
  {
    std::lock_guard<std::mutex> lock(mu);
    gate = false;  // the next inference waits until the tick below has popped
  }
  for (std::uint64_t n = 0; n < 6; ++n) {
    buffer->pop(n, &action);
    feeder.observe(&obs, n + 1);  // at 6 the plan runs short: a refill is due
  }
  ASSERT_TRUE(eventually([&] { return calls.load() == 2; }));
  buffer->pop(6, &action);  // the tick pops before the chunk lands ...
  {
    std::lock_guard<std::mutex> lock(mu);
    gate = true;
  }
  cv.notify_all();
  ASSERT_TRUE(eventually([&] { return buffer->stats().published == 2; }));
  feeder.observe(&obs, 7);  // ... and observes after it: the old plan, 3 actions left
  std::this_thread::sleep_for(100ms);
  EXPECT_EQ(calls.load(), 2);  // not asked again for a plan the loop has not taken in
  buffer->pop(7, &action);  // taken in: 8 actions left from tick 8
  feeder.observe(&obs, 8);
  std::this_thread::sleep_for(50ms);
  EXPECT_EQ(calls.load(), 2);
  feeder.stop();
}

TEST(ChunkFeeder, StopFromSeveralThreadsAtOnceJoinsOnce) {
  // Two joins of one thread hung (a watchdog and the main thread stopping together).
  auto buffer = buffer_of(4);
  for (int round = 0; round < 50; ++round) {
    ChunkFeeder feeder(buffer, feeder_options(0), [](const Tensor&, std::uint64_t) {
      return Tensor::from<float>({0, 0}, {2, 1});
    });
    feeder.start();
    std::thread a([&] { feeder.stop(); });
    std::thread b([&] { feeder.stop(); });
    a.join();
    b.join();
  }
}

}  // namespace

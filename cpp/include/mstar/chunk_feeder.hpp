// mstar/chunk_feeder.hpp — runs a chunk policy on its own thread and keeps an ActionChunkBuffer
// filled for a control loop.
//
// The control tick hands its observation over with observe(): a copy into a lock-free triple
// buffer (no lock, no allocation; a futex wake only when the feeder sleeps and the plan runs
// short). The feeder thread takes the newest observation, and when the plan holds fewer than
// `refill_below` actions from its tick on, calls the policy (a C++ Runtime request, or an
// embedded Python model: whatever `infer` does, on this thread, never on the tick's) and
// publishes the chunk stamped with the observation's tick; the buffer drops what the delay made
// stale and merges the rest. One chunk per observation: after publishing it waits for an
// observation made after the loop took the chunk in, so a plan the loop has not merged yet is
// not asked for twice. stop() may be called from several threads at once (one joins).
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "mstar/action_chunk_buffer.hpp"
#include "mstar/control_loop.hpp"
#include "mstar/tensor.hpp"

namespace mstar {

struct ChunkFeederOptions {
  std::size_t obs_dim = 0;        ///< floats per observation
  std::size_t refill_below = 0;   ///< ask for a chunk when fewer actions are left (0: H / 2)
  double latency_max_ms = 1000;   ///< range of the inference latency histogram
};

/// The policy: observation (float32 [obs_dim]) taken at `obs_tick` -> chunk (float32 [n, A],
/// n <= H). An exception counts as a failure; the feeder retries on the next observation.
using InferFn = std::function<Tensor(const Tensor& obs, std::uint64_t obs_tick)>;

struct ChunkFeederStats {
  std::uint64_t chunks = 0;    ///< published
  std::uint64_t rejected = 0;  ///< refused: bad shape, a NaN/inf action (last_error() says) or no free slot
  std::uint64_t failures = 0;  ///< infer threw
  double latency_p50_ms = 0, latency_p99_ms = 0, latency_max_ms = 0;
};

class ChunkFeeder {
 public:
  /// Throws std::invalid_argument for obs_dim 0, no buffer or no infer function.
  ChunkFeeder(std::shared_ptr<ActionChunkBuffer> actions, ChunkFeederOptions options, InferFn infer);
  ~ChunkFeeder();  ///< stops
  ChunkFeeder(const ChunkFeeder&) = delete;
  ChunkFeeder& operator=(const ChunkFeeder&) = delete;

  void start();  ///< starts the feeder thread (throws std::logic_error if running)
  void stop();   ///< ends and joins it (waits for an inference in progress)

  /// Control tick: the observation (obs_dim floats) for tick `obs_tick`, the tick the next
  /// action popped will be for. No lock, no allocation.
  void observe(const float* obs, std::uint64_t obs_tick) noexcept;

  /// Counters are live; the latency percentiles are filled in once stopped.
  ChunkFeederStats stats() const;
  std::string last_error() const;

 private:
  struct Slot {
    std::vector<float> obs;
    std::uint64_t tick = 0;
    std::size_t left = 0;
    std::uint64_t consumed = 0;  // chunks the loop had taken in when it was observed
  };
  void run();

  std::shared_ptr<ActionChunkBuffer> actions_;
  ChunkFeederOptions options_;
  InferFn infer_;
  // Triple buffer: the tick writes slots_[back_], then swaps it with middle_ (bit 4: fresh); the
  // feeder swaps middle_ with its front_ when fresh. Neither side ever waits for the other.
  Slot slots_[3];
  std::atomic<std::uint32_t> middle_{1};
  std::uint32_t back_ = 0;  // tick thread
  std::uint32_t front_ = 2; // feeder thread
  std::vector<float> plan_;  // tick thread: scratch for remaining()
  std::atomic<std::uint32_t> seq_{0};  // futex word: bumped by the tick when a refill is due
  std::atomic<bool> sleeping_{false}, stop_{false}, running_{false};
  std::atomic<std::uint64_t> chunks_{0}, rejected_{0}, failures_{0};
  Histogram latency_;  // feeder thread
  mutable std::mutex error_mu_;
  std::string last_error_;
  std::mutex control_mu_;  // start/stop: who joins the thread
  std::thread thread_;
};

}  // namespace mstar

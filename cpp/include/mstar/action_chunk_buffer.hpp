// mstar/action_chunk_buffer.hpp — chunks of actions in, one action per control tick out.
//
// A policy produces chunks of up to H actions (each A floats) from an observation taken at
// control tick t0: action k of the chunk is meant for tick t0 + k. Inference takes time, so by
// the time the chunk is published the loop is already at tick tc = t0 + d: the first d actions
// are stale (the old chunk executed those ticks) and are never used. The control loop pops
// exactly one action per tick and never waits or locks: publish() hands the chunk over through a
// lock-free ring of preallocated chunk slots (see spsc_ring.hpp); pop() picks up the newest
// published chunk at the start of a tick and merges it into the plan it is executing.
//
// Merge modes, for tick tau >= tc with new-chunk index k = tau - t0 and old plan action old(tau).
// The new plan covers [tc, t0 + count): it ends where the new chunk ends (an old tail beyond it
// is dropped), and wherever the old plan has no action for tau, a = new(k) in every mode.
//   latest    a = new(k)                              (switch at once; can jump)
//   weighted  a = (1 - w) * old(tau) + w * new(k)
//             w = weight_new (LeRobot blends 0.3 old + 0.7 new by default)
//   rtc       real-time chunking (Black et al. 2025): the new chunk's first d actions are frozen to
//             what the old plan executes (here: they are skipped, tau >= tc means k >= d) and the
//             overlap is blended with prefix weights W(k): 1 for k < d, decaying over
//             [d, H - s) by the schedule (linear, exp, ones, zeros), 0 from H - s on:
//             a = W(k) * old(tau) + (1 - W(k)) * new(k).
//   with c(k) = (H - s - k) / (H - s - d + 1) for d <= k < H - s:
//   linear  W(k) = c(k)
//   exp     W(k) = c(k) * (e^c(k) - 1) / (e - 1)       (the schedule Black et al. use)
//   ones    W(k) = 1 over [d, H - s)     zeros   W(k) = 0 over [d, H - s)
// A chunk with d >= count has nothing left for the future: it is stale and the old plan stays.
// A chunk stamped ahead of the loop (obs_tick > tc) is taken as observed at tc (d = 0).
// Starvation: a tick for which no plan has an action; pop() then returns false and repeats the
// last action it gave (the safe "hold"). Switch discontinuity: max over coordinates of
// |a(tc) - old(tc)|, the new plan's first action against where the old plan would have gone
// (against the last action given when the old plan has nothing for tc): the jerk a user sees.
// The first chunk ever applied has nothing to jump from.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

namespace mstar {

enum class MergeMode : std::uint8_t { latest, weighted, rtc };
enum class RtcSchedule : std::uint8_t { linear, exp, ones, zeros };

struct ActionChunkOptions {
  std::size_t horizon = 50;       ///< H: the most actions a chunk may hold
  std::size_t action_dim = 7;     ///< A: floats per action
  MergeMode mode = MergeMode::latest;
  float weight_new = 0.7f;        ///< weighted: weight of the new chunk over the overlap
  RtcSchedule schedule = RtcSchedule::exp;
  std::size_t execution_horizon = 0;  ///< s (rtc): the last s actions get no old-plan weight
  std::size_t slots = 4;          ///< published chunks that may wait for the loop (power of two)
};

/// Counters and the switch-jerk measure. Read from any thread (a snapshot).
struct ActionBufferStats {
  std::uint64_t ticks = 0;            ///< pop() calls
  std::uint64_t starved_ticks = 0;    ///< ticks with no action to give
  std::uint64_t published = 0;        ///< chunks publish() accepted (calls = published + rejected)
  std::uint64_t applied = 0;          ///< chunks merged into the plan
  std::uint64_t superseded = 0;       ///< chunks replaced by a newer one before any tick used them
  std::uint64_t rejected = 0;         ///< publish() calls refused (all slots waiting, bad size, NaN)
  std::uint64_t nonfinite = 0;        ///< of `rejected`: chunks holding a NaN or infinite action
  std::uint64_t stale = 0;            ///< chunks that arrived with nothing left for the future
  float max_switch_jump = 0;          ///< max |Δa| over coordinates at chunk switches
  std::uint64_t last_delay_ticks = 0; ///< d of the most recently applied chunk
};

class ActionChunkBuffer {
 public:
  /// Throws std::invalid_argument for H = 0, A = 0, s >= H (rtc), weight outside [0, 1], or
  /// slots not a power of two.
  explicit ActionChunkBuffer(ActionChunkOptions options);
  ~ActionChunkBuffer();
  ActionChunkBuffer(const ActionChunkBuffer&) = delete;
  ActionChunkBuffer& operator=(const ActionChunkBuffer&) = delete;

  /// Producer (one thread): `count` <= H actions, row-major count x A, computed from the
  /// observation taken at `obs_tick`. Copies into a preallocated slot; never blocks. Returns
  /// false (and counts it) when every slot is still waiting for the loop, count is 0 or > H, or
  /// an action is NaN or infinite (never passed to the robot; the plan in hand keeps running).
  bool publish(const float* actions, std::size_t count, std::uint64_t obs_tick) noexcept;

  /// Control loop (one thread): writes the action for `tick` (A floats) to `out`. Returns false
  /// on starvation (then `out` holds the last action given, or zeros before the first). Ticks
  /// must not go backwards. No allocation, no lock, no system call.
  bool pop(std::uint64_t tick, float* out) noexcept;

  /// Control loop: copies up to `max_count` actions the plan still holds from `tick` on into
  /// `out` (what RTC's policy side conditions on); returns how many. The plan is the one the last
  /// pop() left: chunks published since are not looked at. 0 when the plan has nothing for `tick`.
  std::size_t remaining(std::uint64_t tick, float* out, std::size_t max_count) const noexcept;

  /// The RTC prefix weight W(k) for a chunk that arrives with delay d (exposed for tests and for
  /// guided policies). Uses H and s from the options whatever the mode; 1 for k < d first, so
  /// with d >= H - s there is no decay: 1 below d, 0 from d on.
  float rtc_weight(std::size_t k, std::size_t d) const noexcept;

  ActionBufferStats stats() const noexcept;
  const ActionChunkOptions& options() const noexcept;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

/// Inference latency over a sliding window of the last N observations, turned into the delay d
/// (in control ticks) to give the policy: d = ceil(max latency / control period).
class LatencyTracker {
 public:
  /// Throws std::invalid_argument for window 0 or a non-positive period.
  LatencyTracker(std::size_t window, double control_period_s);
  void record(double latency_s) noexcept;  ///< a negative or NaN latency counts as 0
  double max_s() const noexcept;      ///< over the window (0 before any record)
  /// Nearest-rank 95th percentile over the window (0 before any record). No allocation: it
  /// counts ranks in place, O(window^2), meant for windows of up to a few hundred samples.
  double p95_s() const noexcept;
  /// ceil(max_s / period), less a 1e-9 tick tolerance so that exactly k periods give k.
  std::size_t delay_ticks() const noexcept;
  std::size_t count() const noexcept; ///< samples in the window

 private:
  std::vector<double> samples_;  // ring of the last `window` latencies
  std::size_t next_ = 0;
  std::size_t filled_ = 0;
  double period_;
};

}  // namespace mstar

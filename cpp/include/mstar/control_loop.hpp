// mstar/control_loop.hpp — a fixed-rate loop on absolute deadlines, with a simulated clock.
//
// Tick n is due at start + n * period. The loop sleeps until the deadline with
// clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME) — never "sleep for the period", which would
// accumulate the callback's run time and wake-up jitter — then calls the tick callback and
// records how late it woke (wake-up lateness) and how long the callback ran, into histograms
// allocated up front. A tick that starts after the next deadline has passed is a deadline miss;
// the loop does not try to catch up with a burst, it skips to the next future deadline and
// counts the skipped ticks.
//
// Real-time mode (optional): SCHED_FIFO at a priority, CPU affinity and mlockall(MCL_CURRENT |
// MCL_FUTURE). Each is attempted only when asked; what took effect is reported in mode(), e.g.
// "SCHED_FIFO(80) cpu=1 mlockall" or "SCHED_OTHER (SCHED_FIFO refused: Operation not permitted)".
// Always: the thread's timer slack is 1 ns while it runs (Linux delays a SCHED_OTHER thread's
// timed wake-ups by up to 50 µs by default), put back afterwards.
//
// SimulatedClock has the same interface: sleeping just moves its time to the deadline, so a
// closed loop (policy, buffer, physics) runs as fast as it can and identically every time.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace mstar {

/// Time source and sleeper. now_ns() is monotonic nanoseconds.
class Clock {
 public:
  virtual ~Clock() = default;
  virtual std::int64_t now_ns() = 0;
  /// Returns once now_ns() >= deadline_ns (or at once if it already is).
  virtual void sleep_until(std::int64_t deadline_ns) = 0;
};

/// CLOCK_MONOTONIC with clock_nanosleep(TIMER_ABSTIME).
class SystemClock final : public Clock {
 public:
  std::int64_t now_ns() override;
  void sleep_until(std::int64_t deadline_ns) override;
};

/// Deterministic time: starts at 0, sleep_until jumps to the deadline, advance() adds time (a
/// test injects a slow tick this way).
class SimulatedClock final : public Clock {
 public:
  std::int64_t now_ns() override { return now_.load(std::memory_order_acquire); }
  void sleep_until(std::int64_t deadline_ns) override;
  void advance(std::int64_t ns) { now_.fetch_add(ns, std::memory_order_acq_rel); }

 private:
  std::atomic<std::int64_t> now_{0};
};

/// A histogram with fixed bins [0, max) of equal width plus an overflow bin; no allocation after
/// construction. Percentiles are bin upper edges (the max is exact). Values below 0 count in the
/// first bin, NaN is ignored. Not thread-safe: one writer, read after it is done.
class Histogram {
 public:
  static constexpr std::size_t kMaxBins = std::size_t{1} << 24;
  /// Throws std::invalid_argument unless max_value > 0 and 0 < bins <= kMaxBins.
  Histogram(double max_value, std::size_t bins);
  void add(double value) noexcept;
  std::uint64_t count() const noexcept { return count_; }
  double max() const noexcept { return max_seen_; }
  double mean() const noexcept { return count_ ? sum_ / static_cast<double>(count_) : 0.0; }
  double percentile(double p) const noexcept;  ///< p in [0, 100]
  const std::vector<std::uint64_t>& bins() const noexcept { return bins_; }
  double bin_width() const noexcept { return width_; }
  void reset() noexcept;

 private:
  std::vector<std::uint64_t> bins_;  // last one: overflow
  double width_;
  std::uint64_t count_ = 0;
  double sum_ = 0, max_seen_ = 0;
};

struct ControlLoopOptions {
  double rate_hz = 100.0;
  bool realtime = false;      ///< try SCHED_FIFO at `priority`
  int priority = 80;
  int cpu = -1;               ///< pin to this CPU (-1: leave as is)
  bool lock_memory = false;   ///< try mlockall
  double histogram_max_ms = 20.0;
  std::size_t histogram_bins = 2000;
};

/// What the tick callback learns about the tick it runs.
struct TickInfo {
  std::uint64_t tick = 0;          ///< 0, 1, 2, ... (skipped ticks are never called)
  std::int64_t deadline_ns = 0;    ///< when it was due
  std::int64_t woke_ns = 0;        ///< when the loop woke for it
  std::uint64_t missed = 0;        ///< deadlines skipped so far
};

struct ControlLoopStats {
  std::uint64_t ticks = 0;
  std::uint64_t missed_deadlines = 0;
  double lateness_p50_ms = 0, lateness_p99_ms = 0, lateness_p999_ms = 0, lateness_max_ms = 0;
  double tick_p50_ms = 0, tick_p99_ms = 0, tick_max_ms = 0;
  long minor_faults = 0, major_faults = 0;  ///< page faults during run() (getrusage, this thread)
};

class ControlLoop {
 public:
  using Callback = std::function<void(const TickInfo&)>;

  /// Throws std::invalid_argument for a rate outside [1e-6, 1e9] Hz, an empty callback
  /// or bad histogram options. The clock defaults to SystemClock.
  ControlLoop(ControlLoopOptions options, Callback on_tick, std::shared_ptr<Clock> clock = nullptr);
  /// Stops and joins a start()ed loop. Never destroy the loop from its own callback: the
  /// callback is still running inside it (a start()ed one terminates the process).
  ~ControlLoop();
  ControlLoop(const ControlLoop&) = delete;
  ControlLoop& operator=(const ControlLoop&) = delete;

  /// Runs ticks 0 .. ticks-1 (0 = until stop()) on the calling thread, applying the real-time
  /// options to it first (and restoring its scheduling policy and affinity afterwards; an
  /// mlockall stays, it is process-wide). Skipped ticks count towards `ticks`, so a run lasts
  /// about ticks periods; stats().ticks + stats().missed_deadlines == ticks unless stopped.
  /// An exception from the callback stops the loop and is rethrown here. Throws
  /// std::logic_error if the loop is already running.
  void run(std::uint64_t ticks = 0);
  /// Runs on a thread of its own; stop() ends it, joins, and rethrows a callback exception.
  /// Throws std::logic_error if running. A previous start() whose loop has ended (its ticks
  /// done, or stop() from its callback) is joined here, and a callback exception of it nobody
  /// collected with stop() is rethrown instead of starting.
  void start(std::uint64_t ticks = 0);
  /// Asks the loop to end (it notices within one period) and joins a start()ed thread. Safe to
  /// call from the callback, from another thread during run(), when not running, and from
  /// several threads at once (one joins, the others return). A stop() before run() is entered
  /// is not remembered: to stop a loop that runs on another thread, use start() and stop().
  void stop();
  bool running() const noexcept { return running_.load(std::memory_order_acquire); }

  /// mode(), stats() and the histograms describe the last run: read them after run() returns,
  /// after stop(), or once running() is false — not during a run.
  /// The scheduling mode that took effect in the last run, in words.
  std::string mode() const;
  ControlLoopStats stats() const;
  const Histogram& lateness() const noexcept { return lateness_; }  ///< milliseconds
  const Histogram& tick_time() const noexcept { return tick_time_; }  ///< milliseconds
  double period_s() const noexcept { return 1.0 / options_.rate_hz; }

 private:
  void loop(std::uint64_t ticks);  // the body of run(), on whichever thread runs the loop

  ControlLoopOptions options_;
  Callback on_tick_;
  std::shared_ptr<Clock> clock_;
  std::int64_t period_ns_;  // integer period, so deadline n = start + n * period_ns_ is exact
  Histogram lateness_, tick_time_;
  std::atomic<bool> running_{false}, stop_{false};
  std::mutex control_mu_;  // start/stop/destruction: who joins thread_
  std::thread thread_;
  std::exception_ptr thread_error_;  // a callback exception on the start() thread, for stop()
  // Written by the loop thread; the counters are atomic so a poller never races on them.
  std::string mode_ = "not run";
  std::atomic<std::uint64_t> ticks_{0}, missed_{0};
  long minor_faults_ = 0, major_faults_ = 0;
};

}  // namespace mstar

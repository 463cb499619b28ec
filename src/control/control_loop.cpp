#include "mstar/control_loop.hpp"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <utility>

#if defined(__GLIBCXX__)
#include <cxxabi.h>  // abi::__forced_unwind
#endif

#include <pthread.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <time.h>

namespace mstar {

namespace {

constexpr std::int64_t kNsPerSec = 1000000000;

double ns_to_ms(std::int64_t ns) noexcept { return static_cast<double>(ns) / 1e6; }

const char* policy_name(int policy) noexcept {
  switch (policy) {
    case SCHED_OTHER: return "SCHED_OTHER";
    case SCHED_FIFO: return "SCHED_FIFO";
    case SCHED_RR: return "SCHED_RR";
#ifdef SCHED_BATCH
    case SCHED_BATCH: return "SCHED_BATCH";
#endif
#ifdef SCHED_IDLE
    case SCHED_IDLE: return "SCHED_IDLE";
#endif
    default: return "SCHED_?";
  }
}

// Applies the real-time options to the calling thread, describes the outcome, and puts the
// thread's policy and affinity back when it goes out of scope (also when the callback threw),
// so a caller's thread leaves run() as it came in.
class RealtimeScope {
 public:
  explicit RealtimeScope(const ControlLoopOptions& o) : self_(pthread_self()) {
    std::string refused;
    auto refuse = [&refused](const std::string& what, int err) {
      refused += refused.empty() ? "" : "; ";
      refused += what + " refused: " + std::strerror(err);
    };

    // Timer slack (50 µs by default) delays every wake-up of a SCHED_OTHER thread by up to that
    // much: an error the loop would add to each deadline. SCHED_FIFO ignores it anyway.
    old_slack_ = prctl(PR_GET_TIMERSLACK, 0, 0, 0, 0);
    slack_changed_ = old_slack_ > 1 && prctl(PR_SET_TIMERSLACK, 1UL, 0, 0, 0) == 0;

    pthread_getschedparam(self_, &old_policy_, &old_param_);
    std::string sched = policy_name(old_policy_);
    if (old_policy_ == SCHED_FIFO || old_policy_ == SCHED_RR) {
      sched += "(" + std::to_string(old_param_.sched_priority) + ")";
    }
    if (o.realtime) {
      sched_param p{};
      p.sched_priority = o.priority;
      const int err = pthread_setschedparam(self_, SCHED_FIFO, &p);
      if (err == 0) {
        sched_changed_ = true;
        sched = "SCHED_FIFO(" + std::to_string(o.priority) + ")";
      } else {
        refuse("SCHED_FIFO(" + std::to_string(o.priority) + ")", err);
      }
    }
    mode_ = sched;

    if (o.cpu >= 0) {
      const std::string what = "cpu=" + std::to_string(o.cpu);
      if (o.cpu >= CPU_SETSIZE) {
        refuse(what, EINVAL);
      } else if (int err = pthread_getaffinity_np(self_, sizeof old_cpus_, &old_cpus_); err != 0) {
        refuse(what, err);
      } else {
        cpu_set_t one;
        CPU_ZERO(&one);
        CPU_SET(o.cpu, &one);
        err = pthread_setaffinity_np(self_, sizeof one, &one);
        if (err == 0) {
          cpus_changed_ = true;
          mode_ += " " + what;
        } else {
          refuse(what, err);
        }
      }
    }

    // Not undone afterwards: the lock is process-wide and someone else may rely on it.
    if (o.lock_memory) {
      if (mlockall(MCL_CURRENT | MCL_FUTURE) == 0) {
        mode_ += " mlockall";
      } else {
        refuse("mlockall", errno);
      }
    }
    if (!refused.empty()) mode_ += " (" + refused + ")";
  }

  ~RealtimeScope() {
    if (slack_changed_) prctl(PR_SET_TIMERSLACK, static_cast<unsigned long>(old_slack_), 0, 0, 0);
    if (sched_changed_) pthread_setschedparam(self_, old_policy_, &old_param_);
    if (cpus_changed_) pthread_setaffinity_np(self_, sizeof old_cpus_, &old_cpus_);
  }
  RealtimeScope(const RealtimeScope&) = delete;
  RealtimeScope& operator=(const RealtimeScope&) = delete;

  const std::string& mode() const noexcept { return mode_; }

 private:
  pthread_t self_;
  int old_policy_ = SCHED_OTHER;
  sched_param old_param_{};
  cpu_set_t old_cpus_{};
  bool sched_changed_ = false, cpus_changed_ = false, slack_changed_ = false;
  int old_slack_ = 0;
  std::string mode_;
};

}  // namespace

// ---- clocks ----

std::int64_t SystemClock::now_ns() {
  timespec ts{};
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<std::int64_t>(ts.tv_sec) * kNsPerSec + ts.tv_nsec;
}

void SystemClock::sleep_until(std::int64_t deadline_ns) {
  if (deadline_ns < 0) return;  // CLOCK_MONOTONIC is never negative: already due
  timespec ts{};
  ts.tv_sec = static_cast<time_t>(deadline_ns / kNsPerSec);
  ts.tv_nsec = static_cast<long>(deadline_ns % kNsPerSec);
  // An absolute deadline makes a signal harmless: just sleep again until the same instant.
  while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, nullptr) == EINTR) {
  }
}

void SimulatedClock::sleep_until(std::int64_t deadline_ns) {
  // Only ever moves forward, even if another thread advance()s at the same time.
  std::int64_t now = now_.load(std::memory_order_acquire);
  while (now < deadline_ns &&
         !now_.compare_exchange_weak(now, deadline_ns, std::memory_order_acq_rel)) {
  }
}

namespace {
// start + n * period, saturated: a clock that jumps to the end of time (a simulation's) must
// not wrap the deadlines around (signed overflow).
std::int64_t deadline_at(std::int64_t start, std::uint64_t n, std::int64_t period) noexcept {
  std::int64_t offset = 0, d = 0;  // period > 0: only upward overflow is possible
  if (n > static_cast<std::uint64_t>(INT64_MAX) ||
      __builtin_mul_overflow(static_cast<std::int64_t>(n), period, &offset) ||
      __builtin_add_overflow(start, offset, &d))
    return INT64_MAX;
  return d;
}

// The first tick whose deadline is at or after `finished` (the ceiling of its distance in
// periods), saturated likewise.
std::uint64_t first_tick_after(std::int64_t start, std::int64_t finished, std::int64_t period) noexcept {
  std::int64_t since = 0;
  if (__builtin_sub_overflow(finished, start, &since)) since = INT64_MAX;
  return static_cast<std::uint64_t>(since / period + (since % period != 0));
}
}  // namespace

// ---- Histogram ----

Histogram::Histogram(double max_value, std::size_t bins)
    : width_(max_value / static_cast<double>(bins ? bins : 1)) {
  if (!(max_value > 0) || !std::isfinite(max_value) || bins == 0) {
    throw std::invalid_argument("Histogram: needs max_value > 0 and bins > 0, got max_value " +
                                std::to_string(max_value) + " and bins " + std::to_string(bins));
  }
  if (bins > kMaxBins)  // bins + 1 wrapped to 0 at SIZE_MAX: the first add() wrote nowhere
    throw std::invalid_argument("Histogram: bins " + std::to_string(bins) + " is above the " +
                                std::to_string(kMaxBins) + " it takes");
  bins_.assign(bins + 1, 0);
}

void Histogram::add(double value) noexcept {
  if (std::isnan(value)) return;
  const std::size_t regular = bins_.size() - 1;
  std::size_t i = 0;
  if (value >= width_ * static_cast<double>(regular)) {
    i = regular;
  } else if (value > 0) {
    // min(): value / width_ can round up to `regular` just below the top edge.
    i = std::min(static_cast<std::size_t>(value / width_), regular - 1);
  }
  ++bins_[i];
  max_seen_ = count_ == 0 ? value : std::max(max_seen_, value);
  sum_ += value;
  ++count_;
}

double Histogram::percentile(double p) const noexcept {
  if (count_ == 0) return 0.0;
  p = p > 0 ? std::min(p, 100.0) : 0.0;
  // Nearest rank; the epsilon keeps p * count / 100 == k from rounding up to k + 1.
  const double r = std::ceil(p * static_cast<double>(count_) / 100.0 - 1e-9);
  const std::uint64_t rank = std::max<std::uint64_t>(1, static_cast<std::uint64_t>(r));
  const std::size_t regular = bins_.size() - 1;
  std::uint64_t seen = 0;
  for (std::size_t i = 0; i < regular; ++i) {
    seen += bins_[i];
    if (seen >= rank) return std::min(width_ * static_cast<double>(i + 1), max_seen_);
  }
  return max_seen_;  // the rank lies in the overflow bin: the max is the only exact value there
}

void Histogram::reset() noexcept {
  std::fill(bins_.begin(), bins_.end(), 0);
  count_ = 0;
  sum_ = 0;
  max_seen_ = 0;
}

// ---- ControlLoop ----

namespace {

// The loop running on this thread, so stop() from the callback can tell it must not join itself
// without reading thread_, which start() may still be assigning when the first tick runs.
thread_local const ControlLoop* t_current_loop = nullptr;

struct CurrentLoop {
  explicit CurrentLoop(const ControlLoop* loop) : outer(t_current_loop) { t_current_loop = loop; }
  ~CurrentLoop() { t_current_loop = outer; }
  const ControlLoop* outer;
};

std::int64_t checked_period_ns(const ControlLoopOptions& o) {
  // Also rejects NaN; above 1 GHz the period would round to 0 ns, below 1 uHz (a period of
  // ~11.6 days) the period in ns no longer fits the deadline arithmetic (it overflowed).
  if (!(o.rate_hz >= 1e-6) || !(o.rate_hz <= 1e9)) {
    throw std::invalid_argument("ControlLoop: rate_hz must be in [1e-6, 1e9], got " +
                                std::to_string(o.rate_hz));
  }
  return std::max<std::int64_t>(1, std::llround(1e9 / o.rate_hz));
}

}  // namespace

ControlLoop::ControlLoop(ControlLoopOptions options, Callback on_tick, std::shared_ptr<Clock> clock)
    : options_(options),
      on_tick_(std::move(on_tick)),
      clock_(clock ? std::move(clock) : std::make_shared<SystemClock>()),
      period_ns_(checked_period_ns(options_)),
      lateness_(options_.histogram_max_ms, options_.histogram_bins),
      tick_time_(options_.histogram_max_ms, options_.histogram_bins) {
  if (!on_tick_) throw std::invalid_argument("ControlLoop: the tick callback is empty");
}

ControlLoop::~ControlLoop() {
  // Never throws: a callback exception nobody collected with stop() is dropped here.
  stop_.store(true, std::memory_order_release);
  // Destroying the loop from its own callback is a bug; std::thread then terminates loudly.
  std::lock_guard<std::mutex> lock(control_mu_);
  if (t_current_loop != this && thread_.joinable()) thread_.join();
}

void ControlLoop::run(std::uint64_t ticks) {
  if (running_.exchange(true, std::memory_order_acq_rel)) {
    throw std::logic_error("ControlLoop::run: the loop is already running");
  }
  stop_.store(false, std::memory_order_release);
  try {
    loop(ticks);
  } catch (...) {
    running_.store(false, std::memory_order_release);
    throw;
  }
  running_.store(false, std::memory_order_release);
}

void ControlLoop::start(std::uint64_t ticks) {
  std::lock_guard<std::mutex> lock(control_mu_);
  if (running_.exchange(true, std::memory_order_acq_rel)) {
    throw std::logic_error("ControlLoop::start: the loop is already running");
  }
  if (thread_.joinable()) {  // a previous start()'s loop has ended: stop() from its callback
    thread_.join();
    if (thread_error_) {
      running_.store(false, std::memory_order_release);
      std::rethrow_exception(std::exchange(thread_error_, nullptr));
    }
  }
  // Reset here, not on the new thread, so a stop() right after start() is never lost.
  stop_.store(false, std::memory_order_release);
  thread_error_ = nullptr;
  try {
    thread_ = std::thread([this, ticks] {
      try {
        loop(ticks);
#if defined(__GLIBCXX__)
      } catch (abi::__forced_unwind&) {  // pthread_exit (a callback's interpreter is exiting):
        running_.store(false, std::memory_order_release);  // swallowing it aborts the process
        throw;
#endif
      } catch (...) {
        thread_error_ = std::current_exception();
      }
      running_.store(false, std::memory_order_release);
    });
  } catch (...) {  // no thread (std::system_error): not running after all
    running_.store(false, std::memory_order_release);
    throw;
  }
}

void ControlLoop::stop() {
  stop_.store(true, std::memory_order_release);
  // From the callback: the flag suffices (and joining ourselves would deadlock).
  if (t_current_loop == this) return;
  // One caller joins: two joins of one thread (a watchdog and the main thread) hung.
  std::thread t;
  {
    std::lock_guard<std::mutex> lock(control_mu_);
    t = std::move(thread_);
  }
  if (!t.joinable()) return;
  t.join();
  std::exception_ptr error;
  {
    std::lock_guard<std::mutex> lock(control_mu_);
    error = std::exchange(thread_error_, nullptr);
  }
  if (error) std::rethrow_exception(error);
}

void ControlLoop::loop(std::uint64_t ticks) {
  lateness_.reset();
  tick_time_.reset();
  ticks_.store(0, std::memory_order_relaxed);
  missed_.store(0, std::memory_order_relaxed);
  minor_faults_ = major_faults_ = 0;

  const CurrentLoop current(this);
  const RealtimeScope realtime(options_);
  mode_ = realtime.mode();

  rusage before{};
  getrusage(RUSAGE_THREAD, &before);
  // Counted even when the callback throws, so stats() describe the partial run too.
  struct FaultCounter {
    ControlLoop& loop;
    const rusage& before;
    ~FaultCounter() {
      rusage after{};
      getrusage(RUSAGE_THREAD, &after);
      loop.minor_faults_ = after.ru_minflt - before.ru_minflt;
      loop.major_faults_ = after.ru_majflt - before.ru_majflt;
    }
  } fault_counter{*this, before};

  // No allocation from here on: the histograms are preallocated, TickInfo lives on the stack.
  Clock& clock = *clock_;
  const std::uint64_t end = ticks == 0 ? UINT64_MAX : ticks;
  const std::int64_t start = clock.now_ns();
  std::uint64_t done = 0, missed = 0;
  for (std::uint64_t n = 0; n < end;) {
    if (stop_.load(std::memory_order_acquire)) break;
    TickInfo info;
    info.tick = n;
    info.deadline_ns = deadline_at(start, n, period_ns_);
    clock.sleep_until(info.deadline_ns);
    // A stop() during the sleep must not cost one more callback.
    if (stop_.load(std::memory_order_acquire)) break;
    info.woke_ns = clock.now_ns();
    info.missed = missed;
    lateness_.add(ns_to_ms(info.woke_ns - info.deadline_ns));

    on_tick_(info);

    const std::int64_t finished = clock.now_ns();
    tick_time_.add(ns_to_ms(finished - info.woke_ns));
    ticks_.store(++done, std::memory_order_relaxed);

    // No catch-up burst: skip every deadline already in the past. A deadline equal to now is
    // not missed (it runs at once with lateness 0).
    std::uint64_t next = n + 1;
    if (finished > deadline_at(start, next, period_ns_)) {
      next = first_tick_after(start, finished, period_ns_);
      // Deadlines beyond the end of a bounded run were never going to run: not misses.
      missed += std::min(next, end) - (n + 1);
      missed_.store(missed, std::memory_order_relaxed);
    }
    n = next;
  }
}

std::string ControlLoop::mode() const { return mode_; }

ControlLoopStats ControlLoop::stats() const {
  ControlLoopStats s;
  s.ticks = ticks_.load(std::memory_order_relaxed);
  s.missed_deadlines = missed_.load(std::memory_order_relaxed);
  s.lateness_p50_ms = lateness_.percentile(50);
  s.lateness_p99_ms = lateness_.percentile(99);
  s.lateness_p999_ms = lateness_.percentile(99.9);
  s.lateness_max_ms = lateness_.max();
  s.tick_p50_ms = tick_time_.percentile(50);
  s.tick_p99_ms = tick_time_.percentile(99);
  s.tick_max_ms = tick_time_.max();
  s.minor_faults = minor_faults_;
  s.major_faults = major_faults_;
  return s;
}

}  // namespace mstar

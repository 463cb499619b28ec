// ControlLoop: exact deadlines and misses on a SimulatedClock, determinism, no allocation per
// tick, exceptions, start()/stop(); Histogram percentiles; short, tolerant SystemClock runs.
#include "mstar/control_loop.hpp"

#include <gtest/gtest.h>

#include <pthread.h>
#include <sched.h>
#include <sys/prctl.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <memory>
#include <new>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "alloc_counter.hpp"

namespace {

using mstar::ControlLoop;
using mstar::ControlLoopOptions;
using mstar::Histogram;
using mstar::SimulatedClock;
using mstar::TickInfo;
using i64 = std::int64_t;
using u64 = std::uint64_t;
using Steady = std::chrono::steady_clock;

constexpr i64 kMs = 1000000;

ControlLoopOptions at_hz(double rate_hz) {
  ControlLoopOptions o;
  o.rate_hz = rate_hz;
  return o;
}

// For a loop that ends by itself; bounded so a broken loop fails instead of hanging the test.
void wait_until_done(const ControlLoop& loop) {
  const auto give_up = Steady::now() + std::chrono::seconds(5);
  while (loop.running() && Steady::now() < give_up) std::this_thread::yield();
  EXPECT_FALSE(loop.running());
}

TEST(SimulatedClock, SleepUntilJumpsForwardButNeverBack) {
  SimulatedClock clock;
  clock.sleep_until(5 * kMs);
  clock.sleep_until(2 * kMs);
  EXPECT_EQ(clock.now_ns(), 5 * kMs);
  clock.advance(kMs);
  EXPECT_EQ(clock.now_ns(), 6 * kMs);
}

TEST(Histogram, PercentilesAreBinUpperEdgesCappedAtTheExactMax) {
  Histogram h(100.0, 100);
  for (int i = 0; i < 100; ++i) h.add(i + 0.5);  // one value in each bin
  EXPECT_EQ(h.count(), 100u);
  EXPECT_DOUBLE_EQ(h.mean(), 50.0);
  EXPECT_DOUBLE_EQ(h.max(), 99.5);
  EXPECT_DOUBLE_EQ(h.percentile(0), 1.0);
  EXPECT_DOUBLE_EQ(h.percentile(50), 50.0);
  EXPECT_DOUBLE_EQ(h.percentile(99), 99.0);
  EXPECT_DOUBLE_EQ(h.percentile(100), 99.5);  // the bin edge would be 100; the max is exact
  EXPECT_DOUBLE_EQ(h.percentile(250), 99.5);  // p is clamped to [0, 100]
}

TEST(Histogram, SkewedDataOverflowNegativesAndReset) {
  Histogram h(10.0, 10);
  for (int i = 0; i < 999; ++i) h.add(0.25);
  h.add(42.0);  // past the top: the overflow bin
  EXPECT_DOUBLE_EQ(h.percentile(50), 1.0);  // the upper edge of the bin holding 0.25
  EXPECT_DOUBLE_EQ(h.percentile(99.9), 1.0);  // rank 999 of 1000, not rounded up to 1000
  EXPECT_DOUBLE_EQ(h.percentile(100), 42.0);
  EXPECT_EQ(h.bins().back(), 1u);
  h.add(-3.0);  // counts in the first bin
  h.add(std::numeric_limits<double>::quiet_NaN());  // ignored
  EXPECT_EQ(h.count(), 1001u);
  EXPECT_EQ(h.bins().front(), 1000u);
  h.reset();
  EXPECT_EQ(h.count(), 0u);
  EXPECT_EQ(h.percentile(50), 0.0);
  EXPECT_THROW(Histogram(0.0, 10), std::invalid_argument);
  EXPECT_THROW(Histogram(10.0, 0), std::invalid_argument);
}

TEST(ControlLoop, RejectsBadRateAndEmptyCallback) {
  auto noop = [](const TickInfo&) {};
  EXPECT_THROW(ControlLoop(at_hz(0), noop), std::invalid_argument);
  EXPECT_THROW(ControlLoop(at_hz(-5), noop), std::invalid_argument);
  EXPECT_THROW(ControlLoop(at_hz(std::nan("")), noop), std::invalid_argument);
  EXPECT_THROW(ControlLoop(at_hz(1e-12), noop), std::invalid_argument);  // period overflowed
  EXPECT_THROW(ControlLoop(at_hz(2e9), noop), std::invalid_argument);    // rounds to 0 ns
  EXPECT_NO_THROW(ControlLoop(at_hz(1e-6), noop));
  EXPECT_THROW(ControlLoop(at_hz(100), ControlLoop::Callback{}), std::invalid_argument);
}

TEST(ControlLoop, SimulatedRunHitsEveryDeadlineExactly) {
  auto clock = std::make_shared<SimulatedClock>();
  std::vector<TickInfo> seen;
  seen.reserve(100);
  ControlLoop loop(at_hz(100), [&](const TickInfo& t) { seen.push_back(t); }, clock);
  loop.run(100);
  ASSERT_EQ(seen.size(), 100u);
  for (u64 n = 0; n < 100; ++n) {
    EXPECT_EQ(seen[n].tick, n);
    EXPECT_EQ(seen[n].deadline_ns, static_cast<i64>(n) * 10 * kMs);
    EXPECT_EQ(seen[n].woke_ns, seen[n].deadline_ns);
    EXPECT_EQ(seen[n].missed, 0u);
  }
  EXPECT_EQ(clock->now_ns(), 99 * 10 * kMs);  // ends after the last tick, not a period later
  const auto s = loop.stats();
  EXPECT_EQ(s.ticks, 100u);
  EXPECT_EQ(s.missed_deadlines, 0u);
  EXPECT_EQ(s.lateness_max_ms, 0.0);
  EXPECT_EQ(s.lateness_p99_ms, 0.0);
  EXPECT_EQ(loop.lateness().count(), 100u);
  EXPECT_FALSE(loop.running());
}

// A tick that overruns by `slow` periods skips the deadlines already past and resumes on the
// grid; a deadline exactly at "now" is not missed.
class SlowTick : public ::testing::TestWithParam<std::tuple<double, u64>> {};

TEST_P(SlowTick, SkipsPastDeadlinesAndResumesOnTheGrid) {
  const auto [slow_periods, expected_missed] = GetParam();
  auto clock = std::make_shared<SimulatedClock>();
  std::vector<TickInfo> seen;
  seen.reserve(20);
  const i64 period = 10 * kMs;
  ControlLoop loop(
      at_hz(100),
      [&](const TickInfo& t) {
        seen.push_back(t);
        if (t.tick == 5) clock->advance(static_cast<i64>(slow_periods * period));
      },
      clock);
  loop.run(20);

  ASSERT_EQ(seen.size() + expected_missed, 20u);
  const u64 resume = 6 + expected_missed;
  u64 i = 0;
  for (u64 tick = 0; tick < 20; ++tick) {
    if (tick > 5 && tick < resume) continue;  // skipped, never called
    ASSERT_LT(i, seen.size());
    EXPECT_EQ(seen[i].tick, tick);
    EXPECT_EQ(seen[i].deadline_ns, static_cast<i64>(tick) * period);
    EXPECT_EQ(seen[i].woke_ns, seen[i].deadline_ns);  // back on the grid, not late
    EXPECT_EQ(seen[i].missed, tick < resume ? 0u : expected_missed);
    ++i;
  }
  const auto s = loop.stats();
  EXPECT_EQ(s.missed_deadlines, expected_missed);
  EXPECT_EQ(s.lateness_max_ms, 0.0);
  EXPECT_DOUBLE_EQ(s.tick_max_ms, slow_periods * 10.0);
}

INSTANTIATE_TEST_SUITE_P(
    ControlLoop, SlowTick,
    ::testing::Values(std::make_tuple(0.5, u64{0}), std::make_tuple(1.0, u64{0}),
                      std::make_tuple(1.5, u64{1}), std::make_tuple(2.5, u64{2}),
                      std::make_tuple(3.0, u64{2})));

TEST(ControlLoop, SlowLastTickOfABoundedRunIsNotAMiss) {
  auto clock = std::make_shared<SimulatedClock>();
  ControlLoop loop(
      at_hz(100), [&](const TickInfo& t) { if (t.tick == 9) clock->advance(50 * kMs); }, clock);
  loop.run(10);
  EXPECT_EQ(loop.stats().ticks, 10u);
  EXPECT_EQ(loop.stats().missed_deadlines, 0u);
}

// A seeded pseudo-physics closed loop (noisy PD control of a unit mass) with random slow ticks.
using Sample = std::tuple<u64, u64, i64, i64, double>;  // tick, missed, deadline, woke, x

std::vector<Sample> closed_loop(unsigned seed) {
  auto clock = std::make_shared<SimulatedClock>();
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> unit(0.0, 1.0);
  double x = 1.0, v = 0.0;
  std::vector<Sample> out;
  out.reserve(500);
  ControlLoop loop(
      at_hz(250),
      [&](const TickInfo& t) {
        const double dt = 1.0 / 250;
        const double u = -40.0 * x - 6.0 * v + 0.5 * (unit(rng) - 0.5);
        v += u * dt;
        x += v * dt;
        out.emplace_back(t.tick, t.missed, t.deadline_ns, t.woke_ns, x);
        if (unit(rng) < 0.05) clock->advance(static_cast<i64>(unit(rng) * 3 * 4 * kMs));
      },
      clock);
  loop.run(500);
  return out;
}

TEST(ControlLoop, SimulatedClosedLoopIsDeterministic) {
  const auto a = closed_loop(7), b = closed_loop(7);
  EXPECT_TRUE(a == b);
  EXPECT_LT(a.size(), 500u);  // the random slow ticks did cause misses
  EXPECT_GT(std::get<1>(a.back()), 0u);
  EXPECT_FALSE(a == closed_loop(8));
}

TEST(ControlLoop, TickLoopDoesNotAllocate) {
  auto clock = std::make_shared<SimulatedClock>();
  u64 at_first = 0, at_last = 0;
  ControlLoop loop(
      at_hz(1000),
      [&](const TickInfo& t) {
        if (t.tick == 0) at_first = g_allocations.load();
        if (t.tick % 97 == 3) clock->advance(3 * kMs);  // exercise the skip path too
        at_last = g_allocations.load();
      },
      clock);
  loop.run(2000);
  EXPECT_GT(loop.stats().missed_deadlines, 0u);
  EXPECT_EQ(at_last, at_first);
}

TEST(ControlLoop, CallbackExceptionStopsRunAndPropagates) {
  auto clock = std::make_shared<SimulatedClock>();
  u64 calls = 0;
  ControlLoop loop(
      at_hz(100),
      [&](const TickInfo& t) {
        ++calls;
        if (t.tick == 3) throw std::runtime_error("policy crashed");
      },
      clock);
  try {
    loop.run(100);
    FAIL() << "run() returned";
  } catch (const std::runtime_error& e) {
    EXPECT_STREQ(e.what(), "policy crashed");
  }
  EXPECT_EQ(calls, 4u);
  EXPECT_EQ(loop.stats().ticks, 3u);  // the throwing tick did not complete
  EXPECT_FALSE(loop.running());
  EXPECT_THROW(loop.run(10), std::runtime_error);  // still usable: runs again, throws again
}

TEST(ControlLoop, CallbackExceptionOnStartedLoopIsRethrownByStop) {
  auto clock = std::make_shared<SimulatedClock>();
  ControlLoop loop(
      at_hz(100), [](const TickInfo& t) { if (t.tick == 5) throw std::out_of_range("tick 5"); },
      clock);
  loop.start();
  wait_until_done(loop);
  EXPECT_THROW(loop.stop(), std::out_of_range);
  EXPECT_NO_THROW(loop.stop());  // reported once
  EXPECT_EQ(loop.stats().ticks, 5u);
}

TEST(ControlLoop, StopFromCallbackAndRightAfterStart) {
  auto clock = std::make_shared<SimulatedClock>();
  ControlLoop* self = nullptr;
  ControlLoop loop(
      at_hz(100), [&](const TickInfo& t) { if (t.tick == 7) self->stop(); }, clock);
  self = &loop;
  loop.run();  // unbounded: only the stop() from the callback ends it
  EXPECT_EQ(loop.stats().ticks, 8u);

  loop.start();  // ditto on its own thread: stop() from there must not try to join itself
  wait_until_done(loop);
  loop.stop();
  EXPECT_EQ(loop.stats().ticks, 8u);

  ControlLoop endless(at_hz(100), [](const TickInfo&) {}, clock);
  endless.start();  // a stop() lost to the thread's start-up would hang here
  endless.stop();
  EXPECT_FALSE(endless.running());
}

TEST(ControlLoop, RunOrStartWhileRunningIsRefused) {
  auto clock = std::make_shared<SimulatedClock>();
  ControlLoop loop(at_hz(1000), [](const TickInfo&) {}, clock);
  loop.start();
  EXPECT_THROW(loop.run(1), std::logic_error);
  EXPECT_THROW(loop.start(), std::logic_error);
  loop.stop();
  loop.start(3);  // finishes on its own ...
  wait_until_done(loop);
  EXPECT_EQ(loop.stats().ticks, 3u);
  loop.start(2);  // ... and the next start() joins it
  wait_until_done(loop);
  loop.stop();
  EXPECT_EQ(loop.stats().ticks, 2u);
}

TEST(ControlLoop, StopInItsCallbackThenStartAgainAndAnUncollectedErrorComesBackFromStart) {
  auto clock = std::make_shared<SimulatedClock>();
  ControlLoop* self = nullptr;
  int calls = 0;
  ControlLoop loop(at_hz(1000), [&](const TickInfo& t) {
    ++calls;
    if (t.tick == 3) self->stop();  // start() refused to run again after this
    if (calls == 100) throw std::runtime_error("the arm's driver failed");
  }, clock);
  self = &loop;
  loop.start();
  wait_until_done(loop);
  EXPECT_EQ(loop.stats().ticks, 4u);
  loop.start();  // ticks 0-3 again, then the error at the 100th call overall ...
  wait_until_done(loop);
  calls = 99;
  loop.start(10);
  wait_until_done(loop);
  try {  // ... is not lost to the next start()
    loop.start();
    FAIL() << "the uncollected error was dropped";
  } catch (const std::runtime_error& e) {
    EXPECT_STREQ(e.what(), "the arm's driver failed");
  }
  EXPECT_FALSE(loop.running());
  loop.start(1);
  loop.stop();
}

TEST(ControlLoop, StopFromSeveralThreadsAtOnceJoinsOnce) {
  auto clock = std::make_shared<SimulatedClock>();
  for (int round = 0; round < 100; ++round) {  // two joins of one thread hung
    ControlLoop loop(at_hz(1000), [](const TickInfo&) {}, clock);
    loop.start();
    std::thread a([&] { loop.stop(); });
    std::thread b([&] { loop.stop(); });
    a.join();
    b.join();
    EXPECT_FALSE(loop.running());
  }
}

TEST(ControlLoop, HistogramBinsThatWrapAroundAreRefused) {
  // bins + 1 wrapped to 0 at SIZE_MAX: the first tick wrote through a null pointer
  EXPECT_THROW(mstar::Histogram(20, SIZE_MAX), std::invalid_argument);
  EXPECT_THROW(mstar::Histogram(20, mstar::Histogram::kMaxBins + 1), std::invalid_argument);
  mstar::Histogram(20, mstar::Histogram::kMaxBins);
}

TEST(ControlLoop, AClockAtTheEndOfTimeDoesNotWrapTheDeadlines) {
  auto clock = std::make_shared<SimulatedClock>();
  int ticks = 0;
  ControlLoop loop(at_hz(1000), [&](const TickInfo&) {
    if (++ticks == 2) clock->advance(INT64_MAX - clock->now_ns() - 10);  // UBSan: overflow
  }, clock);
  loop.run(5);
  EXPECT_EQ(loop.stats().ticks + loop.stats().missed_deadlines, 5u);
}

// ---- SystemClock: real time on a noisy VM, so only loose bounds ----

TEST(ControlLoop, SystemClockPacesOnAbsoluteDeadlines) {
  std::vector<TickInfo> seen;
  seen.reserve(100);
  ControlLoop loop(at_hz(200), [&](const TickInfo& t) { seen.push_back(t); });
  const auto t0 = Steady::now();
  loop.run(100);
  const double elapsed = std::chrono::duration<double>(Steady::now() - t0).count();
  EXPECT_GT(elapsed, 0.45);  // tick 99 is due 495 ms after tick 0
  EXPECT_LT(elapsed, 1.5);

  const auto s = loop.stats();
  ASSERT_FALSE(seen.empty());
  EXPECT_EQ(s.ticks + s.missed_deadlines, 100u);
  EXPECT_EQ(seen.size(), s.ticks);
  const i64 start = seen[0].deadline_ns;
  for (std::size_t i = 0; i < seen.size(); ++i) {
    if (i > 0) {
      EXPECT_GT(seen[i].tick, seen[i - 1].tick);
    }
    EXPECT_EQ(seen[i].deadline_ns, start + static_cast<i64>(seen[i].tick) * 5 * kMs);
    EXPECT_GE(seen[i].woke_ns, seen[i].deadline_ns);
  }
  EXPECT_LT(s.lateness_p50_ms, 5.0);
}

TEST(ControlLoop, StartAndStopFromAnotherThread) {
  std::atomic<u64> calls{0};
  std::vector<u64> ticks;
  ticks.reserve(100000);
  ControlLoop loop(at_hz(1000), [&](const TickInfo& t) {
    ticks.push_back(t.tick);
    calls.fetch_add(1, std::memory_order_release);
  });
  loop.start();
  EXPECT_TRUE(loop.running());
  const auto give_up = Steady::now() + std::chrono::seconds(3);
  while (calls.load(std::memory_order_acquire) < 20 && Steady::now() < give_up) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
    EXPECT_TRUE(loop.running());  // polling running() is race-free (TSan)
  }
  loop.stop();
  EXPECT_FALSE(loop.running());
  EXPECT_GE(calls.load(), 20u);
  EXPECT_EQ(loop.stats().ticks, calls.load());
  for (std::size_t i = 1; i < ticks.size(); ++i) EXPECT_GT(ticks[i], ticks[i - 1]);
}

TEST(ControlLoop, ModeReportsTheThreadsPolicyWithoutRealtime) {
  if (sched_getscheduler(0) != SCHED_OTHER) GTEST_SKIP() << "test runner is not SCHED_OTHER";
  ControlLoop loop(at_hz(1000), [](const TickInfo&) {});
  EXPECT_EQ(loop.mode(), "not run");
  loop.run(2);
  EXPECT_EQ(loop.mode(), "SCHED_OTHER");
}

TEST(ControlLoop, TicksRunWithoutTimerSlackWhichComesBackAfterRun) {
  // Linux's default 50 µs slack would make every SCHED_OTHER wake-up up to 50 µs late.
  const int before = prctl(PR_GET_TIMERSLACK, 0, 0, 0, 0);
  if (before <= 1) GTEST_SKIP() << "this thread already has no timer slack";
  std::vector<int> during;
  during.reserve(8);
  mstar::ControlLoopOptions o;
  o.rate_hz = 1000.0;
  mstar::ControlLoop loop(o, [&](const mstar::TickInfo&) {
    during.push_back(prctl(PR_GET_TIMERSLACK, 0, 0, 0, 0));
  });
  loop.run(5);
  ASSERT_FALSE(during.empty());
  for (int slack : during) EXPECT_EQ(slack, 1);
  EXPECT_EQ(prctl(PR_GET_TIMERSLACK, 0, 0, 0, 0), before);
}

TEST(ControlLoop, RealtimeModeTakesEffectOrSaysWhyAndIsUndoneAfterRun) {
  int policy_before = 0;
  sched_param param_before{};
  pthread_getschedparam(pthread_self(), &policy_before, &param_before);
  cpu_set_t cpus_before;
  ASSERT_EQ(pthread_getaffinity_np(pthread_self(), sizeof cpus_before, &cpus_before), 0);
  int cpu = 0;
  while (!CPU_ISSET(cpu, &cpus_before)) ++cpu;  // the first CPU we may run on

  ControlLoopOptions o = at_hz(1000);
  o.realtime = true;
  o.priority = 10;
  o.cpu = cpu;
  int policy_inside = -1, cpu_inside = -1;
  ControlLoop loop(o, [&](const TickInfo&) {
    sched_param p{};
    pthread_getschedparam(pthread_self(), &policy_inside, &p);
    cpu_inside = sched_getcpu();
  });
  loop.run(5);

  const std::string mode = loop.mode();
  if (mode.rfind("SCHED_FIFO(10)", 0) == 0) {
    EXPECT_EQ(policy_inside, SCHED_FIFO);
  } else {
    EXPECT_NE(mode.find("SCHED_FIFO(10) refused: "), std::string::npos) << mode;
  }
  const std::string pinned = "cpu=" + std::to_string(cpu);
  if (mode.find(pinned + " refused: ") == std::string::npos) {
    EXPECT_NE(mode.find(" " + pinned), std::string::npos) << mode;
    EXPECT_EQ(cpu_inside, cpu);
  }

  int policy_after = 0;
  sched_param param_after{};
  pthread_getschedparam(pthread_self(), &policy_after, &param_after);
  EXPECT_EQ(policy_after, policy_before);
  EXPECT_EQ(param_after.sched_priority, param_before.sched_priority);
  cpu_set_t cpus_after;
  ASSERT_EQ(pthread_getaffinity_np(pthread_self(), sizeof cpus_after, &cpus_after), 0);
  EXPECT_TRUE(CPU_EQUAL(&cpus_after, &cpus_before));
}

}  // namespace

// ActionChunkBuffer: merge modes on hand-checked chunks, RTC weights, starvation, counters,
// switch jumps, remaining(), option checks, a two-thread run; LatencyTracker.
#include "mstar/action_chunk_buffer.hpp"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <limits>
#include <stdexcept>
#include <thread>
#include <vector>

namespace {

using mstar::ActionChunkBuffer;
using mstar::ActionChunkOptions;
using mstar::LatencyTracker;
using mstar::MergeMode;
using mstar::RtcSchedule;
using u64 = std::uint64_t;

ActionChunkOptions opts(MergeMode mode, std::size_t A = 1, RtcSchedule sched = RtcSchedule::linear) {
  ActionChunkOptions o;
  o.horizon = 6;
  o.action_dim = A;
  o.mode = mode;
  o.schedule = sched;
  o.execution_horizon = 1;
  return o;
}

float pop1(ActionChunkBuffer& b, u64 tick, bool expect_ok = true) {
  float a = -1;
  EXPECT_EQ(b.pop(tick, &a), expect_ok) << "tick " << tick;
  return a;
}

// The merge fixture: an old chunk 10..15 for ticks 0..5 (observed at 0, applied at tick 0), two
// ticks of it executed, then a new chunk 20..25 observed at tick 0 arrives at tick 2: d = 2, so
// new actions k = 2..5 (22..25) land on ticks 2..5, all of which the old plan still holds.
std::vector<float> merged(ActionChunkOptions o) {
  ActionChunkBuffer b(o);
  const float old_chunk[6] = {10, 11, 12, 13, 14, 15};
  const float new_chunk[6] = {20, 21, 22, 23, 24, 25};
  EXPECT_TRUE(b.publish(old_chunk, 6, 0));
  EXPECT_EQ(pop1(b, 0), 10);
  EXPECT_EQ(pop1(b, 1), 11);
  EXPECT_TRUE(b.publish(new_chunk, 6, 0));
  std::vector<float> out;
  for (u64 t = 2; t < 6; ++t) out.push_back(pop1(b, t));
  EXPECT_EQ(b.stats().last_delay_ticks, 2u);
  EXPECT_EQ(b.stats().applied, 2u);
  EXPECT_EQ(pop1(b, 6, false), out.back()) << "past the plan: hold the last action";
  return out;
}

void expect_near(const std::vector<float>& got, const std::vector<float>& want) {
  ASSERT_EQ(got.size(), want.size());
  for (std::size_t i = 0; i < got.size(); ++i) EXPECT_NEAR(got[i], want[i], 1e-5) << "i " << i;
}

TEST(ActionChunkBuffer, LatestSwitchesAtOnce) {
  expect_near(merged(opts(MergeMode::latest)), {22, 23, 24, 25});
}

TEST(ActionChunkBuffer, WeightedBlendsOverlap) {
  // 0.3 * old + 0.7 * new: 0.3*12 + 0.7*22 = 19, then 20, 21, 22.
  expect_near(merged(opts(MergeMode::weighted)), {19, 20, 21, 22});
  auto o = opts(MergeMode::weighted);
  o.weight_new = 0.25f;  // 0.75*12 + 0.25*22 = 14.5, 0.75*13 + 0.25*23 = 15.5, ...
  expect_near(merged(o), {14.5f, 15.5f, 16.5f, 17.5f});
}

TEST(ActionChunkBuffer, RtcLinear) {
  // H=6, s=1, d=2: W(2..5) = 3/4, 2/4, 1/4, 0. 0.75*12 + 0.25*22 = 14.5; .5*13 + .5*23 = 18;
  // .25*14 + .75*24 = 21.5; 25.
  expect_near(merged(opts(MergeMode::rtc, 1, RtcSchedule::linear)), {14.5f, 18, 21.5f, 25});
}

TEST(ActionChunkBuffer, RtcExp) {
  // W = c (e^c - 1) / (e - 1) at c = .75, .5, .25: 0.48755099, 0.18877033, 0.04132404.
  const float w2 = 0.48755099f, w3 = 0.18877033f, w4 = 0.04132404f;
  expect_near(merged(opts(MergeMode::rtc, 1, RtcSchedule::exp)),
              {w2 * 12 + (1 - w2) * 22, w3 * 13 + (1 - w3) * 23, w4 * 14 + (1 - w4) * 24, 25});
}

TEST(ActionChunkBuffer, RtcOnesAndZeros) {
  // ones keeps the old plan over [d, H - s), zeros is latest; both take new from H - s on.
  expect_near(merged(opts(MergeMode::rtc, 1, RtcSchedule::ones)), {12, 13, 14, 25});
  expect_near(merged(opts(MergeMode::rtc, 1, RtcSchedule::zeros)), {22, 23, 24, 25});
}

TEST(ActionChunkBuffer, RtcTwoDimsAndOldPlanEndingFirst) {
  // A=2. Old: (i, -i) for ticks 0..5 (obs 0). New observed at tick 1, applied at tick 3 (d=2):
  // k=2..5 -> ticks 3..6 with (100+k, 0); the old plan has no tick 6 -> new there.
  ActionChunkBuffer b(opts(MergeMode::rtc, 2, RtcSchedule::linear));
  float old_chunk[12], new_chunk[12];
  for (int i = 0; i < 6; ++i) {
    old_chunk[2 * i] = float(i), old_chunk[2 * i + 1] = -float(i);
    new_chunk[2 * i] = 100.0f + float(i), new_chunk[2 * i + 1] = 0;
  }
  ASSERT_TRUE(b.publish(old_chunk, 6, 0));
  float a[2];
  for (u64 t = 0; t < 3; ++t) ASSERT_TRUE(b.pop(t, a));
  ASSERT_TRUE(b.publish(new_chunk, 6, 1));
  const float want[4][2] = {{.75f * 3 + .25f * 102, .75f * -3},  // tick 3, k=2, W=.75
                            {.5f * 4 + .5f * 103, .5f * -4},     // tick 4, k=3, W=.5
                            {.25f * 5 + .75f * 104, .25f * -5},  // tick 5, k=4, W=.25
                            {105, 0}};                           // tick 6, k=5, no old
  for (u64 t = 3; t < 7; ++t) {
    ASSERT_TRUE(b.pop(t, a));
    EXPECT_NEAR(a[0], want[t - 3][0], 1e-4) << t;
    EXPECT_NEAR(a[1], want[t - 3][1], 1e-4) << t;
  }
  EXPECT_FALSE(b.pop(7, a));
  EXPECT_EQ(b.stats().last_delay_ticks, 2u);
}

TEST(ActionChunkBuffer, RtcWeightValues) {
  ActionChunkBuffer lin(opts(MergeMode::rtc, 1, RtcSchedule::linear));
  const float want_lin[6] = {1, 1, 0.75f, 0.5f, 0.25f, 0};
  for (std::size_t k = 0; k < 6; ++k) EXPECT_FLOAT_EQ(lin.rtc_weight(k, 2), want_lin[k]) << k;
  ActionChunkBuffer ex(opts(MergeMode::rtc, 1, RtcSchedule::exp));
  const float want_exp[6] = {1, 1, 0.48755099f, 0.18877033f, 0.04132404f, 0};
  for (std::size_t k = 0; k < 6; ++k) EXPECT_FLOAT_EQ(ex.rtc_weight(k, 2), want_exp[k]) << k;
  ActionChunkBuffer ones(opts(MergeMode::rtc, 1, RtcSchedule::ones));
  ActionChunkBuffer zeros(opts(MergeMode::rtc, 1, RtcSchedule::zeros));
  const float want_ones[6] = {1, 1, 1, 1, 1, 0}, want_zeros[6] = {1, 1, 0, 0, 0, 0};
  for (std::size_t k = 0; k < 6; ++k) {
    EXPECT_EQ(ones.rtc_weight(k, 2), want_ones[k]) << k;
    EXPECT_EQ(zeros.rtc_weight(k, 2), want_zeros[k]) << k;
  }
  // s = 2, d = 1: c(k) = (4 - k) / 4 over [1, 4): 0.75, 0.5, 0.25.
  auto o = opts(MergeMode::rtc);
  o.execution_horizon = 2;
  ActionChunkBuffer s2(o);
  const float want_s2[6] = {1, 0.75f, 0.5f, 0.25f, 0, 0};
  for (std::size_t k = 0; k < 6; ++k) EXPECT_FLOAT_EQ(s2.rtc_weight(k, 1), want_s2[k]) << k;
  // d beyond H - s: no band, 1 below d and 0 from it.
  EXPECT_EQ(lin.rtc_weight(4, 5), 1.0f);
  EXPECT_EQ(lin.rtc_weight(5, 5), 0.0f);
}

TEST(ActionChunkBuffer, Starvation) {
  ActionChunkBuffer b(opts(MergeMode::latest, 2));
  float a[2] = {7, 7};
  EXPECT_FALSE(b.pop(0, a)) << "no chunk yet";
  EXPECT_EQ(a[0], 0);
  EXPECT_EQ(a[1], 0);
  const float chunk[4] = {1, 2, 3, 4};
  ASSERT_TRUE(b.publish(chunk, 2, 1));
  EXPECT_TRUE(b.pop(1, a));
  EXPECT_TRUE(b.pop(2, a));
  EXPECT_FALSE(b.pop(3, a)) << "the plan ran out";
  EXPECT_EQ(a[0], 3);  // the hold: the last action given
  EXPECT_EQ(a[1], 4);
  EXPECT_FALSE(b.pop(4, a));
  const auto s = b.stats();
  EXPECT_EQ(s.ticks, 5u);
  EXPECT_EQ(s.starved_ticks, 3u);
  EXPECT_EQ(s.applied, 1u);
}

TEST(ActionChunkBuffer, SupersededStaleRejected) {
  auto o = opts(MergeMode::latest);
  o.slots = 2;
  ActionChunkBuffer b(o);
  const float c1[6] = {1, 1, 1, 1, 1, 1}, c2[6] = {2, 2, 2, 2, 2, 2}, c3[6] = {3, 3, 3, 3, 3, 3};
  EXPECT_TRUE(b.publish(c1, 6, 0));
  EXPECT_TRUE(b.publish(c2, 6, 0));
  EXPECT_FALSE(b.publish(c3, 6, 0)) << "both slots wait";
  EXPECT_FALSE(b.publish(c3, 0, 0)) << "empty chunk";
  EXPECT_FALSE(b.publish(c3, 7, 0)) << "more than H";
  EXPECT_EQ(pop1(b, 0), 2) << "only the newest is applied";
  auto s = b.stats();
  EXPECT_EQ(s.published, 2u);
  EXPECT_EQ(s.rejected, 3u);
  EXPECT_EQ(s.superseded, 1u);
  EXPECT_EQ(s.applied, 1u);
  // Stale: observed at tick 1, 3 actions (ticks 1..3), arriving at tick 4 -> nothing left.
  EXPECT_TRUE(b.publish(c3, 3, 1));
  EXPECT_EQ(pop1(b, 4), 2) << "the old plan stays";
  // Exactly nothing left: observed at 3, 2 actions (ticks 3, 4), arriving at tick 5.
  EXPECT_TRUE(b.publish(c3, 2, 3));
  EXPECT_EQ(pop1(b, 5), 2);
  s = b.stats();
  EXPECT_EQ(s.stale, 2u);
  EXPECT_EQ(s.applied, 1u);
  EXPECT_EQ(s.last_delay_ticks, 0u);
  // Slots wrap: many rounds of two publishes per tick keep working.
  for (u64 t = 6; t < 40; ++t) {
    const float x[1] = {float(t)}, y[1] = {float(t) + 0.5f};
    ASSERT_TRUE(b.publish(x, 1, t));
    ASSERT_TRUE(b.publish(y, 1, t));
    ASSERT_EQ(pop1(b, t), float(t) + 0.5f);
  }
  EXPECT_EQ(b.stats().superseded, 1u + 34u);
}

TEST(ActionChunkBuffer, NonFiniteActionsNeverReachTheLoop) {
  ActionChunkBuffer b(opts(MergeMode::weighted));
  const float good[6] = {1, 1, 1, 1, 1, 1};
  ASSERT_TRUE(b.publish(good, 6, 0));
  EXPECT_EQ(pop1(b, 0), 1);
  const float inf = std::numeric_limits<float>::infinity();
  const float nan_last[6] = {2, 2, 2, 2, 2, std::nanf("")}, inf_first[6] = {-inf, 2, 2, 2, 2, 2};
  EXPECT_FALSE(b.publish(nan_last, 6, 1));
  EXPECT_FALSE(b.publish(inf_first, 6, 1));
  for (u64 t = 1; t < 6; ++t) EXPECT_EQ(pop1(b, t), 1) << "the plan in hand keeps running";
  const auto s = b.stats();
  EXPECT_EQ(s.rejected, 2u);
  EXPECT_EQ(s.nonfinite, 2u);
  EXPECT_EQ(s.published, 1u);
  EXPECT_EQ(s.max_switch_jump, 0.0f);
}

TEST(ActionChunkBuffer, FutureStampCountsAsNow) {
  ActionChunkBuffer b(opts(MergeMode::latest));
  const float c[3] = {5, 6, 7};
  ASSERT_TRUE(b.publish(c, 3, 10));
  EXPECT_EQ(pop1(b, 4), 5);
  EXPECT_EQ(b.stats().last_delay_ticks, 0u);
  EXPECT_EQ(pop1(b, 5), 6);
}

// Old plan all 0, new chunk all 1, arriving with d = 2: latest jumps by 1, rtc (linear, H=6,
// s=1) starts at 1 - W(2) = 0.25.
float jump(MergeMode mode) {
  ActionChunkBuffer b(opts(mode));
  const float zeros[6] = {}, ones[6] = {1, 1, 1, 1, 1, 1};
  EXPECT_TRUE(b.publish(zeros, 6, 0));
  pop1(b, 0);
  pop1(b, 1);
  EXPECT_EQ(b.stats().max_switch_jump, 0.0f) << "the first chunk has nothing to jump from";
  EXPECT_TRUE(b.publish(ones, 6, 0));
  pop1(b, 2);
  return b.stats().max_switch_jump;
}

TEST(ActionChunkBuffer, SwitchJump) {
  EXPECT_FLOAT_EQ(jump(MergeMode::latest), 1.0f);
  EXPECT_FLOAT_EQ(jump(MergeMode::weighted), 0.7f);
  EXPECT_FLOAT_EQ(jump(MergeMode::rtc), 0.25f);
  // After starvation the reference is the held action: 3 -> 10 is a jump of 7.
  ActionChunkBuffer b(opts(MergeMode::rtc));
  const float c[2] = {2, 3}, d[1] = {10};
  ASSERT_TRUE(b.publish(c, 2, 0));
  pop1(b, 0);
  pop1(b, 1);
  pop1(b, 2, false);
  ASSERT_TRUE(b.publish(d, 1, 3));
  EXPECT_EQ(pop1(b, 3), 10);
  EXPECT_FLOAT_EQ(b.stats().max_switch_jump, 7.0f);
}

TEST(ActionChunkBuffer, Remaining) {
  ActionChunkBuffer b(opts(MergeMode::latest, 2));
  float out[12];
  EXPECT_EQ(b.remaining(0, out, 6), 0u) << "no plan";
  const float c[10] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9};
  ASSERT_TRUE(b.publish(c, 5, 0));
  EXPECT_EQ(b.remaining(0, out, 6), 0u) << "not looked at before a pop";
  float a[2];
  ASSERT_TRUE(b.pop(1, a));  // d = 1: the plan holds ticks 1..4 = actions 1..4
  ASSERT_EQ(b.remaining(1, out, 6), 4u);
  for (int i = 0; i < 8; ++i) EXPECT_EQ(out[i], float(i + 2));
  ASSERT_EQ(b.remaining(3, out, 1), 1u);
  EXPECT_EQ(out[0], 6);
  EXPECT_EQ(out[1], 7);
  EXPECT_EQ(b.remaining(4, out, 6), 1u);
  EXPECT_EQ(b.remaining(5, out, 6), 0u);
  EXPECT_EQ(b.remaining(0, out, 6), 0u) << "before the plan";
  EXPECT_EQ(b.remaining(2, out, 0), 0u);
}

TEST(ActionChunkBuffer, InvalidOptionsThrow) {
  auto bad = [](auto edit) {
    ActionChunkOptions o;
    edit(o);
    EXPECT_THROW(ActionChunkBuffer{o}, std::invalid_argument);
  };
  bad([](ActionChunkOptions& o) { o.horizon = 0; });
  bad([](ActionChunkOptions& o) { o.action_dim = 0; });
  bad([](ActionChunkOptions& o) { o.mode = MergeMode::rtc, o.execution_horizon = 50; });
  bad([](ActionChunkOptions& o) { o.weight_new = -0.1f; });
  bad([](ActionChunkOptions& o) { o.weight_new = 1.1f; });
  bad([](ActionChunkOptions& o) { o.weight_new = std::numeric_limits<float>::quiet_NaN(); });
  bad([](ActionChunkOptions& o) { o.slots = 3; });
  bad([](ActionChunkOptions& o) { o.slots = 0; });
  ActionChunkOptions ok;
  ok.execution_horizon = 50;  // s only matters for rtc
  ok.weight_new = 1.0f;
  ok.slots = 1;
  EXPECT_NO_THROW(ActionChunkBuffer{ok});
  EXPECT_EQ(ActionChunkBuffer{ok}.options().horizon, 50u);
}

// A policy thread publishes a chunk (H=16) from the tick it sees, every 7 ticks; the loop waits
// at tick t + 3 until the chunk from t is out, like an inference delay of up to 3 ticks. Action
// values are their own target ticks, so every merge mode must give exactly the tick.
void two_threads(MergeMode mode) {
  ActionChunkOptions o = opts(mode);
  o.horizon = 16;
  ActionChunkBuffer b(o);
  constexpr u64 kTicks = 10000, kEvery = 7, kLag = 3;
  std::atomic<u64> now{0}, sent{0};
  std::thread policy([&] {
    float chunk[16];
    for (u64 t0 = 0; t0 < kTicks; t0 += kEvery) {
      while (now.load(std::memory_order_acquire) < t0) std::this_thread::yield();
      for (int k = 0; k < 16; ++k) chunk[k] = float(t0 + k);
      while (!b.publish(chunk, 16, t0)) std::this_thread::yield();  // slots: 4, rarely full
      sent.store(t0 / kEvery + 1, std::memory_order_release);
      (void)b.stats();  // reads the loop's counters while it writes them: TSan checks they are atomics
    }
  });
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  u64 bad = 0, starved_late = 0;
  for (u64 t = 0; t < kTicks + 1; ++t) {
    if (t >= kLag && (t - kLag) % kEvery == 0 && t - kLag < kTicks) {
      while (sent.load(std::memory_order_acquire) < (t - kLag) / kEvery + 1 &&
             std::chrono::steady_clock::now() < deadline)
        std::this_thread::yield();
    }
    float a = -1;
    if (b.pop(t, &a)) {
      bad += std::fabs(a - float(t)) > 1e-3f * float(t + 1) ? 1 : 0;
    } else if (t >= kLag) {
      ++starved_late;
    }
    (void)b.stats();  // and the other way round
    now.store(t + 1, std::memory_order_release);
  }
  policy.join();
  EXPECT_EQ(bad, 0u);
  EXPECT_EQ(starved_late, 0u);
  const auto s = b.stats();
  EXPECT_EQ(s.ticks, kTicks + 1);
  EXPECT_EQ(s.published, (kTicks + kEvery - 1) / kEvery);
  EXPECT_EQ(s.published, s.applied + s.superseded + s.stale) << "the last pop drained the ring";
  EXPECT_LE(s.starved_ticks, kLag);
  EXPECT_LE(s.last_delay_ticks, kLag);
}

TEST(ActionChunkBuffer, TwoThreadsLatest) { two_threads(MergeMode::latest); }
TEST(ActionChunkBuffer, TwoThreadsWeighted) { two_threads(MergeMode::weighted); }
TEST(ActionChunkBuffer, TwoThreadsRtc) { two_threads(MergeMode::rtc); }

TEST(ActionChunkLatencyTracker, DelayFromMaxLatency) {
  LatencyTracker lt(8, 0.010);
  EXPECT_EQ(lt.count(), 0u);
  EXPECT_EQ(lt.max_s(), 0.0);
  EXPECT_EQ(lt.p95_s(), 0.0);
  EXPECT_EQ(lt.delay_ticks(), 0u);
  for (double x : {0.005, 0.012, 0.025}) lt.record(x);
  EXPECT_EQ(lt.count(), 3u);
  EXPECT_DOUBLE_EQ(lt.max_s(), 0.025);
  EXPECT_EQ(lt.delay_ticks(), 3u);
  LatencyTracker exact(4, 0.010);
  exact.record(0.020);
  EXPECT_EQ(exact.delay_ticks(), 2u) << "exactly two periods";
  exact.record(0.070);  // 0.07 / 0.01 = 7.000000000000001 in doubles
  EXPECT_EQ(exact.delay_ticks(), 7u);
  exact.record(-1.0);  // counts as 0
  exact.record(std::numeric_limits<double>::quiet_NaN());
  EXPECT_EQ(exact.delay_ticks(), 7u);
  EXPECT_EQ(exact.count(), 4u);
}

TEST(ActionChunkLatencyTracker, WindowSlides) {
  LatencyTracker lt(3, 0.010);
  lt.record(0.050);
  EXPECT_EQ(lt.delay_ticks(), 5u);
  lt.record(0.005);
  lt.record(0.004);
  EXPECT_EQ(lt.delay_ticks(), 5u);
  lt.record(0.003);  // the 50 ms sample leaves the window
  EXPECT_EQ(lt.count(), 3u);
  EXPECT_DOUBLE_EQ(lt.max_s(), 0.005);
  EXPECT_EQ(lt.delay_ticks(), 1u);
}

TEST(ActionChunkLatencyTracker, P95NearestRank) {
  LatencyTracker lt(20, 0.010);
  for (int i = 20; i >= 1; --i) lt.record(i * 0.001);  // 1..20 ms in reverse order
  EXPECT_DOUBLE_EQ(lt.p95_s(), 0.019);  // rank ceil(0.95 * 20) = 19
  LatencyTracker ten(10, 0.010);
  for (int i = 1; i <= 10; ++i) ten.record(i * 0.001);
  EXPECT_DOUBLE_EQ(ten.p95_s(), 0.010);  // rank ceil(9.5) = 10
  LatencyTracker ties(4, 0.010);
  for (double x : {0.002, 0.002, 0.002, 0.001}) ties.record(x);
  EXPECT_DOUBLE_EQ(ties.p95_s(), 0.002);
  for (int i = 0; i < 20; ++i) lt.record(0.001);  // the window forgets the slow ones
  EXPECT_DOUBLE_EQ(lt.p95_s(), 0.001);
}

TEST(ActionChunkLatencyTracker, InvalidArgumentsThrow) {
  EXPECT_THROW(LatencyTracker(0, 0.01), std::invalid_argument);
  EXPECT_THROW(LatencyTracker(4, 0.0), std::invalid_argument);
  EXPECT_THROW(LatencyTracker(4, -0.01), std::invalid_argument);
  EXPECT_THROW(LatencyTracker(4, std::numeric_limits<double>::quiet_NaN()), std::invalid_argument);
}

}  // namespace

// ActionChunkBuffer: chunk records through an SpscRing, merged into a double-buffered plan on the
// control loop's thread; LatencyTracker.
#include "mstar/action_chunk_buffer.hpp"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>

#include "mstar/spsc_ring.hpp"

namespace mstar {

namespace {

// A chunk record in a ring slot: this header, then H * A floats (count * A of them used).
struct RecordHeader {
  std::uint64_t obs_tick;
  std::uint64_t count;
};
constexpr std::size_t kLine = 64;

bool is_power_of_two(std::size_t v) { return v != 0 && (v & (v - 1)) == 0; }

const ActionChunkOptions& checked(const ActionChunkOptions& o) {
  if (o.horizon == 0) throw std::invalid_argument("ActionChunkBuffer: horizon must be at least 1");
  if (o.action_dim == 0)
    throw std::invalid_argument("ActionChunkBuffer: action_dim must be at least 1");
  if (o.mode == MergeMode::rtc && o.execution_horizon >= o.horizon)
    throw std::invalid_argument("ActionChunkBuffer: execution_horizon (" +
                                std::to_string(o.execution_horizon) +
                                ") must be below the horizon (" + std::to_string(o.horizon) +
                                ") for rtc");
  if (!(o.weight_new >= 0.0f && o.weight_new <= 1.0f))  // written so that NaN fails too
    throw std::invalid_argument("ActionChunkBuffer: weight_new must lie in [0, 1]");
  if (!is_power_of_two(o.slots))
    throw std::invalid_argument("ActionChunkBuffer: slots must be a power of two, got " +
                                std::to_string(o.slots));
  if (o.horizon > (std::numeric_limits<std::size_t>::max() / sizeof(float) - kLine) / o.action_dim)
    throw std::invalid_argument("ActionChunkBuffer: horizon * action_dim is too large");
  return o;
}

// Slots are whole cache lines: the header and the floats stay aligned and neighbouring slots
// (one being written, one being read) do not share a line.
std::size_t record_bytes(const ActionChunkOptions& o) {
  const std::size_t raw = sizeof(RecordHeader) + o.horizon * o.action_dim * sizeof(float);
  return (raw + kLine - 1) / kLine * kLine;
}

// W(k) of the header. c runs from (H-s-d)/(H-s-d+1) at k = d down to 1/(H-s-d+1): inside the
// band the linear and exp schedules never reach 1 or 0.
float prefix_weight(const ActionChunkOptions& o, std::size_t k, std::size_t d) noexcept {
  const std::size_t H = o.horizon, s = o.execution_horizon;
  if (k < d) return 1.0f;
  if (s >= H || k >= H - s) return 0.0f;
  const double c = static_cast<double>(H - s - k) / static_cast<double>(H - s - d + 1);
  switch (o.schedule) {
    case RtcSchedule::linear: return static_cast<float>(c);
    case RtcSchedule::exp: return static_cast<float>(c * std::expm1(c) / std::expm1(1.0));
    case RtcSchedule::ones: return 1.0f;
    case RtcSchedule::zeros: return 0.0f;
  }
  return 0.0f;
}

// Counters with one writer each: a relaxed load + store is enough (no read-modify-write), and
// being atomic lets stats() read them from any thread without a data race.
using Counter = std::atomic<std::uint64_t>;
inline void bump(Counter& c, std::uint64_t n = 1) noexcept {
  c.store(c.load(std::memory_order_relaxed) + n, std::memory_order_relaxed);
}

}  // namespace

struct ActionChunkBuffer::Impl {
  explicit Impl(const ActionChunkOptions& o)
      : opt(checked(o)),
        width(o.horizon * o.action_dim),
        ring(record_bytes(o), o.slots, Overflow::reject),
        plan_data{std::vector<float>(width), std::vector<float>(width)},
        last(o.action_dim, 0.0f) {
    plans[0].data = plan_data[0].data();
    plans[1].data = plan_data[1].data();
  }

  struct Plan {
    std::uint64_t start = 0;
    std::size_t length = 0;  // actions, for ticks [start, start + length)
    float* data = nullptr;
    const float* at(std::uint64_t tick, std::size_t a) const noexcept {
      if (tick < start || tick - start >= length) return nullptr;
      return data + static_cast<std::size_t>(tick - start) * a;
    }
  };

  const std::byte* take_newest() noexcept;
  void apply(const std::byte* record, std::uint64_t tick) noexcept;

  const ActionChunkOptions opt;
  const std::size_t width;  // H * A
  SpscRing ring;

  // Control loop's thread only. The new plan is merged into the back buffer while the front one
  // (the old plan) is still readable, then the two swap: no allocation after construction.
  std::vector<float> plan_data[2];
  Plan plans[2];
  int front = 0;
  std::vector<float> last;  // the last action given (the hold on starvation)
  bool given = false;

  // Producer-written counters, on their own line so publish() does not false-share with pop().
  alignas(kLine) Counter published{0};
  Counter rejected{0};
  Counter nonfinite{0};
  // Consumer-written.
  alignas(kLine) Counter ticks{0};
  Counter starved{0};
  Counter applied{0};
  Counter superseded{0};
  Counter stale{0};
  Counter last_delay{0};
  std::atomic<float> max_jump{0.0f};
};

// Leaves the ring holding only the newest record that was there when we looked, and returns it
// (peeked in place; the caller releases it), or nullptr when nothing waits. Records published
// meanwhile wait for the next tick, so this takes at most three peeks (a wrap splits the skip).
const std::byte* ActionChunkBuffer::Impl::take_newest() noexcept {
  const std::uint64_t w = ring.write_position();
  const std::uint64_t r = ring.read_position();
  if (w == r) return nullptr;
  std::size_t skip = static_cast<std::size_t>(w - r - 1);
  if (skip != 0) bump(superseded, skip);
  while (skip != 0) {
    const ReadRegion older = ring.peek(skip);
    ring.release(older.count);
    skip -= older.count;
  }
  const ReadRegion newest = ring.peek(1);
  return newest.count == 1 ? newest.data : nullptr;
}

void ActionChunkBuffer::Impl::apply(const std::byte* record, std::uint64_t tick) noexcept {
  RecordHeader h;
  std::memcpy(&h, record, sizeof h);
  // The slot was filled with memcpy by publish(); it is cache-line aligned, so floats are too.
  const float* chunk = reinterpret_cast<const float*>(record + sizeof(RecordHeader));
  const std::uint64_t t0 = std::min(h.obs_tick, tick);  // a future stamp counts as observed now
  const std::uint64_t d = tick - t0;
  if (d >= h.count) {
    bump(stale);
    return;
  }
  const std::size_t A = opt.action_dim;
  const std::size_t first = static_cast<std::size_t>(d);
  const Plan& old = plans[front];
  Plan& next = plans[1 - front];
  next.start = tick;
  next.length = static_cast<std::size_t>(h.count) - first;
  const float w_new = opt.weight_new;
  for (std::size_t i = 0; i < next.length; ++i) {
    const std::size_t k = first + i;
    const float* n = chunk + k * A;
    const float* o = old.at(tick + i, A);
    float* out = next.data + i * A;
    float w_old = 0.0f;  // latest, or no old action for this tick
    if (o != nullptr && opt.mode == MergeMode::weighted) w_old = 1.0f - w_new;
    if (o != nullptr && opt.mode == MergeMode::rtc) w_old = prefix_weight(opt, k, first);
    if (w_old == 0.0f) {
      std::memcpy(out, n, A * sizeof(float));
    } else {
      for (std::size_t j = 0; j < A; ++j) out[j] = w_old * o[j] + (1.0f - w_old) * n[j];
    }
  }
  // The jerk at the switch: against where the old plan would have gone, else where we stopped.
  const float* before = old.at(tick, A);
  if (before == nullptr && given) before = last.data();
  if (before != nullptr) {
    float jump = 0.0f;
    for (std::size_t j = 0; j < A; ++j) jump = std::max(jump, std::fabs(next.data[j] - before[j]));
    if (jump > max_jump.load(std::memory_order_relaxed))
      max_jump.store(jump, std::memory_order_relaxed);
  }
  front = 1 - front;
  bump(applied);
  last_delay.store(d, std::memory_order_relaxed);
}

ActionChunkBuffer::ActionChunkBuffer(ActionChunkOptions options)
    : impl_(std::make_unique<Impl>(options)) {}

ActionChunkBuffer::~ActionChunkBuffer() = default;

bool ActionChunkBuffer::publish(const float* actions, std::size_t count,
                                std::uint64_t obs_tick) noexcept {
  Impl& m = *impl_;
  if (count == 0 || count > m.opt.horizon || actions == nullptr) {
    bump(m.rejected);
    return false;
  }
  // A NaN or inf action would reach the robot as a fresh command (and hide from the jump
  // measure): the chunk is refused, the plan in hand keeps running.
  const std::size_t n = count * m.opt.action_dim;
  for (std::size_t i = 0; i < n; ++i) {
    if (!std::isfinite(actions[i])) {
      bump(m.rejected);
      bump(m.nonfinite);
      return false;
    }
  }
  const WriteRegion slot = m.ring.reserve(1);
  if (slot.count == 0) {  // every slot waits for the loop: the policy's chunk is dropped, not queued
    bump(m.rejected);
    return false;
  }
  const RecordHeader h{obs_tick, count};
  std::memcpy(slot.data, &h, sizeof h);
  std::memcpy(slot.data + sizeof h, actions, count * m.opt.action_dim * sizeof(float));
  m.ring.commit(1);
  bump(m.published);
  return true;
}

bool ActionChunkBuffer::pop(std::uint64_t tick, float* out) noexcept {
  Impl& m = *impl_;
  bump(m.ticks);
  if (const std::byte* record = m.take_newest()) {
    m.apply(record, tick);
    m.ring.release(1);
  }
  const std::size_t A = m.opt.action_dim;
  const std::size_t bytes = A * sizeof(float);
  if (const float* a = m.plans[m.front].at(tick, A)) {
    std::memcpy(out, a, bytes);
    std::memcpy(m.last.data(), a, bytes);
    m.given = true;
    return true;
  }
  bump(m.starved);
  std::memcpy(out, m.last.data(), bytes);  // zeros until the first action was given
  return false;
}

std::size_t ActionChunkBuffer::remaining(std::uint64_t tick, float* out,
                                         std::size_t max_count) const noexcept {
  const Impl& m = *impl_;
  const Impl::Plan& plan = m.plans[m.front];
  const std::size_t A = m.opt.action_dim;
  const float* from = plan.at(tick, A);
  if (from == nullptr || max_count == 0) return 0;
  const std::size_t left = plan.length - static_cast<std::size_t>(tick - plan.start);
  const std::size_t n = std::min(left, max_count);
  std::memcpy(out, from, n * A * sizeof(float));
  return n;
}

float ActionChunkBuffer::rtc_weight(std::size_t k, std::size_t d) const noexcept {
  return prefix_weight(impl_->opt, k, d);
}

ActionBufferStats ActionChunkBuffer::stats() const noexcept {
  const Impl& m = *impl_;
  constexpr auto relaxed = std::memory_order_relaxed;
  ActionBufferStats s;
  s.ticks = m.ticks.load(relaxed);
  s.starved_ticks = m.starved.load(relaxed);
  s.published = m.published.load(relaxed);
  s.applied = m.applied.load(relaxed);
  s.superseded = m.superseded.load(relaxed);
  s.rejected = m.rejected.load(relaxed);
  s.nonfinite = m.nonfinite.load(relaxed);
  s.stale = m.stale.load(relaxed);
  s.max_switch_jump = m.max_jump.load(relaxed);
  s.last_delay_ticks = m.last_delay.load(relaxed);
  return s;
}

const ActionChunkOptions& ActionChunkBuffer::options() const noexcept { return impl_->opt; }

// ---- LatencyTracker ---------------------------------------------------------------------------

LatencyTracker::LatencyTracker(std::size_t window, double control_period_s)
    : period_(control_period_s) {
  if (window == 0) throw std::invalid_argument("LatencyTracker: window must be at least 1");
  if (!(control_period_s > 0.0))
    throw std::invalid_argument("LatencyTracker: the control period must be positive");
  samples_.assign(window, 0.0);
}

void LatencyTracker::record(double latency_s) noexcept {
  samples_[next_] = latency_s >= 0.0 ? latency_s : 0.0;  // NaN fails the test too
  next_ = next_ + 1 == samples_.size() ? 0 : next_ + 1;
  if (filled_ < samples_.size()) ++filled_;
}

// Until the ring is full the samples are exactly its first filled_ entries.
double LatencyTracker::max_s() const noexcept {
  double m = 0.0;
  for (std::size_t i = 0; i < filled_; ++i) m = std::max(m, samples_[i]);
  return m;
}

double LatencyTracker::p95_s() const noexcept {
  if (filled_ == 0) return 0.0;
  // Nearest rank: the smallest sample x with at least ceil(0.95 n) samples <= x. The tolerance
  // keeps 0.95 * 20 (19.000...) from rounding up to 20.
  const auto rank = static_cast<std::size_t>(std::ceil(0.95 * static_cast<double>(filled_) - 1e-9));
  double best = std::numeric_limits<double>::infinity();
  for (std::size_t i = 0; i < filled_; ++i) {
    const double x = samples_[i];
    if (x >= best) continue;
    std::size_t at_most = 0;
    for (std::size_t j = 0; j < filled_; ++j) at_most += samples_[j] <= x ? 1 : 0;
    if (at_most >= rank) best = x;
  }
  return best;
}

std::size_t LatencyTracker::delay_ticks() const noexcept {
  // 0.07 / 0.01 is 7.000000000000001 in doubles: without the tolerance 7 periods would give 8.
  const double ticks = std::ceil(max_s() / period_ - 1e-9);
  if (!(ticks < 1e18)) return std::numeric_limits<std::size_t>::max();
  return ticks > 0.0 ? static_cast<std::size_t>(ticks) : 0;
}

std::size_t LatencyTracker::count() const noexcept { return filled_; }

}  // namespace mstar

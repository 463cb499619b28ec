// ChunkFeeder (see mstar/chunk_feeder.hpp).
#include <chrono>
#include <stdexcept>

#include "mstar/chunk_feeder.hpp"
#include "core/wait_word.hpp"

namespace mstar {

namespace {
constexpr std::uint32_t kFresh = 4;
}

ChunkFeeder::ChunkFeeder(std::shared_ptr<ActionChunkBuffer> actions, ChunkFeederOptions options,
                         InferFn infer)
    : actions_(std::move(actions)), options_(options), infer_(std::move(infer)),
      latency_(options.latency_max_ms > 0 ? options.latency_max_ms : 1000, 20000) {
  if (!actions_) throw std::invalid_argument("ChunkFeeder: no action buffer");
  if (!infer_) throw std::invalid_argument("ChunkFeeder: no infer function");
  if (options_.obs_dim == 0) throw std::invalid_argument("ChunkFeeder: obs_dim must be > 0");
  const auto& o = actions_->options();
  if (options_.refill_below == 0) options_.refill_below = (o.horizon + 1) / 2;
  for (Slot& s : slots_) s.obs.assign(options_.obs_dim, 0.0f);
  plan_.assign(o.horizon * o.action_dim, 0.0f);
}

ChunkFeeder::~ChunkFeeder() { stop(); }

void ChunkFeeder::start() {
  std::lock_guard<std::mutex> lock(control_mu_);
  if (thread_.joinable()) throw std::logic_error("ChunkFeeder::start: already running");
  stop_.store(false);
  running_.store(true, std::memory_order_release);
  thread_ = std::thread([this] { run(); });
}

void ChunkFeeder::stop() {
  stop_.store(true, std::memory_order_release);
  seq_.fetch_add(1, std::memory_order_release);
  detail::wake_all(seq_);
  // One caller joins; another stop() at the same time (a watchdog and the main thread) returns
  // at once: two joins of one thread hung.
  std::thread t;
  {
    std::lock_guard<std::mutex> lock(control_mu_);
    t = std::move(thread_);
  }
  if (t.joinable()) t.join();
  running_.store(false, std::memory_order_release);
}

namespace {
// Chunks the loop has taken in (merged, replaced or dropped as stale): a relaxed sum, no lock.
std::uint64_t consumed(const ActionChunkBuffer& actions) noexcept {
  const ActionBufferStats s = actions.stats();
  return s.applied + s.superseded + s.stale;
}
}  // namespace

void ChunkFeeder::observe(const float* obs, std::uint64_t obs_tick) noexcept {
  Slot& s = slots_[back_];
  for (std::size_t i = 0; i < options_.obs_dim; ++i) s.obs[i] = obs[i];
  s.tick = obs_tick;
  s.consumed = consumed(*actions_);  // before remaining(): its plan has at least these merged
  s.left = actions_->remaining(obs_tick, plan_.data(), actions_->options().horizon);
  const bool due = s.left < options_.refill_below;
  back_ = middle_.exchange(back_ | kFresh, std::memory_order_acq_rel) & 3;
  if (due) {
    seq_.fetch_add(1, std::memory_order_release);
    if (sleeping_.load(std::memory_order_acquire)) detail::wake_all(seq_);
  }
}

void ChunkFeeder::run() {
  bool have = false;
  std::uint64_t published_at = 0;  // the newest tick seen when the last chunk went out
  bool published = false;
  // After a chunk went out, an observation counts only once the loop had taken it in: one made
  // between the loop's pop and its merge saw the old plan run short, and asked for a second
  // chunk (about a third of the policy calls at 50 Hz with 20-40 ms inference).
  std::uint64_t merged_by = 0;
  Tensor obs = Tensor::empty(DType::float32, {static_cast<std::int64_t>(options_.obs_dim)});
  const std::size_t action_dim = actions_->options().action_dim;
  auto take = [&] {
    if (middle_.load(std::memory_order_acquire) & kFresh) {
      front_ = middle_.exchange(front_, std::memory_order_acq_rel) & 3;
      have = true;
    }
  };
  while (!stop_.load(std::memory_order_acquire)) {
    const std::uint32_t seen = seq_.load(std::memory_order_acquire);
    take();
    const Slot& s = slots_[front_];
    const bool waiting_for_merge = published && (s.tick <= published_at || s.consumed < merged_by);
    if (!have || waiting_for_merge || s.left >= options_.refill_below) {
      sleeping_.store(true, std::memory_order_release);
      // A tick bumps seq_ when a refill is due; the timeout covers a loop that stopped ticking.
      if (!(middle_.load(std::memory_order_acquire) & kFresh) || !have)
        detail::wait_on(seq_, seen, std::chrono::milliseconds(20));
      sleeping_.store(false, std::memory_order_release);
      continue;
    }
    float* o = obs.data<float>();
    for (std::size_t i = 0; i < options_.obs_dim; ++i) o[i] = s.obs[i];
    const std::uint64_t t0 = s.tick;
    const auto start = std::chrono::steady_clock::now();
    try {
      Tensor chunk = infer_(obs, t0);
      latency_.add(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count());
      const std::size_t horizon = actions_->options().horizon;
      const bool shape_ok = chunk.defined() && chunk.dtype() == DType::float32 &&
                            chunk.ndim() == 2 && static_cast<std::size_t>(chunk.dim(1)) == action_dim &&
                            chunk.dim(0) >= 1 && static_cast<std::size_t>(chunk.dim(0)) <= horizon;
      const std::uint64_t nonfinite = actions_->stats().nonfinite;
      if (shape_ok && actions_->publish(chunk.data<float>(), static_cast<std::size_t>(chunk.dim(0)), t0)) {
        chunks_.fetch_add(1, std::memory_order_relaxed);
        merged_by = actions_->stats().published;  // (this feeder is the buffer's publisher)
      } else {
        rejected_.fetch_add(1, std::memory_order_relaxed);
        // no free slot is the loop being behind, not an error; the rest name what to fix
        std::string why;
        if (!shape_ok)
          why = "the policy returned " + chunk.describe() + "; expected float32[n, " +
                std::to_string(action_dim) + "] with 1 <= n <= " + std::to_string(horizon);
        else if (actions_->stats().nonfinite != nonfinite)
          why = "the policy returned a chunk holding NaN or infinite actions (refused: the plan "
                "in hand keeps running)";
        if (!why.empty()) {
          std::lock_guard<std::mutex> lock(error_mu_);
          last_error_ = std::move(why);
        }
      }
    } catch (const std::exception& e) {
      failures_.fetch_add(1, std::memory_order_relaxed);
      std::lock_guard<std::mutex> lock(error_mu_);
      last_error_ = e.what();
    } catch (...) {  // the header promises any exception counts as a failure
      failures_.fetch_add(1, std::memory_order_relaxed);
      std::lock_guard<std::mutex> lock(error_mu_);
      last_error_ = "the infer function threw an exception that is not a std::exception";
    }
    take();
    published_at = slots_[front_].tick;
    published = true;
  }
}

ChunkFeederStats ChunkFeeder::stats() const {
  ChunkFeederStats s;
  s.chunks = chunks_.load();
  s.rejected = rejected_.load();
  s.failures = failures_.load();
  if (!running_.load(std::memory_order_acquire) && latency_.count()) {
    s.latency_p50_ms = latency_.percentile(50);
    s.latency_p99_ms = latency_.percentile(99);
    s.latency_max_ms = latency_.max();
  }
  return s;
}

std::string ChunkFeeder::last_error() const {
  std::lock_guard<std::mutex> lock(error_mu_);
  return last_error_;
}

}  // namespace mstar

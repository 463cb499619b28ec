// SpscRing: construction, regions, overflow handling and the spin-then-futex waits.
#include "mstar/spsc_ring.hpp"

#include <algorithm>
#include <cstdlib>
#include <new>
#include <stdexcept>
#include <string>
#include <thread>

#include "core/cpu_relax.hpp"
#include "core/wait_word.hpp"

namespace mstar {

namespace {

bool is_power_of_two(std::size_t v) { return v != 0 && (v & (v - 1)) == 0; }

using detail::cpu_relax;

}  // namespace

SpscRing::SpscRing(std::size_t item_size, std::size_t capacity, Overflow overflow,
                   std::size_t mirror)
    : item_size_(item_size),
      capacity_(capacity),
      mask_(capacity - 1),
      mirror_(mirror),
      overflow_(overflow),
      asymmetric_(detail::heavy_barrier_available()),
      buf_(nullptr) {
  if (item_size == 0) throw std::invalid_argument("SpscRing: item_size must be at least 1 byte");
  if (!is_power_of_two(capacity))
    throw std::invalid_argument("SpscRing: capacity must be a power of two, got " +
                                std::to_string(capacity));
  if (mirror > capacity)
    throw std::invalid_argument("SpscRing: mirror (" + std::to_string(mirror) +
                                ") must not exceed capacity (" + std::to_string(capacity) + ")");
  // Cache-line aligned so slot 0 does not share a line with anything else; zeroed so that a
  // reader of never-written memory (a bug) sees zeros, not garbage.
  std::size_t bytes = 0;  // 2^62 items wrapped to a 0-byte buffer, then a double free
  if (__builtin_mul_overflow(capacity + mirror, item_size, &bytes) || bytes > (SIZE_MAX >> 2))
    throw std::length_error("SpscRing: " + std::to_string(capacity) + " items of " +
                            std::to_string(item_size) + " bytes do not fit in memory");
  const std::size_t rounded = (bytes + kLine - 1) / kLine * kLine;
  buf_ = static_cast<std::byte*>(::operator new(rounded, std::align_val_t{kLine}));
  std::memset(buf_, 0, rounded);
}

SpscRing::~SpscRing() { ::operator delete(buf_, std::align_val_t{kLine}); }

std::size_t SpscRing::size() const noexcept {
  // Read the read side first: it only grows, so the difference can only over-estimate briefly.
  const std::uint64_t r = read_state_.load(std::memory_order_acquire) >> 1;
  const std::uint64_t w = write_pos_.load(std::memory_order_acquire);
  return w > r ? static_cast<std::size_t>(w - r) : 0;
}

RingStats SpscRing::stats() const noexcept {
  // pushed and popped are positions, not counters: no per-item bookkeeping on the hot paths.
  RingStats s;
  s.dropped = dropped_.load(std::memory_order_relaxed);
  s.pushed = write_pos_.load(std::memory_order_acquire);
  const std::uint64_t read = read_state_.load(std::memory_order_acquire) >> 1;
  s.popped = read > s.dropped ? read - s.dropped : 0;
  s.rejected = rejected_.load(std::memory_order_relaxed);
  return s;
}

// ---- producer -------------------------------------------------------------------------------

bool SpscRing::make_room(std::size_t count) noexcept {
  if (overflow_ == Overflow::block) return false;  // full, not refused: the caller may wait
  if (overflow_ == Overflow::reject || count > capacity_) {
    bump(rejected_, count);
    return false;
  }
  std::uint64_t state = read_state_.load(std::memory_order_acquire);
  for (;;) {
    if (state & 1u) break;  // the consumer holds the oldest items: they cannot go
    const std::uint64_t read = state >> 1;
    const std::uint64_t need = write_local_ + count - read;
    if (need <= capacity_) {
      read_cache_ = read;
      return true;
    }
    const std::uint64_t drop = need - capacity_;
    if (read_state_.compare_exchange_weak(state, (read + drop) << 1, std::memory_order_acq_rel,
                                          std::memory_order_acquire)) {
      read_cache_ = read + drop;
      bump(dropped_, drop);
      return true;
    }
  }
  bump(rejected_, count);
  return false;
}

void SpscRing::mirror_commit(std::uint64_t from, std::size_t count) noexcept {
  if (mirror_ == 0 || count == 0) return;
  const std::size_t start = static_cast<std::size_t>(from & mask_);
  const std::size_t end = start + count;  // may run into the mirror band
  const std::size_t line = capacity_ * item_size_;
  if (end > capacity_) {  // written into the band: copy back to the head
    const std::size_t a = std::max(start, capacity_);
    std::memcpy(buf_ + (a - capacity_) * item_size_, buf_ + a * item_size_, (end - a) * item_size_);
  }
  if (start < mirror_) {  // written into the head: copy into the band
    const std::size_t b = std::min(end, mirror_);
    std::memcpy(buf_ + start * item_size_ + line, buf_ + start * item_size_, (b - start) * item_size_);
  }
}



std::size_t SpscRing::push(const void* items, std::size_t count, Timeout timeout) {
  if (closed()) throw std::logic_error("SpscRing: push after close(); the stream has ended");
  if (overflow_ != Overflow::block && count > capacity_)
    throw std::invalid_argument("SpscRing: cannot push " + std::to_string(count) +
                                " items at once into a ring of capacity " +
                                std::to_string(capacity_) + " with a reject/drop_oldest policy");
  const auto* src = static_cast<const std::byte*>(items);
  if (overflow_ != Overflow::block) {
    if (!has_room(count) && !make_room(count)) return 0;
  }
  std::size_t done = 0;
  // The deadline (one clock read) is only worked out once the ring turns out to be full.
  std::chrono::steady_clock::time_point deadline{};
  bool deadline_set = false;
  while (done < count) {
    const WriteRegion region = reserve(count - done);
    if (region.count > 0) {
      std::memcpy(region.data, src + done * item_size_, region.count * item_size_);
      commit(region.count);
      done += region.count;
      continue;
    }
    if (closed() || timeout <= Timeout::zero()) break;
    const auto now = std::chrono::steady_clock::now();
    if (!deadline_set) {
      deadline = timeout == kForever ? std::chrono::steady_clock::time_point::max() : now + timeout;
      deadline_set = true;
    }
    if (now >= deadline) break;
    const Timeout left = deadline == std::chrono::steady_clock::time_point::max()
                             ? kForever
                             : std::chrono::duration_cast<Timeout>(deadline - now);
    if (wait_for_space(1, left) != WaitStatus::ready) break;
  }
  return done;
}

WaitStatus SpscRing::wait_for_space(std::size_t count, Timeout timeout) noexcept {
  return wait(false, count, timeout);
}

void SpscRing::close() noexcept {
  closed_.store(true, std::memory_order_seq_cst);
  wake(items_seq_);
  wake(space_seq_);
}

// ---- consumer -------------------------------------------------------------------------------

std::uint64_t SpscRing::hold_for_read() noexcept {
  // Set the held bit so the producer cannot drop what we are about to read.
  std::uint64_t state = read_state_.load(std::memory_order_acquire);
  while (!read_state_.compare_exchange_weak(state, state | 1u, std::memory_order_acq_rel,
                                            std::memory_order_acquire)) {
  }
  read_local_ = state >> 1;
  holding_ = true;
  return read_local_;
}



WaitStatus SpscRing::wait_for_items(std::size_t count, Timeout timeout) noexcept {
  return wait(true, count, timeout);
}

// ---- waiting --------------------------------------------------------------------------------

void SpscRing::wake(std::atomic<std::uint32_t>& seq) noexcept {
  seq.fetch_add(1, std::memory_order_release);
  detail::wake_all(seq);
}

WaitStatus SpscRing::wait(bool for_items, std::size_t count, Timeout timeout) noexcept {
  // Each side reads only published positions here, never the other side's private fields.
  auto ready = [&]() noexcept {
    const std::uint64_t w = write_pos_.load(std::memory_order_acquire);
    const std::uint64_t r = read_state_.load(std::memory_order_acquire) >> 1;
    return for_items ? w - r >= count : capacity_ - (w - r) >= count;
  };
  auto& seq = for_items ? items_seq_ : space_seq_;
  auto& waiting = for_items ? consumer_waiting_ : producer_waiting_;
  const auto deadline = timeout == kForever ? std::chrono::steady_clock::time_point::max()
                                            : std::chrono::steady_clock::now() + timeout;
  for (int i = 0; i < kSpinIterations; ++i) {
    if (ready()) return WaitStatus::ready;
    if (closed()) break;
    cpu_relax();
  }
  WaitStatus status = WaitStatus::timeout;
  for (;;) {
    waiting.store(1, std::memory_order_relaxed);
    // The heavy half of the handshake (see light_barrier): after it, either the other side's
    // position store is visible to us or our flag is visible to the other side.
    if (asymmetric_) {
      detail::heavy_barrier();
    } else {
      std::atomic_thread_fence(std::memory_order_seq_cst);
    }
    const std::uint32_t observed = seq.load(std::memory_order_acquire);
    if (ready()) {
      status = WaitStatus::ready;
      break;
    }
    if (closed()) {
      status = WaitStatus::closed;
      break;
    }
    const auto now = std::chrono::steady_clock::now();
    if (now >= deadline) break;
    const Timeout left = deadline == std::chrono::steady_clock::time_point::max()
                             ? kForever
                             : std::chrono::duration_cast<Timeout>(deadline - now);
    detail::wait_on(seq, observed, left);
  }
  waiting.store(0, std::memory_order_relaxed);
  return status;
}

}  // namespace mstar

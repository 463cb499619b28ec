// mstar/spsc_ring.hpp — bounded lock-free single-producer / single-consumer ring.
//
// Items are fixed-size byte blobs (size and capacity chosen at construction, capacity a power of
// two). Positions are 64-bit and monotonic: item p lives in slot p & (capacity - 1), so a 64-bit
// position never wraps in practice and "full" is simply write - read == capacity (no spare slot).
//
// Threading contract: exactly one producer thread calls the producer methods and exactly one
// consumer thread calls the consumer methods; close(), size() and stats() are safe from any thread.
//
// Regions. reserve()/commit() and peek()/release() let a side produce or consume in place. A
// region is always contiguous: the storage carries `mirror` extra slots after the last one that
// repeat slots [0, mirror). commit() keeps the two copies equal (it copies only the part of a
// region that falls in either band, i.e. `mirror` items per lap at most), so any window of up to
// mirror + 1 items can be read or written as one span. With mirror = 0 a region stops at the end
// of the storage and the caller takes the rest in a second call, as with JACK/PortAudio rings.
//
// Waiting. wait_for_items()/wait_for_space() first spin (kSpinIterations polls with a CPU pause),
// then sleep on a futex (Linux) until the other side signals or the timeout passes. The other side
// only makes a wake-up system call when a sleeper has announced itself, through an asymmetric
// Dekker handshake: the sleeper sets its flag and issues a process-wide barrier
// (membarrier(PRIVATE_EXPEDITED)), which lets the fast paths get by with a compiler barrier
// instead of a full fence per item. Where membarrier is unavailable both sides use a
// sequentially consistent fence. The non-blocking paths never enter the kernel. The waits touch
// no Python state: bindings call them with the GIL released.
//
// Overflow. The policy says what a push does when the ring is full:
//   block        push() waits for room (up to its timeout); try_push() returns false.
//   reject       the push stores nothing, returns false and counts the items in stats().rejected.
//   drop_oldest  the oldest stored items are discarded (counted in stats().dropped) to make room.
//                Items inside a region the consumer holds (peeked, not yet released) are never
//                discarded; if room cannot be made, the push is rejected instead.
// For drop_oldest the read position is shared by both sides and moved by compare-and-swap; a
// "held" bit in the same word keeps the producer off a region the consumer is reading. The other
// policies keep the cheaper single-writer read position.
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace mstar {

enum class Overflow : std::uint8_t { block, drop_oldest, reject };

enum class WaitStatus : std::uint8_t {
  ready,    ///< the condition holds
  timeout,  ///< the timeout passed first
  closed,   ///< the ring was closed and the condition can no longer become true
};

/// Counters, each written by one side only; read them from any thread.
struct RingStats {
  std::uint64_t pushed = 0;    ///< items stored (the write position)
  std::uint64_t popped = 0;    ///< items released by the consumer (read position - dropped)
  std::uint64_t dropped = 0;   ///< items discarded by drop_oldest
  std::uint64_t rejected = 0;  ///< items refused by reject, or by drop_oldest over a held region
};

/// A contiguous span of `count` items starting at stream position `position`.
template <class Byte>
struct BasicRegion {
  Byte* data = nullptr;
  std::size_t count = 0;
  std::uint64_t position = 0;
};
using WriteRegion = BasicRegion<std::byte>;
using ReadRegion = BasicRegion<const std::byte>;

using Timeout = std::chrono::nanoseconds;
inline constexpr Timeout kForever = Timeout::max();

class SpscRing {
 public:
  static constexpr int kSpinIterations = 256;

  /// Throws std::invalid_argument for item_size 0, a capacity that is not a power of two, or
  /// mirror > capacity.
  SpscRing(std::size_t item_size, std::size_t capacity, Overflow overflow = Overflow::block,
           std::size_t mirror = 0);
  ~SpscRing();
  SpscRing(const SpscRing&) = delete;
  SpscRing& operator=(const SpscRing&) = delete;

  // ---- producer ----------------------------------------------------------------------------

  /// Stores one item of item_size() bytes, applying the overflow policy without waiting.
  /// Returns false when the item was not stored (full, or closed). A full block-policy ring is
  /// not a rejection: the caller may wait and retry.
  [[nodiscard]] bool try_push(const void* item) noexcept;

  /// Typed fast path: T must be trivially copyable with sizeof(T) == item_size().
  template <class T>
  [[nodiscard]] bool try_push_as(const T& item) noexcept;

  /// Stores `count` items, applying the overflow policy; block waits up to `timeout` for room and
  /// may store a prefix (the return value says how much; the rest is the caller's to retry).
  /// reject and drop_oldest store all or nothing. Returns the number stored. Throws std::logic_error after close() and
  /// std::invalid_argument when reject/drop_oldest is asked for more than capacity() items.
  std::size_t push(const void* items, std::size_t count, Timeout timeout = kForever);

  /// Up to `max_count` free slots to write in place, contiguous; count 0 when full. Never drops.
  [[nodiscard]] WriteRegion reserve(std::size_t max_count) noexcept;
  /// Publishes the first `count` items of the last reserve() (count <= its count).
  void commit(std::size_t count) noexcept;

  WaitStatus wait_for_space(std::size_t count, Timeout timeout) noexcept;

  /// End of stream: the consumer drains what is stored, then waits report closed. Wakes both
  /// sides. Idempotent; callable from any thread.
  void close() noexcept;

  // ---- consumer ----------------------------------------------------------------------------

  [[nodiscard]] bool try_pop(void* out) noexcept;
  template <class T>
  [[nodiscard]] bool try_pop_as(T& out) noexcept;

  /// Up to `max_count` stored items, contiguous, readable in place. A non-empty region stays
  /// valid (the producer will not overwrite or drop it) until release().
  [[nodiscard]] ReadRegion peek(std::size_t max_count) noexcept;
  /// Frees the first `count` items of the last peek() and ends the hold (count may be 0).
  void release(std::size_t count) noexcept;

  WaitStatus wait_for_items(std::size_t count, Timeout timeout) noexcept;

  // ---- either side -------------------------------------------------------------------------

  std::size_t item_size() const noexcept { return item_size_; }
  std::size_t capacity() const noexcept { return capacity_; }
  std::size_t mirror() const noexcept { return mirror_; }
  Overflow overflow() const noexcept { return overflow_; }
  bool closed() const noexcept { return closed_.load(std::memory_order_acquire); }
  /// Stored items (a snapshot when called from a third thread).
  std::size_t size() const noexcept;
  std::uint64_t write_position() const noexcept { return write_pos_.load(std::memory_order_acquire); }
  std::uint64_t read_position() const noexcept { return read_state_.load(std::memory_order_acquire) >> 1; }
  RingStats stats() const noexcept;
  /// The whole storage, mirror band included: (capacity + mirror) * item_size bytes.
  const std::byte* storage() const noexcept { return buf_; }
  std::size_t storage_bytes() const noexcept { return (capacity_ + mirror_) * item_size_; }

 private:
  static constexpr std::size_t kLine = 64;  // std::hardware_destructive_interference_size is not portable yet
  using Counter = std::atomic<std::uint64_t>;

  std::byte* slot(std::uint64_t pos) const noexcept { return buf_ + (pos & mask_) * item_size_; }
  bool has_room(std::size_t count) noexcept;
  bool make_room(std::size_t count) noexcept;  // reject / drop_oldest slow path
  bool full_slow_path(std::size_t count) noexcept {
    return overflow_ != Overflow::block && make_room(count);
  }
  void light_barrier() const noexcept;
  void mirror_commit(std::uint64_t from, std::size_t count) noexcept;
  void notify_consumer() noexcept;
  void notify_producer() noexcept;
  void wake(std::atomic<std::uint32_t>& seq) noexcept;
  WaitStatus wait(bool for_items, std::size_t count, Timeout timeout) noexcept;
  static void bump(Counter& c, std::uint64_t n) noexcept {
    c.store(c.load(std::memory_order_relaxed) + n, std::memory_order_relaxed);
  }
  std::uint64_t hold_for_read() noexcept;  // drop_oldest: pin the read position, return it

  // Read-only after construction.
  std::size_t item_size_;
  std::size_t capacity_;
  std::uint64_t mask_;
  std::size_t mirror_;
  Overflow overflow_;
  bool asymmetric_;  // membarrier available: the fast paths may skip the hardware fence
  std::byte* buf_;

  // Producer-owned line: its private write index, its cached view of the read position, counters.
  alignas(kLine) std::uint64_t write_local_ = 0;
  std::uint64_t read_cache_ = 0;
  Counter dropped_{0};
  Counter rejected_{0};

  // Consumer-owned line.
  alignas(kLine) std::uint64_t read_local_ = 0;
  std::uint64_t write_cache_ = 0;
  bool holding_ = false;

  // Shared: published positions, each on its own line so the sides do not false-share.
  alignas(kLine) std::atomic<std::uint64_t> write_pos_{0};
  // (read position << 1) | held; only drop_oldest ever sets the held bit or lets the producer move it.
  alignas(kLine) std::atomic<std::uint64_t> read_state_{0};

  // Sleep/wake words: a sequence number to futex-wait on plus a "someone sleeps" flag per side.
  alignas(kLine) std::atomic<std::uint32_t> items_seq_{0};
  std::atomic<std::uint32_t> consumer_waiting_{0};
  alignas(kLine) std::atomic<std::uint32_t> space_seq_{0};
  std::atomic<std::uint32_t> producer_waiting_{0};
  std::atomic<bool> closed_{false};
};

// ---- inline hot paths -------------------------------------------------------------------------

inline bool SpscRing::has_room(std::size_t count) noexcept {
  if (write_local_ + count - read_cache_ <= capacity_) return true;
  // Refresh the cached read position only when it changes the answer: a failed poll must not
  // dirty the producer's line (the other side reads nothing from it, but the store still costs).
  const std::uint64_t r = read_state_.load(std::memory_order_acquire) >> 1;
  if (write_local_ + count - r > capacity_) return false;
  read_cache_ = r;
  return true;
}

inline void SpscRing::light_barrier() const noexcept {
  // Orders our position store before the load of the other side's "sleeping" flag. With
  // membarrier the sleeper's heavy barrier supplies the hardware ordering.
  if (asymmetric_) {
    std::atomic_signal_fence(std::memory_order_seq_cst);
  } else {
    std::atomic_thread_fence(std::memory_order_seq_cst);
  }
}

inline void SpscRing::notify_consumer() noexcept {
  light_barrier();
  if (consumer_waiting_.load(std::memory_order_relaxed) != 0) wake(items_seq_);
}

inline void SpscRing::notify_producer() noexcept {
  light_barrier();
  if (producer_waiting_.load(std::memory_order_relaxed) != 0) wake(space_seq_);
}

inline bool SpscRing::try_push(const void* item) noexcept {
  if (closed_.load(std::memory_order_relaxed)) return false;
  if (!has_room(1) && !full_slow_path(1)) return false;
  const std::uint64_t w = write_local_;
  std::byte* dst = slot(w);
  std::memcpy(dst, item, item_size_);
  if ((w & mask_) < mirror_) std::memcpy(dst + capacity_ * item_size_, item, item_size_);
  write_local_ = w + 1;
  write_pos_.store(w + 1, std::memory_order_release);
  notify_consumer();
  return true;
}

template <class T>
inline bool SpscRing::try_push_as(const T& item) noexcept {
  static_assert(std::is_trivially_copyable_v<T>, "ring items are copied as bytes");
  if (sizeof(T) != item_size_ || closed_.load(std::memory_order_relaxed)) return false;
  if (!has_room(1) && !full_slow_path(1)) return false;
  const std::uint64_t w = write_local_;
  std::byte* dst = slot(w);
  std::memcpy(dst, &item, sizeof(T));
  if ((w & mask_) < mirror_) std::memcpy(dst + capacity_ * sizeof(T), &item, sizeof(T));
  write_local_ = w + 1;
  write_pos_.store(w + 1, std::memory_order_release);
  notify_consumer();
  return true;
}

inline bool SpscRing::try_pop(void* out) noexcept {
  if (overflow_ == Overflow::drop_oldest) {
    const ReadRegion r = peek(1);
    if (r.count == 0) return false;
    std::memcpy(out, r.data, item_size_);
    release(1);
    return true;
  }
  const std::uint64_t r = read_local_;
  if (r == write_cache_) {
    const std::uint64_t w = write_pos_.load(std::memory_order_acquire);
    if (r == w) return false;  // empty: leave the cache untouched (see has_room)
    write_cache_ = w;
  }
  std::memcpy(out, slot(r), item_size_);
  read_local_ = r + 1;
  read_state_.store((r + 1) << 1, std::memory_order_release);
  notify_producer();
  return true;
}

template <class T>
inline bool SpscRing::try_pop_as(T& out) noexcept {
  static_assert(std::is_trivially_copyable_v<T>, "ring items are copied as bytes");
  if (sizeof(T) != item_size_) return false;
  if (overflow_ == Overflow::drop_oldest) return try_pop(&out);
  const std::uint64_t r = read_local_;
  if (r == write_cache_) {
    const std::uint64_t w = write_pos_.load(std::memory_order_acquire);
    if (r == w) return false;
    write_cache_ = w;
  }
  std::memcpy(&out, slot(r), sizeof(T));
  read_local_ = r + 1;
  read_state_.store((r + 1) << 1, std::memory_order_release);
  notify_producer();
  return true;
}

inline WriteRegion SpscRing::reserve(std::size_t max_count) noexcept {
  const std::uint64_t w = write_local_;
  if (closed_.load(std::memory_order_relaxed)) return {slot(w), 0, w};
  std::size_t room = static_cast<std::size_t>(capacity_ - (w - read_cache_));
  if (room < max_count) {
    const std::uint64_t r = read_state_.load(std::memory_order_acquire) >> 1;
    if (r != read_cache_) {
      read_cache_ = r;
      room = static_cast<std::size_t>(capacity_ - (w - r));
    }
  }
  const std::size_t contiguous = capacity_ + mirror_ - static_cast<std::size_t>(w & mask_);
  std::size_t n = max_count < room ? max_count : room;
  if (contiguous < n) n = contiguous;
  return {slot(w), n, w};
}

inline void SpscRing::commit(std::size_t count) noexcept {
  if (count == 0) return;
  const std::uint64_t w = write_local_;
  if (mirror_ != 0) mirror_commit(w, count);
  write_local_ = w + count;
  write_pos_.store(w + count, std::memory_order_release);
  notify_consumer();
}

inline ReadRegion SpscRing::peek(std::size_t max_count) noexcept {
  const std::uint64_t r = overflow_ == Overflow::drop_oldest ? hold_for_read() : read_local_;
  std::size_t avail = static_cast<std::size_t>(write_cache_ - r);
  if (write_cache_ < r || avail < max_count) {
    const std::uint64_t w = write_pos_.load(std::memory_order_acquire);
    if (w != write_cache_) write_cache_ = w;
    avail = static_cast<std::size_t>(w - r);
  }
  const std::size_t contiguous = capacity_ + mirror_ - static_cast<std::size_t>(r & mask_);
  std::size_t n = max_count < avail ? max_count : avail;
  if (contiguous < n) n = contiguous;
  if (n == 0 && holding_) {  // nothing to hold: give the producer its freedom back
    holding_ = false;
    read_state_.store(r << 1, std::memory_order_release);
  }
  return {slot(r), n, r};
}

inline void SpscRing::release(std::size_t count) noexcept {
  // Without a hold, release(0) must not publish: the producer may have moved the read position.
  if (count == 0 && !holding_) return;
  const std::uint64_t r = read_local_ + count;
  read_local_ = r;
  holding_ = false;
  read_state_.store(r << 1, std::memory_order_release);
  if (count != 0) notify_producer();
}

}  // namespace mstar

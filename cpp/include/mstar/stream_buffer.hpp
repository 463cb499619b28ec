// mstar/stream_buffer.hpp — a ring plus a chunk policy: one streaming edge between two components.
//
// The producer appends items; the consumer receives whole chunks (see chunk_policy.hpp) as
// contiguous, in-place spans of the ring. The ring's mirror band is sized to the policy's largest
// window, so a chunk that wraps around the end of the storage is still one span and is never
// copied out. A held chunk pins its items: the producer cannot overwrite (or drop) them until
// release_chunk(). Same threading contract as SpscRing: one producer thread, one consumer thread.
#pragma once

#include <cstddef>
#include <cstdint>

#include "mstar/chunk_policy.hpp"
#include "mstar/spsc_ring.hpp"

namespace mstar {

/// A ready chunk and where its first item (position chunk.begin) lies in the ring's storage.
struct ChunkView {
  Chunk chunk;
  const std::byte* data = nullptr;  ///< chunk.size() items of item_size() bytes each
};

class StreamBuffer {
 public:
  /// Throws std::invalid_argument if the policy's largest window exceeds `capacity`, or if its
  /// left context leaves no room for new items (context >= capacity).
  StreamBuffer(std::size_t item_size, std::size_t capacity, ChunkPolicy policy,
               Overflow overflow = Overflow::block);

  // ---- producer ----
  std::size_t push(const void* items, std::size_t count, Timeout timeout = kForever) {
    return ring_.push(items, count, timeout);
  }
  [[nodiscard]] WriteRegion reserve(std::size_t max_count) noexcept { return ring_.reserve(max_count); }
  void commit(std::size_t count) noexcept { ring_.commit(count); }
  /// End of stream: the consumer gets the remaining items as a flushed last chunk.
  void close() noexcept { ring_.close(); }

  // ---- consumer ----
  /// Waits up to `timeout` for the next chunk. ready: *out is held until release_chunk().
  /// closed: the stream ended and every item has been delivered. timeout: nothing yet.
  /// Calling it while a chunk is held is a usage error (std::logic_error).
  WaitStatus next_chunk(ChunkView* out, Timeout timeout = kForever);
  /// Non-blocking form of next_chunk (returns ready, timeout or closed at once).
  WaitStatus try_next_chunk(ChunkView* out) { return next_chunk(out, Timeout::zero()); }
  /// Ends the hold on the current chunk and frees the items no later chunk needs.
  void release_chunk();
  bool holding() const noexcept { return holding_; }

  const ChunkPolicy& policy() const noexcept { return policy_; }
  SpscRing& ring() noexcept { return ring_; }
  const SpscRing& ring() const noexcept { return ring_; }
  std::size_t item_size() const noexcept { return ring_.item_size(); }

 private:
  WaitStatus poll(ChunkView* out, std::uint64_t* need);
  ChunkPolicy policy_;
  SpscRing ring_;
  ChunkCursor cursor_;
  ChunkView held_{};
  bool holding_ = false;
};

}  // namespace mstar

#include "mstar/stream_buffer.hpp"

#include <chrono>
#include <stdexcept>
#include <string>

namespace mstar {

namespace {

const ChunkPolicy& checked(const ChunkPolicy& policy, std::size_t capacity) {
  // The ring's own rule first: a capacity of 0 otherwise reads as "no room beside the context".
  if (capacity == 0 || (capacity & (capacity - 1)) != 0)
    throw std::invalid_argument("StreamBuffer: capacity must be a power of two, got " +
                                std::to_string(capacity));
  // A sliding window's overlap is not a context the user chose: report its window instead.
  if (policy.context() >= capacity && policy.kind() != ChunkPolicy::Kind::sliding_window)
    throw std::invalid_argument("StreamBuffer: " + policy.describe() + " keeps a left context of " +
                                std::to_string(policy.context()) +
                                " items, which leaves no room for new items in a ring of capacity " +
                                std::to_string(capacity) + "; raise the capacity");
  if (policy.max_chunk() > capacity)
    throw std::invalid_argument("StreamBuffer: " + policy.describe() + " needs windows of up to " +
                                std::to_string(policy.max_chunk()) +
                                " items but the ring holds only " + std::to_string(capacity) +
                                "; raise the capacity to at least that (a power of two)");
  return policy;
}

}  // namespace

StreamBuffer::StreamBuffer(std::size_t item_size, std::size_t capacity, ChunkPolicy policy,
                           Overflow overflow)
    : policy_(checked(policy, capacity)),
      ring_(item_size, capacity, overflow, policy_.max_chunk()),
      cursor_(policy_) {}

WaitStatus StreamBuffer::poll(ChunkView* out, std::uint64_t* need) {
  // Read `closed` before the write position: a producer writes, then closes, so if we see the
  // close we also see every item it wrote.
  const bool ended = ring_.closed();
  const ReadRegion region = ring_.peek(policy_.max_chunk());
  const std::uint64_t oldest = region.position;
  Chunk chunk;
  // An empty peek pins nothing: do not look at items that arrived after it.
  const std::uint64_t written = region.count == 0 ? oldest : ring_.write_position();
  switch (cursor_.next(oldest, written, ended, &chunk)) {
    case ChunkCursor::Next::ready:
      out->chunk = chunk;
      // begin == oldest except right after drops; the span starts at the region's first item.
      out->data = region.data + (chunk.begin - oldest) * ring_.item_size();
      return WaitStatus::ready;
    case ChunkCursor::Next::finished:
      ring_.release(0);
      return WaitStatus::closed;
    case ChunkCursor::Next::wait:
      break;
  }
  ring_.release(0);
  *need = cursor_.needed_end() - oldest;
  return WaitStatus::timeout;
}

WaitStatus StreamBuffer::next_chunk(ChunkView* out, Timeout timeout) {
  if (holding_)
    throw std::logic_error("StreamBuffer: release the current chunk before asking for the next");
  std::chrono::steady_clock::time_point start{};  // read the clock only once we have to wait
  for (bool first = true;; first = false) {
    std::uint64_t need = 0;
    const WaitStatus status = poll(out, &need);
    if (status == WaitStatus::ready) {
      held_ = *out;
      holding_ = true;
      return status;
    }
    if (status == WaitStatus::closed) return status;
    if (timeout == Timeout::zero()) return WaitStatus::timeout;
    if (first) start = std::chrono::steady_clock::now();
    Timeout left = timeout;
    if (timeout != kForever) {
      left = timeout - std::chrono::duration_cast<Timeout>(std::chrono::steady_clock::now() - start);
      if (left <= Timeout::zero()) return WaitStatus::timeout;
    }
    // `closed` from the ring wait is only a hint: poll() decides (it flushes the tail).
    if (ring_.wait_for_items(static_cast<std::size_t>(need), left) == WaitStatus::timeout)
      return WaitStatus::timeout;
  }
}

void StreamBuffer::release_chunk() {
  if (!holding_) throw std::logic_error("StreamBuffer: release_chunk() without a held chunk");
  const std::uint64_t keep_from = cursor_.advance(held_.chunk);
  const std::uint64_t oldest = ring_.read_position();
  ring_.release(keep_from > oldest ? static_cast<std::size_t>(keep_from - oldest) : 0);
  holding_ = false;
}

}  // namespace mstar

// mstar/chunk_policy.hpp — when a streaming consumer fires, and on which items.
//
// A producer appends items (tokens, codec frames, audio samples) at stream positions 0, 1, 2, ...
// A chunk policy cuts that stream into chunks. Every chunk i is three positions:
//
//     begin <= new_begin < end       items [begin, new_begin) are left context the consumer saw
//                                    before; items [new_begin, end) are delivered for the first time.
//
// The fresh parts of consecutive chunks tile the stream exactly: chunk i+1's new_begin is chunk
// i's end, so every item is new in exactly one chunk — including the tail, which the explicit end
// of stream flushes as a final, possibly shorter chunk (marked `last`). No item is ever dropped
// (but see "Drops" below for a drop_oldest ring, which drops items itself).
// A chunk is ready once `end` items exist; the consumer then releases everything before the next
// chunk's begin, which is all the ring has to keep.
//
// All policies are one rule: fresh sizes s0, s1, ... (a list of first sizes, then a steady size
// forever) and a left context of up to C items (clamped at the start of the stream):
//     new_begin_i = s0 + ... + s(i-1),   end_i = new_begin_i + s_i,   begin_i = max(0, new_begin_i - C)
//
//   Fixed(K)            sizes K, K, ...             context 0     (Qwen3-Omni thinker→talker: K=1)
//   SlidingWindow(W,S)  sizes W, S, S, ...          context W-S   windows [iS, iS+W)  (Orpheus: 28, 7)
//   LeftContext(C,L)    sizes L, L, ...             context C     (Qwen3-Omni code2wav: C=L=25)
//   Ramp(f..., K, C)    sizes f0, f1, ..., K, K...  context C     (small first chunks for low latency)
//
// Worked table, SlidingWindow(W=4, S=2), 9 items then end of stream:
//
//   chunk  ready when  begin  new_begin  end  keeps after release
//     0    n >= 4        0        0       4    items 2..
//     1    n >= 6        2        4       6    items 4..
//     2    n >= 8        4        6       8    items 6..
//     3    end (n=9)     6        8       9    last: the flushed tail, 3 items not 4
//
// LeftContext(C=2, L=3), 7 items then end of stream:
//
//   chunk  ready when  begin  new_begin  end
//     0    n >= 3        0        0       3
//     1    n >= 6        1        3       6
//     2    end (n=7)     4        6       7    last
//
// Ramp(first={1,2}, steady=4, context=0), 12 items then end of stream:
//
//   chunk  ready when  begin  new_begin  end
//     0    n >= 1        0        0       1
//     1    n >= 3        1        1       3
//     2    n >= 7        3        3       7
//     3    n >= 11       7        7      11
//     4    end (n=12)   11       11      12    last
//
// If the stream ends exactly on a chunk boundary, no extra chunk is made: the end of stream then
// marks nothing new, and ChunkCursor::next reports `finished`.
//
// Drops. A drop_oldest ring that overflows discards its oldest items, which may be items the next
// chunk needs. A drop never shortens a chunk: chunk i keeps the shape it has in an undisturbed
// stream (c_i = min(C, s0 + ... + s(i-1)) items of context, then s_i new items) and moves up so
// that it begins at or after the oldest surviving item `oldest`:
//     new_begin_i = max(end_(i-1), oldest + c_i)
//     begin_i = new_begin_i - c_i,   end_i = new_begin_i + s_i
// and is ready once end_i items exist (the cursor waits for a whole window, never hands out part
// of one). Survivors that fall into the moved chunk's context are never delivered as new; the
// gap in positions (new_begin_i > end_(i-1)) shows what was lost. Indexes run on. Only the flushed
// last chunk is shorter: once the stream has ended, it makes every survivor not yet delivered new.
//
// SlidingWindow(W=4, S=2) in a drop_oldest ring of 8: chunk 0 is [0, 4), the consumer keeps 2, 3;
// items 4..12 arrive before it asks again, so 2..4 are dropped. Chunk 1 is [5, 9) new from 7 (not
// [5, 7)), chunk 2 is [7, 11) new from 9: back to windows of W, one stride apart.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace mstar {

/// One chunk: positions in the producer's stream (see the file comment).
struct Chunk {
  std::uint64_t begin = 0;
  std::uint64_t new_begin = 0;
  std::uint64_t end = 0;
  std::uint64_t index = 0;  ///< 0 for the first chunk of the stream
  bool last = false;        ///< made by the end-of-stream flush, or ends exactly at it
  std::size_t size() const noexcept { return static_cast<std::size_t>(end - begin); }
  std::size_t new_size() const noexcept { return static_cast<std::size_t>(end - new_begin); }
};

/// A policy is immutable configuration, shared freely; per-stream state lives in ChunkCursor.
class ChunkPolicy {
 public:
  enum class Kind : std::uint8_t { fixed, sliding_window, left_context, ramp };

  /// Each factory throws std::invalid_argument for nonsense parameters, naming the parameter.
  static ChunkPolicy fixed(std::size_t k);
  static ChunkPolicy sliding_window(std::size_t window, std::size_t stride);
  static ChunkPolicy left_context(std::size_t context, std::size_t size);
  static ChunkPolicy ramp(std::vector<std::size_t> first, std::size_t steady,
                          std::size_t context = 0);

  Kind kind() const noexcept { return kind_; }
  /// Fresh items in chunk `index`.
  std::size_t new_size(std::uint64_t index) const noexcept {
    return index < first_.size() ? first_[static_cast<std::size_t>(index)] : steady_;
  }
  std::size_t context() const noexcept { return context_; }
  const std::vector<std::size_t>& first_sizes() const noexcept { return first_; }
  std::size_t steady_size() const noexcept { return steady_; }
  /// The largest chunk the policy can make: a ring must hold at least this many items.
  std::size_t max_chunk() const noexcept;
  /// The constructor call that makes this policy, e.g. "SlidingWindow(28, 7)".
  std::string describe() const;

 private:
  ChunkPolicy(Kind kind, std::vector<std::size_t> first, std::size_t steady, std::size_t context);
  Kind kind_;
  std::vector<std::size_t> first_;
  std::size_t steady_;
  std::size_t context_;
  // For describe(): the parameters as the user gave them.
  std::size_t a_ = 0, b_ = 0;
};

/// Per-stream chunking state. Not thread-safe: the consumer owns it.
class ChunkCursor {
 public:
  enum class Next : std::uint8_t { ready, wait, finished };

  explicit ChunkCursor(const ChunkPolicy& policy) : policy_(&policy), need_(policy.new_size(0)) {}

  /// The next chunk, given that items [oldest, written) are available and whether the producer
  /// has ended the stream. `oldest` is the first item still stored (items before it were
  /// released, or dropped by a drop_oldest ring: the chunk then moves up whole, see "Drops").
  /// On `wait`, `needed_end()` says how many items the chunk needs in total.
  Next next(std::uint64_t oldest, std::uint64_t written, bool ended, Chunk* out) noexcept;

  /// Marks `chunk` consumed; returns the first position the next chunk may read (release below).
  std::uint64_t advance(const Chunk& chunk) noexcept;

  std::uint64_t needed_end() const noexcept { return need_; }
  std::uint64_t index() const noexcept { return index_; }
  void reset() noexcept {
    index_ = 0;
    new_begin_ = 0;
    need_ = policy_->new_size(0);
  }

 private:
  const ChunkPolicy* policy_;
  std::uint64_t index_ = 0;
  std::uint64_t new_begin_ = 0;  ///< the end of the last chunk: drops never move it
  std::uint64_t need_;           ///< end of the next chunk as last seen (a drop moves it up)
};

}  // namespace mstar

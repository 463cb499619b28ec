#include "mstar/chunk_policy.hpp"

#include <algorithm>
#include <stdexcept>
#include <string>

namespace mstar {

namespace {

void require(bool ok, const std::string& message) {
  if (!ok) throw std::invalid_argument(message);
}

}  // namespace

ChunkPolicy::ChunkPolicy(Kind kind, std::vector<std::size_t> first, std::size_t steady,
                         std::size_t context)
    : kind_(kind), first_(std::move(first)), steady_(steady), context_(context) {
  // No ring holds 2^48 items; the bound keeps max_chunk()'s sum from wrapping (a wrapped
  // max_chunk of 0 passed every capacity check and then no chunk was ever ready).
  constexpr std::size_t kMost = std::size_t{1} << 48;
  std::size_t largest = std::max(steady_, context_);
  for (std::size_t s : first_) largest = std::max(largest, s);
  if (largest > kMost)
    throw std::invalid_argument("a chunk policy's sizes and context must be at most 2^48 items, "
                                "got " + std::to_string(largest));
}

ChunkPolicy ChunkPolicy::fixed(std::size_t k) {
  require(k >= 1, "Fixed(K): K must be at least 1, got 0");
  ChunkPolicy p(Kind::fixed, {}, k, 0);
  p.a_ = k;
  return p;
}

ChunkPolicy ChunkPolicy::sliding_window(std::size_t window, std::size_t stride) {
  require(window >= 1, "SlidingWindow(W, S): W must be at least 1, got 0");
  require(stride >= 1, "SlidingWindow(W, S): S must be at least 1, got 0");
  require(stride <= window, "SlidingWindow(W, S): S (" + std::to_string(stride) +
                                ") must not exceed W (" + std::to_string(window) +
                                "), or items between windows would never be seen");
  ChunkPolicy p(Kind::sliding_window, {window}, stride, window - stride);
  p.a_ = window;
  p.b_ = stride;
  return p;
}

ChunkPolicy ChunkPolicy::left_context(std::size_t context, std::size_t size) {
  require(size >= 1, "LeftContext(C, L): L must be at least 1, got 0");
  ChunkPolicy p(Kind::left_context, {}, size, context);
  p.a_ = context;
  p.b_ = size;
  return p;
}

ChunkPolicy ChunkPolicy::ramp(std::vector<std::size_t> first, std::size_t steady,
                              std::size_t context) {
  require(steady >= 1, "Ramp(first, steady, context): steady must be at least 1, got 0");
  for (std::size_t i = 0; i < first.size(); ++i)
    require(first[i] >= 1, "Ramp(first, steady, context): first[" + std::to_string(i) +
                               "] must be at least 1, got 0");
  return ChunkPolicy(Kind::ramp, std::move(first), steady, context);
}

std::size_t ChunkPolicy::max_chunk() const noexcept {
  std::size_t biggest = steady_;
  for (std::size_t s : first_) biggest = std::max(biggest, s);
  // Sliding windows: the first window (W) has no context, later ones are S + (W - S) = W.
  if (kind_ == Kind::sliding_window) return first_[0];
  return biggest + context_;
}

std::string ChunkPolicy::describe() const {
  switch (kind_) {
    case Kind::fixed:
      return "Fixed(" + std::to_string(a_) + ")";
    case Kind::sliding_window:
      return "SlidingWindow(" + std::to_string(a_) + ", " + std::to_string(b_) + ")";
    case Kind::left_context:
      return "LeftContext(" + std::to_string(a_) + ", " + std::to_string(b_) + ")";
    case Kind::ramp: {
      std::string s = "Ramp([";
      for (std::size_t i = 0; i < first_.size(); ++i)
        s += (i ? ", " : "") + std::to_string(first_[i]);
      return s + "], " + std::to_string(steady_) + ", " + std::to_string(context_) + ")";
    }
  }
  return "ChunkPolicy(?)";
}

namespace {

// Chunk `index`'s left context in a stream nothing was dropped from: C, clamped by the items
// before it (s_0 + ... + s_(index-1)). Only a drop needs it; at most one pass over first sizes.
std::uint64_t undisturbed_context(const ChunkPolicy& policy, std::uint64_t index) noexcept {
  const std::uint64_t ctx = policy.context();
  const std::vector<std::size_t>& first = policy.first_sizes();
  std::uint64_t before = 0;
  for (std::size_t i = 0; i < first.size() && i < index; ++i) {
    before += first[i];
    if (before >= ctx) return ctx;
  }
  if (index <= first.size()) return before;
  const std::uint64_t steady_chunks = index - first.size();
  const std::uint64_t steady = policy.steady_size();
  return steady_chunks > (ctx - before) / steady ? ctx : before + steady_chunks * steady;
}

}  // namespace

ChunkCursor::Next ChunkCursor::next(std::uint64_t oldest, std::uint64_t written, bool ended,
                                    Chunk* out) noexcept {
  const std::uint64_t ctx = policy_->context();
  std::uint64_t new_begin = new_begin_;
  std::uint64_t begin = new_begin > ctx ? new_begin - ctx : 0;
  if (begin < oldest) {
    // A drop_oldest ring dropped items this window needs. A shorter window would break a
    // consumer that decodes whole windows, so the window keeps its shape and moves up to the
    // oldest survivor; survivors it then covers as context are never new.
    const std::uint64_t c = undisturbed_context(*policy_, index_);
    new_begin = std::max(new_begin, oldest + c);
    begin = new_begin - c;
  }
  const std::uint64_t end = new_begin + policy_->new_size(index_);
  need_ = end;
  if (written >= end) {
    *out = Chunk{begin, new_begin, end, index_, ended && end == written};
    return Next::ready;
  }
  if (!ended) return Next::wait;
  // The flush: no window is coming, so every survivor not yet new is, with what context is left.
  new_begin = std::max(new_begin_, oldest);
  if (written <= new_begin) return Next::finished;
  begin = std::max(new_begin > ctx ? new_begin - ctx : 0, oldest);
  *out = Chunk{begin, new_begin, written, index_, true};
  return Next::ready;
}

std::uint64_t ChunkCursor::advance(const Chunk& chunk) noexcept {
  new_begin_ = chunk.end;
  index_ = chunk.index + 1;
  need_ = new_begin_ + policy_->new_size(index_);
  const std::uint64_t ctx = policy_->context();
  return new_begin_ > ctx ? new_begin_ - ctx : 0;
}

}  // namespace mstar

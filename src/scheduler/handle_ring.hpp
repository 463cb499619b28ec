// A FIFO of handles on one power-of-two array: a stream's items from its oldest unreleased
// position on. It grows by doubling when full and never shrinks, so once a stream has reached
// its widest window (and a recycled request its widest stream) pushes and pops allocate nothing;
// std::deque gets and frees a block every few hundred items.
#pragma once

#include <cstddef>
#include <vector>

#include "mstar/graph.hpp"

namespace mstar::detail {

class HandleRing {
 public:
  HandleRing() = default;
  HandleRing(HandleRing&& o) noexcept : buf_(std::move(o.buf_)), head_(o.head_), size_(o.size_) {
    o.head_ = o.size_ = 0;
  }
  HandleRing& operator=(HandleRing&& o) noexcept {
    buf_.swap(o.buf_);  // the old storage goes to `o`, which a caller may still reuse
    head_ = o.head_;
    size_ = o.size_;
    o.head_ = o.size_ = 0;
    return *this;
  }
  HandleRing(const HandleRing&) = delete;
  HandleRing& operator=(const HandleRing&) = delete;

  bool empty() const noexcept { return size_ == 0; }
  std::size_t size() const noexcept { return size_; }
  std::size_t capacity() const noexcept { return buf_.size(); }
  Handle front() const noexcept { return buf_[head_]; }
  Handle operator[](std::size_t i) const noexcept { return buf_[(head_ + i) & (buf_.size() - 1)]; }

  void push_back(Handle h) {
    if (size_ == buf_.size()) grow();
    buf_[(head_ + size_) & (buf_.size() - 1)] = h;
    ++size_;
  }
  void pop_front() noexcept {
    head_ = (head_ + 1) & (buf_.size() - 1);
    --size_;
  }
  void clear() noexcept { head_ = size_ = 0; }

 private:
  void grow() {
    std::vector<Handle> bigger(buf_.empty() ? 16 : 2 * buf_.size());
    for (std::size_t i = 0; i < size_; ++i) bigger[i] = (*this)[i];
    buf_.swap(bigger);
    head_ = 0;
  }

  std::vector<Handle> buf_;  // size: 0 or a power of two
  std::size_t head_ = 0, size_ = 0;
};

}  // namespace mstar::detail

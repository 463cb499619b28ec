// Reference counts per handle in an open-addressing table: no allocation per handle once the
// table has grown to the working set (the Conductor's dispatch path must not allocate).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "mstar/graph.hpp"

namespace mstar::detail {

class HandleCounts {
 public:
  HandleCounts() : slots_(64) {}

  void retain(Handle h) {
    if (h == 0) return;
    if ((used_ + 1) * 2 > slots_.size()) grow();
    Slot& s = find_or_insert(h);
    ++s.count;
  }

  /// Returns true when the count reached zero (the handle is gone).
  bool release(Handle h) {
    if (h == 0) return false;
    Slot* s = find(h);
    if (s == nullptr) return false;
    if (--s->count != 0) return false;
    s->key = kTomb;
    --live_;
    return true;
  }

  std::size_t size() const noexcept { return live_; }

 private:
  static constexpr Handle kEmpty = 0;
  static constexpr Handle kTomb = kReservedHandle;  // why ~0 is reserved (graph.hpp)
  struct Slot {
    Handle key = kEmpty;
    std::uint32_t count = 0;
  };

  std::size_t mask() const noexcept { return slots_.size() - 1; }
  static std::size_t hash(Handle h) noexcept { return static_cast<std::size_t>(h * 0x9E3779B97F4A7C15ull >> 17); }

  Slot* find(Handle h) {
    for (std::size_t i = hash(h) & mask();; i = (i + 1) & mask()) {
      if (slots_[i].key == h) return &slots_[i];
      if (slots_[i].key == kEmpty) return nullptr;
    }
  }

  Slot& find_or_insert(Handle h) {
    Slot* tomb = nullptr;
    for (std::size_t i = hash(h) & mask();; i = (i + 1) & mask()) {
      Slot& s = slots_[i];
      if (s.key == h) return s;
      if (s.key == kTomb && tomb == nullptr) tomb = &s;
      if (s.key == kEmpty) {
        Slot& dst = tomb != nullptr ? *tomb : s;
        if (tomb == nullptr) ++used_;
        dst.key = h;
        dst.count = 0;
        ++live_;
        return dst;
      }
    }
  }

  void grow() {
    // Tombstones are dropped on rehash; double only if live handles need it. Handles are never
    // reused, so same-size rehashes recur forever: they rebuild into the spare buffer, whose
    // capacity is kept, instead of allocating a new table each time.
    const std::size_t size = live_ * 4 > slots_.size() ? slots_.size() * 2 : slots_.size();
    spare_.swap(slots_);
    slots_.assign(size, Slot{});
    used_ = live_ = 0;
    for (const Slot& s : spare_) {
      if (s.key == kEmpty || s.key == kTomb) continue;
      Slot& d = find_or_insert(s.key);
      d.count = s.count;
    }
  }

  std::vector<Slot> slots_;
  std::vector<Slot> spare_;  // the previous table: reused by the next rehash
  std::size_t used_ = 0;  // non-empty slots (live + tombstones)
  std::size_t live_ = 0;
};

}  // namespace mstar::detail

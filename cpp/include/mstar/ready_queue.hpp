// mstar/ready_queue.hpp — work ready to run on one engine, in the order the runtime runs it.
//
// Work is ordered by earliest deadline, then highest priority, then earliest arrival (of its
// request), then its own id; an engine takes the most urgent entry and, in the same batch, the
// next most urgent entries of the same node and walk. The Conductor keeps one queue per engine;
// a placement worker keeps the same queues for the work its parent sends (mstar_rt._core's
// ReadyQueue), so both order work identically by construction.
//
// Not thread-safe: the owner locks. Entries live in a vector kept sorted: an insert lands at the
// back in the common case (same deadline and priority, newer request), and once the vector has
// grown nothing is allocated.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

namespace mstar {

/// Where a piece of work goes in a ready queue; smaller runs first.
struct WorkOrder {
  std::int64_t deadline_ns = INT64_MAX;  ///< absolute, steady clock; INT64_MAX = none
  std::int32_t priority = 0;             ///< higher first among equal deadlines
  std::uint64_t arrival = 0;             ///< the request's arrival; earlier first
  std::uint64_t id = 0;                  ///< the item's own id; earlier first

  bool operator<(const WorkOrder& o) const noexcept {
    if (deadline_ns != o.deadline_ns) return deadline_ns < o.deadline_ns;
    if (priority != o.priority) return priority > o.priority;
    if (arrival != o.arrival) return arrival < o.arrival;
    return id < o.id;
  }
};

template <class T>
class ReadyQueue {
 public:
  struct Entry {
    WorkOrder order;
    std::uint32_t node = 0;
    std::uint32_t walk = 0;
    T value;
  };

  void push(Entry e) {
    auto at = std::upper_bound(entries_.begin(), entries_.end(), e.order,
                               [](const WorkOrder& o, const Entry& x) { return o < x.order; });
    entries_.insert(at, std::move(e));
  }

  [[nodiscard]] bool empty() const noexcept { return entries_.empty(); }
  [[nodiscard]] std::size_t size() const noexcept { return entries_.size(); }
  [[nodiscard]] const Entry& front() const { return entries_.front(); }
  /// The i-th most urgent entry.
  [[nodiscard]] const Entry& operator[](std::size_t i) const { return entries_[i]; }

  /// Moves up to `limit` entries of the front entry's node and walk, most urgent first, out of
  /// the queue: `take(entry)` gets each. The rest keep their order. Compacts in place.
  template <class Take>
  void take_batch(std::size_t limit, Take&& take) {
    if (entries_.empty()) return;
    const std::uint32_t node = entries_.front().node, walk = entries_.front().walk;
    std::size_t kept = 0, taken = 0;
    for (std::size_t i = 0; i < entries_.size(); ++i) {
      Entry& e = entries_[i];
      if (taken < limit && e.node == node && e.walk == walk) {
        take(e);
        ++taken;
      } else {
        if (kept != i) entries_[kept] = std::move(e);
        ++kept;
      }
    }
    entries_.erase(entries_.begin() + static_cast<std::ptrdiff_t>(kept), entries_.end());
  }

  /// Removes the entries `pred` accepts (it may act on them first); returns how many.
  template <class Pred>
  std::size_t remove_if(Pred&& pred) {
    auto keep = std::remove_if(entries_.begin(), entries_.end(), pred);
    const auto n = static_cast<std::size_t>(entries_.end() - keep);
    entries_.erase(keep, entries_.end());
    return n;
  }

  /// Moves the entries `pred` accepts out of the queue, most urgent first: `take(entry)` gets
  /// each, and they are left moved-from (a value whose destruction must wait until a lock is
  /// released is moved out in `take`, never destroyed here). The rest keep their order.
  /// Returns how many.
  template <class Pred, class Take>
  std::size_t extract_if(Pred&& pred, Take&& take) {
    std::size_t kept = 0;
    for (std::size_t i = 0; i < entries_.size(); ++i) {
      Entry& e = entries_[i];
      if (pred(static_cast<const Entry&>(e))) {
        take(e);
      } else {
        if (kept != i) entries_[kept] = std::move(e);
        ++kept;
      }
    }
    const std::size_t n = entries_.size() - kept;
    entries_.erase(entries_.begin() + static_cast<std::ptrdiff_t>(kept), entries_.end());
    return n;
  }

 private:
  std::vector<Entry> entries_;
};

}  // namespace mstar

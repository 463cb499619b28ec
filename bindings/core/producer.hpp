// Producer-side calls shared by Ring and StreamBuffer: push from numpy, reserve/commit in place.
#pragma once

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <optional>
#include <stdexcept>
#include <string>

#include "core/array_layout.hpp"
#include "mstar/spsc_ring.hpp"
#include "core/waiting.hpp"

namespace mstar::py_bind {

/// Raised for a push onto a closed stream (Python: mstar_rt.StreamClosedError).
struct StreamClosed : std::runtime_error {
  using std::runtime_error::runtime_error;
};

/// Producer bookkeeping the core leaves to its caller: how much of the last reserve() is open.
struct ProducerState {
  std::size_t reserved = 0;
};

inline void require_open(const SpscRing& ring, const char* where) {
  if (ring.closed())
    throw StreamClosed(std::string(where) + ": the stream is closed (close() was called); "
                       "open a new stream to send more items");
}

/// Copies the items of `items` straight from its buffer into the ring (the only copy). Under the
/// block policy waits for room with the GIL released; returns how many items were stored.
inline std::size_t push_array(SpscRing& ring, const ItemLayout& layout, ProducerState& state,
                              py::array items, std::optional<double> timeout_s) {
  const Timeout timeout = to_timeout(timeout_s);
  require_open(ring, "push");
  if (state.reserved != 0)
    throw std::logic_error("push: a reserve() region is open; commit() it (commit(0) to abandon)");
  const std::size_t count = layout.count_items(items, "push");
  if (ring.overflow() != Overflow::block && count > ring.capacity())
    throw py::value_error("push: " + std::to_string(count) + " items do not fit a ring of capacity " +
                          std::to_string(ring.capacity()) + "; split the batch or raise capacity");
  const auto* src = static_cast<const std::byte*>(items.data());
  std::size_t done = ring.push(src, count, Timeout::zero());
  while (done < count && ring.overflow() == Overflow::block) {
    // Wait for one free slot, not for the whole rest: a consumer may keep items stored (a
    // chunk's left context), so room for more than capacity - kept never comes.
    const WaitStatus status =
        wait_released([&](Timeout slice) { return ring.wait_for_space(1, slice); }, timeout);
    if (status != WaitStatus::ready) {
      if (status == WaitStatus::closed) require_open(ring, "push");
      break;
    }
    require_open(ring, "push");
    done += ring.push(src + done * layout.item_bytes, count - done, Timeout::zero());
  }
  return done;
}

/// A writable view of up to `max_count` free slots, to fill in place and then commit().
inline py::array reserve_view(SpscRing& ring, const ItemLayout& layout, ProducerState& state,
                              std::size_t max_count, py::handle owner) {
  require_open(ring, "reserve");
  const WriteRegion region = ring.reserve(max_count);
  // reserved only once the view exists: a view that failed let commit() publish unwritten slots
  py::array view = layout.view(region.data, region.count, owner, /*writable=*/true);
  state.reserved = region.count;
  return view;
}

inline void commit_reserved(SpscRing& ring, ProducerState& state, std::size_t count) {
  if (count > state.reserved)
    throw py::value_error("commit(" + std::to_string(count) + "): only " +
                          std::to_string(state.reserved) + " slots are reserved");
  state.reserved = 0;
  ring.commit(count);
}

inline py::dict stats_dict(const SpscRing& ring) {
  const RingStats s = ring.stats();
  py::dict d;
  d["pushed"] = s.pushed;
  d["popped"] = s.popped;
  d["dropped"] = s.dropped;
  d["rejected"] = s.rejected;
  d["size"] = ring.size();
  return d;
}

inline Overflow parse_overflow(const std::string& name) {
  if (name == "block") return Overflow::block;
  if (name == "drop_oldest") return Overflow::drop_oldest;
  if (name == "reject") return Overflow::reject;
  throw py::value_error("overflow must be 'block', 'drop_oldest' or 'reject', got '" + name + "'");
}

inline const char* overflow_name(Overflow o) {
  switch (o) {
    case Overflow::block: return "block";
    case Overflow::drop_oldest: return "drop_oldest";
    case Overflow::reject: return "reject";
  }
  return "?";
}

}  // namespace mstar::py_bind

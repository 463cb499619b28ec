// The per-engine ready queues of the Conductor, in the order work runs.
#pragma once

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <vector>

#include "scheduler/request_state.hpp"

namespace mstar::detail {

/// Ready-queue order: earliest deadline, then highest priority, then oldest request, then item.
struct ItemOrder {
  bool operator()(const Item* a, const Item* b) const noexcept {
    if (a->req->options.deadline_ns != b->req->options.deadline_ns)
      return a->req->options.deadline_ns < b->req->options.deadline_ns;
    if (a->req->options.priority != b->req->options.priority)
      return a->req->options.priority > b->req->options.priority;
    if (a->req->seq != b->req->seq) return a->req->seq < b->req->seq;
    return a->id < b->id;
  }
};

/// A ready queue kept sorted by ItemOrder in a vector: inserts land at the back in the common
/// case (same deadline and priority, newer request), and nothing is allocated once it has grown.
struct EngineQueue {
  std::vector<Item*> ready;
  std::condition_variable cv;
  // Bumped under the mutex by every insert; read without it by a spinning wait_ready.
  std::atomic<std::uint64_t> inserted{0};
  void insert(Item* item) {
    ready.insert(std::upper_bound(ready.begin(), ready.end(), item, ItemOrder{}), item);
    inserted.fetch_add(1, std::memory_order_release);
  }
};

}  // namespace mstar::detail

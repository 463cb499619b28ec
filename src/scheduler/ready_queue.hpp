// The per-engine ready queues of the Conductor: mstar::ReadyQueue (mstar/ready_queue.hpp, the
// order work runs in) of work items, plus what waiting workers need.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>

#include "mstar/ready_queue.hpp"
#include "scheduler/request_state.hpp"

namespace mstar::detail {

struct EngineQueue {
  ReadyQueue<Item*> ready;
  std::condition_variable cv;
  // Bumped under the mutex by every insert; read without it by a spinning wait_ready.
  std::atomic<std::uint64_t> inserted{0};
  bool submitter_takes = false;  // Conductor::set_submitter_takes
  void insert(Item* item) {
    const SubmitOptions& o = item->req->options;
    ready.push({{o.deadline_ns, o.priority, item->req->seq, item->id}, item->node, item->walk, item});
    inserted.fetch_add(1, std::memory_order_release);
  }
};

}  // namespace mstar::detail

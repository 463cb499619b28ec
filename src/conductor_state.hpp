// Internal state of the Conductor: requests, activations, streams, work items.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <mutex>
#include <algorithm>
#include <string>
#include <unordered_map>
#include <vector>

#include "mstar/conductor.hpp"

namespace mstar::detail {

/// The value a name has for one request: nothing, one handle, or a list (accumulated, window).
struct Slot {
  bool present = false;
  bool list = false;
  Handle single = 0;
  std::vector<Handle> many;
};

/// A running section instance. Loop bodies get a fresh child activation per iteration.
struct Activation {
  std::uint32_t section = 0;
  Activation* parent = nullptr;
  std::uint32_t index = 0;                 // sequential: child; parallel: pending; loop: iteration
  std::vector<std::vector<Handle>> acc;    // loop: retained values per accumulated name
  std::vector<Handle> acc_before;          // loop: each accumulated name's value as the iteration began
  std::uint32_t live_pos = 0;              // its position in Request::live
};

struct Request;

struct StreamState {
  explicit StreamState(const StreamSpec& s) : spec(&s), cursor(s.policy) {}
  const StreamSpec* spec;
  std::deque<Handle> items;  // items[i] is stream position base + i
  std::uint64_t base = 0;
  std::uint64_t written = 0;
  bool ended = false;
  bool inflight = false;       // a window is with an engine: windows run one at a time, in order
  bool any_sent = false;       // some window was dispatched
  bool last_sent = false;      // the window marked last was dispatched
  Activation* consumer = nullptr;  // the consumer's activation, once the walk has reached it
  ChunkCursor cursor;
};

struct Item : WorkItem {
  bool in_use = false;
  Request* req = nullptr;
  Activation* act = nullptr;  // the node activation (nullptr for stream windows)
  int stream = -1;            // window of this stream
  std::int64_t queued_ns = 0, started_ns = 0;
  std::uint32_t batch_size = 0;
};

struct Request {
  RequestId id = 0;
  std::uint64_t seq = 0;
  SubmitOptions options;
  WalkId walk = 0;
  enum class State : std::uint8_t { running, between_walks, over } state = State::running;
  std::vector<Slot> env;                 // by NameId
  std::vector<std::uint8_t> is_input;    // request inputs stay visible in every walk
  std::vector<std::uint8_t> stop;        // by loop NameId
  // Activations of the current walk; a vector with swap-removal (Activation::live_pos) because a
  // node-based set would allocate once per loop iteration.
  std::vector<Activation*> live;
  std::vector<StreamState> streams;      // of the current walk
  std::size_t queued = 0;                // items in ready queues
  std::size_t inflight = 0;
  std::vector<TimelineEvent> timeline;
};

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

/// Per-walk lookups computed once from the IR.
struct WalkIndex {
  std::vector<int> node_section;                  // node -> its section, -1 if not in the walk
  std::vector<std::vector<NameId>> emit_names;    // node -> names it emits
  std::vector<std::vector<int>> produces_streams; // node -> streams it feeds
  std::vector<int> consumes_stream;               // node -> stream it consumes, -1 if none
  std::vector<std::vector<int>> ends_streams;     // section -> streams its end closes
  std::vector<std::uint8_t> persist;              // name -> kept across walks
};

}  // namespace mstar::detail

// Per-request state of the Conductor: values by name, activations, streams, work items.
#pragma once

#include <cstdint>
#include <vector>

#include "mstar/conductor.hpp"
#include "scheduler/handle_ring.hpp"

namespace mstar::detail {

/// The value a name has for one request: nothing, one handle, or a list (accumulated, chunk).
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
  std::uint32_t index = 0;                 // sequential: child; parallel: pending; loop: iteration;
                                           // part: the child running (or last run)
  bool awaiting = false;                   // part: waiting for Conductor::choose_part
  std::vector<std::vector<Handle>> acc;    // loop: retained values per accumulated name
  std::vector<Handle> acc_before;          // loop: each accumulated name's value as the iteration began
  std::uint32_t live_pos = 0;              // its position in Request::live
};

struct Request;

struct StreamState {
  explicit StreamState(const StreamSpec& s) : spec(&s), cursor(s.policy) {}
  const StreamSpec* spec;
  HandleRing items;  // items[i] is stream position base + i
  std::uint64_t base = 0;
  std::uint64_t written = 0;
  bool ended = false;
  bool inflight = false;       // a chunk is with an engine: chunks run one at a time, in order
  bool last_sent = false;      // the chunk marked last (or the stream-end item) was dispatched
  Activation* consumer = nullptr;  // the consumer's activation, once the walk has reached it
  ChunkCursor cursor;
};

struct Item : WorkItem {
  bool in_use = false;
  Request* req = nullptr;
  Activation* act = nullptr;  // the node activation (nullptr for stream chunks)
  int stream = -1;            // chunk of this stream
  std::int64_t queued_ns = 0, started_ns = 0;
  // The engine's time between its previous batch and this one while this work waited: the
  // worker's own overhead, part of what each batch costs (deadlines.cpp).
  std::int64_t gap_ns = 0;
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
  std::vector<HandleRing> spare_rings;   // streams' storage kept for the next walk and request
  std::uint64_t emitted = 0;             // Emits made, in all walks
  std::size_t queued = 0;                // items in ready queues
  std::size_t inflight = 0;
  std::vector<TimelineEvent> timeline;

  /// Starts a stream of the walk on storage a finished stream left (no allocation once warm).
  void open_stream(const StreamSpec& spec) {
    streams.emplace_back(spec);
    if (!spare_rings.empty()) {
      streams.back().items = std::move(spare_rings.back());
      spare_rings.pop_back();
    }
  }
  /// Drops the walk's streams (their handles already released), keeping their storage.
  void close_streams() {
    for (StreamState& s : streams) {
      s.items.clear();
      spare_rings.push_back(std::move(s.items));
    }
    streams.clear();
  }
};

}  // namespace mstar::detail

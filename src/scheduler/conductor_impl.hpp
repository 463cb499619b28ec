// The Conductor's state and the operations its parts share. conductor.cpp: the public API and
// its locking; walk_index.cpp: checks of the IR and per-walk lookups; activations.cpp: the
// activation walker (sections, loops, work items); streams.cpp: streaming edges and their
// chunks; requests.cpp: request lifecycle, recycling and completion. Every member function runs
// with `mu` held.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "mstar/conductor.hpp"
#include "scheduler/handle_counts.hpp"
#include "scheduler/ready_queue.hpp"
#include "scheduler/request_state.hpp"
#include "scheduler/walk_index.hpp"

namespace mstar {

namespace detail {

inline std::int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

}  // namespace detail

struct Conductor::Impl {
  using Activation = detail::Activation;
  using Item = detail::Item;
  using Request = detail::Request;
  using Slot = detail::Slot;
  using StreamState = detail::StreamState;

  GraphSpec g;
  std::vector<detail::WalkIndex> index;  // by walk
  std::vector<std::uint8_t> persisted_anywhere;  // name -> some walk persists it

  mutable std::mutex mu;
  std::vector<detail::EngineQueue> engines;
  std::unordered_map<RequestId, std::unique_ptr<detail::Request>> requests;
  std::unordered_map<RequestId, std::vector<TimelineEvent>> finished_timelines;
  // Work items live in reused slots; an item id is (generation << 32 | slot), so a stale or
  // made-up id is recognised without a hash lookup.
  std::vector<std::unique_ptr<detail::Item>> slots;
  std::vector<std::uint32_t> free_slots;
  std::uint32_t generation = 1;
  detail::HandleCounts refs;
  std::vector<detail::Activation*> free_acts;  // reused: no allocation per loop iteration once warm
  static constexpr std::size_t kSpares = 256;                 // requests / timelines kept
  static constexpr std::size_t kSpareTimelineCapacity = 4096;  // longer ones are freed
  // A request's timeline keeps its first node executions only: one that streams for hours (a
  // voice session) would otherwise grow by 40 bytes per execution for as long as it runs.
  static constexpr std::size_t kMaxTimeline = 1 << 16;
  std::vector<std::unique_ptr<detail::Request>> spare_requests;
  std::vector<std::vector<TimelineEvent>> spare_timelines;
  RequestId next_request = 1;
  bool stopping = false;
  std::chrono::nanoseconds spin = std::chrono::microseconds(100);  // wait_ready's spin
  bool submitting = false;  // inside submit(): engines whose submitter takes their work sleep on
  std::thread::id inline_taker{};  // take_inline: the one thread given the work of those engines

  /// Whether this thread may take work from `q` now (work waits, and no inline taker keeps it).
  bool takable(const detail::EngineQueue& q) const {
    return !q.ready.empty() && (!q.submitter_takes || inline_taker == std::thread::id() ||
                                inline_taker == std::this_thread::get_id());
  }
  std::size_t inflight = 0;
  // Deadlines (deadlines.cpp): live fail_late requests, recent per-item time by node, and a
  // scratch list reused by expire_late.
  // Written under `mu`; Conductor::expire reads it without, so that a worker's check before
  // each batch costs no lock while no fail_late request is live.
  std::atomic<std::size_t> late_watch{0};
  std::vector<std::int64_t> item_ns;
  std::vector<std::int64_t> engine_done_ns;  // by engine: when its last item completed
  std::vector<std::int64_t> engine_busy_ns;  // by engine: when its batch in flight should end
  std::vector<std::pair<RequestId, NodeId>> late;

  explicit Impl(GraphSpec graph);
  ~Impl();

  // ---- IR checks (walk_index.cpp) -------------------------------------------------------------

  void validate_and_index();

  // ---- handles --------------------------------------------------------------------------------

  void retain(Handle h) { refs.retain(h); }
  void release(Handle h, Outcome* out) {
    if (refs.release(h)) out->released.push_back(h);
  }

  // ---- work item slots and values (activations.cpp) ------------------------------------------------

  detail::Item* new_item();
  detail::Item* find_item(std::uint64_t id);
  void free_item(Item* item);
  void clear_slot(Slot& s, Outcome* out);
  void set_single(Request& r, NameId name, Handle h, Outcome* out);

  // ---- the activation walker (activations.cpp) -----------------------------------------------------

  const WalkSpec& walk_of(const Request& r) const { return g.walks[r.walk]; }
  const SectionSpec& sec(const Request& r, std::uint32_t s) const { return g.walks[r.walk].sections[s]; }

  detail::Activation* new_act(Request& r, std::uint32_t section, Activation* parent);
  void drop_act(Request& r, Activation* a, Outcome* out);
  void start(Request& r, Activation* a, Outcome* out);
  /// Notes each accumulated name's value as an iteration starts: only a value the iteration
  /// itself produced (a different handle) is accumulated at its end.
  void begin_iteration(Request& r, Activation* loop, const SectionSpec& s);
  void done(Request& r, Activation* a, Outcome* out);
  void end_loop(Request& r, Activation* loop, const SectionSpec& p, Outcome* out);
  /// A Part waits for the model's choice: pushes it into out->part_choices (`finished`: the
  /// child that just ended, -1 as the Part starts).
  void await_part(Request& r, Activation* part, int finished, Outcome* out);
  /// The model chose: starts child `child` of the waiting Part, or completes it (-1).
  void choose(Request& r, Activation* part, int child, Outcome* out);
  std::uint32_t innermost_iteration(const Request& r, const Activation* a) const;
  /// Queues a work item of `node`: a plain execution (`streams` null), or one window per stream
  /// the node consumes (`chunks`, aligned with `streams`), or its stream-end item.
  void dispatch_chunks(Request& r, NodeId node, Activation* act, const std::vector<int>* streams,
                       const Chunk* chunks, bool stream_end, Outcome* out);
  /// A reused buffer for one window per stream of a consumer (no allocation once warm).
  Chunk* chunk_scratch(std::size_t n);
  std::vector<Chunk> chunk_buf;

  // ---- streams (streams.cpp) -----------------------------------------------------------------------

  /// A stream's producer scope starting again (an outer loop's next iteration) starts a fresh
  /// stream: positions, chunks and the end-of-stream flag begin anew.
  void restart_streams(Request& r, std::uint32_t section, Outcome* out);
  /// Chunks go out once the walk has reached the consumer (its place in the walk says when it
  /// may run: put it in a Parallel with the producer to stream while the producer runs).
  void pump(Request& r, std::size_t st, Outcome* out);
  void clear_streams(Request& r, Outcome* out);

  // ---- request lifecycle, recycling and completion (requests.cpp) ----------------------------------

  void begin_walk(Request& r, WalkId w, Outcome* out);
  void walk_done(Request& r, Outcome* out);
  /// Frees everything the request holds; it disappears once its in-flight items are back.
  void end_request(Request& r, Outcome* out);
  std::unique_ptr<Request> new_request();
  void recycle(std::unique_ptr<Request> r);
  void recycle_timeline(std::vector<TimelineEvent>&& t);
  /// Erases a request that is over once no engine holds its items. Called last by each public
  /// entry point, never in the middle of walking (callers up the stack still hold `r`).
  void reap(RequestId id);
  void fail_request(Request& r, const std::string& message, Outcome* out);
  Request* find(RequestId id);
  void complete_one(const Completion& c, std::int64_t t, Outcome* out);

  // ---- deadlines (deadlines.cpp) -------------------------------------------------------------------

  void note_batch_time(NodeId node, std::int64_t per_item_ns);
  /// Fails the fail_late requests with queued work past its deadline.
  void expire_late(Outcome* out);
  /// For a fail_late request just submitted: false (and the request failed) when its queued
  /// work cannot be expected to start before its deadline.
  bool admit(Request& r, Outcome* out);
  void apply_outputs(Request& r, const Item& item, const Completion& c, Outcome* out);

};

}  // namespace mstar

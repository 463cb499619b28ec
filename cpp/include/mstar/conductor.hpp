// mstar/conductor.hpp — runs requests through a compiled graph (see graph.hpp).
//
// The Conductor keeps, per request, the current walk, an activation tree over its sections
// (sequential position, parallel branches pending, loop counters and stop flags, nested loop
// indices), the values visible by name (handles into the application's tensor store, with
// reference counts), accumulated loop outputs, persisted handles and streaming-edge state. It
// emits work items into per-engine ready queues ordered by deadline, then priority, then request
// arrival, and engine workers pull batches of one node and walk across requests. It never runs a
// node and never touches tensor bytes: it routes handles.
//
// Threading: every method is safe from any thread (one internal mutex; next_batch waits on a
// condition variable without holding it). The handles a call stops referencing are returned in
// `released`: the caller frees them from its store.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "mstar/graph.hpp"

namespace mstar {

using RequestId = std::uint64_t;

struct NamedHandle {
  NameId name = 0;
  Handle handle = 0;
};

struct SubmitOptions {
  /// Absolute steady-clock deadline in ns since its epoch; INT64_MAX = none. Earlier goes first.
  std::int64_t deadline_ns = INT64_MAX;
  /// Higher goes first among equal deadlines; then the request submitted first.
  std::int32_t priority = 0;
  /// Keep the deadline instead of only ordering by it: work of this request that would start
  /// after `deadline_ns` fails the request (Outcome::expired names the node it had reached), and
  /// submit refuses the request at once when its first nodes are not expected to be done by the
  /// deadline, given the work queued ahead of them (estimated from the batch times seen so far).
  bool fail_late = false;
};

/// One execution of one node for one request, as handed to an engine worker.
struct WorkItem {
  std::uint64_t id = 0;
  RequestId request = 0;
  NodeId node = 0;
  WalkId walk = 0;
  std::uint32_t iteration = 0;  ///< of the innermost enclosing loop (0 outside loops)
  /// Input k of the node is handles[offsets[k] .. offsets[k+1]); list_input[k] says whether it is
  /// a list (an accumulated loop output or a stream chunk) rather than one value.
  std::vector<Handle> handles;
  std::vector<std::uint32_t> offsets;
  std::vector<std::uint8_t> list_input;
  bool chunked = false;  ///< a stream consumer's chunk: `chunk` says which items
  /// Not a chunk: the consumed stream ended and no chunk marked `last` went out
  /// (NodeSpec::on_stream_end). `chunk` is then empty at the stream's end, marked `last`.
  bool stream_end = false;
  Chunk chunk;  ///< the window of the node's first stream (chunks[0])
  /// One window per stream the node consumes, in the order of its inputs: a node may read
  /// several streams, each cut by its own policy. A stream that is over gives an empty window
  /// (begin == end, marked `last`).
  std::vector<Chunk> chunks;
};

/// What an engine reports for one work item.
struct Completion {
  std::uint64_t item = 0;
  std::vector<Handle> outputs;     ///< aligned with NodeSpec::outputs; 0 = not produced
  std::vector<NameId> stop_loops;  ///< DynamicLoops (by name) to stop for this item's request
};

/// An output streamed to the caller. Its handle may be among the same call's `released`, and a
/// later call (from another thread) may release it too: read the value before freeing `released`
/// and before another call can run — the Python bindings do both while holding the GIL; a
/// multi-threaded C++ embedder serialises each call with the handling of its Outcome.
struct Emit {
  RequestId request = 0;
  NodeId node = 0;
  NameId name = 0;
  Handle handle = 0;
};

/// A request failed by its deadline (SubmitOptions::fail_late).
struct Expired {
  RequestId request = 0;
  NodeId node = 0;         ///< the node whose work would have started late (or was refused)
  bool refused = false;    ///< refused at submit: the queue ahead could not be served in time
  std::int64_t late_ns = 0;  ///< how far past the deadline (refused: expected start - deadline)
};

/// A Part (SectionKind::part) waits for the model's state machine to choose its next sub-walk:
/// answer with Conductor::choose_part(request, section, child).
struct PartChoice {
  RequestId request = 0;
  WalkId walk = 0;
  std::uint32_t section = 0;  ///< the Part's section index within the walk
  NameId part = 0;            ///< the Part's name (SectionSpec::part_name)
  int finished = -1;          ///< the child (sub-walk) that just finished; -1: the Part starts
};

/// Everything a call changed that the caller has to act on.
struct Outcome {
  std::vector<Emit> emits;                ///< in completion order
  std::vector<RequestId> walks_done;      ///< ask the model for the next walk (or finish)
  std::vector<PartChoice> part_choices;   ///< ask the model for a Part's next sub-walk (or none)
  std::vector<std::pair<RequestId, std::string>> failed;  ///< ended with this error
  std::vector<Expired> expired;           ///< those of `failed` that their deadline ended
  std::vector<Handle> released;           ///< free these from the tensor store, after the emits
};

struct TimelineEvent {
  NodeId node = 0;
  WalkId walk = 0;
  std::uint32_t iteration = 0;
  std::uint32_t batch_size = 0;
  std::int64_t queued_ns = 0, started_ns = 0, finished_ns = 0;  ///< steady clock
};

class Conductor {
 public:
  /// Throws std::invalid_argument when the IR refers to unknown names, nodes, sections or engines.
  explicit Conductor(GraphSpec graph);
  ~Conductor();
  Conductor(const Conductor&) = delete;
  Conductor& operator=(const Conductor&) = delete;

  const GraphSpec& graph() const noexcept;

  /// Starts `walk` for a new request whose inputs stay visible in every walk. Returns its id.
  RequestId submit(WalkId walk, const std::vector<NamedHandle>& inputs, SubmitOptions options,
                   Outcome* out);
  /// After a walks_done report: run the next walk (persisted names and inputs remain visible).
  /// Returns false if the request was cancelled or failed meanwhile.
  bool start_walk(RequestId request, WalkId walk, Outcome* out);
  /// After a part_choices report: starts child `child` (a sub-walk, by its index in the Part's
  /// children) of the Part at `section` of the request's walk, or completes the Part (-1).
  /// Returns false if the request was cancelled or failed meanwhile. Throws
  /// std::invalid_argument for a child the Part does not have and std::logic_error when that
  /// Part is not waiting for a choice.
  bool choose_part(RequestId request, std::uint32_t section, int child, Outcome* out);
  /// After a walks_done report: the request is complete; frees everything it holds. Returns
  /// false if the request was already over (e.g. cancelled meanwhile).
  bool finish(RequestId request, Outcome* out);
  /// At any moment: drops queued work and frees everything; in-flight items are ignored when they
  /// complete. Returns false if the request is unknown or already over.
  bool cancel(RequestId request, Outcome* out);
  /// Ends a request with an error (e.g. the model's state machine raised).
  void fail(RequestId request, const std::string& message, Outcome* out);
  /// Appends `value` to the stream `name` that node `producer` makes, as one more execution of
  /// the producer would, while that node is in flight: placement's stand-in for a section a
  /// worker runs reports the items of a stream leaving the section as they are made (its end
  /// ends the stream, as a producer's scope does). Returns whether a stream took the value:
  /// false (the value released) for a request that is not running or a stream already ended,
  /// so a caller feeding from outside can say so. Throws std::invalid_argument for an unknown
  /// node or name.
  bool push_stream(RequestId request, NodeId producer, NameId name, Handle value, Outcome* out);
  /// Fails the fail_late requests whose queued work is past its deadline. Submit, start_walk
  /// and complete do this themselves; an engine worker calls it before next_batch so that it
  /// never takes such work. Costs no lock and no clock read while no fail_late request is live.
  void expire(Outcome* out);

  /// Waits up to `timeout` for work on `engine`; returns up to `max_batch` items of one node and
  /// walk, the most urgent first. Empty on timeout or after shutdown().
  std::vector<const WorkItem*> next_batch(EngineId engine, std::size_t max_batch,
                                          std::chrono::nanoseconds timeout);
  /// The same into `batch` (cleared first): a worker that reuses its vector allocates nothing
  /// per batch once warm.
  void next_batch(EngineId engine, std::size_t max_batch, std::chrono::nanoseconds timeout,
                  std::vector<const WorkItem*>* batch);
  /// Waits up to `timeout` for work on `engine` without taking it; false on timeout or after
  /// shutdown(). A worker that must do something slow before it can run a batch (take Python's
  /// GIL) waits here first and takes the batch with next_batch(..., 0) afterwards, so the batch
  /// also holds what arrived meanwhile.
  bool wait_ready(EngineId engine, std::chrono::nanoseconds timeout);
  /// How long wait_ready spins (without the mutex) before it sleeps: 100 µs by default; 0 never
  /// spins. Spinning saves the submitter a wake-up system call and the worker a reschedule.
  void set_spin(std::chrono::nanoseconds spin);
  /// The thread that calls submit() takes `engine`'s first batch itself (next_batch with a zero
  /// timeout): submit() then does not wake that engine's worker, which would only wake to find
  /// nothing and contend with that thread. Other work for the engine wakes it as usual.
  void set_submitter_takes(EngineId engine, bool takes);
  /// While on, the calling thread alone takes the work of the engines of set_submitter_takes
  /// (their workers neither wake for it nor get it), to run a short walk start to end itself,
  /// with no thread hand-off. Turning it off wakes their workers for what it left.
  void take_inline(bool on);
  /// Wakes a worker of `engine` if work waits there (what a submitter of set_submitter_takes
  /// left: more than one batch, or no way to send it now).
  void wake(EngineId engine);
  /// Reports finished items (any subset of batches). Items of cancelled requests are ignored.
  void complete(const std::vector<Completion>& done, Outcome* out);
  /// Reports that items failed: their requests end with `message` (other requests go on), after
  /// "node '<node>' in walk '<walk>' failed: " unless `named` (the message says where already:
  /// a placement worker's segment names the node inside it that failed).
  void fail_items(const std::vector<std::uint64_t>& items, const std::string& message, Outcome* out,
                  bool named = false);
  /// The nodes of the batches taken and not yet reported, each with when its oldest such item
  /// was taken (steady clock, ns): what a placement worker's heartbeat tells its watchdog.
  std::vector<std::pair<NodeId, std::int64_t>> running() const;
  /// Wakes every waiting next_batch; later calls return at once.
  void shutdown();

  /// Single values currently visible to the request by name (after a walk: persisted + inputs).
  std::vector<NamedHandle> values(RequestId request) const;
  /// The request's per-node-execution timeline (kept until forget(); its first 65536 node
  /// executions, so a request that streams for hours holds a bounded record).
  std::vector<TimelineEvent> timeline(RequestId request) const;
  void forget(RequestId request);

  /// How many Emits the request has made so far (0 once it is gone). Between walks this is its
  /// final count: a caller whose threads hand Emits over concurrently can wait until it has
  /// delivered them all before it reports the request finished.
  std::uint64_t emitted(RequestId request) const;

  std::size_t live_requests() const;
  std::size_t live_handles() const;   ///< handles with a nonzero reference count
  std::size_t queued_items() const;
  std::size_t inflight_items() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace mstar

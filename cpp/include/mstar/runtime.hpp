// mstar/runtime.hpp — serves a C++ Model (model.hpp) in this process: the C++ face of
// mstar_rt.Runtime.
//
//   mstar::Runtime runtime(std::move(model));
//   mstar::Request r = runtime.submit({{"x", mstar::Tensor::from<float>({1, 2}, {2})}});
//   mstar::Output out;
//   while (r.next(&out)) use(out.name, out.value);   // streamed EMIT outputs, in order
//
// The Runtime compiles the model, creates a Conductor (conductor.hpp) and starts one worker
// thread per engine; workers pull batches, run the nodes' C++ callables on tensors, and report
// completions. The Conductor routes handles; the Runtime keeps the tensor store they index.
// Every request's trouble stays its own: a bad input is refused by submit() with a message
// naming the input; a node that throws fails its request (status failed, error() names the node
// and walk), and others go on. Cancel at any moment frees what the request holds.
//
// Control: make_action_buffer() and make_control_loop() give the ActionChunkBuffer and the
// ControlLoop (control_loop.hpp) that a policy served here feeds; ChunkFeeder
// (chunk_feeder.hpp) runs the policy on its own thread whenever the plan runs short.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "mstar/action_chunk_buffer.hpp"
#include "mstar/control_loop.hpp"
#include "mstar/model.hpp"
#include "mstar/tensor.hpp"

namespace mstar {

/// An EMIT output streamed to the caller.
struct Output {
  std::string node;
  std::string name;
  Tensor value;
};

enum class RequestStatus : std::uint8_t { running, finished, failed, cancelled };
const char* status_name(RequestStatus status) noexcept;

/// A request ended by failure or cancellation (result() throws it).
class RequestError : public std::runtime_error {
 public:
  RequestError(RequestStatus status, const std::string& message)
      : std::runtime_error(message), status_(status) {}
  RequestStatus status() const noexcept { return status_; }

 private:
  RequestStatus status_;
};

/// One node execution of a request (steady-clock ns).
struct NodeRun {
  std::string node, walk;
  std::uint32_t iteration = 0, batch_size = 0;
  std::int64_t queued_ns = 0, started_ns = 0, finished_ns = 0;
};

using OutputCallback = std::function<void(RequestId request, const Output& output)>;

struct RequestOptions {
  /// Relative deadline; earlier deadlines run first. Zero or negative: none.
  std::chrono::nanoseconds deadline{0};
  std::int32_t priority = 0;  ///< higher first among equal deadlines
  /// Keep the deadline rather than only order by it: the request fails ("deadline exceeded:
  /// node '<node>' ...") instead of starting work after it, and submit() fails it at once
  /// ("deadline cannot be met: ...") when the work queued ahead is expected to take too long.
  bool fail_late = false;
  /// If set, outputs go here (on the worker thread that made them, one at a time per request,
  /// in order) instead of to next(). It must not block for long: it holds up that engine. An
  /// exception it throws is swallowed (the request goes on; the callback owns its own errors).
  OutputCallback on_output;
};

class Runtime;

/// A submitted request. Cheap to copy (all copies refer to one request); it stays valid after
/// the Runtime is gone (cancel() then returns false).
class Request {
 public:
  RequestId id() const noexcept;
  /// Waits up to `timeout` for the next output. True with *out set; false when the request is
  /// over and every output was taken (status() says how), or on timeout (status() running).
  bool next(Output* out, std::chrono::nanoseconds timeout = std::chrono::nanoseconds::max());
  /// Waits up to `timeout` for the end; returns the status then.
  RequestStatus wait(std::chrono::nanoseconds timeout = std::chrono::nanoseconds::max());
  /// Waits for the end; returns the outputs next() has not taken, by name, in order. Throws
  /// RequestError if the request failed or was cancelled.
  std::map<std::string, std::vector<Tensor>> result();
  /// Stops the request now (queued work dropped, memory freed). False if it was already over.
  bool cancel();
  RequestStatus status() const;
  std::string error() const;  ///< why it failed or was cancelled ("" otherwise)
  std::vector<NodeRun> timeline() const;  ///< every node execution so far

  struct State;
  /// What a server makes (Runtime::submit, PythonModel::submit); throws on a null state.
  explicit Request(std::shared_ptr<State> state);

 private:
  std::shared_ptr<State> state_;
};

struct RuntimeOptions {
  /// How long an idle worker waits for work before it re-checks for shutdown.
  std::chrono::milliseconds poll{50};
};

struct RuntimeStats {
  std::size_t live_requests = 0, live_handles = 0, queued_items = 0, inflight_items = 0;
  std::size_t stored_tensors = 0;  ///< tensors in the store (inputs and node outputs)
  std::uint64_t submitted = 0, finished = 0, failed = 0, cancelled = 0;
  std::uint64_t expired = 0;  ///< of `failed`: ended by their deadline (RequestOptions::fail_late)
  std::uint64_t node_runs = 0, batches = 0;
};

class Runtime {
 public:
  /// Compiles `model` (throws GraphError) and starts the workers.
  explicit Runtime(Model model, RuntimeOptions options = {});
  /// Cancels what still runs and joins the workers; destroyed in its own on_output callback, it
  /// stops them and the calling worker exits once the callback returns. Never throws.
  ~Runtime();
  Runtime(const Runtime&) = delete;
  Runtime& operator=(const Runtime&) = delete;

  /// Starts a request. Throws std::invalid_argument for an input the model does not declare, a
  /// missing one, or one that does not match its TensorSpec; std::logic_error after close().
  Request submit(const std::map<std::string, Tensor>& inputs, RequestOptions options = {});
  /// Cancels every request and stops the workers; submit() is refused afterwards. Called from one
  /// of this runtime's own worker threads (a node, next_walk, on_output) it throws
  /// std::logic_error and closes nothing: a thread cannot join itself.
  void close();

  RuntimeStats stats() const;
  const GraphSpec& graph() const noexcept;

  /// An ActionChunkBuffer for a policy served here to fill and a control loop to drain.
  static std::shared_ptr<ActionChunkBuffer> make_action_buffer(ActionChunkOptions options);
  /// What a control tick receives: the action for this tick (action_dim floats) and whether the
  /// buffer had one (false: starved, the last action is repeated).
  using ActionFn = std::function<void(const TickInfo& tick, const float* action, bool fresh)>;
  /// A ControlLoop whose tick pops one action from `actions` and passes it to `on_action`: C++
  /// only, no lock, no allocation, never Python. Run it with run() or start().
  static std::unique_ptr<ControlLoop> make_control_loop(ControlLoopOptions options,
                                                        std::shared_ptr<ActionChunkBuffer> actions,
                                                        ActionFn on_action,
                                                        std::shared_ptr<Clock> clock = nullptr);

  struct Impl;

 private:
  std::shared_ptr<Impl> impl_;
};

}  // namespace mstar

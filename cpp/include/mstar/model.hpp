// mstar/model.hpp — a model written in C++: nodes (C++ callables on tensors), walks and the
// state machine that picks the next walk. The C++ counterpart of mstar_rt.Model.
//
//   mstar::Model m;
//   m.input("x", mstar::TensorSpec::of(mstar::DType::float32, {-1}));
//   m.node("double", {"x"}, {mstar::Edge::emit("y")}, [](mstar::NodeCall& c) { ... });
//   m.walk("main", "double");
//
// compile() validates it the way the Python compiler does (unknown nodes, edges to nothing,
// inputs nobody produces, a node twice in a walk, streams consumed inside their producer's loop)
// and throws GraphError naming what to fix; it then yields the graph IR the Conductor runs.
// Model::load() takes an IR built elsewhere (e.g. by the Python compiler) and binds nodes to it.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

#include "mstar/chunk_policy.hpp"
#include "mstar/conductor.hpp"
#include "mstar/graph.hpp"
#include "mstar/tensor.hpp"

namespace mstar {

/// A model's graph or walks are malformed; the message names the node, walk or edge to fix.
class GraphError : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

/// Destination of outputs that stream to the caller.
inline const std::string kEmit = "EMIT";

/// One output of a node: a value `name` for node `to` (or kEmit), kept across walks if
/// `persist`, or streamed item by item to `to` in windows of `policy` if `streaming`.
struct Edge {
  std::string to;
  std::string name;
  bool persist = false;
  bool streaming = false;
  ChunkPolicy policy = ChunkPolicy::fixed(1);

  static Edge to_node(std::string to, std::string name) { return {std::move(to), std::move(name)}; }
  static Edge persisted(std::string to, std::string name) {
    return {std::move(to), std::move(name), true};
  }
  static Edge emit(std::string name) { return {kEmit, std::move(name)}; }
  static Edge stream(std::string to, std::string name, ChunkPolicy policy) {
    return {std::move(to), std::move(name), false, true, policy};
  }
};

/// A section of a walk: a node, or Sequential / Parallel / Loop / DynamicLoop over sections.
/// A node name converts implicitly, so `Section::seq({"a", "b"})` reads like the Python DSL.
struct Section {
  SectionKind kind = SectionKind::node;
  std::string node;
  std::vector<Section> children;
  std::uint32_t max_iters = 1;
  bool dynamic = false;
  std::string loop_name;                ///< DynamicLoop: the name NodeCall::stop() uses
  std::vector<std::string> outputs;     ///< loop: visible after it with their last value
  std::vector<std::string> accumulated; ///< loop: visible after it as every iteration's value

  Section(const char* node_name) : node(node_name) {}        // NOLINT: implicit on purpose
  Section(std::string node_name) : node(std::move(node_name)) {}  // NOLINT
  static Section seq(std::vector<Section> parts);
  static Section par(std::vector<Section> branches);
  static Section loop(Section body, std::uint32_t max_iters, std::vector<std::string> outputs = {},
                      std::vector<std::string> accumulated = {});
  static Section dynamic_loop(std::string name, Section body, std::uint32_t max_iters,
                              std::vector<std::string> outputs = {},
                              std::vector<std::string> accumulated = {});

 private:
  Section() = default;
};

/// One execution of a node for one request: its inputs, and where its outputs go.
class NodeCall {
 public:
  RequestId request() const noexcept;
  const std::string& node() const noexcept;
  const std::string& walk() const noexcept;
  std::uint32_t iteration() const noexcept;  ///< of the innermost enclosing loop (0 outside)
  /// The single value of input `name`. Throws std::invalid_argument for an input the node does
  /// not declare, or one that arrives as a list (use list()).
  const Tensor& input(const std::string& name) const;
  /// Every value of input `name`: an accumulated loop output, or a stream window's items (for
  /// a single value, a list of one).
  const std::vector<Tensor>& list(const std::string& name) const;
  /// The stream window this execution consumes, or nullptr (never an empty window).
  const Chunk* window() const noexcept;
  /// True in a NodeOptions::on_stream_end call: the consumed stream ended with no window marked
  /// `last`; flush what the node held back.
  bool stream_ended() const noexcept;
  /// Sets output `name` (one the node declares; throws std::invalid_argument otherwise). An
  /// output never set is "not produced".
  void output(const std::string& name, Tensor value);
  /// Stops the DynamicLoop `loop_name` for this request at the next iteration boundary.
  void stop(const std::string& loop_name);

  struct Data;
  explicit NodeCall(Data* data) noexcept : d_(data) {}

 private:
  Data* d_;
};

/// A node run per execution. An exception fails this execution's request only.
using NodeFn = std::function<void(NodeCall& call)>;
/// A node run on a batch (executions of several requests); an exception fails them all.
using BatchNodeFn = std::function<void(const std::vector<NodeCall*>& batch)>;
/// What a finished walk leads to: the next walk's name, or "" to finish the request. `visible`
/// holds the request's inputs and persisted values by name.
using NextWalkFn = std::function<std::string(RequestId request, const std::string& finished_walk,
                                             const std::map<std::string, Tensor>& visible)>;

struct NodeOptions {
  std::string engine = "default";  ///< one worker thread per engine
  std::uint32_t max_batch = 1;     ///< the most executions one batch may hold
  /// A stream consumer's flush: called (instead of the node's function, with no window) when its
  /// stream ends and no window was marked `last` — it ended exactly where the last window ended,
  /// or carried no items. At most once per stream; unset, the end of stream calls nothing.
  NodeFn on_stream_end;
};

class Model {
 public:
  /// Declares a request input; submit() checks every request against `spec`.
  Model& input(std::string name, TensorSpec spec = {});
  Model& node(std::string name, std::vector<std::string> inputs, std::vector<Edge> outputs,
              NodeFn fn, NodeOptions options = {});
  Model& batch_node(std::string name, std::vector<std::string> inputs, std::vector<Edge> outputs,
                    BatchNodeFn fn, NodeOptions options = {});
  Model& walk(std::string name, Section root);
  Model& initial_walk(std::string name);  ///< default: the first walk added
  Model& next_walk(NextWalkFn fn);        ///< default: finish after the initial walk

  /// A model whose structure is an IR compiled elsewhere; `inputs` are the request inputs.
  /// Bind every node with bind() (or bind_batch()) before running it.
  static Model load(GraphSpec ir, std::vector<std::string> inputs);
  Model& bind(const std::string& node, NodeFn fn);
  Model& bind_batch(const std::string& node, BatchNodeFn fn);

  /// Validates and compiles into the graph IR. Throws GraphError naming the problem.
  GraphSpec compile() const;

  // What the Runtime reads (after compile(): ids follow the IR's node order).
  struct NodeDef {
    std::string name;
    std::vector<std::string> inputs;
    std::vector<Edge> outputs;
    NodeFn fn;
    BatchNodeFn batch_fn;
    NodeOptions options;
  };
  const std::vector<NodeDef>& nodes() const noexcept { return nodes_; }
  const std::vector<std::pair<std::string, TensorSpec>>& inputs() const noexcept { return inputs_; }
  const std::string& first_walk() const;
  const NextWalkFn& next_walk_fn() const noexcept { return next_walk_; }

 private:
  std::vector<std::pair<std::string, TensorSpec>> inputs_;
  std::vector<NodeDef> nodes_;
  std::vector<std::pair<std::string, Section>> walks_;
  std::string initial_walk_;
  NextWalkFn next_walk_;
  bool loaded_ = false;
  GraphSpec loaded_ir_;
};

}  // namespace mstar

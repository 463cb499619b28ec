// mstar/model.hpp — a model written in C++: nodes (C++ callables on tensors), walks and the
// state machine that picks the next walk. The C++ counterpart of mstar_rt.Model.
//
//   mstar::Model m;
//   m.input("x", mstar::TensorSpec::of(mstar::DType::float32, {-1}));
//   m.node("double", {"x"}, {mstar::Edge::emit("y")}, [](mstar::NodeCall& c) { ... });
//   m.walk("main", "double");
//
// compile() lowers it into the one graph compiler, mstar::GraphBuilder (the one the Python DSL
// uses too), which validates it (unknown nodes, edges to nothing, inputs nobody produces, a node
// twice in a walk, streams consumed inside their producer's loop) and throws GraphError naming
// what to fix; it then yields the graph IR the Conductor runs.
// Model::load() takes an IR compiled elsewhere (another GraphBuilder) and binds nodes to it.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "mstar/chunk_policy.hpp"
#include "mstar/conductor.hpp"
#include "mstar/graph.hpp"
#include "mstar/graph_builder.hpp"
#include "mstar/tensor.hpp"

namespace mstar {

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
  /// Every value of input `name`: an accumulated loop output, or a stream chunk's items (for
  /// a single value, a list of one).
  const std::vector<Tensor>& list(const std::string& name) const;
  /// The stream chunk this execution consumes, or nullptr (never an empty chunk).
  const Chunk* chunk() const noexcept;
  /// True in a Model::on_stream_end call: the consumed stream ended with no chunk marked
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
};

class Model {
 public:
  /// Declares a request input; submit() checks every request against `spec`.
  Model& input(std::string name, TensorSpec spec = {});
  Model& node(std::string name, std::vector<std::string> inputs, std::vector<Edge> outputs,
              NodeFn fn, NodeOptions options = {});
  Model& batch_node(std::string name, std::vector<std::string> inputs, std::vector<Edge> outputs,
                    BatchNodeFn fn, NodeOptions options = {});
  /// A stream consumer's flush: `fn` is called (instead of the node's function, with no chunk)
  /// when the stream `node` consumes ends and no chunk was marked `last` — it ended exactly
  /// where the last chunk ended, or carried no items. At most once per stream; without it the
  /// end of stream calls nothing.
  Model& on_stream_end(const std::string& node, NodeFn fn);
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
    NodeFn stream_end_fn;  ///< on_stream_end()
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

// mstar/graph_builder.hpp — the graph compiler: nodes (where they sit in the graph, not what they
// compute) and walks in, the validated graph IR out.
//
//   mstar::GraphBuilder b;
//   b.input("x");
//   b.node("enc", {"x"}, {mstar::Edge::to_node("dec", "h")});
//   b.node("dec", {"h"}, {mstar::Edge::emit("y")}, "gpu", 8);
//   b.walk("main", mstar::Section::seq({"enc", "dec"}));
//   mstar::GraphSpec ir = b.compile();  // or GraphError naming what to fix
//
// It is the only compiler: mstar::Model (nodes with C++ functions) and the Python DSL
// (mstar_rt.compile_model, through the bound mstar_rt._core.GraphBuilder) both lower into it, so
// a malformed graph gets the same GraphError, word for word, in either language. The messages
// use the Python DSL's words (GraphNode, GraphEdge(EMIT, ...), check_stop) where the two APIs
// name a thing differently.
#pragma once

#include <cstdint>
#include <set>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "mstar/chunk_policy.hpp"
#include "mstar/graph.hpp"

namespace mstar {

/// A model's graph or walks are malformed; the message names the node, walk or edge to fix.
class GraphError : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

/// Destination of outputs that stream to the caller.
inline const std::string kEmit = "EMIT";

/// One output of a node: a value `name` for node `to` (or kEmit), kept across walks if
/// `persist`, or streamed item by item to `to` in chunks of `policy` if `streaming`. A value
/// edge with an empty `to` is a plain output: any later node of the walk may read it by name.
struct Edge {
  std::string to;
  std::string name;
  bool persist = false;
  bool streaming = false;
  ChunkPolicy policy = ChunkPolicy::fixed(1);
  /// Streaming only: a consumer that runs once per loop iteration (it sits in a loop its
  /// producer is not in) keeps running after the producer's stream is over, with empty windows
  /// (M*'s `continue_after_done`). Without it, reading past the end fails the request.
  bool continue_after_done = false;

  static Edge output(std::string name) { return {"", std::move(name)}; }
  static Edge to_node(std::string to, std::string name) { return {std::move(to), std::move(name)}; }
  static Edge persisted(std::string to, std::string name) {
    return {std::move(to), std::move(name), true};
  }
  static Edge emit(std::string name) { return {kEmit, std::move(name)}; }
  static Edge stream(std::string to, std::string name, ChunkPolicy policy,
                     bool continue_after_done = false) {
    return {std::move(to), std::move(name), false, true, policy, continue_after_done};
  }
};

/// A section of a walk: a node, or Sequential / Parallel / Loop / DynamicLoop / Part over sections.
/// A node name converts implicitly, so `Section::seq({"a", "b"})` reads like the Python DSL.
struct Section {
  SectionKind kind = SectionKind::node;
  std::string node;
  std::vector<Section> children;
  /// Signed so that a bad count from another language (Loop(..., -1)) is reported as written,
  /// not wrapped into a huge one.
  std::int64_t max_iters = 1;
  bool dynamic = false;
  std::string loop_name;                ///< DynamicLoop: the name NodeCall::stop() uses
  std::vector<std::string> outputs;     ///< loop: visible after it with their last value
  std::vector<std::string> accumulated; ///< loop: visible after it as every iteration's value
  std::string part_name;                ///< Part: its name
  std::vector<std::string> part_walks;  ///< Part: its sub-walks' keys, aligned with children

  Section(const char* node_name) : node(node_name) {}        // NOLINT: implicit on purpose
  Section(std::string node_name) : node(std::move(node_name)) {}  // NOLINT
  static Section seq(std::vector<Section> parts);
  static Section par(std::vector<Section> branches);
  static Section loop(Section body, std::int64_t max_iters, std::vector<std::string> outputs = {},
                      std::vector<std::string> accumulated = {});
  static Section dynamic_loop(std::string name, Section body, std::int64_t max_iters,
                              std::vector<std::string> outputs = {},
                              std::vector<std::string> accumulated = {});
  /// A Part (SectionKind::part): sub-walks by key, in the order given (the default order the
  /// model's state machine runs them in).
  static Section part(std::string name, std::vector<std::pair<std::string, Section>> walks);

 private:
  Section() = default;
};

class GraphBuilder {
 public:
  /// Declares a request input: a name every walk may read.
  GraphBuilder& input(std::string name);
  /// Declares a node with everything the graph needs to know of it: what it reads, where its
  /// outputs go, which engine runs it, how many executions one batch may hold, and whether it
  /// wants a call when its stream ends with no chunk marked last (NodeSpec::on_stream_end), and
  /// whether its items are held open rather than run (NodeSpec::untimed).
  GraphBuilder& node(std::string name, std::vector<std::string> inputs, std::vector<Edge> outputs,
                     std::string engine = "default", std::uint32_t max_batch = 1,
                     bool on_stream_end = false, bool untimed = false);
  GraphBuilder& walk(std::string name, Section root);
  /// Says node `name` runs outside this graph's walks (placement: inside a worker's segment,
  /// while the parent's graph keeps the node for its id), so compile() lets it sit in no walk.
  /// Any other node in no walk is refused: it would never run.
  GraphBuilder& elsewhere(std::string name);

  /// Validates the nodes and walks and compiles them into the IR: node ids follow the order the
  /// nodes were declared in, walk ids the order of the walks, name ids the order names are first
  /// met (inputs, then each node's inputs and outputs). Throws GraphError naming the problem.
  [[nodiscard]] GraphSpec compile() const;

  /// What node() records.
  struct Node {
    std::string name;
    std::vector<std::string> inputs;
    std::vector<Edge> outputs;
    std::string engine;
    std::uint32_t max_batch;
    bool on_stream_end;
    bool untimed;
  };

 private:
  std::vector<std::string> inputs_;
  std::vector<Node> nodes_;
  std::vector<std::pair<std::string, Section>> walks_;
  std::set<std::string> elsewhere_;
};

}  // namespace mstar

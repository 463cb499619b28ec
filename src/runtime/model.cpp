// Model: nodes with C++ functions, walks and the next-walk state machine. Its graph structure is
// compiled by mstar::GraphBuilder (src/scheduler/graph_builder.cpp), the compiler the Python DSL
// uses too.
#include <algorithm>

#include "mstar/model.hpp"

namespace mstar {

Model& Model::input(std::string name, TensorSpec spec) {
  for (const auto& [x, s] : inputs_)
    if (x == name) throw GraphError("input '" + name + "' is declared twice; declare each input once");
  inputs_.emplace_back(std::move(name), std::move(spec));
  return *this;
}

Model& Model::node(std::string name, std::vector<std::string> inputs, std::vector<Edge> outputs,
                   NodeFn fn, NodeOptions options) {
  if (!fn) throw GraphError("node '" + name + "' has no function; pass a callable");
  nodes_.push_back({std::move(name), std::move(inputs), std::move(outputs), std::move(fn), nullptr,
                    std::move(options), nullptr});
  return *this;
}

Model& Model::batch_node(std::string name, std::vector<std::string> inputs,
                         std::vector<Edge> outputs, BatchNodeFn fn, NodeOptions options) {
  if (!fn) throw GraphError("node '" + name + "' has no function; pass a callable");
  nodes_.push_back({std::move(name), std::move(inputs), std::move(outputs), nullptr, std::move(fn),
                    std::move(options), nullptr});
  return *this;
}

Model& Model::on_stream_end(const std::string& node, NodeFn fn) {
  for (auto& n : nodes_)
    if (n.name == node) {
      n.stream_end_fn = std::move(fn);
      return *this;
    }
  throw GraphError("on_stream_end: the model has no node '" + node + "'; declare it first");
}

Model& Model::walk(std::string name, Section root) {
  if (initial_walk_.empty()) initial_walk_ = name;
  walks_.emplace_back(std::move(name), std::move(root));
  return *this;
}

Model& Model::initial_walk(std::string name) {
  initial_walk_ = std::move(name);
  return *this;
}

Model& Model::next_walk(NextWalkFn fn) {
  next_walk_ = std::move(fn);
  return *this;
}

Model Model::load(GraphSpec ir, std::vector<std::string> inputs) {
  Model m;
  m.loaded_ = true;
  for (auto& n : inputs) {
    // submit() looks each input up among the IR's values: one not there failed every request
    if (std::find(ir.names.begin(), ir.names.end(), n) == ir.names.end()) {
      std::string all;
      for (const auto& x : ir.names) all += (all.empty() ? "'" : ", '") + x + "'";
      throw GraphError("Model::load: input '" + n + "' is not a value of the IR (its values are [" +
                       all + "]); pass the request inputs the IR was compiled with");
    }
    m.input(std::move(n));
  }
  for (const NodeSpec& n : ir.nodes) {
    NodeDef d;
    d.name = n.name;
    for (NameId x : n.inputs) d.inputs.push_back(ir.names.at(x));
    for (NameId x : n.outputs) d.outputs.push_back(Edge::output(ir.names.at(x)));
    d.options.engine = ir.engines.at(n.engine);
    d.options.max_batch = n.max_batch;
    m.nodes_.push_back(std::move(d));
  }
  if (!ir.walks.empty()) m.initial_walk_ = ir.walks.front().name;
  m.loaded_ir_ = std::move(ir);
  return m;
}

Model& Model::bind(const std::string& node, NodeFn fn) {
  for (auto& n : nodes_)
    if (n.name == node) {
      n.fn = std::move(fn);
      n.batch_fn = nullptr;
      return *this;
    }
  throw GraphError("bind: the graph has no node '" + node + "'");
}

Model& Model::bind_batch(const std::string& node, BatchNodeFn fn) {
  for (auto& n : nodes_)
    if (n.name == node) {
      n.batch_fn = std::move(fn);
      n.fn = nullptr;
      return *this;
    }
  throw GraphError("bind_batch: the graph has no node '" + node + "'");
}

const std::string& Model::first_walk() const {
  if (initial_walk_.empty()) throw GraphError("the model has no walks; add at least one");
  return initial_walk_;
}

GraphSpec Model::compile() const {
  for (const NodeDef& n : nodes_)
    if (!n.fn && !n.batch_fn)
      throw GraphError("node '" + n.name + "' has no function; bind() one before running the model");
  if (loaded_) return loaded_ir_;
  for (const NodeDef& n : nodes_) {
    if (!n.stream_end_fn) continue;
    const bool streamed = std::any_of(nodes_.begin(), nodes_.end(), [&](const NodeDef& p) {
      return std::any_of(p.outputs.begin(), p.outputs.end(),
                         [&](const Edge& e) { return e.streaming && e.to == n.name; });
    });
    if (!streamed)
      throw GraphError("on_stream_end: node '" + n.name + "' reads no stream, so its stream never "
                       "ends; stream an edge into it (Edge::stream) or drop the callback");
  }
  GraphBuilder graph;
  for (const auto& [x, spec] : inputs_) graph.input(x);
  for (const NodeDef& n : nodes_)
    graph.node(n.name, n.inputs, n.outputs, n.options.engine, n.options.max_batch,
               static_cast<bool>(n.stream_end_fn));
  for (const auto& [name, root] : walks_) graph.walk(name, root);
  GraphSpec ir = graph.compile();
  if (std::none_of(ir.walks.begin(), ir.walks.end(),
                   [&](const WalkSpec& w) { return w.name == initial_walk_; }))
    throw GraphError("initial walk '" + initial_walk_ + "' is not a walk of the model");
  return ir;
}

}  // namespace mstar

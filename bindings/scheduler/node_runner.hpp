// mstar_rt._core.NodeRunner: the one batch path for Python nodes: prepare (stream chunks made,
// prepare_inputs) -> forward (split_batch's groups) -> check_stop, and end_stream for a stream's
// end. The Conductor's run_batch calls it from C++ (the in-process Runtime); a placement worker,
// the KV engine's prepare and the Runtime's item-by-item retry call it through Python.
#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>
#include <vector>

#include "mstar/graph.hpp"

namespace mstar::py_bind {

namespace py = pybind11;

/// One work item as the runner reads it, from the Conductor's WorkItem or a Python WorkItem.
struct BatchItem {
  std::uint64_t id = 0;
  std::uint64_t request = 0;
  std::uint32_t iteration = 0;
  py::object inputs;     ///< {input name: value}; a stream consumer's streamed input: its items
  /// One window of a stream the node consumes: items begin..end, new ones from new_begin.
  struct Window {
    std::uint64_t begin = 0, new_begin = 0, end = 0;
    bool last = false;
  };
  bool chunked = false;  ///< windows of the node's streams (one per stream), or its stream end
  bool end = false;      ///< the stream-end item (NodeSubmodule.end_stream), not windows
  std::vector<Window> windows;
  bool stream_end() const { return chunked && end; }
};

/// What one batch made: outputs[k] (and stops[k], when the node has a check_stop) belong to
/// items[order[k]]: the chunks in batch order, then the stream ends.
struct BatchResult {
  std::vector<std::size_t> order;
  py::object outputs;  ///< a list: per item, its {output name: value}
  py::object stops;    ///< None, or a list: per item, the names of the DynamicLoops to stop
  /// (k, why): items[order[k]] failed in check_stop after a forward that ran for every item; its
  /// outputs[k] and stops[k] are placeholders. Its batch-mates' results stand: running their
  /// forward again to find the culprit would repeat it (a KV append, a sampled token).
  std::vector<std::pair<std::size_t, std::string>> failed;
};

/// "TypeError: ...", as the Python engines word an exception a node raised.
std::string exception_text(const std::exception& e);

class NodeRunner {
 public:
  /// `nodes[i]`: node i as the host runs it (mstar_rt.nodes.NodeEntry: submodule, stream_input,
  /// prepares, splits, stops); `requests`: the host's RequestRegistry (by_id, context(rid));
  /// `loop_ids`: DynamicLoop name -> name id, or None for a host that passes names on.
  NodeRunner(const py::sequence& nodes, py::object requests, py::object loop_ids);

  [[nodiscard]] bool runs(NodeId node) const noexcept { return node < nodes_.size(); }

  /// prepare -> forward -> check_stop for the chunks, end_stream for the stream ends. Raises
  /// (a Python error, or std::runtime_error with the node's type named) when a hook does, or
  /// answers for another number of items than it was given; except a check_stop that does so
  /// for a batch, which is asked again item by item, the items it still fails on listed in
  /// `out->failed`.
  void run(NodeId node, const std::vector<BatchItem>& items, BatchResult* out) const;

  /// Each item's inputs as forward() takes them: stream chunks made, prepare_inputs run (with
  /// `call_prepare`).
  py::list prepare(NodeId node, const std::vector<BatchItem>& items,
                   const std::vector<std::size_t>& order, std::size_t count,
                   bool call_prepare) const;

  /// Appends the name ids of the DynamicLoops one item's check_stop answer names.
  void stop_ids(py::handle stop, std::vector<NameId>* out) const;

  /// The loop's name id (a host without loop_ids: the name itself); RuntimeError naming an
  /// unknown loop.
  [[nodiscard]] py::object loop_id(py::handle name) const;

  /// stops as Python takes them: per item, a list of loop ids (or names); None stays None.
  [[nodiscard]] py::object stop_lists(const py::object& stops) const;

 private:
  struct Node {
    py::object submodule;
    std::vector<py::object> stream_inputs;  // the inputs streams' windows arrive under, in order
    bool prepares, splits, stops;
  };

  const Node& node(NodeId id) const;
  py::object work_context(const BatchItem& item) const;
  py::list forward(const Node& n, const py::list& prepared) const;
  /// check_stop's answer for the batch; after it raised, per item (culprits in `failed`).
  py::list stops(const Node& n, const py::list& prepared, const py::object& outputs,
                 bool copy, std::vector<std::pair<std::size_t, std::string>>* failed) const;

  std::vector<Node> nodes_;
  py::dict by_id_;         // the registry's request id -> entry (entry.context)
  py::object requests_;    // the registry: context(rid) when by_id_ misses
  py::object loop_ids_;    // dict, or None
  py::object stream_chunk_;  // mstar_rt.model.StreamChunk
  // Interned once: attr("...") would build the string per call, and an interned name finds a
  // method by identity in the type's dict.
  static py::str interned(const char* name) {
    return py::reinterpret_steal<py::str>(PyUnicode_InternFromString(name));
  }
  struct Names {
    py::str forward = interned("forward"), prepare_inputs = interned("prepare_inputs"),
            check_stop = interned("check_stop"), split_batch = interned("split_batch"),
            end_stream = interned("end_stream"), context = interned("context");
  } names_;
};

void bind_node_runner(py::module_& m);

}  // namespace mstar::py_bind

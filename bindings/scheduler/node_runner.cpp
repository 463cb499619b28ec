// mstar_rt._core.NodeRunner (see node_runner.hpp): the batch path every host of Python nodes
// shares, so a node behaves the same in the Runtime, a placement worker and a KV engine.
#include "scheduler/node_runner.hpp"

#include <pybind11/stl.h>

#include <numeric>
#include <stdexcept>
#include <string>

#include "scheduler/work_context.hpp"

namespace mstar::py_bind {

namespace {

std::string type_name(const py::handle& obj) {
  py::handle type(reinterpret_cast<PyObject*>(Py_TYPE(obj.ptr())));
  return type.attr("__name__").cast<std::string>();
}

/// RuntimeError "<Type>.<hook> returned n results for a batch of m" unless n == m.
void check_count(const py::handle& sub, const char* hook, std::size_t n, std::size_t m) {
  if (n != m)
    throw std::runtime_error(type_name(sub) + "." + hook + " returned " + std::to_string(n) +
                             " results for a batch of " + std::to_string(m));
}

/// `obj` if it is a list, else list(obj); `copy`: a new list either way (the caller appends).
/// `sub` and `hook` name who returned it: a dict, a string or None is refused (list() would make
/// the dict's keys or the string's characters the items).
py::list as_list(py::object obj, const py::handle& sub, const char* hook, bool copy = false) {
  if (!copy && PyList_Check(obj.ptr())) return py::reinterpret_steal<py::list>(obj.release());
  if (obj.is_none() || PyDict_Check(obj.ptr()) || PyUnicode_Check(obj.ptr()))
    throw py::type_error(type_name(sub) + "." + hook + " returned " +
                         (obj.is_none() ? std::string("None") : "a " + type_name(obj)) +
                         "; return a list with one entry per item of the batch");
  PyObject* list = PySequence_List(obj.ptr());
  if (list == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::list>(list);
}

/// obj.name(args...) by vectorcall: neither a bound method nor an argument tuple is made per
/// call, and a method set on the instance still wins, as with getattr (a submodule's methods may
/// be replaced while it serves).
template <typename... Args>
py::object call_method(const py::handle& obj, const py::str& name, const Args&... args) {
  PyObject* argv[] = {obj.ptr(), args.ptr()...};
  PyObject* result = PyObject_VectorcallMethod(name.ptr(), argv, 1 + sizeof...(Args), nullptr);
  if (result == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(result);
}

BatchItem::Window window(const py::handle& w) {
  py::sequence c = py::reinterpret_borrow<py::sequence>(w);
  if (c.size() != 4)
    throw py::value_error("a stream window is (begin, new_begin, end, last), got " +
                          py::repr(w).cast<std::string>());
  return {c[0].cast<std::uint64_t>(), c[1].cast<std::uint64_t>(), c[2].cast<std::uint64_t>(),
          static_cast<bool>(py::bool_(c[3]))};
}

/// A Python WorkItem (id, request, iteration, inputs, chunk | None) as the runner reads it. The
/// chunk is one stream's window (begin, new_begin, end, last), empty for the stream-end item,
/// or (windows, stream_end) for a node reading several streams or an empty window.
BatchItem from_python(const py::handle& item) {
  py::sequence s = py::reinterpret_borrow<py::sequence>(item);
  BatchItem b;
  b.id = s[0].cast<std::uint64_t>();
  b.request = s[1].cast<std::uint64_t>();
  b.iteration = s[2].cast<std::uint32_t>();
  b.inputs = s[3];
  py::object chunk = s[4];
  if (!chunk.is_none()) {
    py::sequence c = py::reinterpret_borrow<py::sequence>(chunk);
    b.chunked = true;
    if (c.size() == 2) {
      for (py::handle w : py::reinterpret_borrow<py::sequence>(c[0])) b.windows.push_back(window(w));
      b.end = static_cast<bool>(py::bool_(c[1]));
    } else {
      b.windows.push_back(window(chunk));
      b.end = b.windows[0].begin == b.windows[0].end;  // a window always holds a new item
    }
  }
  return b;
}

std::vector<BatchItem> from_python(const py::sequence& items) {
  std::vector<BatchItem> out;
  out.reserve(items.size());
  for (py::handle item : items) out.push_back(from_python(item));
  return out;
}

}  // namespace

std::string exception_text(const std::exception& e) {
  if (const auto* p = dynamic_cast<const py::error_already_set*>(&e))
    return py::str(p->type().attr("__name__")).cast<std::string>() + ": " +
           py::str(p->value()).cast<std::string>();
  if (dynamic_cast<const py::type_error*>(&e) != nullptr) return std::string("TypeError: ") + e.what();
  if (dynamic_cast<const py::value_error*>(&e) != nullptr) return std::string("ValueError: ") + e.what();
  return std::string("RuntimeError: ") + e.what();
}

NodeRunner::NodeRunner(const py::sequence& nodes, py::object requests, py::object loop_ids)
    : by_id_(requests.attr("by_id")),
      requests_(std::move(requests)),
      loop_ids_(std::move(loop_ids)),
      // model.py imports _core, so StreamChunk is looked up when a host is built, not at import.
      stream_chunk_(py::module_::import("mstar_rt.model").attr("StreamChunk")) {
  if (!loop_ids_.is_none() && !PyDict_Check(loop_ids_.ptr()))
    throw py::type_error("NodeRunner: loop_ids must be a dict of loop name -> name id, or None");
  for (py::handle e : nodes) {
    // stream_input: None, one input name, or a tuple of them (a node reading several streams)
    py::object names = e.attr("stream_input");
    std::vector<py::object> inputs;
    if (PyTuple_Check(names.ptr()) || PyList_Check(names.ptr())) {
      for (py::handle x : names) inputs.push_back(py::reinterpret_borrow<py::object>(x));
    } else if (!names.is_none()) {
      inputs.push_back(names);
    }
    nodes_.push_back({e.attr("submodule"), std::move(inputs), e.attr("prepares").cast<bool>(),
                      e.attr("splits").cast<bool>(), e.attr("stops").cast<bool>()});
  }
}

const NodeRunner::Node& NodeRunner::node(NodeId id) const {
  if (!runs(id))
    throw py::value_error("NodeRunner: unknown node id " + std::to_string(id) + "; the table has " +
                          std::to_string(nodes_.size()) + " nodes");
  return nodes_[id];
}

/// WorkContext(the request's context, the item's iteration). The request is looked up in the
/// registry's dict; a miss (submit queues work before it registers the request, under the
/// registry's lock) asks the registry, which looks again under the lock.
py::object NodeRunner::work_context(const BatchItem& item) const {
  py::object rid = py::int_(item.request);
  PyObject* entry = PyDict_GetItemWithError(by_id_.ptr(), rid.ptr());
  py::object ctx;
  if (entry != nullptr) {
    ctx = py::handle(entry).attr(names_.context);
  } else {
    if (PyErr_Occurred()) throw py::error_already_set();
    ctx = requests_.attr("context")(rid);
  }
  PyObject* work = new_work_context(ctx.ptr(), static_cast<Py_ssize_t>(item.iteration));
  if (work == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(work);
}

py::list NodeRunner::prepare(NodeId id, const std::vector<BatchItem>& items,
                             const std::vector<std::size_t>& order, std::size_t count,
                             bool call_prepare) const {
  const Node& n = node(id);
  py::list prepared(count);
  for (std::size_t k = 0; k < count; ++k) {
    const BatchItem& item = items[order[k]];
    py::object values = item.inputs;
    if (item.chunked) {
      if (item.windows.size() != n.stream_inputs.size())
        throw py::value_error("a work item of node " + std::to_string(id) + " carries " +
                              std::to_string(item.windows.size()) + " stream windows; the node "
                              "reads " + std::to_string(n.stream_inputs.size()) + " streams");
      py::dict copy = py::reinterpret_steal<py::dict>(PyDict_Copy(values.ptr()));
      if (!copy) throw py::error_already_set();
      for (std::size_t s = 0; s < item.windows.size(); ++s) {
        const BatchItem::Window& w = item.windows[s];
        const py::object& name = n.stream_inputs[s];
        copy[name] = stream_chunk_(values[name], w.begin, w.new_begin, w.end, w.last);
      }
      values = std::move(copy);
    }
    if (call_prepare)
      values = call_method(n.submodule, names_.prepare_inputs, work_context(item), values);
    PyList_SET_ITEM(prepared.ptr(), static_cast<Py_ssize_t>(k), values.release().ptr());
  }
  return prepared;
}

/// forward() over the prepared items, in split_batch's groups when the node splits batches.
py::list NodeRunner::forward(const Node& n, const py::list& prepared) const {
  const py::object& sub = n.submodule;
  if (!n.splits) {
    py::list outputs = as_list(call_method(sub, names_.forward, prepared), sub, "forward");
    check_count(sub, "forward", outputs.size(), prepared.size());
    return outputs;
  }
  // Nones at first: an item that no group holds stays None, which complete refuses.
  py::list outputs(prepared.size());
  for (std::size_t k = 0; k < prepared.size(); ++k) {
    Py_INCREF(Py_None);
    PyList_SET_ITEM(outputs.ptr(), static_cast<Py_ssize_t>(k), Py_None);
  }
  for (py::handle g : call_method(sub, names_.split_batch, prepared)) {
    py::list group = as_list(py::reinterpret_borrow<py::object>(g), sub, "split_batch (a group)");
    py::list batch;
    for (py::handle i : group) batch.append(prepared[i]);
    py::list result = as_list(call_method(sub, names_.forward, batch), sub, "forward");
    check_count(sub, "forward", result.size(), group.size());
    for (std::size_t k = 0; k < group.size(); ++k) outputs[py::object(group[k])] = result[k];
  }
  return outputs;
}

py::list NodeRunner::stops(const Node& n, const py::list& prepared, const py::object& outputs,
                          bool copy,
                          std::vector<std::pair<std::size_t, std::string>>* failed) const {
  const std::size_t count = prepared.size();
  try {
    py::list answer = as_list(call_method(n.submodule, names_.check_stop, prepared, outputs),
                              n.submodule, "check_stop", copy);
    check_count(n.submodule, "check_stop", answer.size(), count);
    return answer;
  } catch (std::exception& e) {  // the Python error is cleared (error_already_set holds it)
    if (count == 1) {  // the culprit is known: asking again would repeat any side effect
      failed->emplace_back(0, exception_text(e));
      py::list placeholder(1);
      placeholder[0] = py::tuple();
      return placeholder;
    }
  }
  py::list answer;
  py::list outs = py::reinterpret_borrow<py::list>(outputs);  // forward's: always a list
  for (std::size_t k = 0; k < count; ++k) {
    try {
      py::list one(1), out(1);
      one[0] = prepared[k];
      out[0] = outs[k];
      py::list got = as_list(call_method(n.submodule, names_.check_stop, one, out), n.submodule,
                             "check_stop");
      check_count(n.submodule, "check_stop", got.size(), 1);
      answer.append(got[0]);
    } catch (std::exception& e) {
      failed->emplace_back(k, exception_text(e));
      answer.append(py::tuple());
    }
  }
  return answer;
}

void NodeRunner::run(NodeId id, const std::vector<BatchItem>& items, BatchResult* out) const {
  const Node& n = node(id);
  std::vector<std::size_t>& order = out->order;
  order.clear();
  out->failed.clear();
  bool chunked = false;
  for (std::size_t i = 0; i < items.size(); ++i) {
    chunked = chunked || items[i].chunked;
    if (!items[i].stream_end()) order.push_back(i);
  }
  const std::size_t chunks = order.size();
  const bool ends = chunks < items.size();
  for (std::size_t i = 0; ends && i < items.size(); ++i)
    if (items[i].stream_end()) order.push_back(i);
  // Not py::list: its default constructor makes an empty list, a wasted allocation per batch.
  py::object outputs, stops = py::none();
  if (chunks > 0) {
    py::list prepared = n.prepares || chunked ? prepare(id, items, order, chunks, n.prepares)
                                              : py::list(chunks);
    if (!(n.prepares || chunked))
      for (std::size_t k = 0; k < chunks; ++k)
        PyList_SET_ITEM(prepared.ptr(), static_cast<Py_ssize_t>(k),
                        py::object(items[order[k]].inputs).release().ptr());
    outputs = forward(n, prepared);
    if (n.stops) stops = this->stops(n, prepared, outputs, ends, &out->failed);
    if (ends) outputs = as_list(outputs, n.submodule, "forward", true);  // not ours to extend
  } else {
    outputs = py::list();
  }
  if (ends) {
    for (std::size_t k = chunks; k < items.size(); ++k) {
      py::reinterpret_borrow<py::list>(outputs).append(
          call_method(n.submodule, names_.end_stream, work_context(items[order[k]])));
      if (!stops.is_none()) py::reinterpret_borrow<py::list>(stops).append(py::list());
    }
  }
  out->outputs = std::move(outputs);
  out->stops = std::move(stops);
}

void NodeRunner::stop_ids(py::handle stop, std::vector<NameId>* out) const {
  if (PyUnicode_Check(stop.ptr()))  // iterated, its characters would be the loop names
    throw py::type_error("check_stop gave the string '" + py::str(stop).cast<std::string>() +
                         "' for an item; give a tuple of loop names, e.g. ('" +
                         py::str(stop).cast<std::string>() + "',), or () to go on");
  for (py::handle name : stop) {
    // The Conductor's completion calls this per item: the dict is read without a new reference;
    // loop_id raises for what it misses.
    PyObject* id = loop_ids_.is_none() ? nullptr
                                       : PyDict_GetItemWithError(loop_ids_.ptr(), name.ptr());
    if (id == nullptr && PyErr_Occurred()) throw py::error_already_set();
    out->push_back(id != nullptr ? py::handle(id).cast<NameId>() : loop_id(name).cast<NameId>());
  }
}

py::object NodeRunner::loop_id(py::handle name) const {
  if (loop_ids_.is_none()) return py::reinterpret_borrow<py::object>(name);
  PyObject* id = PyDict_GetItemWithError(loop_ids_.ptr(), name.ptr());
  if (id == nullptr) {
    if (PyErr_Occurred()) throw py::error_already_set();
    throw std::runtime_error("check_stop named loop '" + py::str(name).cast<std::string>() +
                             "', which is not a DynamicLoop of the model");
  }
  return py::reinterpret_borrow<py::object>(id);
}

py::object NodeRunner::stop_lists(const py::object& stops) const {
  if (stops.is_none()) return stops;
  py::list out;
  for (py::handle stop : stops) {
    py::list ids;
    for (py::handle name : stop) ids.append(loop_id(name));
    out.append(std::move(ids));
  }
  return std::move(out);
}

void bind_node_runner(py::module_& m) {
  py::class_<NodeRunner>(m, "NodeRunner", R"doc(
The one batch path for Python nodes: prepare (stream chunks made into StreamChunk values,
prepare_inputs with a WorkContext) -> forward (in split_batch's groups) -> check_stop, and
end_stream for a stream's end. The Conductor's run_batch runs every node with it; a placement
worker and the KV engine's prepare call it here.)doc")
      .def(py::init<const py::sequence&, py::object, py::object>(), py::arg("nodes"),
           py::arg("requests"), py::arg("loop_ids") = py::none())
      .def("run", [](const NodeRunner& r, NodeId node, const py::sequence& items) {
             const std::vector<BatchItem> batch = from_python(items);
             BatchResult out;
             r.run(node, batch, &out);
             std::vector<bool> bad(out.order.size(), false);
             py::list ids, outputs, stops, failed;
             for (const auto& [k, why] : out.failed) {
               bad[k] = true;
               failed.append(py::make_tuple(batch[out.order[k]].id, why));
             }
             const bool has_stops = !out.stops.is_none();
             for (std::size_t k = 0; k < out.order.size(); ++k) {
               if (bad[k]) continue;
               ids.append(batch[out.order[k]].id);
               outputs.append(py::reinterpret_borrow<py::list>(out.outputs)[k]);
               if (has_stops) stops.append(py::reinterpret_borrow<py::list>(out.stops)[k]);
             }
             return py::make_tuple(ids, outputs,
                                   r.stop_lists(has_stops ? py::object(stops) : py::none()),
                                   failed);
           }, py::arg("node"), py::arg("items"),
           "(item ids, outputs per item, loop ids (or names) to stop per item, or None, failed), "
           "in one order: the chunks, then the stream ends; failed: [(item id, why)] for items "
           "whose check_stop raised after the batch's forward (not in the other three).")
      .def("prepare", [](const NodeRunner& r, NodeId node, const py::sequence& items,
                         bool call_prepare) {
             const std::vector<BatchItem> batch = from_python(items);
             std::vector<std::size_t> order(batch.size());
             std::iota(order.begin(), order.end(), std::size_t{0});
             return r.prepare(node, batch, order, batch.size(), call_prepare);
           }, py::arg("node"), py::arg("items"), py::arg("call_prepare") = true,
           "Each item's inputs as forward() takes them: stream chunks made, prepare_inputs run.")
      .def("loop_id", &NodeRunner::loop_id, py::arg("name"),
           "The DynamicLoop's name id (without loop_ids: the name); RuntimeError if unknown.");
}

}  // namespace mstar::py_bind

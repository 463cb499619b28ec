// Python class Conductor (and NoopEngine, a C++ engine whose nodes do nothing, for measuring the
// Conductor itself). The Python Runtime drives these; see python/mstar_rt/runtime.py.
#include <pybind11/stl.h>

#include <atomic>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <thread>

#include "mstar/conductor.hpp"
#include "waiting.hpp"

namespace mstar::py_bind {

namespace {

using ConductorPtr = std::shared_ptr<Conductor>;

SectionKind parse_kind(const std::string& k) {
  if (k == "node") return SectionKind::node;
  if (k == "sequential") return SectionKind::sequential;
  if (k == "parallel") return SectionKind::parallel;
  if (k == "loop") return SectionKind::loop;
  throw py::value_error("unknown section kind '" + k + "'");
}

/// Builds the IR from the plain lists python/mstar_rt/compiler.py produces.
GraphSpec build_spec(std::vector<std::string> names, std::vector<std::string> engines,
                     const py::list& nodes, const py::list& walks) {
  GraphSpec g;
  g.names = std::move(names);
  g.engines = std::move(engines);
  for (py::handle n : nodes) {
    auto t = n.cast<py::tuple>();
    NodeSpec spec;
    spec.name = t[0].cast<std::string>();
    spec.engine = t[1].cast<EngineId>();
    spec.max_batch = t[2].cast<std::uint32_t>();
    spec.inputs = t[3].cast<std::vector<NameId>>();
    spec.outputs = t[4].cast<std::vector<NameId>>();
    g.nodes.push_back(std::move(spec));
  }
  for (py::handle w : walks) {
    auto d = w.cast<py::dict>();
    WalkSpec walk;
    walk.name = d["name"].cast<std::string>();
    walk.root = d["root"].cast<std::uint32_t>();
    for (py::handle s : d["sections"].cast<py::list>()) {
      auto sd = s.cast<py::dict>();
      SectionSpec sec;
      sec.kind = parse_kind(sd["kind"].cast<std::string>());
      sec.node = sd["node"].cast<NodeId>();
      sec.children = sd["children"].cast<std::vector<std::uint32_t>>();
      sec.max_iters = sd["max_iters"].cast<std::uint32_t>();
      sec.dynamic = sd["dynamic"].cast<bool>();
      sec.loop_name = sd["loop_name"].cast<NameId>();
      sec.outputs = sd["outputs"].cast<std::vector<NameId>>();
      sec.accumulated = sd["accumulated"].cast<std::vector<NameId>>();
      sec.scoped = sd["scoped"].cast<std::vector<NameId>>();
      walk.sections.push_back(std::move(sec));
    }
    walk.emits = d["emits"].cast<std::vector<std::pair<NodeId, NameId>>>();
    walk.persist = d["persist"].cast<std::vector<NameId>>();
    for (py::handle s : d["streams"].cast<py::list>()) {
      auto t = s.cast<py::tuple>();
      StreamSpec st;
      st.producer = t[0].cast<NodeId>();
      st.name = t[1].cast<NameId>();
      st.consumer = t[2].cast<NodeId>();
      st.policy = t[3].cast<ChunkPolicy>();
      st.producer_scope = t[4].cast<std::uint32_t>();
      walk.streams.push_back(std::move(st));
    }
    g.walks.push_back(std::move(walk));
  }
  return g;
}

py::tuple to_python(const Outcome& o) {
  py::list emits, done, failed;
  for (const Emit& e : o.emits) emits.append(py::make_tuple(e.request, e.node, e.name, e.handle));
  for (RequestId r : o.walks_done) done.append(r);
  for (const auto& [r, msg] : o.failed) failed.append(py::make_tuple(r, msg));
  return py::make_tuple(emits, done, failed, py::cast(o.released));
}

/// One batch for Python: (node, walk, [(item, request, iteration, inputs, chunk)]), where each
/// input is a handle or a list of handles and chunk is (begin, new_begin, end, last) or None.
py::object batch_to_python(const std::vector<const WorkItem*>& batch) {
  if (batch.empty()) return py::none();
  py::list items;
  for (const WorkItem* w : batch) {
    py::list inputs;
    for (std::size_t k = 0; k + 1 < w->offsets.size(); ++k) {
      if (w->list_input[k]) {
        py::list l;
        for (std::uint32_t i = w->offsets[k]; i < w->offsets[k + 1]; ++i) l.append(w->handles[i]);
        inputs.append(l);
      } else {
        inputs.append(w->handles[w->offsets[k]]);
      }
    }
    py::object chunk = py::none();
    if (w->windowed)
      chunk = py::make_tuple(w->chunk.begin, w->chunk.new_begin, w->chunk.end, w->chunk.last);
    items.append(py::make_tuple(w->id, w->request, w->iteration, inputs, chunk));
  }
  return py::make_tuple(batch.front()->node, batch.front()->walk, items);
}

/// A C++ engine whose nodes do nothing: completes each item with fresh handles for every output
/// and finishes a request when its walk ends. Measures the Conductor without Python in the loop.
class NoopEngine {
 public:
  NoopEngine(ConductorPtr conductor, EngineId engine, std::size_t max_batch)
      : conductor_(std::move(conductor)), engine_(engine), max_batch_(max_batch),
        thread_([this] { run(); }) {}
  ~NoopEngine() { stop(); }

  void stop() {
    stopping_ = true;
    if (thread_.joinable()) thread_.join();
  }
  std::uint64_t finished() const { return finished_.load(); }
  bool wait_finished(std::uint64_t n, Timeout timeout) {
    std::unique_lock<std::mutex> lock(mu_);
    return cv_.wait_for(lock, timeout, [&] { return finished_.load() >= n; });
  }

 private:
  void run() {
    std::vector<Completion> done;
    Outcome out;
    while (!stopping_) {
      const auto batch = conductor_->next_batch(engine_, max_batch_, std::chrono::milliseconds(20));
      if (batch.empty()) continue;
      done.clear();
      for (const WorkItem* w : batch) {
        Completion c;
        c.item = w->id;
        c.outputs.resize(conductor_->graph().nodes[w->node].outputs.size());
        for (Handle& h : c.outputs) h = next_handle_++;
        done.push_back(std::move(c));
      }
      out = Outcome{};
      conductor_->complete(done, &out);
      std::uint64_t ended = out.failed.size();
      for (RequestId r : out.walks_done) {
        conductor_->finish(r, &out);
        conductor_->forget(r);
        ++ended;
      }
      if (ended) {
        std::lock_guard<std::mutex> lock(mu_);
        finished_ += ended;
        cv_.notify_all();
      }
    }
  }

  ConductorPtr conductor_;
  EngineId engine_;
  std::size_t max_batch_;
  std::atomic<bool> stopping_{false};
  std::atomic<std::uint64_t> finished_{0};
  Handle next_handle_ = Handle{1} << 62;  // far from the Python store's handles
  std::mutex mu_;
  std::condition_variable cv_;
  std::thread thread_;
};

}  // namespace

void bind_conductor(py::module_& m) {
  py::class_<Conductor, ConductorPtr>(m, "Conductor", R"doc(
Runs requests through a compiled walk graph (built by mstar_rt.compile_model). Engine workers
pull batches with next_batch() (GIL released) and report complete(); every call that changes
state returns an outcome (emits, walks_done, failed, released handles).)doc")
      .def(py::init([](std::vector<std::string> names, std::vector<std::string> engines,
                       const py::list& nodes, const py::list& walks) {
             return std::make_shared<Conductor>(build_spec(std::move(names), std::move(engines), nodes, walks));
           }),
           py::arg("names"), py::arg("engines"), py::arg("nodes"), py::arg("walks"))
      .def("submit", [](Conductor& c, WalkId walk, const std::vector<std::pair<NameId, Handle>>& inputs,
                        std::int64_t deadline_ns, std::int32_t priority) {
             std::vector<NamedHandle> in;
             for (auto [n, h] : inputs) in.push_back({n, h});
             Outcome out;
             const RequestId id = c.submit(walk, in, {deadline_ns, priority}, &out);
             return py::make_tuple(id, to_python(out));
           }, py::arg("walk"), py::arg("inputs"), py::arg("deadline_ns") = INT64_MAX,
           py::arg("priority") = 0)
      .def("start_walk", [](Conductor& c, RequestId r, WalkId w) {
             Outcome out;
             c.start_walk(r, w, &out);
             return to_python(out);
           })
      .def("finish", [](Conductor& c, RequestId r) {
             Outcome out;
             c.finish(r, &out);
             return to_python(out);
           })
      .def("cancel", [](Conductor& c, RequestId r) {
             Outcome out;
             const bool ok = c.cancel(r, &out);
             return py::make_tuple(ok, to_python(out));
           })
      .def("fail", [](Conductor& c, RequestId r, const std::string& msg) {
             Outcome out;
             c.fail(r, msg, &out);
             return to_python(out);
           })
      .def("next_batch", [](Conductor& c, EngineId e, std::size_t max_batch, double timeout_s) {
             std::vector<const WorkItem*> batch;
             {
               py::gil_scoped_release nogil;
               batch = c.next_batch(e, max_batch, to_timeout(timeout_s));
             }
             return batch_to_python(batch);
           }, py::arg("engine"), py::arg("max_batch"), py::arg("timeout"))
      .def("complete", [](Conductor& c, const py::list& done) {
             std::vector<Completion> cs;
             cs.reserve(done.size());
             for (py::handle d : done) {
               auto t = d.cast<py::tuple>();
               Completion comp;
               comp.item = t[0].cast<std::uint64_t>();
               comp.outputs = t[1].cast<std::vector<Handle>>();
               comp.stop_loops = t[2].cast<std::vector<NameId>>();
               cs.push_back(std::move(comp));
             }
             Outcome out;
             c.complete(cs, &out);
             return to_python(out);
           })
      .def("fail_items", [](Conductor& c, const std::vector<std::uint64_t>& ids, const std::string& msg) {
             Outcome out;
             c.fail_items(ids, msg, &out);
             return to_python(out);
           })
      .def("shutdown", &Conductor::shutdown)
      .def("values", [](Conductor& c, RequestId r) {
             std::vector<std::pair<NameId, Handle>> v;
             for (const NamedHandle& nh : c.values(r)) v.emplace_back(nh.name, nh.handle);
             return v;
           })
      .def("timeline", [](Conductor& c, RequestId r) {
             py::list out;
             for (const TimelineEvent& e : c.timeline(r))
               out.append(py::make_tuple(e.node, e.walk, e.iteration, e.batch_size, e.queued_ns,
                                         e.started_ns, e.finished_ns));
             return out;
           })
      .def("forget", &Conductor::forget)
      .def_property_readonly("live_requests", &Conductor::live_requests)
      .def_property_readonly("live_handles", &Conductor::live_handles)
      .def_property_readonly("queued_items", &Conductor::queued_items)
      .def_property_readonly("inflight_items", &Conductor::inflight_items);

  py::class_<NoopEngine>(m, "NoopEngine", "A C++ engine whose nodes do nothing (for benchmarks).")
      .def(py::init<ConductorPtr, EngineId, std::size_t>(), py::arg("conductor"), py::arg("engine"),
           py::arg("max_batch"))
      .def("stop", &NoopEngine::stop, py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("finished", &NoopEngine::finished)
      .def("wait_finished", [](NoopEngine& e, std::uint64_t n, double timeout_s) {
             py::gil_scoped_release nogil;
             return e.wait_finished(n, to_timeout(timeout_s));
           });
}

}  // namespace mstar::py_bind

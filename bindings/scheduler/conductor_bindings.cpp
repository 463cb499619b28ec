// Python class Conductor: the C++ Conductor plus the store of the Python values its handles stand
// for. The Python Runtime drives it; see python/mstar_rt/runtime.py.
#include <pybind11/stl.h>

#include <algorithm>
#include <chrono>
#include <memory>
#include <mutex>

#include "mstar/conductor.hpp"
#include "core/waiting.hpp"
#include "scheduler/node_runner.hpp"
#include "scheduler/records.hpp"

namespace mstar::py_bind {

namespace {

using ConductorPtr = std::shared_ptr<Conductor>;

/// The Python face of a Conductor: the C++ Conductor routes handles; this wrapper holds the
/// values behind them (the tensor store) and converts at the boundary, so a batch crosses into
/// Python as values, not handles, and no per-item Python bookkeeping is needed.
class PyConductor {
 public:
  explicit PyConductor(GraphSpec g) : c_(std::make_shared<Conductor>(std::move(g))) {
    for (const std::string& n : c_->graph().names) names_.push_back(py::str(n));
    for (const NodeSpec& n : c_->graph().nodes) {
      std::vector<py::str> outs;
      for (NameId o : n.outputs) outs.push_back(names_[o]);
      outputs_.push_back(std::move(outs));
    }
  }

  const ConductorPtr& conductor() const { return c_; }

  // The store: handle h is slot h - 1; freed slots are reused (the Conductor never sees a handle
  // again once it has released it), so storing a value allocates nothing once warm.
  Handle put(py::handle value) {
    std::size_t slot;
    if (free_.empty()) {
      slot = store_.size();
      store_.emplace_back();
    } else {
      slot = free_.back();
      free_.pop_back();
    }
    store_[slot] = py::reinterpret_borrow<py::object>(value);
    ++stored_;
    return static_cast<Handle>(slot) + 1;
  }
  void drop(Handle h) {
    const std::size_t slot = static_cast<std::size_t>(h - 1);
    if (h == 0 || slot >= store_.size() || !store_[slot]) return;
    store_[slot] = py::object();
    free_.push_back(slot);
    --stored_;
  }

  /// Outcome(emits [(request, name, value)], walks_done [request], failed [(request, message)],
  /// expired [(request, node, refused, seconds late)])
  py::tuple outcome(const Outcome& o) {
    if (o.emits.empty() && o.walks_done.empty() && o.failed.empty() && o.part_choices.empty()) {
      for (Handle h : o.released) drop(h);
      return empty_outcome_;  // most completions change nothing the caller acts on
    }
    py::list emits, done, failed, expired, parts;
    for (const Emit& e : o.emits) emits.append(py::make_tuple(e.request, names_[e.name], value(e.handle)));
    for (RequestId r : o.walks_done) done.append(r);
    for (const auto& [r, msg] : o.failed) failed.append(py::make_tuple(r, msg));
    for (const Expired& x : o.expired)
      expired.append(py::make_tuple(x.request, c_->graph().nodes[x.node].name, x.refused,
                                    static_cast<double>(x.late_ns) * 1e-9));
    for (const PartChoice& p : o.part_choices)
      parts.append(py::make_tuple(p.request, p.section, names_[p.part], p.finished));
    for (Handle h : o.released) drop(h);  // after the emits took their values
    return py::reinterpret_borrow<py::tuple>(new_outcome(emits, done, failed, expired, parts));
  }

  /// Fails the fail_late requests whose queued work is past its deadline; their outcome.
  py::tuple expire() {
    Outcome out;
    c_->expire(&out);
    return outcome(out);
  }

  /// `reporter(outcome)` gets what the workers' own expire calls find (next_batch and run_batch
  /// clear late work before taking a batch); None turns that off.
  void set_reporter(py::object reporter) { reporter_ = std::move(reporter); }

  py::tuple submit(WalkId walk, const py::dict& inputs, std::int64_t deadline_ns,
                   std::int32_t priority, bool fail_late) {
    std::vector<NamedHandle> in;
    for (auto [k, v] : inputs) in.push_back({k.cast<NameId>(), put(v)});
    Outcome out;
    RequestId id;
    try {
      id = c_->submit(walk, in, {deadline_ns, priority, fail_late}, &out);
    } catch (...) {
      for (const NamedHandle& nh : in) drop(nh.handle);
      throw;
    }
    return py::make_tuple(id, outcome(out));
  }

  /// (node, walk, [(item, request, iteration, {input: value | [values]}, chunk | None)])
  py::object next_batch(EngineId engine, std::size_t max_batch, double timeout_s) {
    // One vector per worker thread, reused: workers wait here concurrently without the GIL.
    static thread_local std::vector<const WorkItem*> batch;
    wait_batch(engine, max_batch, timeout_s, &batch);
    if (batch.empty()) return py::none();
    return batch_tuple(batch);
  }

  /// Hands run_batch the node runner (mstar_rt._core.NodeRunner: the batch path of every Python
  /// node) that runs the batches of the nodes it knows; None: every batch goes to the caller.
  /// With `finish_walks` (a model whose requests end after one walk), run_batch also finishes
  /// the requests whose walk ended, sparing a round trip through Python per request.
  void bind_nodes(py::object runner, bool finish_walks) {
    runner_ = runner.is_none() ? nullptr : &runner.cast<NodeRunner&>();
    runner_object_ = std::move(runner);  // keeps runner_ alive
    finish_walks_ = finish_walks;
  }

  /// One turn of a stateless worker: (batch, outcome, finished). Waits for a batch; if the bound
  /// runner knows its node, runs it (NodeRunner.run: prepare, forward, check_stop, stream ends)
  /// and completes it here: returns (None, outcome | None, finished | None), finished being what
  /// finish_walks ended. Otherwise returns ((node, walk, items), None, None), as next_batch
  /// would, for the caller to run; or ((node, walk, items), True, None) when a hook raised or
  /// returned something malformed, for the caller to isolate the culprit item by item. All None
  /// when nothing came. The batch crosses into Python once, not once per bookkeeping step.
  py::tuple run_batch(EngineId engine, std::size_t max_batch, double timeout_s) {
    Turn& t = turn();  // one thread-local lookup per turn
    wait_batch(engine, max_batch, timeout_s, &t.batch);
    if (t.batch.empty()) return py::make_tuple(py::none(), py::none(), py::none());
    const NodeId node = t.batch.front()->node;
    if (runner_ == nullptr || !runner_->runs(node)) return hand_back(t.batch, false);
    struct Drop {
      Turn& t;
      ~Drop() { t.drop(); }
    } drop{t};
    Outcome out;
    try {
      t.items.clear();
      for (const WorkItem* w : t.batch) t.items.push_back(batch_item(*w));
      runner_->run(node, t.items, &t.result);
      t.ids.clear();
      for (std::size_t i : t.result.order) t.ids.push_back(t.items[i].id);
      if (t.result.failed.empty()) {
        complete_into(node, t.ids, py::reinterpret_borrow<py::list>(t.result.outputs),
                      t.result.stops, true, &out);
      } else {
        complete_except(node, t.ids, t.result, &out);
      }
    } catch (std::exception& e) {  // py::error_already_set included; the Python error is cleared
      return hand_back(t.batch, true, t.batch.size() == 1 ? exception_text(e) : std::string());
    }
    // Completed: from here on the items are gone, and their outcome must reach the caller.
    py::object finished = finish_walks(&out);
    py::tuple o = outcome(out);
    return py::make_tuple(py::none(), o.is(empty_outcome_) ? py::none() : py::object(o),
                          finished);
  }

  /// outputs[i] is item i's {output name: value}; stops[i] its DynamicLoop name ids (or None).
  /// `failed`: (item id, why) of items that failed after their batch's forward (NodeRunner.run's
  /// fourth answer), failed in the same outcome.
  py::tuple complete(NodeId node, const std::vector<std::uint64_t>& ids, const py::list& outputs,
                     const py::object& stops,
                     const std::vector<std::pair<std::uint64_t, std::string>>& failed) {
    Outcome out;
    complete_into(node, ids, outputs, stops, false, &out);
    for (const auto& [id, why] : failed) c_->fail_items({id}, why, &out, false);
    return outcome(out);
  }

  /// The items of `r` that did not fail completed, those in r.failed failed (a check_stop that
  /// raised for them alone): the rest of the batch keeps the forward it ran.
  void complete_except(NodeId node, const std::vector<std::uint64_t>& ids, const BatchResult& r,
                       Outcome* out) {
    std::vector<bool> bad(ids.size(), false);
    for (const auto& f : r.failed) bad[f.first] = true;
    std::vector<std::uint64_t> keep;
    py::list outputs, stops;
    for (std::size_t k = 0; k < ids.size(); ++k) {
      if (bad[k]) continue;
      keep.push_back(ids[k]);
      outputs.append(py::reinterpret_borrow<py::list>(r.outputs)[k]);
      if (!r.stops.is_none()) stops.append(py::reinterpret_borrow<py::list>(r.stops)[k]);
    }
    complete_into(node, keep, outputs, r.stops.is_none() ? py::object(py::none()) : stops, true,
                  out);
    for (const auto& [k, why] : r.failed) c_->fail_items({ids[k]}, why, out, false);
  }

  /// complete() up to the Conductor's Outcome. With stop_names, stops[i] holds loop names
  /// (mapped by the bound runner).
  void complete_into(NodeId node, const std::vector<std::uint64_t>& ids, const py::list& outputs,
                     const py::object& stops, bool stop_names, Outcome* out) {
    if (node >= outputs_.size()) throw py::value_error("complete: unknown node id");
    if (outputs.size() != ids.size())
      throw py::value_error("complete: " + std::to_string(outputs.size()) + " results for " +
                            std::to_string(ids.size()) + " items");
    if (stop_names && !stops.is_none() &&
        static_cast<std::size_t>(PyList_GET_SIZE(stops.ptr())) != ids.size())
      throw py::value_error("complete: stops for another number of items than the batch has");
    const auto& names = outputs_[node];
    // Reused per thread: completing a batch allocates nothing here once warm.
    static thread_local std::vector<Completion> done;
    static thread_local std::vector<Handle> created;
    done.resize(ids.size());
    created.clear();
    try {
      for (std::size_t i = 0; i < ids.size(); ++i) {
        done[i].item = ids[i];
        done[i].outputs.clear();
        done[i].stop_loops.clear();
        py::handle out = PyList_GET_ITEM(outputs.ptr(), static_cast<Py_ssize_t>(i));
        if (!PyDict_Check(out.ptr()))
          throw py::type_error("node '" + c_->graph().nodes[node].name + "' returned a " +
                               std::string(Py_TYPE(out.ptr())->tp_name) +
                               " for an item; return one dict of outputs per item");
        std::size_t found = 0;
        done[i].outputs.resize(names.size(), 0);
        for (std::size_t k = 0; k < names.size(); ++k) {
          PyObject* v = PyDict_GetItemWithError(out.ptr(), names[k].ptr());
          if (v == nullptr) {
            if (PyErr_Occurred()) throw py::error_already_set();
            continue;
          }
          ++found;
          done[i].outputs[k] = put(v);
          created.push_back(done[i].outputs[k]);
        }
        if (found != static_cast<std::size_t>(PyDict_Size(out.ptr())))
          throw py::value_error("node '" + c_->graph().nodes[node].name + "' returned outputs " +
                                py::str(py::reinterpret_borrow<py::dict>(out).attr("keys")()).cast<std::string>() +
                                " but declares " + py::str(py::cast(names)).cast<std::string>());
        if (stop_names) {
          if (!stops.is_none())
            runner_->stop_ids(PyList_GET_ITEM(stops.ptr(), static_cast<Py_ssize_t>(i)),
                              &done[i].stop_loops);
        } else if (!stops.is_none()) {
          done[i].stop_loops = stops.cast<py::list>()[i].cast<std::vector<NameId>>();
        }
      }
    } catch (...) {
      for (Handle h : created) drop(h);
      throw;
    }
    c_->complete(done, out);
  }

  /// One item of node `producer`'s stream `name` for `request` (Conductor::push_stream):
  /// (whether a stream took it, the outcome).
  py::tuple push_stream(RequestId request, NodeId producer, NameId name, py::handle value) {
    Outcome out;
    const Handle h = put(value);
    bool taken = false;
    try {
      taken = c_->push_stream(request, producer, name, h, &out);
    } catch (...) {
      drop(h);
      throw;
    }
    return py::make_tuple(taken, outcome(out));
  }

  py::tuple fail_items(const std::vector<std::uint64_t>& ids, const std::string& msg,
                       bool named = false) {
    Outcome out;
    c_->fail_items(ids, msg, &out, named);
    return outcome(out);
  }
  py::tuple start_walk(RequestId r, WalkId w) {
    Outcome out;
    c_->start_walk(r, w, &out);  // false: cancelled meanwhile, and the outcome is empty
    return outcome(out);
  }
  /// (chosen, outcome): starts sub-walk `child` of the Part at `section`, or ends it (-1);
  /// chosen is False when the request ended meanwhile.
  py::tuple choose_part(RequestId r, std::uint32_t section, int child) {
    Outcome out;
    const bool ok = c_->choose_part(r, section, child, &out);
    return py::make_tuple(ok, outcome(out));
  }
  py::tuple finish(RequestId r) {
    Outcome out;
    const bool ended = c_->finish(r, &out);
    return py::make_tuple(ended, outcome(out));
  }
  py::tuple cancel(RequestId r) {
    Outcome out;
    const bool ok = c_->cancel(r, &out);
    return py::make_tuple(ok, outcome(out));
  }
  py::tuple fail(RequestId r, const std::string& msg) {
    Outcome out;
    c_->fail(r, msg, &out);
    return outcome(out);
  }
  py::dict values(RequestId r) {
    py::dict d;
    for (const NamedHandle& nh : c_->values(r)) d[names_[nh.name]] = value(nh.handle);
    return d;
  }
  std::size_t stored() const { return stored_; }

 private:
  py::object value(Handle h) const {
    const std::size_t slot = static_cast<std::size_t>(h - 1);
    if (h == 0 || slot >= store_.size() || !store_[slot])
      throw std::logic_error("tensor store: handle " + std::to_string(h) + " is gone");
    return store_[slot];
  }

  // Waits without the GIL, takes the batch with it: whatever was queued while this thread
  // waited for the GIL (a client submitting a burst holds it) joins the batch.
  void wait_batch(EngineId engine, std::size_t max_batch, double timeout_s,
                  std::vector<const WorkItem*>* batch) {
    batch->clear();
    bool ready;
    if (timeout_s <= 0) {
      // A look, not a wait: keep the GIL, so that a worker woken meanwhile cannot take the GIL
      // and the batch from under the caller (the placed runtime sends a request's first batch
      // from the submitting thread). The Conductor's lock is never held by a thread that waits
      // for the GIL.
      ready = c_->wait_ready(engine, std::chrono::nanoseconds(0));
    } else {
      py::gil_scoped_release nogil;
      ready = c_->wait_ready(engine, to_timeout(timeout_s));
    }
    if (!ready) return;
    if (!reporter_.is_none()) {  // never take work that would start past a kept deadline
      Outcome late;
      c_->expire(&late);
      if (!late.failed.empty() || !late.released.empty()) {
        try {
          reporter_(outcome(late));
        } catch (py::error_already_set& e) {  // the reporter must not take the worker down
          e.discard_as_unraisable("mstar_rt Conductor reporter");
        }
      }
    }
    c_->next_batch(engine, max_batch, std::chrono::nanoseconds(0), batch);
  }

  /// Under bind_nodes' finish_walks: finishes the requests of out->walks_done (into `out`) and
  /// returns [(request, timeline bytes, emits made)] for them, having forgotten them; else None.
  py::object finish_walks(Outcome* out) {
    if (!finish_walks_ || out->walks_done.empty()) return py::none();
    py::list finished;
    static thread_local std::vector<RequestId> ended;
    ended.swap(out->walks_done);
    out->walks_done.clear();
    for (RequestId r : ended) {
      const std::uint64_t emitted = c_->emitted(r);  // final: the walk is over
      if (c_->finish(r, out)) finished.append(py::make_tuple(r, take_timeline(r), emitted));
    }
    ended.clear();
    return finished;
  }

 public:
  /// timeline() then forget(), as the raw records (TimelineEvent, little-endian "<IIIIqqq"): one
  /// copy, decoded only if someone asks for the stats; a tuple per event would cost one per node
  /// execution.
  py::bytes take_timeline(RequestId r) {
    static_assert(sizeof(TimelineEvent) == 40, "TimelineEvent layout changed");
    const std::vector<TimelineEvent> t = c_->timeline(r);
    c_->forget(r);
    return py::bytes(reinterpret_cast<const char*>(t.data()), t.size() * sizeof(TimelineEvent));
  }

 private:
  /// run_batch's answer for a batch the caller must run ((node, walk, items), failed, None); if
  /// even that cannot be built, the items fail here so that no request waits for them forever.
  /// `failed`: the node already raised on this batch; `error` (a batch of one) says how, so the
  /// caller fails it rather than running it again to find the culprit.
  py::tuple hand_back(const std::vector<const WorkItem*>& batch, bool failed,
                      const std::string& error = {}) {
    try {
      py::object why = py::none();
      if (failed) why = error.empty() ? py::object(py::bool_(true)) : py::object(py::str(error));
      return py::make_tuple(batch_tuple(batch), why, py::none());
    } catch (std::exception& e) {
      std::vector<std::uint64_t> ids;
      for (const WorkItem* w : batch) ids.push_back(w->id);
      return py::make_tuple(py::none(), fail_items(ids, std::string("runtime error: ") + e.what()),
                            py::none());
    }
  }

  /// What a worker thread reuses from one run_batch turn to the next, so that a turn allocates
  /// nothing once warm. items and result hold Python values only during a turn (dropped on
  /// every way out, with the GIL held): a thread_local's destructor runs at thread exit, without.
  struct Turn {
    std::vector<const WorkItem*> batch;
    std::vector<std::uint64_t> ids;
    std::vector<BatchItem> items;
    BatchResult result;
    void drop() {
      items.clear();
      result.outputs = py::object();
      result.stops = py::object();
    }
  };
  static Turn& turn() {
    static thread_local Turn t;
    return t;
  }

  /// A Conductor WorkItem as the node runner reads it; a stream end is an empty chunk.
  BatchItem batch_item(const WorkItem& w) const {
    BatchItem b;
    b.id = w.id;
    b.request = w.request;
    b.iteration = w.iteration;
    b.inputs = input_dict(w);
    b.chunked = w.chunked || w.stream_end;
    b.end = w.stream_end;
    for (const Chunk& c : w.chunks) b.windows.push_back({c.begin, c.new_begin, c.end, c.last});
    return b;
  }

  py::dict input_dict(const WorkItem& w) const {
    const NodeSpec& node = c_->graph().nodes[w.node];
    py::dict inputs;
    for (std::size_t k = 0; k < node.inputs.size(); ++k) {
      const py::str& name = names_[node.inputs[k]];
      if (w.list_input[k]) {
        py::list l;
        for (std::uint32_t i = w.offsets[k]; i < w.offsets[k + 1]; ++i) l.append(value(w.handles[i]));
        inputs[name] = l;
      } else {
        inputs[name] = value(w.handles[w.offsets[k]]);
      }
    }
    return inputs;
  }

  py::tuple batch_tuple(const std::vector<const WorkItem*>& batch) const {
    py::list items;
    for (const WorkItem* w : batch) {
      py::object chunk = py::none();
      if (w->chunks.size() == 1 && (w->stream_end || w->chunk.end > w->chunk.begin)) {
        // one stream: its window, or the stream-end item as an empty one (BatchItem)
        chunk = py::make_tuple(w->chunk.begin, w->chunk.new_begin, w->chunk.end, w->chunk.last);
      } else if (w->chunked || w->stream_end) {
        py::tuple windows(w->chunks.size());
        for (std::size_t k = 0; k < w->chunks.size(); ++k) {
          const Chunk& c = w->chunks[k];
          windows[k] = py::make_tuple(c.begin, c.new_begin, c.end, c.last);
        }
        chunk = py::make_tuple(windows, w->stream_end);
      }
      items.append(new_work_item(w->id, w->request, w->iteration, input_dict(*w), chunk));
    }
    return py::make_tuple(batch.front()->node, batch.front()->walk, items);
  }

  ConductorPtr c_;
  const NodeRunner* runner_ = nullptr;  // bind_nodes
  py::object runner_object_ = py::none();
  bool finish_walks_ = false;
  py::tuple empty_outcome_ = py::reinterpret_borrow<py::tuple>(
      new_outcome(py::tuple(), py::tuple(), py::tuple(), py::tuple(), py::tuple()));
  py::object reporter_ = py::none();
  std::vector<py::str> names_;
  std::vector<std::vector<py::str>> outputs_;
  std::vector<py::object> store_;  // touched only with the GIL held
  std::vector<std::size_t> free_;
  std::size_t stored_ = 0;
};

}  // namespace

void bind_conductor(py::module_& m) {
  py::class_<PyConductor>(m, "Conductor", R"doc(
Runs requests through a compiled walk graph (see mstar_rt.compile_model) and holds the values
its handles stand for. Engine workers pull batches with next_batch() (GIL released while
waiting) and report complete(); each call that changes state returns its outcome
(emits [(request, name, value)], walks_done [request], failed [(request, message)], expired
[(request, node, refused, seconds late)]).)doc")
      .def(py::init<GraphSpec>(), py::arg("graph"))
      .def("submit", &PyConductor::submit, py::arg("walk"), py::arg("inputs"),
           py::arg("deadline_ns") = INT64_MAX, py::arg("priority") = 0,
           py::arg("fail_late") = false)
      .def("expire", &PyConductor::expire)
      .def("set_reporter", &PyConductor::set_reporter, py::arg("reporter"))
      .def("start_walk", &PyConductor::start_walk)
      .def("choose_part", &PyConductor::choose_part, py::arg("request"), py::arg("section"),
           py::arg("child"))
      .def("finish", &PyConductor::finish)
      .def("cancel", &PyConductor::cancel)
      .def("fail", &PyConductor::fail)
      .def("next_batch", &PyConductor::next_batch, py::arg("engine"), py::arg("max_batch"),
           py::arg("timeout"))
      .def("bind_nodes", &PyConductor::bind_nodes, py::arg("runner"), py::arg("finish_walks"))
      .def("run_batch", &PyConductor::run_batch, py::arg("engine"), py::arg("max_batch"),
           py::arg("timeout"))
      .def("complete", [](PyConductor& c, NodeId node, const std::vector<std::uint64_t>& ids,
                          const py::list& outputs, const py::object& stops,
                          const std::vector<std::pair<std::uint64_t, std::string>>& failed) {
             return c.complete(node, ids, outputs, stops, failed);
           }, py::arg("node"), py::arg("items"), py::arg("outputs"), py::arg("stops") = py::none(),
           py::arg("failed") = std::vector<std::pair<std::uint64_t, std::string>>())
      .def("push_stream", &PyConductor::push_stream, py::arg("request"), py::arg("producer"),
           py::arg("name"), py::arg("value"),
           "Appends value to the stream name (id) of node producer (id), as one more execution "
           "of it would (placement: a stream leaving a worker's segment); (whether a stream "
           "took it, the outcome): False for a request not running or a stream ended.")
      .def("fail_items", &PyConductor::fail_items, py::arg("items"), py::arg("message"),
           py::arg("named") = false,
           "Fails the items' requests with the message, after \"node '<node>' in walk '<walk>' "
           "failed: \" unless named (the message says where).")
      .def("running", [](PyConductor& c) {
             const std::int64_t now = std::chrono::duration_cast<std::chrono::nanoseconds>(
                 std::chrono::steady_clock::now().time_since_epoch()).count();
             py::list out;
             for (const auto& [node, since] : c.conductor()->running())
               out.append(py::make_tuple(node, std::max<double>(0.0, (now - since) * 1e-9)));
             return out;
           }, "[(node id, seconds since its batch was taken)] for the batches not yet reported.")
      .def("emitted", [](PyConductor& c, RequestId r) { return c.conductor()->emitted(r); },
           py::arg("request"), "How many outputs the request has EMITted so far.")
      .def("set_spin", [](PyConductor& c, double seconds) {
             c.conductor()->set_spin(std::chrono::duration_cast<std::chrono::nanoseconds>(
                 std::chrono::duration<double>(seconds)));
           }, py::arg("seconds"), "How long an idle worker spins before it sleeps (0: never).")
      .def("set_submitter_takes", [](PyConductor& c, EngineId engine, bool takes) {
             c.conductor()->set_submitter_takes(engine, takes);
           }, py::arg("engine"), py::arg("takes"),
           "submit() leaves this engine's worker asleep: the submitting thread takes the batch.")
      .def("take_inline", [](PyConductor& c, bool on) { c.conductor()->take_inline(on); },
           py::arg("on"), "This thread alone takes the work of set_submitter_takes engines.")
      .def("wake", [](PyConductor& c, EngineId engine) { c.conductor()->wake(engine); },
           py::arg("engine"), "Wakes a worker of the engine if work waits there.")
      .def("shutdown", [](PyConductor& c) { c.conductor()->shutdown(); })
      .def("values", &PyConductor::values)
      .def("timeline", [](PyConductor& c, RequestId r) {
             py::list out;
             for (const TimelineEvent& e : c.conductor()->timeline(r))
               out.append(py::make_tuple(e.node, e.walk, e.iteration, e.batch_size, e.queued_ns,
                                         e.started_ns, e.finished_ns));
             return out;
           })
      .def("take_timeline", &PyConductor::take_timeline)
      .def("forget", [](PyConductor& c, RequestId r) { c.conductor()->forget(r); })
      .def_property_readonly("live_requests", [](PyConductor& c) { return c.conductor()->live_requests(); })
      .def_property_readonly("live_handles", [](PyConductor& c) { return c.conductor()->live_handles(); })
      .def_property_readonly("queued_items", [](PyConductor& c) { return c.conductor()->queued_items(); })
      .def_property_readonly("inflight_items", [](PyConductor& c) { return c.conductor()->inflight_items(); })
      .def_property_readonly("stored", &PyConductor::stored);
}

}  // namespace mstar::py_bind

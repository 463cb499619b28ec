// Runtime: the Conductor plus a tensor store, engine worker threads running C++ nodes, and
// request handles (see mstar/runtime.hpp).
//
// Locking: `mu` serialises every Conductor call that can emit or release with the handling of
// its Outcome (the Conductor's contract: read an emitted value before anything frees it), and
// guards the store and the request table. Node callables, the state machine and output
// callbacks run without it, so they may submit or cancel.
#include <algorithm>
#include <atomic>
#include <climits>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <stdexcept>
#include <thread>
#include <unordered_map>

#include "mstar/runtime.hpp"
#include "runtime/request.hpp"

namespace mstar {

// ---- NodeCall --------------------------------------------------------------------------------

struct NodeCall::Data {
  RequestId request = 0;
  const Model::NodeDef* def = nullptr;
  const std::string* walk = nullptr;
  const std::vector<std::string>* output_names = nullptr;
  const std::map<std::string, NameId>* name_ids = nullptr;
  std::uint32_t iteration = 0;
  std::vector<std::vector<Tensor>> inputs;  // aligned with def->inputs
  std::vector<std::uint8_t> is_list;
  bool chunked = false;
  bool stream_end = false;
  Chunk chunk;
  std::vector<Tensor> outputs;  // aligned with *output_names
  std::vector<NameId> stops;

  std::size_t input_index(const std::string& name) const {
    for (std::size_t k = 0; k < def->inputs.size(); ++k)
      if (def->inputs[k] == name) return k;
    std::string have;
    for (const auto& n : def->inputs) have += (have.empty() ? "'" : ", '") + n + "'";
    throw std::invalid_argument("node '" + def->name + "' has no input '" + name +
                                "'; its inputs are " + (have.empty() ? "none" : have));
  }
};

RequestId NodeCall::request() const noexcept { return d_->request; }
const std::string& NodeCall::node() const noexcept { return d_->def->name; }
const std::string& NodeCall::walk() const noexcept { return *d_->walk; }
std::uint32_t NodeCall::iteration() const noexcept { return d_->iteration; }
const Chunk* NodeCall::chunk() const noexcept { return d_->chunked ? &d_->chunk : nullptr; }
bool NodeCall::stream_ended() const noexcept { return d_->stream_end; }

const Tensor& NodeCall::input(const std::string& name) const {
  const std::size_t k = d_->input_index(name);
  if (d_->is_list[k] || d_->inputs[k].size() != 1)
    throw std::invalid_argument("node '" + d_->def->name + "' input '" + name + "' holds " +
                                std::to_string(d_->inputs[k].size()) +
                                " values (a loop accumulation or stream chunk); read it with list()");
  return d_->inputs[k][0];
}

const std::vector<Tensor>& NodeCall::list(const std::string& name) const {
  return d_->inputs[d_->input_index(name)];
}

void NodeCall::output(const std::string& name, Tensor value) {
  const auto& names = *d_->output_names;
  for (std::size_t k = 0; k < names.size(); ++k)
    if (names[k] == name) {
      d_->outputs[k] = std::move(value);
      return;
    }
  std::string have;
  for (const auto& n : names) have += (have.empty() ? "'" : ", '") + n + "'";
  throw std::invalid_argument("node '" + d_->def->name + "' has no output '" + name +
                              "'; its outputs are " + (have.empty() ? "none" : have));
}

void NodeCall::stop(const std::string& loop_name) {
  auto it = d_->name_ids->find(loop_name);
  if (it == d_->name_ids->end())
    throw std::invalid_argument("node '" + d_->def->name + "' stopped loop '" + loop_name +
                                "', which is not a DynamicLoop of the model");
  d_->stops.push_back(it->second);
}

// ---- Runtime::Impl ---------------------------------------------------------------------------

namespace {
// The runtime (its Impl) whose worker runs on this thread, if any: close() from inside a node.
thread_local const void* serving_runtime = nullptr;
// A Runtime destroyed on one of its own workers (from on_output): that thread is still inside
// the Impl's code, so it keeps the Impl alive until it exits.
thread_local std::shared_ptr<void> outlive_until_exit;
}  // namespace

struct Runtime::Impl : std::enable_shared_from_this<Runtime::Impl> {
  Impl(Model m, RuntimeOptions o)
      : model(std::move(m)), ir(model.compile()), conductor(ir), options(o) {
    for (std::size_t i = 0; i < ir.names.size(); ++i) name_ids[ir.names[i]] = static_cast<NameId>(i);
    for (std::size_t i = 0; i < ir.walks.size(); ++i) walk_ids[ir.walks[i].name] = static_cast<WalkId>(i);
    for (const NodeSpec& n : ir.nodes) {
      std::vector<std::string> outs;
      for (NameId x : n.outputs) outs.push_back(ir.names[x]);
      output_names.push_back(std::move(outs));
    }
    initial_walk = walk_ids.at(model.first_walk());
    for (const WalkSpec& w : ir.walks)
      for (const SectionSpec& sec : w.sections)
        if (sec.kind == SectionKind::part)
          throw GraphError("walk '" + w.name + "' has Part '" + ir.names[sec.part_name] +
                           "'; mstar::Runtime has no state machine choosing a Part's walks: "
                           "serve the model with the Python Runtime, or drive the Conductor "
                           "(Conductor::choose_part)");
  }

  // Cancels every request, stops the Conductor and joins the workers; the calling thread, when
  // it is one of them (the destructor in on_output), is detached instead and exits on its own.
  void shut() {
    if (closed.exchange(true)) return;
    std::vector<RequestId> live;
    {
      std::lock_guard<std::mutex> lock(mu);
      for (const auto& [r, s] : requests) live.push_back(r);
    }
    for (RequestId r : live) {
      bool ok = false;
      cancel(r, &ok);
    }
    conductor.shutdown();
    for (auto& t : workers) {
      if (t.get_id() == std::this_thread::get_id())
        t.detach();
      else
        t.join();
    }
    workers.clear();
  }

  void start() {
    for (EngineId e = 0; e < ir.engines.size(); ++e)
      workers.emplace_back([this, e] {
        serving_runtime = this;
        serve(e);
      });
  }

  // Pending work after an Outcome is absorbed, done without `mu`.
  struct After {
    std::vector<std::shared_ptr<Request::State>> deliver;
    std::vector<RequestId> walks_done;
  };

  Model model;
  GraphSpec ir;
  Conductor conductor;
  RuntimeOptions options;
  std::map<std::string, NameId> name_ids;
  std::map<std::string, WalkId> walk_ids;
  std::vector<std::vector<std::string>> output_names;  // by node
  WalkId initial_walk = 0;

  mutable std::mutex mu;
  std::unordered_map<Handle, Tensor> store;
  Handle next_handle = 1;
  std::unordered_map<RequestId, std::shared_ptr<Request::State>> requests;

  std::atomic<bool> closed{false};
  // Live fail_late requests: while there are none, workers skip Conductor::expire (and its lock).
  std::atomic<std::size_t> fail_late_live{0};
  std::vector<std::thread> workers;
  std::atomic<std::uint64_t> submitted{0}, finished{0}, failed{0}, cancelled{0}, expired{0},
      node_runs{0}, batches{0};

  Handle put_locked(Tensor t) {
    const Handle h = next_handle++;
    store.emplace(h, std::move(t));
    return h;
  }

  std::vector<NodeRun> timeline_of(RequestId r) const {
    std::vector<NodeRun> v;
    for (const TimelineEvent& e : conductor.timeline(r))
      v.push_back({ir.nodes[e.node].name, ir.walks[e.walk].name, e.iteration, e.batch_size,
                   e.queued_ns, e.started_ns, e.finished_ns});
    return v;
  }

  // Under mu: the request is over. Outputs already queued stay readable.
  void end_locked(RequestId r, RequestStatus status, const std::string& error) {
    auto it = requests.find(r);
    if (it == requests.end()) return;
    std::shared_ptr<Request::State> s = it->second;
    requests.erase(it);
    if (s->fail_late) fail_late_live.fetch_sub(1);
    auto timeline = timeline_of(r);
    conductor.forget(r);
    (status == RequestStatus::finished ? finished
     : status == RequestStatus::failed ? failed : cancelled).fetch_add(1);
    s->end(status, error, std::move(timeline));
  }

  // Under mu: emits reach their requests, failures end them, released handles leave the store.
  void absorb_locked(const Outcome& o, After* after) {
    for (const Emit& e : o.emits) {
      auto it = requests.find(e.request);
      auto v = store.find(e.handle);
      if (it == requests.end() || v == store.end()) continue;
      const auto& s = it->second;
      s->push({ir.nodes[e.node].name, ir.names[e.name], v->second});
      if (s->on_output) after->deliver.push_back(s);
    }
    expired.fetch_add(o.expired.size());
    for (const auto& [r, message] : o.failed) end_locked(r, RequestStatus::failed, message);
    for (Handle h : o.released) store.erase(h);
    after->walks_done.insert(after->walks_done.end(), o.walks_done.begin(), o.walks_done.end());
  }

  // Delivers callbacks and asks the state machine about finished walks, until nothing is left.
  void settle(After after) {
    while (!after.deliver.empty() || !after.walks_done.empty()) {
      After next;
      for (const auto& s : after.deliver) s->deliver();
      for (RequestId r : after.walks_done) next_walk(r, &next);
      after = std::move(next);
    }
  }

  void next_walk(RequestId r, After* after) {
    std::shared_ptr<Request::State> s;
    std::map<std::string, Tensor> visible;
    std::string finished_walk;
    {
      std::lock_guard<std::mutex> lock(mu);
      auto it = requests.find(r);
      if (it == requests.end()) return;
      s = it->second;
      finished_walk = s->walk;
      for (const NamedHandle& nh : conductor.values(r)) {
        auto v = store.find(nh.handle);
        if (v != store.end()) visible[ir.names[nh.name]] = v->second;
      }
    }
    std::string next;
    std::string error;
    if (const NextWalkFn& fn = model.next_walk_fn()) {
      try {
        next = fn(r, finished_walk, visible);
        if (!next.empty() && !walk_ids.count(next))
          error = "next_walk returned '" + next + "', which is not a walk of the model";
      } catch (const std::exception& e) {
        error = "next_walk after '" + finished_walk + "' threw: " + e.what();
      } catch (...) {
        error = "next_walk after '" + finished_walk + "' threw a non-standard exception";
      }
    }
    std::lock_guard<std::mutex> lock(mu);
    Outcome o;
    if (!error.empty()) {
      conductor.fail(r, error, &o);
    } else if (next.empty()) {
      if (conductor.finish(r, &o)) end_locked(r, RequestStatus::finished, "");
    } else {
      s->walk = next;
      conductor.start_walk(r, walk_ids.at(next), &o);
    }
    absorb_locked(o, after);
  }

  void serve(EngineId engine) {
    std::vector<const WorkItem*> batch;
    std::vector<NodeCall::Data> calls;
    std::vector<NodeCall> views;
    std::vector<NodeCall*> ptrs;
    while (!closed.load(std::memory_order_acquire)) {
      if (!conductor.wait_ready(engine, options.poll)) continue;
      expire();  // never take work that would start past a fail_late request's deadline
      conductor.next_batch(engine, SIZE_MAX, std::chrono::nanoseconds(0), &batch);
      if (batch.empty()) continue;
      run_batch(batch, &calls, &views, &ptrs);
    }
  }

  void expire() {
    if (fail_late_live.load(std::memory_order_relaxed) == 0) return;
    After after;
    {
      std::lock_guard<std::mutex> lock(mu);
      Outcome o;
      conductor.expire(&o);
      if (o.failed.empty()) return;
      absorb_locked(o, &after);
    }
    settle(std::move(after));
  }

  void run_batch(const std::vector<const WorkItem*>& batch, std::vector<NodeCall::Data>* calls,
                 std::vector<NodeCall>* views, std::vector<NodeCall*>* ptrs) {
    const NodeId node = batch.front()->node;
    const Model::NodeDef& def = model.nodes()[node];
    calls->resize(batch.size());
    {
      std::lock_guard<std::mutex> lock(mu);
      for (std::size_t i = 0; i < batch.size(); ++i) {
        const WorkItem& it = *batch[i];
        NodeCall::Data& d = (*calls)[i];
        d.request = it.request;
        d.def = &def;
        d.walk = &ir.walks[it.walk].name;
        d.output_names = &output_names[node];
        d.name_ids = &name_ids;
        d.iteration = it.iteration;
        d.chunked = it.chunked;
        d.stream_end = it.stream_end;
        d.chunk = it.chunk;
        d.is_list = it.list_input;
        d.inputs.resize(def.inputs.size());
        for (std::size_t k = 0; k < d.inputs.size(); ++k) {
          d.inputs[k].clear();
          for (std::uint32_t j = it.offsets[k]; j < it.offsets[k + 1]; ++j) {
            auto v = store.find(it.handles[j]);
            d.inputs[k].push_back(v == store.end() ? Tensor() : v->second);
          }
        }
        d.outputs.assign(output_names[node].size(), Tensor());
        d.stops.clear();
      }
    }
    views->clear();
    ptrs->clear();
    for (auto& d : *calls) views->emplace_back(&d);
    for (auto& v : *views)
      if (!v.stream_ended()) ptrs->push_back(&v);  // stream ends go to on_stream_end, one by one
    // Per item: (item id, error message) for those that threw.
    std::vector<std::pair<std::uint64_t, std::string>> errors;
    // The Conductor prefixes "node '<node>' in walk '<walk>' failed: ".
    auto run_one = [&](std::size_t i, const NodeFn& fn) {
      try {
        if (fn) fn((*views)[i]);
      } catch (const std::exception& e) {
        errors.emplace_back(batch[i]->id, e.what());
      } catch (...) {
        errors.emplace_back(batch[i]->id, "unknown exception");
      }
    };
    if (def.batch_fn && !ptrs->empty()) {
      try {
        def.batch_fn(*ptrs);
      } catch (const std::exception& e) {
        for (const WorkItem* it : batch)
          if (!it->stream_end) errors.emplace_back(it->id, e.what());
      } catch (...) {
        for (const WorkItem* it : batch)
          if (!it->stream_end) errors.emplace_back(it->id, "unknown exception");
      }
    }
    for (std::size_t i = 0; i < batch.size(); ++i) {
      if (batch[i]->stream_end)
        run_one(i, def.stream_end_fn);
      else if (!def.batch_fn)
        run_one(i, def.fn);
    }
    node_runs.fetch_add(batch.size(), std::memory_order_relaxed);
    batches.fetch_add(1, std::memory_order_relaxed);
    After after;
    {
      std::lock_guard<std::mutex> lock(mu);
      Outcome o;
      for (const auto& [item, message] : errors) conductor.fail_items({item}, message, &o);
      std::vector<Completion> done;
      for (std::size_t i = 0; i < batch.size(); ++i) {
        const std::uint64_t id = batch[i]->id;
        if (std::any_of(errors.begin(), errors.end(), [&](const auto& e) { return e.first == id; }))
          continue;
        NodeCall::Data& d = (*calls)[i];
        Completion c;
        c.item = id;
        for (Tensor& t : d.outputs) c.outputs.push_back(t.defined() ? put_locked(std::move(t)) : 0);
        c.stop_loops = d.stops;
        done.push_back(std::move(c));
      }
      conductor.complete(done, &o);
      absorb_locked(o, &after);
    }
    for (auto& d : *calls)  // drop the input references now, not when the slot is reused
      for (auto& in : d.inputs) in.clear();
    settle(std::move(after));
  }

  void cancel(RequestId r, bool* ok) {
    After after;
    {
      std::lock_guard<std::mutex> lock(mu);
      Outcome o;
      *ok = conductor.cancel(r, &o);
      if (*ok) end_locked(r, RequestStatus::cancelled, "request " + std::to_string(r) + " was cancelled");
      absorb_locked(o, &after);
    }
    settle(std::move(after));
  }
};

// ---- Runtime ---------------------------------------------------------------------------------

Runtime::Runtime(Model model, RuntimeOptions options)
    : impl_(std::make_shared<Impl>(std::move(model), options)) {
  impl_->start();
}

Runtime::~Runtime() {
  if (serving_runtime == impl_.get()) {  // destroyed in its own on_output: a worker cannot join itself
    impl_->shut();
    outlive_until_exit = impl_;
    return;
  }
  close();
}

const GraphSpec& Runtime::graph() const noexcept { return impl_->ir; }

Request Runtime::submit(const std::map<std::string, Tensor>& inputs, RequestOptions options) {
  Impl& m = *impl_;
  if (m.closed.load()) throw std::logic_error("submit: the runtime is closed");
  const auto& declared = m.model.inputs();
  std::string unknown, missing;
  for (const auto& [name, value] : inputs)
    if (std::none_of(declared.begin(), declared.end(), [&](const auto& d) { return d.first == name; }))
      unknown += (unknown.empty() ? "'" : ", '") + name + "'";
  for (const auto& [name, spec] : declared) {
    auto it = inputs.find(name);
    if (it == inputs.end()) {
      missing += (missing.empty() ? "'" : ", '") + name + "'";
      continue;
    }
    const std::string bad = spec.mismatch(it->second);
    if (!bad.empty()) throw std::invalid_argument("submit: input '" + name + "': " + bad);
  }
  if (!unknown.empty() || !missing.empty()) {
    std::string all;
    for (const auto& d : declared) all += (all.empty() ? "'" : ", '") + d.first + "'";
    throw std::invalid_argument("submit: inputs [" + unknown + "] are not declared by the model and [" +
                                missing + "] are missing; the model takes [" + all + "]");
  }
  SubmitOptions so;
  if (options.deadline.count() > 0)
    so.deadline_ns = std::chrono::duration_cast<std::chrono::nanoseconds>(
                         std::chrono::steady_clock::now().time_since_epoch() + options.deadline)
                         .count();
  so.priority = options.priority;
  so.fail_late = options.fail_late;
  auto state = std::make_shared<Request::State>();
  std::weak_ptr<Impl> weak = impl_;
  state->cancel = [weak](RequestId r) {
    auto rt = weak.lock();
    bool ok = false;
    if (rt) rt->cancel(r, &ok);
    return ok;
  };
  state->live_timeline = [weak](RequestId r) {
    auto rt = weak.lock();
    return rt ? rt->timeline_of(r) : std::vector<NodeRun>{};
  };
  state->on_output = std::move(options.on_output);
  state->fail_late = options.fail_late;
  state->walk = m.ir.walks[m.initial_walk].name;
  Impl::After after;
  {
    std::lock_guard<std::mutex> lock(m.mu);  // the state must be known before a worker reports
    std::vector<NamedHandle> handles;
    Outcome o;
    try {  // a refused submit leaves none of its inputs in the store
      for (const auto& [name, value] : inputs) {
        const auto id = m.name_ids.find(name);
        if (id == m.name_ids.end())
          throw std::invalid_argument("submit: input '" + name + "' is not a value of the graph");
        handles.push_back({id->second, m.put_locked(value)});
      }
      state->id = m.conductor.submit(m.initial_walk, handles, so, &o);
    } catch (...) {
      for (const NamedHandle& h : handles) m.store.erase(h.handle);
      throw;
    }
    m.requests[state->id] = state;
    if (state->fail_late) m.fail_late_live.fetch_add(1);
    m.submitted.fetch_add(1);
    m.absorb_locked(o, &after);
  }
  m.settle(std::move(after));
  return Request(state);
}

void Runtime::close() {
  Impl& m = *impl_;
  // A worker cannot join itself: refused before anything is shut, so another thread's close()
  // (or the destructor) still stops everything.
  if (serving_runtime == &m)
    throw std::logic_error("Runtime::close() called from one of this runtime's own worker threads "
                           "(a node, next_walk or on_output callback); close it from another thread");
  m.shut();
}

RuntimeStats Runtime::stats() const {
  const Impl& m = *impl_;
  RuntimeStats s;
  s.live_requests = m.conductor.live_requests();
  s.live_handles = m.conductor.live_handles();
  s.queued_items = m.conductor.queued_items();
  s.inflight_items = m.conductor.inflight_items();
  {
    std::lock_guard<std::mutex> lock(m.mu);
    s.stored_tensors = m.store.size();
  }
  s.submitted = m.submitted.load();
  s.finished = m.finished.load();
  s.failed = m.failed.load();
  s.expired = m.expired.load();
  s.cancelled = m.cancelled.load();
  s.node_runs = m.node_runs.load();
  s.batches = m.batches.load();
  return s;
}

std::shared_ptr<ActionChunkBuffer> Runtime::make_action_buffer(ActionChunkOptions options) {
  return std::make_shared<ActionChunkBuffer>(options);
}

std::unique_ptr<ControlLoop> Runtime::make_control_loop(ControlLoopOptions options,
                                                        std::shared_ptr<ActionChunkBuffer> actions,
                                                        ActionFn on_action,
                                                        std::shared_ptr<Clock> clock) {
  if (!actions) throw std::invalid_argument("make_control_loop: no action buffer");
  if (!on_action) throw std::invalid_argument("make_control_loop: no on_action callable");
  // The action vector is allocated here, once: the tick itself allocates nothing.
  auto action = std::make_shared<std::vector<float>>(actions->options().action_dim, 0.0f);
  return std::make_unique<ControlLoop>(
      options,
      [actions, action, on_action = std::move(on_action)](const TickInfo& tick) {
        const bool fresh = actions->pop(tick.tick, action->data());
        on_action(tick, action->data(), fresh);
      },
      std::move(clock));
}

}  // namespace mstar

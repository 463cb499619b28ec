// Conductor: the public API (conductor.hpp); each call takes the mutex and delegates to Impl.
#include "mstar/conductor.hpp"

#include <algorithm>
#include <stdexcept>
#include <string>

#include "core/cpu_relax.hpp"
#include "scheduler/conductor_impl.hpp"

namespace mstar {

using detail::Item;
using detail::Request;
using detail::now_ns;

Conductor::Impl::Impl(GraphSpec graph) : g(std::move(graph)), engines(g.engines.size()) {
  validate_and_index();
  item_ns.assign(g.nodes.size(), 0);
  engine_done_ns.assign(g.engines.size(), 0);
  engine_busy_ns.assign(g.engines.size(), 0);
}

Conductor::Impl::~Impl() {
  for (Activation* a : free_acts) delete a;
  for (auto& [id, r] : requests)
    for (Activation* a : r->live) delete a;
}

// ---- public API ---------------------------------------------------------------------------------

Conductor::Conductor(GraphSpec graph) : impl_(std::make_unique<Impl>(std::move(graph))) {}
Conductor::~Conductor() = default;

const GraphSpec& Conductor::graph() const noexcept { return impl_->g; }

RequestId Conductor::submit(WalkId walk, const std::vector<NamedHandle>& inputs,
                            SubmitOptions options, Outcome* out) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  auto& m = *impl_;
  if (walk >= m.g.walks.size()) throw std::invalid_argument("submit: unknown walk id " + std::to_string(walk));
  std::unique_ptr<Request> r = m.new_request();
  r->id = m.next_request++;
  r->seq = r->id;
  r->options = options;
  r->env.resize(m.g.names.size());
  r->is_input.assign(m.g.names.size(), 0);
  r->stop.assign(m.g.names.size(), 0);
  for (const NamedHandle& in : inputs) {  // check everything before taking any reference
    if (in.name >= m.g.names.size()) throw std::invalid_argument("submit: unknown input name id");
    if (in.handle == kReservedHandle) throw std::invalid_argument("submit: handle ~0 is reserved");
  }
  for (const NamedHandle& in : inputs) {
    m.set_single(*r, in.name, in.handle, out);
    r->is_input[in.name] = 1;
  }
  const RequestId id = r->id;
  Request& ref = *r;
  m.requests.emplace(id, std::move(r));
  if (options.fail_late) ++m.late_watch;
  struct Submitting {  // reset even when begin_walk throws
    bool& flag;
    ~Submitting() { flag = false; }
  } submitting{m.submitting = true};
  m.begin_walk(ref, walk, out);
  if (options.fail_late && ref.state == Request::State::running) m.admit(ref, out);
  m.expire_late(out);
  m.reap(id);
  return id;
}

bool Conductor::start_walk(RequestId id, WalkId walk, Outcome* out) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  Request* r = impl_->find(id);
  if (r == nullptr || r->state == Request::State::over) return false;  // cancelled meanwhile
  if (r->state != Request::State::between_walks)
    throw std::logic_error("start_walk: request " + std::to_string(id) + " is still in a walk");
  impl_->begin_walk(*r, walk, out);
  impl_->expire_late(out);
  impl_->reap(id);
  return true;
}

bool Conductor::choose_part(RequestId id, std::uint32_t section, int child, Outcome* out) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  auto& m = *impl_;
  Request* r = m.find(id);
  if (r == nullptr || r->state != Request::State::running) return false;  // over meanwhile
  const WalkSpec& w = m.g.walks[r->walk];
  if (section >= w.sections.size() || w.sections[section].kind != SectionKind::part)
    throw std::invalid_argument("choose_part: section " + std::to_string(section) + " of walk '" +
                                w.name + "' is not a Part");
  const SectionSpec& s = w.sections[section];
  if (child < -1 || child >= static_cast<int>(s.children.size()))
    throw std::invalid_argument("choose_part: Part '" + m.g.names[s.part_name] + "' in walk '" +
                                w.name + "' has no sub-walk " + std::to_string(child));
  // At most one activation of a section is live at a time (a loop runs one iteration at once).
  detail::Activation* part = nullptr;
  for (detail::Activation* a : r->live)
    if (a->section == section) part = a;
  if (part == nullptr || !part->awaiting)
    throw std::logic_error("choose_part: Part '" + m.g.names[s.part_name] + "' of request " +
                           std::to_string(id) + " is not waiting for a choice");
  m.choose(*r, part, child, out);
  m.expire_late(out);
  m.reap(id);
  return true;
}

bool Conductor::finish(RequestId id, Outcome* out) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  Request* r = impl_->find(id);
  if (r == nullptr || r->state == Request::State::over) return false;
  impl_->end_request(*r, out);
  impl_->reap(id);
  return true;
}

// Ending a request between walks and ending it mid-walk free the same things (end_request
// drops queued work and in-flight items are ignored when they come back).
bool Conductor::cancel(RequestId id, Outcome* out) { return finish(id, out); }

void Conductor::fail(RequestId id, const std::string& message, Outcome* out) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  Request* r = impl_->find(id);
  if (r == nullptr) return;
  impl_->fail_request(*r, message, out);
  impl_->reap(id);
}

std::vector<const WorkItem*> Conductor::next_batch(EngineId engine, std::size_t max_batch,
                                                   std::chrono::nanoseconds timeout) {
  std::vector<const WorkItem*> batch;
  next_batch(engine, max_batch, timeout, &batch);
  return batch;
}

void Conductor::next_batch(EngineId engine, std::size_t max_batch, std::chrono::nanoseconds timeout,
                           std::vector<const WorkItem*>* out) {
  std::unique_lock<std::mutex> lock(impl_->mu);
  auto& m = *impl_;
  if (engine >= m.engines.size()) throw std::invalid_argument("next_batch: unknown engine id");
  auto& q = m.engines[engine];
  std::vector<const WorkItem*>& batch = *out;
  batch.clear();
  // wait_for(max) would overflow the clock arithmetic; an hour is "forever" for a worker loop.
  timeout = std::min<std::chrono::nanoseconds>(timeout, std::chrono::hours(1));
  // A zero timeout is a look: even an expired timed futex wait costs ~70 µs on a VM (timer
  // slack), which a submitter polling an idle engine would pay every time.
  if (timeout > std::chrono::nanoseconds(0))
    q.cv.wait_for(lock, timeout, [&] { return m.stopping || m.takable(q); });
  if (m.stopping || !m.takable(q)) return;
  const std::size_t limit = std::min<std::size_t>(std::max<std::size_t>(max_batch, 1),
                                                  m.g.nodes[q.ready.front().node].max_batch);
  const std::int64_t t = now_ns();
  const std::int64_t last = m.engine_done_ns[engine];
  const std::int64_t gap = q.ready.front().value->queued_ns < last ? t - last : 0;
  q.ready.take_batch(limit, [&](ReadyQueue<Item*>::Entry& e) {
    Item* item = e.value;
    --item->req->queued;
    ++item->req->inflight;
    ++m.inflight;
    item->started_ns = t;
    item->gap_ns = gap;
    batch.push_back(item);
  });
  for (const WorkItem* w : batch)
    static_cast<Item*>(const_cast<WorkItem*>(w))->batch_size = static_cast<std::uint32_t>(batch.size());
  m.engine_busy_ns[engine] = t + m.item_ns[batch.front()->node] * static_cast<std::int64_t>(batch.size());
}

bool Conductor::wait_ready(EngineId engine, std::chrono::nanoseconds timeout) {
  std::unique_lock<std::mutex> lock(impl_->mu);
  auto& m = *impl_;
  if (engine >= m.engines.size()) throw std::invalid_argument("wait_ready: unknown engine id");
  auto& q = m.engines[engine];
  timeout = std::min<std::chrono::nanoseconds>(timeout, std::chrono::hours(1));
  if (!m.stopping && !m.takable(q) && timeout > std::chrono::nanoseconds(0)) {
    // Spin a little before sleeping: a drained queue usually refills within microseconds (the
    // next request of a burst), and a futex sleep plus wake-up costs tens of µs on a VM, paid by
    // the submitter too. Bounded by spin_ and the timeout; shutdown ends the wait below.
    const std::uint64_t seen = q.inserted.load(std::memory_order_acquire);
    const auto spin = std::min(timeout, m.spin);
    lock.unlock();
    const auto until = std::chrono::steady_clock::now() + spin;
    for (unsigned i = 1; q.inserted.load(std::memory_order_acquire) == seen; ++i) {
      detail::cpu_relax();
      if (i % 64 == 0 && std::chrono::steady_clock::now() >= until) break;
    }
    lock.lock();
    timeout -= spin;
  }
  if (timeout > std::chrono::nanoseconds(0))  // a look costs no timed wait (next_batch)
    q.cv.wait_for(lock, timeout, [&] { return m.stopping || m.takable(q); });
  return !m.stopping && m.takable(q);
}

void Conductor::set_submitter_takes(EngineId engine, bool takes) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  if (engine >= impl_->engines.size()) throw std::invalid_argument("set_submitter_takes: unknown engine id");
  impl_->engines[engine].submitter_takes = takes;
}

void Conductor::take_inline(bool on) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  auto& m = *impl_;
  if (on) {
    m.inline_taker = std::this_thread::get_id();
    return;
  }
  m.inline_taker = std::thread::id();
  for (auto& q : m.engines)
    if (q.submitter_takes && !q.ready.empty()) q.cv.notify_one();
}

void Conductor::wake(EngineId engine) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  if (engine >= impl_->engines.size()) throw std::invalid_argument("wake: unknown engine id");
  auto& q = impl_->engines[engine];
  if (!q.ready.empty()) q.cv.notify_one();
}

void Conductor::set_spin(std::chrono::nanoseconds spin) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->spin = std::max(spin, std::chrono::nanoseconds(0));
}

void Conductor::complete(const std::vector<Completion>& done, Outcome* out) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  const std::int64_t t = now_ns();
  for (const Completion& c : done) impl_->complete_one(c, t, out);
  impl_->expire_late(out);
}

void Conductor::expire(Outcome* out) {
  if (impl_->late_watch.load(std::memory_order_relaxed) == 0) return;
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->expire_late(out);
}

void Conductor::fail_items(const std::vector<std::uint64_t>& ids, const std::string& message,
                           Outcome* out, bool named) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  auto& m = *impl_;
  for (std::uint64_t id : ids) {
    Item* item = m.find_item(id);
    if (item == nullptr || item->batch_size == 0) continue;  // unknown or not in flight
    Request& r = *item->req;
    --r.inflight;
    --m.inflight;
    for (Handle h : item->handles) m.release(h, out);
    const std::string where = named ? std::string() : "node '" + m.g.nodes[item->node].name +
                                                          "' in walk '" + m.g.walks[item->walk].name +
                                                          "' failed: ";
    m.free_item(item);
    m.fail_request(r, where + message, out);
    m.reap(r.id);
  }
}

std::vector<std::pair<NodeId, std::int64_t>> Conductor::running() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  std::vector<std::pair<NodeId, std::int64_t>> out;
  for (const auto& slot : impl_->slots) {  // once per heartbeat, not on a hot path
    const detail::Item* item = slot.get();
    if (item == nullptr || !item->in_use || item->batch_size == 0) continue;
    auto same = std::find_if(out.begin(), out.end(),
                             [&](const auto& e) { return e.first == item->node; });
    if (same == out.end())
      out.emplace_back(item->node, item->started_ns);
    else
      same->second = std::min(same->second, item->started_ns);
  }
  return out;
}

void Conductor::shutdown() {
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->stopping = true;
  for (auto& q : impl_->engines) q.cv.notify_all();
}

std::vector<NamedHandle> Conductor::values(RequestId id) const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  std::vector<NamedHandle> out;
  auto it = impl_->requests.find(id);
  if (it == impl_->requests.end()) return out;
  const auto& env = it->second->env;
  for (NameId n = 0; n < env.size(); ++n)
    if (env[n].present && !env[n].list) out.push_back({n, env[n].single});
  return out;
}

std::vector<TimelineEvent> Conductor::timeline(RequestId id) const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  auto it = impl_->requests.find(id);
  if (it != impl_->requests.end() && it->second->state != Request::State::over) return it->second->timeline;
  auto f = impl_->finished_timelines.find(id);
  return f == impl_->finished_timelines.end() ? std::vector<TimelineEvent>{} : f->second;
}

void Conductor::forget(RequestId id) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  auto it = impl_->finished_timelines.find(id);
  if (it == impl_->finished_timelines.end()) return;
  impl_->recycle_timeline(std::move(it->second));
  impl_->finished_timelines.erase(it);
}

std::uint64_t Conductor::emitted(RequestId id) const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  auto it = impl_->requests.find(id);
  return it == impl_->requests.end() ? 0 : it->second->emitted;
}

std::size_t Conductor::live_requests() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->requests.size();
}
std::size_t Conductor::live_handles() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->refs.size();
}
std::size_t Conductor::queued_items() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  std::size_t n = 0;
  for (const auto& q : impl_->engines) n += q.ready.size();
  return n;
}
std::size_t Conductor::inflight_items() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->inflight;
}

}  // namespace mstar

// Request lifecycle (walks, ends, recycling) and the completion of work items.
#include "scheduler/conductor_impl.hpp"

#include <algorithm>
#include <stdexcept>
#include <string>

namespace mstar {

using detail::Activation;
using detail::Item;
using detail::Request;
using detail::Slot;
using detail::StreamState;
using detail::now_ns;

void Conductor::Impl::begin_walk(Request& r, WalkId w, Outcome* out) {
  if (w >= g.walks.size()) throw std::invalid_argument("unknown walk id " + std::to_string(w));
  r.walk = w;
  r.state = Request::State::running;
  r.close_streams();
  r.streams.reserve(g.walks[w].streams.size());
  for (const StreamSpec& spec : g.walks[w].streams) r.open_stream(spec);
  start(r, new_act(r, g.walks[w].root, nullptr), out);
}

void Conductor::Impl::walk_done(Request& r, Outcome* out) {
  const auto& persist = persisted_anywhere;  // the compiler lets any later walk read them
  for (NameId n = 0; n < r.env.size(); ++n)
    if (!persist[n] && !r.is_input[n]) clear_slot(r.env[n], out);
  clear_streams(r, out);
  r.state = Request::State::between_walks;
  out->walks_done.push_back(r.id);
}

/// Frees everything the request holds; it disappears once its in-flight items are back.
void Conductor::Impl::end_request(Request& r, Outcome* out) {
  r.state = Request::State::over;
  if (r.options.fail_late) --late_watch;
  if (r.queued != 0) {  // cancellation is rare: a scan of the ready queues is fine
    for (auto& q : engines) {
      q.ready.remove_if([&](const ReadyQueue<Item*>::Entry& e) {
        Item* it = e.value;
        if (it->req != &r) return false;
        for (Handle h : it->handles) release(h, out);
        free_item(it);
        return true;
      });
    }
    r.queued = 0;
  }
  while (!r.live.empty()) drop_act(r, r.live.back(), out);
  clear_streams(r, out);
  for (Slot& s : r.env) clear_slot(s, out);
  finished_timelines[r.id] = std::move(r.timeline);
}

std::unique_ptr<Request> Conductor::Impl::new_request() {
  if (spare_requests.empty()) return std::make_unique<Request>();
  std::unique_ptr<Request> r = std::move(spare_requests.back());
  spare_requests.pop_back();
  r->id = r->seq = 0;
  r->options = SubmitOptions{};
  r->walk = 0;
  r->state = Request::State::running;
  r->live.clear();
  r->close_streams();
  r->queued = r->inflight = 0;
  r->emitted = 0;
  r->timeline.clear();
  if (!spare_timelines.empty()) {
    r->timeline = std::move(spare_timelines.back());
    spare_timelines.pop_back();
  }
  return r;
}

void Conductor::Impl::recycle(std::unique_ptr<Request> r) {
  if (spare_requests.size() < kSpares) spare_requests.push_back(std::move(r));
}

void Conductor::Impl::recycle_timeline(std::vector<TimelineEvent>&& t) {
  if (spare_timelines.size() >= kSpares || t.capacity() > kSpareTimelineCapacity) return;
  t.clear();
  spare_timelines.push_back(std::move(t));
}

/// Erases a request that is over once no engine holds its items. Called last by each public
/// entry point, never in the middle of walking (callers up the stack still hold `r`).
void Conductor::Impl::reap(RequestId id) {
  auto it = requests.find(id);
  if (it != requests.end() && it->second->state == Request::State::over && it->second->inflight == 0) {
    std::unique_ptr<Request> r = std::move(it->second);
    requests.erase(it);
    recycle(std::move(r));
  }
}

void Conductor::Impl::fail_request(Request& r, const std::string& message, Outcome* out) {
  if (r.state == Request::State::over) return;
  out->failed.emplace_back(r.id, message);
  end_request(r, out);
}

Request* Conductor::Impl::find(RequestId id) {
  auto it = requests.find(id);
  return it == requests.end() ? nullptr : it->second.get();
}

void Conductor::Impl::complete_one(const Completion& c, std::int64_t t, Outcome* out) {
  Item* item = find_item(c.item);
  if (item == nullptr || item->batch_size == 0)
    throw std::invalid_argument("complete: work item " + std::to_string(c.item) +
                                " is not in flight (unknown, queued, or already reported)");
  // Released at the end of this function: the walk below reads the item.
  struct FreeOnExit {
    Impl* m;
    Item* it;
    ~FreeOnExit() { m->free_item(it); }
  } guard{this, item};
  Request& r = *item->req;
  --r.inflight;
  --inflight;
  const NodeSpec& n = g.nodes[item->node];
  if (!n.untimed) {  // a held source's time in flight is the caller's, not a cost to estimate
    note_batch_time(item->node, (t - item->started_ns + item->gap_ns) /
                                   std::max<std::uint32_t>(item->batch_size, 1));
    engine_done_ns[n.engine] = t;
  }
  for (Handle h : c.outputs)
    if (h == kReservedHandle) throw std::invalid_argument("complete: handle ~0 is reserved");
  for (Handle h : c.outputs) retain(h);  // balanced below: unreferenced outputs are released
  for (Handle h : item->handles) release(h, out);
  if (r.state == Request::State::running) {
    if (c.outputs.size() != n.outputs.size()) {
      fail_request(r, "node '" + n.name + "' returned " + std::to_string(c.outputs.size()) +
                          " outputs, expected " + std::to_string(n.outputs.size()), out);
    } else {
      if (r.timeline.size() < kMaxTimeline)
        r.timeline.push_back({item->node, item->walk, item->iteration, item->batch_size,
                              item->queued_ns, item->started_ns, t});
      apply_outputs(r, *item, c, out);
    }
  }
  for (Handle h : c.outputs) release(h, out);
  reap(r.id);
}

void Conductor::Impl::apply_outputs(Request& r, const Item& item, const Completion& c, Outcome* out) {
  const NodeSpec& n = g.nodes[item.node];
  const auto& ix = index[r.walk];
  for (std::size_t k = 0; k < n.outputs.size(); ++k) {
    const Handle h = c.outputs[k];
    if (h == 0) continue;
    const NameId name = n.outputs[k];
    const auto& emits = ix.emit_names[item.node];
    if (std::find(emits.begin(), emits.end(), name) != emits.end()) {
      out->emits.push_back({r.id, item.node, name, h});
      ++r.emitted;
    }
    for (int st : ix.produces_streams[item.node]) {
      StreamState& s = r.streams[static_cast<std::size_t>(st)];
      if (s.spec->name != name) continue;
      retain(h);
      s.items.push_back(h);
      ++s.written;
    }
    set_single(r, name, h, out);
  }
  for (NameId loop : c.stop_loops)
    if (loop < r.stop.size()) r.stop[loop] = 1;
  for (int st : ix.produces_streams[item.node]) pump(r, static_cast<std::size_t>(st), out);
  if (r.state != Request::State::running) return;
  if (item.stream >= 0) {
    const auto& mine = ix.consumes_streams[item.node];
    for (std::size_t k = 0; k < mine.size(); ++k) {
      StreamState& s = r.streams[static_cast<std::size_t>(mine[k])];
      s.inflight = false;
      if (item.chunks[k].end == item.chunks[k].begin) continue;  // an empty window: nothing read
      const std::uint64_t keep = s.cursor.advance(item.chunks[k]);
      while (s.base < keep && !s.items.empty()) {
        release(s.items.front(), out);
        s.items.pop_front();
        ++s.base;
      }
    }
    if (item.act == nullptr) return pump(r, static_cast<std::size_t>(item.stream), out);
    // A per-execution consumer: this run read its windows; the next run (the next iteration)
    // waits for the next ones.
    for (int st : mine) r.streams[static_cast<std::size_t>(st)].consumer = nullptr;
  }
  done(r, item.act, out);
}

}  // namespace mstar

// Deadlines that are kept (SubmitOptions::fail_late): late work fails its request instead of
// running, and submit refuses a request whose first work cannot start in time.
//
// Why at these points: the ready queues are sorted by deadline, so every late item sits at the
// front of its queue and the scan below stops at the first item still in time. A node already
// running is never interrupted; its request fails when its next work would start late.
#include <algorithm>
#include <cstdio>
#include <string>

#include "scheduler/conductor_impl.hpp"

namespace mstar {

using detail::Item;
using detail::Request;

namespace {

std::string ms(std::int64_t ns) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f ms", static_cast<double>(ns) / 1e6);
  return buf;
}

}  // namespace

void Conductor::Impl::note_batch_time(NodeId node, std::int64_t per_item_ns) {
  std::int64_t& e = item_ns[node];
  // An exponential average over the last few batches: follows load changes within a second
  // or so, and one slow batch (a page fault, a GC pause) moves it by a quarter only.
  e = e == 0 ? per_item_ns : e + (per_item_ns - e) / 4;
}

void Conductor::Impl::expire_late(Outcome* out) {
  if (late_watch.load(std::memory_order_relaxed) == 0) return;
  const std::int64_t t = detail::now_ns();
  late.clear();
  for (auto& q : engines)
    for (std::size_t i = 0; i < q.ready.size() && q.ready[i].order.deadline_ns < t; ++i) {
      const Item* it = q.ready[i].value;
      if (it->req->options.fail_late) late.push_back({it->req->id, it->node});
    }
  for (const auto& [id, node] : late) {
    Request* r = find(id);
    if (r == nullptr || r->state == Request::State::over) continue;  // had two late items
    const std::int64_t by = t - r->options.deadline_ns;
    out->expired.push_back({id, node, false, by});
    fail_request(*r,
                 "deadline exceeded: node '" + g.nodes[node].name + "' in walk '" +
                     walk_of(*r).name + "' would start " + ms(by) +
                     " after the request's deadline, so the request failed instead of running late",
                 out);
    reap(id);
  }
}

bool Conductor::Impl::admit(Request& r, Outcome* out) {
  // Each of the request's queued items starts once the items ahead of it in its queue have run,
  // and is done one run of its node later: the estimate sums their nodes' recent per-item times
  // (0 for a node not yet seen, so a fresh Conductor admits everything). A request that could
  // start but not finish its first nodes in time would only expire later, after taking engine
  // time from requests that can make it. The batch an engine runs now counts for what is left
  // of it.
  const std::int64_t t = detail::now_ns();
  std::int64_t worst = 0, waited = 0;
  NodeId at = 0;
  EngineId on = 0;
  for (EngineId e = 0; e < engines.size(); ++e) {
    const auto& q = engines[e].ready;
    std::int64_t ahead = std::max<std::int64_t>(engine_busy_ns[e] - t, 0);
    for (std::size_t i = 0; i < q.size(); ++i) {
      const Item* it = q[i].value;
      if (it->req != &r) {
        ahead += item_ns[it->node];
      } else if (ahead + item_ns[it->node] >= worst) {
        worst = ahead + item_ns[it->node];
        waited = ahead;
        at = it->node;
        on = e;
      }
    }
  }
  if (r.queued == 0 || t + worst <= r.options.deadline_ns) return true;
  const std::int64_t left = r.options.deadline_ns - t;
  out->expired.push_back({r.id, at, true, worst - left});
  fail_request(r,
               "deadline cannot be met: node '" + g.nodes[at].name + "' on engine '" +
                   g.engines[on] + "' would wait for about " + ms(waited) +
                   " of queued work and run about " + ms(worst - waited) + ", and " +
                   (left > 0 ? "the deadline is " + ms(left) + " away"
                             : "the deadline passed " + ms(-left) + " ago") +
                   "; refused at submit",
               out);
  return false;
}

}  // namespace mstar

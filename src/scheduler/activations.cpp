// The activation walker: runs a walk's sections (sequential, parallel, loops) for a request and
// turns the nodes it reaches into work items.
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

Item* Conductor::Impl::new_item() {
  std::uint32_t slot;
  if (free_slots.empty()) {
    slot = static_cast<std::uint32_t>(slots.size());
    slots.push_back(std::make_unique<Item>());
  } else {
    slot = free_slots.back();
    free_slots.pop_back();
  }
  Item* item = slots[slot].get();
  item->id = (static_cast<std::uint64_t>(generation++) << 32) | slot;
  if (generation == 0) generation = 1;
  item->in_use = true;
  item->handles.clear();
  item->offsets.clear();
  item->list_input.clear();
  item->chunked = item->stream_end = false;
  item->chunk = Chunk{};
  item->chunks.clear();
  item->act = nullptr;
  item->stream = -1;
  item->batch_size = 0;
  return item;
}

Item* Conductor::Impl::find_item(std::uint64_t id) {
  const std::uint64_t slot = id & 0xffffffffu;
  if (slot >= slots.size()) return nullptr;
  Item* item = slots[slot].get();
  return item->in_use && item->id == id ? item : nullptr;
}

void Conductor::Impl::free_item(Item* item) {
  item->in_use = false;
  free_slots.push_back(static_cast<std::uint32_t>(item->id & 0xffffffffu));
}

void Conductor::Impl::clear_slot(Slot& s, Outcome* out) {
  if (!s.present) return;
  if (s.list) {
    for (Handle h : s.many) release(h, out);
    s.many.clear();
  } else {
    release(s.single, out);
  }
  s.present = s.list = false;
  s.single = 0;
}

void Conductor::Impl::set_single(Request& r, NameId name, Handle h, Outcome* out) {
  retain(h);  // before clearing: the new value may equal the old one
  clear_slot(r.env[name], out);
  Slot& s = r.env[name];
  s.present = true;
  s.single = h;
}

Activation* Conductor::Impl::new_act(Request& r, std::uint32_t section, Activation* parent) {
  Activation* a;
  if (free_acts.empty()) {
    a = new Activation();
  } else {
    a = free_acts.back();
    free_acts.pop_back();
  }
  a->section = section;
  a->parent = parent;
  a->index = 0;
  a->awaiting = false;
  a->acc.clear();
  a->live_pos = static_cast<std::uint32_t>(r.live.size());
  r.live.push_back(a);
  return a;
}

void Conductor::Impl::drop_act(Request& r, Activation* a, Outcome* out) {
  for (auto& list : a->acc)
    for (Handle h : list) release(h, out);
  a->acc.clear();
  Activation* last = r.live.back();
  r.live[a->live_pos] = last;
  last->live_pos = a->live_pos;
  r.live.pop_back();
  free_acts.push_back(a);
}

void Conductor::Impl::start(Request& r, Activation* a, Outcome* out) {
  const SectionSpec& s = sec(r, a->section);
  restart_streams(r, a->section, out);
  switch (s.kind) {
    case SectionKind::node: {
      const auto& mine = index[r.walk].consumes_streams[s.node];
      if (!mine.empty()) {  // a stream consumer: its chunks run as they come
        for (int st : mine) r.streams[static_cast<std::size_t>(st)].consumer = a;
        pump(r, static_cast<std::size_t>(mine.front()), out);
      } else {
        dispatch_chunks(r, s.node, a, nullptr, nullptr, false, out);
      }
      return;
    }
    case SectionKind::sequential:
      if (s.children.empty()) return done(r, a, out);
      return start(r, new_act(r, s.children[0], a), out);
    case SectionKind::parallel:
      if (s.children.empty()) return done(r, a, out);
      a->index = static_cast<std::uint32_t>(s.children.size());
      for (std::uint32_t c : std::vector<std::uint32_t>(s.children)) {
        if (r.state != Request::State::running) return;  // a branch failed the request
        start(r, new_act(r, c, a), out);
      }
      return;
    case SectionKind::loop:
      if (s.dynamic) r.stop[s.loop_name] = 0;
      a->acc.assign(s.accumulated.size(), {});
      begin_iteration(r, a, s);
      return start(r, new_act(r, s.children[0], a), out);
    case SectionKind::part:
      return await_part(r, a, -1, out);
  }
}

void Conductor::Impl::await_part(Request& r, Activation* part, int finished, Outcome* out) {
  part->awaiting = true;
  out->part_choices.push_back({r.id, r.walk, part->section, sec(r, part->section).part_name,
                               finished});
}

void Conductor::Impl::choose(Request& r, Activation* part, int child, Outcome* out) {
  part->awaiting = false;
  if (child < 0) return done(r, part, out);
  part->index = static_cast<std::uint32_t>(child);
  start(r, new_act(r, sec(r, part->section).children[part->index], part), out);
}

/// Notes each accumulated name's value as an iteration starts: only a value the iteration
/// itself produced (a different handle) is accumulated at its end.
void Conductor::Impl::begin_iteration(Request& r, Activation* loop, const SectionSpec& s) {
  loop->acc_before.resize(s.accumulated.size());
  for (std::size_t k = 0; k < s.accumulated.size(); ++k) {
    const Slot& v = r.env[s.accumulated[k]];
    loop->acc_before[k] = v.present && !v.list ? v.single : 0;
  }
}

void Conductor::Impl::done(Request& r, Activation* a, Outcome* out) {
  for (int st : index[r.walk].ends_streams[a->section]) {
    StreamState& ss = r.streams[static_cast<std::size_t>(st)];
    ss.ended = true;
    pump(r, static_cast<std::size_t>(st), out);
    if (r.state != Request::State::running) return;
  }
  Activation* parent = a->parent;
  if (parent == nullptr) {
    drop_act(r, a, out);
    return walk_done(r, out);
  }
  drop_act(r, a, out);
  const SectionSpec& p = sec(r, parent->section);
  switch (p.kind) {
    case SectionKind::sequential:
      if (++parent->index < p.children.size())
        return start(r, new_act(r, p.children[parent->index], parent), out);
      return done(r, parent, out);
    case SectionKind::parallel:
      if (--parent->index == 0) return done(r, parent, out);
      return;
    case SectionKind::loop: {
      for (std::size_t k = 0; k < p.accumulated.size(); ++k) {
        const Slot& v = r.env[p.accumulated[k]];
        if (v.present && !v.list && v.single != parent->acc_before[k]) {
          retain(v.single);
          parent->acc[k].push_back(v.single);
        }
      }
      ++parent->index;
      const bool stopped = p.dynamic && r.stop[p.loop_name];
      if (!stopped && parent->index < p.max_iters) {
        begin_iteration(r, parent, p);
        return start(r, new_act(r, p.children[0], parent), out);
      }
      end_loop(r, parent, p, out);
      return done(r, parent, out);
    }
    case SectionKind::part:  // the model's state machine chooses what runs next
      return await_part(r, parent, static_cast<int>(parent->index), out);
    case SectionKind::node:
      return;  // nodes have no children
  }
}

void Conductor::Impl::end_loop(Request& r, Activation* loop, const SectionSpec& p, Outcome* out) {
  for (NameId n : p.scoped) clear_slot(r.env[n], out);
  for (std::size_t k = 0; k < p.accumulated.size(); ++k) {
    Slot& s = r.env[p.accumulated[k]];
    clear_slot(s, out);
    s.present = s.list = true;
    s.many = std::move(loop->acc[k]);  // the loop's references move into the slot
    loop->acc[k].clear();
  }
}

std::uint32_t Conductor::Impl::innermost_iteration(const Request& r, const Activation* a) const {
  for (const Activation* p = a ? a->parent : nullptr; p != nullptr; p = p->parent)
    if (sec(r, p->section).kind == SectionKind::loop) return p->index;
  return 0;
}

Chunk* Conductor::Impl::chunk_scratch(std::size_t n) {
  if (chunk_buf.size() < n) chunk_buf.resize(n);
  return chunk_buf.data();
}

void Conductor::Impl::dispatch_chunks(Request& r, NodeId node, Activation* act,
                                      const std::vector<int>* streams, const Chunk* chunks,
                                      bool stream_end, Outcome* out) {
  const NodeSpec& n = g.nodes[node];
  Item* item = new_item();
  item->request = r.id;
  item->node = node;
  item->walk = r.walk;
  item->req = &r;
  item->act = act;
  item->stream = streams != nullptr ? streams->front() : -1;
  const std::size_t n_streams = streams != nullptr ? streams->size() : 0;
  if (n_streams > 0) item->chunks.assign(chunks, chunks + n_streams);
  item->iteration = innermost_iteration(
      r, act != nullptr ? act : r.streams[static_cast<std::size_t>(item->stream)].consumer);
  item->offsets.reserve(n.inputs.size() + 1);
  item->offsets.push_back(0);
  for (NameId in : n.inputs) {
    std::size_t k = 0;
    while (k < n_streams && r.streams[static_cast<std::size_t>((*streams)[k])].spec->name != in) ++k;
    if (k < n_streams) {
      const StreamState& ss = r.streams[static_cast<std::size_t>((*streams)[k])];
      for (std::uint64_t p = chunks[k].begin; p < chunks[k].end; ++p)
        item->handles.push_back(ss.items[static_cast<std::size_t>(p - ss.base)]);
      item->list_input.push_back(1);
    } else {
      const Slot& s = r.env[in];
      if (!s.present) {
        free_item(item);
        return fail_request(r,
                            "node '" + n.name + "' in walk '" + walk_of(r).name + "' reads '" +
                                g.names[in] + "', which has no value at this point",
                            out);
      }
      if (s.list) {
        item->handles.insert(item->handles.end(), s.many.begin(), s.many.end());
      } else {
        item->handles.push_back(s.single);
      }
      item->list_input.push_back(s.list ? 1 : 0);
    }
    item->offsets.push_back(static_cast<std::uint32_t>(item->handles.size()));
  }
  if (n_streams > 0) {
    for (int st : *streams) r.streams[static_cast<std::size_t>(st)].inflight = true;
    item->stream_end = stream_end;
    item->chunked = !stream_end;
    item->chunk = chunks[0];
  }
  for (Handle h : item->handles) retain(h);
  item->queued_ns = now_ns();
  ++r.queued;
  auto& q = engines[n.engine];
  q.insert(item);
  // An engine whose work the submitter (or an inline taker) takes itself sleeps on.
  const bool taken_here = q.submitter_takes && (submitting || inline_taker != std::thread::id());
  if (!taken_here) q.cv.notify_one();
}

}  // namespace mstar

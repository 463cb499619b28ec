// Conductor: walks requests through the compiled graph and feeds engine ready queues.
#include "mstar/conductor.hpp"

#include <algorithm>
#include <stdexcept>
#include <string>

#include "conductor_state.hpp"
#include "cpu_relax.hpp"
#include "handle_counts.hpp"

namespace mstar {

using detail::Activation;
using detail::Item;
using detail::Request;
using detail::Slot;
using detail::StreamState;

namespace {

std::int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

}  // namespace

struct Conductor::Impl {
  GraphSpec g;
  std::vector<detail::WalkIndex> index;  // by walk
  std::vector<std::uint8_t> persisted_anywhere;  // name -> some walk persists it

  mutable std::mutex mu;
  std::vector<detail::EngineQueue> engines;
  std::unordered_map<RequestId, std::unique_ptr<Request>> requests;
  std::unordered_map<RequestId, std::vector<TimelineEvent>> finished_timelines;
  // Work items live in reused slots; an item id is (generation << 32 | slot), so a stale or
  // made-up id is recognised without a hash lookup.
  std::vector<std::unique_ptr<Item>> slots;
  std::vector<std::uint32_t> free_slots;
  std::uint32_t generation = 1;
  detail::HandleCounts refs;
  std::vector<Activation*> free_acts;  // reused: no allocation per loop iteration once warm
  static constexpr std::size_t kSpares = 256;                 // requests / timelines kept
  static constexpr std::size_t kSpareTimelineCapacity = 4096;  // longer ones are freed
  std::vector<std::unique_ptr<Request>> spare_requests;
  std::vector<std::vector<TimelineEvent>> spare_timelines;
  RequestId next_request = 1;
  bool stopping = false;
  std::chrono::nanoseconds spin = std::chrono::microseconds(100);  // wait_ready's spin
  std::size_t inflight = 0;

  explicit Impl(GraphSpec graph) : g(std::move(graph)), engines(g.engines.size()) { validate_and_index(); }

  ~Impl() {
    for (Activation* a : free_acts) delete a;
    for (auto& [id, r] : requests)
      for (Activation* a : r->live) delete a;
  }

  // ---- IR checks ------------------------------------------------------------------------------

  void validate_and_index() {
    auto bad = [](const std::string& what) { throw std::invalid_argument("graph IR: " + what); };
    const std::size_t n_names = g.names.size();
    persisted_anywhere.assign(n_names, 0);
    if (g.engines.empty()) bad("no engines");
    for (const NodeSpec& n : g.nodes) {
      if (n.engine >= g.engines.size()) bad("node '" + n.name + "' uses an unknown engine");
      if (n.max_batch == 0) bad("node '" + n.name + "' has max_batch 0");
      for (NameId x : n.inputs)
        if (x >= n_names) bad("node '" + n.name + "' reads an unknown name id");
      for (NameId x : n.outputs)
        if (x >= n_names) bad("node '" + n.name + "' writes an unknown name id");
    }
    for (const WalkSpec& w : g.walks) {
      detail::WalkIndex ix;
      ix.node_section.assign(g.nodes.size(), -1);
      ix.emit_names.resize(g.nodes.size());
      ix.produces_streams.resize(g.nodes.size());
      ix.consumes_stream.assign(g.nodes.size(), -1);
      ix.ends_streams.resize(w.sections.size());
      ix.persist.assign(n_names, 0);
      if (w.root >= w.sections.size()) bad("walk '" + w.name + "' has no root section");
      std::vector<std::uint8_t> has_parent(w.sections.size(), 0);
      for (std::uint32_t s = 0; s < w.sections.size(); ++s) {
        const SectionSpec& sec = w.sections[s];
        for (std::uint32_t c : sec.children) {
          // A tree: the root has no parent and every other section at most one, so a cycle
          // could only be one the root never reaches (and it is never run).
          if (c >= w.sections.size() || c == w.root || has_parent[c])
            bad("walk '" + w.name + "' sections do not form a tree");
          has_parent[c] = 1;
        }
        if (sec.kind == SectionKind::loop) {
          if (sec.dynamic && sec.loop_name >= n_names) bad("walk '" + w.name + "' has a loop with an unknown name id");
          for (const auto* ids : {&sec.outputs, &sec.accumulated, &sec.scoped})
            for (NameId x : *ids)
              if (x >= n_names) bad("walk '" + w.name + "' has a loop listing an unknown name id");
        }
        if (sec.kind == SectionKind::node) {
          if (sec.node >= g.nodes.size()) bad("walk '" + w.name + "' runs an unknown node");
          if (ix.node_section[sec.node] != -1)
            bad("node '" + g.nodes[sec.node].name + "' appears twice in walk '" + w.name + "'");
          ix.node_section[sec.node] = static_cast<int>(s);
        }
        if (sec.kind == SectionKind::loop && (sec.children.size() != 1 || sec.max_iters == 0))
          bad("walk '" + w.name + "' has a loop without exactly one body or with max_iters 0");
      }
      for (auto [node, name] : w.emits) {
        if (node >= g.nodes.size() || name >= n_names) bad("walk '" + w.name + "' emits nonsense");
        ix.emit_names[node].push_back(name);
      }
      for (NameId p : w.persist) {
        if (p >= n_names) bad("walk '" + w.name + "' persists an unknown name");
        ix.persist[p] = 1;
        persisted_anywhere.resize(n_names, 0);
        persisted_anywhere[p] = 1;
      }
      for (std::size_t k = 0; k < w.streams.size(); ++k) {
        const StreamSpec& st = w.streams[k];
        if (st.producer >= g.nodes.size() || st.consumer >= g.nodes.size() ||
            st.producer_scope >= w.sections.size() || st.name >= n_names ||
            ix.node_section[st.producer] < 0 || ix.node_section[st.consumer] < 0)
          bad("walk '" + w.name + "' has a malformed streaming edge (unknown ids, or a producer or "
              "consumer the walk does not run)");
        if (ix.consumes_stream[st.consumer] != -1)
          bad("node '" + g.nodes[st.consumer].name + "' consumes two streams in one walk");
        ix.produces_streams[st.producer].push_back(static_cast<int>(k));
        ix.consumes_stream[st.consumer] = static_cast<int>(k);
        ix.ends_streams[st.producer_scope].push_back(static_cast<int>(k));
      }
      index.push_back(std::move(ix));
    }
  }

  // ---- handles --------------------------------------------------------------------------------

  void retain(Handle h) { refs.retain(h); }
  void release(Handle h, Outcome* out) {
    if (refs.release(h)) out->released.push_back(h);
  }

  // ---- work item slots ------------------------------------------------------------------------

  Item* new_item() {
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
    item->windowed = false;
    item->chunk = Chunk{};
    item->act = nullptr;
    item->stream = -1;
    item->batch_size = 0;
    return item;
  }
  Item* find_item(std::uint64_t id) {
    const std::uint64_t slot = id & 0xffffffffu;
    if (slot >= slots.size()) return nullptr;
    Item* item = slots[slot].get();
    return item->in_use && item->id == id ? item : nullptr;
  }
  void free_item(Item* item) {
    item->in_use = false;
    free_slots.push_back(static_cast<std::uint32_t>(item->id & 0xffffffffu));
  }
  void clear_slot(Slot& s, Outcome* out) {
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
  void set_single(Request& r, NameId name, Handle h, Outcome* out) {
    retain(h);  // before clearing: the new value may equal the old one
    clear_slot(r.env[name], out);
    Slot& s = r.env[name];
    s.present = true;
    s.single = h;
  }

  // ---- activations ----------------------------------------------------------------------------

  Activation* new_act(Request& r, std::uint32_t section, Activation* parent) {
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
    a->acc.clear();
    a->live_pos = static_cast<std::uint32_t>(r.live.size());
    r.live.push_back(a);
    return a;
  }
  void drop_act(Request& r, Activation* a, Outcome* out) {
    for (auto& list : a->acc)
      for (Handle h : list) release(h, out);
    a->acc.clear();
    Activation* last = r.live.back();
    r.live[a->live_pos] = last;
    last->live_pos = a->live_pos;
    r.live.pop_back();
    free_acts.push_back(a);
  }

  const WalkSpec& walk_of(const Request& r) const { return g.walks[r.walk]; }
  const SectionSpec& sec(const Request& r, std::uint32_t s) const { return g.walks[r.walk].sections[s]; }

  /// A stream's producer scope starting again (an outer loop's next iteration) starts a fresh
  /// stream: positions, windows and the end-of-stream flag begin anew.
  void restart_streams(Request& r, std::uint32_t section, Outcome* out) {
    for (int st : index[r.walk].ends_streams[section]) {
      StreamState& s = r.streams[static_cast<std::size_t>(st)];
      if (s.written == 0 && !s.ended) continue;  // first use: nothing to reset
      for (Handle h : s.items) release(h, out);
      s.items.clear();
      s.base = s.written = 0;
      s.ended = s.inflight = s.any_sent = s.last_sent = false;
      s.cursor.reset();
    }
  }

  void start(Request& r, Activation* a, Outcome* out) {
    const SectionSpec& s = sec(r, a->section);
    restart_streams(r, a->section, out);
    switch (s.kind) {
      case SectionKind::node: {
        const int st = index[r.walk].consumes_stream[s.node];
        if (st >= 0) {  // a stream consumer: its windows run as they come; it ends with the stream
          r.streams[static_cast<std::size_t>(st)].consumer = a;
          pump(r, static_cast<std::size_t>(st), out);
        } else {
          dispatch(r, s.node, a, -1, nullptr, out);
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
    }
  }

  /// Notes each accumulated name's value as an iteration starts: only a value the iteration
  /// itself produced (a different handle) is accumulated at its end.
  void begin_iteration(Request& r, Activation* loop, const SectionSpec& s) {
    loop->acc_before.resize(s.accumulated.size());
    for (std::size_t k = 0; k < s.accumulated.size(); ++k) {
      const Slot& v = r.env[s.accumulated[k]];
      loop->acc_before[k] = v.present && !v.list ? v.single : 0;
    }
  }

  void done(Request& r, Activation* a, Outcome* out) {
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
      case SectionKind::node:
        return;  // nodes have no children
    }
  }

  void end_loop(Request& r, Activation* loop, const SectionSpec& p, Outcome* out) {
    for (NameId n : p.scoped) clear_slot(r.env[n], out);
    for (std::size_t k = 0; k < p.accumulated.size(); ++k) {
      Slot& s = r.env[p.accumulated[k]];
      clear_slot(s, out);
      s.present = s.list = true;
      s.many = std::move(loop->acc[k]);  // the loop's references move into the slot
      loop->acc[k].clear();
    }
  }

  // ---- work items -----------------------------------------------------------------------------

  std::uint32_t innermost_iteration(const Request& r, const Activation* a) const {
    for (const Activation* p = a ? a->parent : nullptr; p != nullptr; p = p->parent)
      if (sec(r, p->section).kind == SectionKind::loop) return p->index;
    return 0;
  }

  void dispatch(Request& r, NodeId node, Activation* act, int stream, const Chunk* chunk,
                Outcome* out) {
    const NodeSpec& n = g.nodes[node];
    Item* item = new_item();
    item->request = r.id;
    item->node = node;
    item->walk = r.walk;
    item->req = &r;
    item->act = act;
    item->stream = stream;
    item->iteration = innermost_iteration(
        r, act != nullptr ? act : r.streams[static_cast<std::size_t>(stream)].consumer);
    item->offsets.reserve(n.inputs.size() + 1);
    item->offsets.push_back(0);
    const StreamState* ss = stream >= 0 ? &r.streams[static_cast<std::size_t>(stream)] : nullptr;
    for (NameId in : n.inputs) {
      if (ss != nullptr && in == ss->spec->name) {
        for (std::uint64_t p = chunk->begin; p < chunk->end; ++p)
          item->handles.push_back(ss->items[static_cast<std::size_t>(p - ss->base)]);
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
    if (chunk != nullptr) {
      item->windowed = true;
      item->chunk = *chunk;
    }
    for (Handle h : item->handles) retain(h);
    item->queued_ns = now_ns();
    ++r.queued;
    auto& q = engines[n.engine];
    q.insert(item);
    q.cv.notify_one();
  }

  /// Windows go out once the walk has reached the consumer (its place in the walk says when it
  /// may run: put it in a Parallel with the producer to stream while the producer runs).
  void pump(Request& r, std::size_t st, Outcome* out) {
    StreamState& s = r.streams[st];
    if (s.inflight || s.consumer == nullptr || r.state != Request::State::running) return;
    Chunk chunk;
    switch (s.cursor.next(s.base, s.written, s.ended, &chunk)) {
      case ChunkCursor::Next::ready:
        s.inflight = s.any_sent = true;
        s.last_sent = chunk.last;
        return dispatch(r, s.spec->consumer, nullptr, static_cast<int>(st), &chunk, out);
      case ChunkCursor::Next::finished:
        if (s.any_sent && !s.last_sent) {
          // The stream ended right after a full window: tell the consumer with an empty last one.
          chunk.begin = chunk.new_begin = chunk.end = s.written;
          chunk.index = s.cursor.index();
          chunk.last = true;
          s.inflight = s.last_sent = true;
          return dispatch(r, s.spec->consumer, nullptr, static_cast<int>(st), &chunk, out);
        }
        {
          Activation* a = s.consumer;
          s.consumer = nullptr;
          done(r, a, out);
        }
        return;
      case ChunkCursor::Next::wait:
        return;
    }
  }

  // ---- request lifecycle ----------------------------------------------------------------------

  void begin_walk(Request& r, WalkId w, Outcome* out) {
    if (w >= g.walks.size()) throw std::invalid_argument("unknown walk id " + std::to_string(w));
    r.walk = w;
    r.state = Request::State::running;
    r.streams.clear();
    r.streams.reserve(g.walks[w].streams.size());
    for (const StreamSpec& spec : g.walks[w].streams) r.streams.emplace_back(spec);
    start(r, new_act(r, g.walks[w].root, nullptr), out);
  }

  void clear_streams(Request& r, Outcome* out) {
    for (StreamState& s : r.streams)
      for (Handle h : s.items) release(h, out);
    r.streams.clear();
  }

  void walk_done(Request& r, Outcome* out) {
    const auto& persist = persisted_anywhere;  // the compiler lets any later walk read them
    for (NameId n = 0; n < r.env.size(); ++n)
      if (!persist[n] && !r.is_input[n]) clear_slot(r.env[n], out);
    clear_streams(r, out);
    r.state = Request::State::between_walks;
    out->walks_done.push_back(r.id);
  }

  /// Frees everything the request holds; it disappears once its in-flight items are back.
  void end_request(Request& r, Outcome* out) {
    r.state = Request::State::over;
    if (r.queued != 0) {  // cancellation is rare: a scan of the ready queues is fine
      for (auto& q : engines) {
        auto keep = std::remove_if(q.ready.begin(), q.ready.end(), [&](Item* it) {
          if (it->req != &r) return false;
          for (Handle h : it->handles) release(h, out);
          free_item(it);
          return true;
        });
        q.ready.erase(keep, q.ready.end());
      }
      r.queued = 0;
    }
    while (!r.live.empty()) drop_act(r, r.live.back(), out);
    clear_streams(r, out);
    for (Slot& s : r.env) clear_slot(s, out);
    finished_timelines[r.id] = std::move(r.timeline);
  }

  // ---- request recycling ----------------------------------------------------------------------
  // A finished request's buffers (names, flags, timeline) are kept for the next one, so a steady
  // stream of short requests allocates little beyond the two map nodes per request.

  std::unique_ptr<Request> new_request() {
    if (spare_requests.empty()) return std::make_unique<Request>();
    std::unique_ptr<Request> r = std::move(spare_requests.back());
    spare_requests.pop_back();
    r->id = r->seq = 0;
    r->options = SubmitOptions{};
    r->walk = 0;
    r->state = Request::State::running;
    r->live.clear();
    r->streams.clear();
    r->queued = r->inflight = 0;
    r->timeline.clear();
    if (!spare_timelines.empty()) {
      r->timeline = std::move(spare_timelines.back());
      spare_timelines.pop_back();
    }
    return r;
  }

  void recycle(std::unique_ptr<Request> r) {
    if (spare_requests.size() < kSpares) spare_requests.push_back(std::move(r));
  }

  void recycle_timeline(std::vector<TimelineEvent>&& t) {
    if (spare_timelines.size() >= kSpares || t.capacity() > kSpareTimelineCapacity) return;
    t.clear();
    spare_timelines.push_back(std::move(t));
  }

  /// Erases a request that is over once no engine holds its items. Called last by each public
  /// entry point, never in the middle of walking (callers up the stack still hold `r`).
  void reap(RequestId id) {
    auto it = requests.find(id);
    if (it != requests.end() && it->second->state == Request::State::over && it->second->inflight == 0) {
      std::unique_ptr<Request> r = std::move(it->second);
      requests.erase(it);
      recycle(std::move(r));
    }
  }

  void fail_request(Request& r, const std::string& message, Outcome* out) {
    if (r.state == Request::State::over) return;
    out->failed.emplace_back(r.id, message);
    end_request(r, out);
  }

  Request* find(RequestId id) {
    auto it = requests.find(id);
    return it == requests.end() ? nullptr : it->second.get();
  }

  // ---- completion -----------------------------------------------------------------------------

  void complete_one(const Completion& c, std::int64_t t, Outcome* out) {
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
    for (Handle h : c.outputs)
      if (h == kReservedHandle) throw std::invalid_argument("complete: handle ~0 is reserved");
    for (Handle h : c.outputs) retain(h);  // balanced below: unreferenced outputs are released
    for (Handle h : item->handles) release(h, out);
    if (r.state == Request::State::running) {
      if (c.outputs.size() != n.outputs.size()) {
        fail_request(r, "node '" + n.name + "' returned " + std::to_string(c.outputs.size()) +
                            " outputs, expected " + std::to_string(n.outputs.size()), out);
      } else {
        r.timeline.push_back({item->node, item->walk, item->iteration, item->batch_size,
                              item->queued_ns, item->started_ns, t});
        apply_outputs(r, *item, c, out);
      }
    }
    for (Handle h : c.outputs) release(h, out);
    reap(r.id);
  }

  void apply_outputs(Request& r, const Item& item, const Completion& c, Outcome* out) {
    const NodeSpec& n = g.nodes[item.node];
    const auto& ix = index[r.walk];
    for (std::size_t k = 0; k < n.outputs.size(); ++k) {
      const Handle h = c.outputs[k];
      if (h == 0) continue;
      const NameId name = n.outputs[k];
      const auto& emits = ix.emit_names[item.node];
      if (std::find(emits.begin(), emits.end(), name) != emits.end())
        out->emits.push_back({r.id, item.node, name, h});
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
      StreamState& s = r.streams[static_cast<std::size_t>(item.stream)];
      const std::uint64_t keep = s.cursor.advance(item.chunk);
      while (s.base < keep && !s.items.empty()) {
        release(s.items.front(), out);
        s.items.pop_front();
        ++s.base;
      }
      s.inflight = false;
      pump(r, static_cast<std::size_t>(item.stream), out);
    } else {
      done(r, item.act, out);
    }
  }
};

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
  m.begin_walk(ref, walk, out);
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
  impl_->reap(id);
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

bool Conductor::cancel(RequestId id, Outcome* out) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  Request* r = impl_->find(id);
  if (r == nullptr || r->state == Request::State::over) return false;
  impl_->end_request(*r, out);
  impl_->reap(id);
  return true;
}

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
  if (!q.cv.wait_for(lock, timeout, [&] { return m.stopping || !q.ready.empty(); })) return;
  if (m.stopping || q.ready.empty()) return;
  Item* first = q.ready.front();
  const std::size_t limit = std::min<std::size_t>(std::max<std::size_t>(max_batch, 1),
                                                  m.g.nodes[first->node].max_batch);
  const std::int64_t t = now_ns();
  std::size_t kept = 0;  // compact the queue in place while taking the batch out of it
  for (std::size_t i = 0; i < q.ready.size(); ++i) {
    Item* item = q.ready[i];
    if (batch.size() < limit && item->node == first->node && item->walk == first->walk) {
      --item->req->queued;
      ++item->req->inflight;
      ++m.inflight;
      item->started_ns = t;
      batch.push_back(item);
    } else {
      q.ready[kept++] = item;
    }
  }
  q.ready.resize(kept);
  for (const WorkItem* w : batch)
    static_cast<Item*>(const_cast<WorkItem*>(w))->batch_size = static_cast<std::uint32_t>(batch.size());
}

bool Conductor::wait_ready(EngineId engine, std::chrono::nanoseconds timeout) {
  std::unique_lock<std::mutex> lock(impl_->mu);
  auto& m = *impl_;
  if (engine >= m.engines.size()) throw std::invalid_argument("wait_ready: unknown engine id");
  auto& q = m.engines[engine];
  timeout = std::min<std::chrono::nanoseconds>(timeout, std::chrono::hours(1));
  if (!m.stopping && q.ready.empty() && timeout > std::chrono::nanoseconds(0)) {
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
  q.cv.wait_for(lock, timeout, [&] { return m.stopping || !q.ready.empty(); });
  return !m.stopping && !q.ready.empty();
}

void Conductor::set_spin(std::chrono::nanoseconds spin) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->spin = std::max(spin, std::chrono::nanoseconds(0));
}

void Conductor::complete(const std::vector<Completion>& done, Outcome* out) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  const std::int64_t t = now_ns();
  for (const Completion& c : done) impl_->complete_one(c, t, out);
}

void Conductor::fail_items(const std::vector<std::uint64_t>& ids, const std::string& message,
                           Outcome* out) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  auto& m = *impl_;
  for (std::uint64_t id : ids) {
    Item* item = m.find_item(id);
    if (item == nullptr || item->batch_size == 0) continue;  // unknown or not in flight
    Request& r = *item->req;
    --r.inflight;
    --m.inflight;
    for (Handle h : item->handles) m.release(h, out);
    const std::string where = "node '" + m.g.nodes[item->node].name + "' in walk '" +
                              m.g.walks[item->walk].name + "' failed: ";
    m.free_item(item);
    m.fail_request(r, where + message, out);
    m.reap(r.id);
  }
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

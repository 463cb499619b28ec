// Streaming edges: a producer's items, cut into chunks by the chunk policy, for the consumer.
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

/// A stream's producer scope, or the section holding it and the consumer, starting again (an
/// outer loop's next iteration) starts a fresh stream: positions, chunks and the end-of-stream
/// flag begin anew -- before the consumer can look at it, whichever of the two starts first.
void Conductor::Impl::restart_streams(Request& r, std::uint32_t section, Outcome* out) {
  for (int st : index[r.walk].restarts_streams[section]) {
    StreamState& s = r.streams[static_cast<std::size_t>(st)];
    if (s.written == 0 && !s.ended) continue;  // first use: nothing to reset
    for (std::size_t i = 0; i < s.items.size(); ++i) release(s.items[i], out);
    s.items.clear();
    s.base = s.written = 0;
    s.ended = s.inflight = s.last_sent = false;
    s.cursor.reset();
  }
}

/// Chunks go out once the walk has reached the consumer (its place in the walk says when it
/// may run: put it in a Parallel with the producer to stream while the producer runs). A
/// consumer of several streams runs when each has a window ready or is over; its streams share
/// one activation and one chunk in flight.
void Conductor::Impl::pump(Request& r, std::size_t st, Outcome* out) {
  const NodeId node = r.streams[st].spec->consumer;
  const auto& mine = index[r.walk].consumes_streams[node];
  StreamState& first = r.streams[static_cast<std::size_t>(mine.front())];
  if (first.inflight || first.consumer == nullptr || r.state != Request::State::running) return;
  const std::size_t n = mine.size();
  Chunk* chunks = chunk_scratch(n);
  bool any_ready = false, all_last = true;
  const StreamState* past_end = nullptr;  // a stream read past its end without continue_after_done
  for (std::size_t k = 0; k < n; ++k) {
    StreamState& s = r.streams[static_cast<std::size_t>(mine[k])];
    switch (s.cursor.next(s.base, s.written, s.ended, &chunks[k])) {
      case ChunkCursor::Next::wait:
        return;  // every window together: this one is not there yet
      case ChunkCursor::Next::ready:
        any_ready = true;
        all_last = all_last && chunks[k].last;
        break;
      case ChunkCursor::Next::finished:
        chunks[k] = Chunk{};
        chunks[k].begin = chunks[k].new_begin = chunks[k].end = s.written;
        chunks[k].index = s.cursor.index();
        chunks[k].last = true;
        all_last = all_last && s.last_sent;
        if (!s.spec->continue_after_done && past_end == nullptr) past_end = &s;
        break;
    }
  }
  const bool per_execution = first.spec->per_execution;
  if (!any_ready && per_execution) {
    if (past_end != nullptr)
      return fail_request(r, "node '" + g.nodes[node].name + "' in walk '" + walk_of(r).name +
                                 "' runs again after the stream '" + g.names[past_end->spec->name] +
                                 "' of '" + g.nodes[past_end->spec->producer].name + "' is over; "
                                 "stop its loop when the stream ends, or set "
                                 "continue_after_done=True on the StreamingGraphEdge to read empty "
                                 "windows",
                          out);
    return dispatch_chunks(r, node, first.consumer, &mine, chunks, false, out);
  }
  if (any_ready) {
    for (std::size_t k = 0; k < n; ++k)
      if (chunks[k].last) r.streams[static_cast<std::size_t>(mine[k])].last_sent = true;
    return dispatch_chunks(r, node, per_execution ? first.consumer : nullptr, &mine, chunks, false,
                           out);
  }
  // Every stream is over and the consumer (one activation for the whole stream) has seen all.
  if (!all_last && g.nodes[node].on_stream_end) {
    // No chunk said `last` (the stream ended on a chunk boundary, or was empty): the consumer
    // asked to be told, with a stream-end item rather than an empty chunk.
    for (int x : mine) r.streams[static_cast<std::size_t>(x)].last_sent = true;
    return dispatch_chunks(r, node, nullptr, &mine, chunks, true, out);
  }
  Activation* a = first.consumer;
  for (int x : mine) r.streams[static_cast<std::size_t>(x)].consumer = nullptr;
  done(r, a, out);
}

bool Conductor::push_stream(RequestId id, NodeId producer, NameId name, Handle h, Outcome* out) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  if (producer >= impl_->g.nodes.size() || name >= impl_->g.names.size())
    throw std::invalid_argument("push_stream: unknown node or name id");
  if (h == 0 || h == kReservedHandle) throw std::invalid_argument("push_stream: not a value handle");
  impl_->retain(h);  // balanced below: a value no stream took is released
  Request* r = impl_->find(id);
  bool taken = false;
  if (r != nullptr && r->state == Request::State::running) {
    for (int st : impl_->index[r->walk].produces_streams[producer]) {
      StreamState& s = r->streams[static_cast<std::size_t>(st)];
      if (s.spec->name != name || s.ended) continue;
      impl_->retain(h);
      s.items.push_back(h);
      ++s.written;
      taken = true;
      impl_->pump(*r, static_cast<std::size_t>(st), out);
      if (r->state != Request::State::running) break;
    }
  }
  impl_->release(h, out);
  if (r != nullptr) impl_->reap(id);
  return taken;
}

void Conductor::Impl::clear_streams(Request& r, Outcome* out) {
  for (StreamState& s : r.streams)
    for (std::size_t i = 0; i < s.items.size(); ++i) release(s.items[i], out);
  r.close_streams();
}

}  // namespace mstar

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

/// A stream's producer scope starting again (an outer loop's next iteration) starts a fresh
/// stream: positions, chunks and the end-of-stream flag begin anew.
void Conductor::Impl::restart_streams(Request& r, std::uint32_t section, Outcome* out) {
  for (int st : index[r.walk].ends_streams[section]) {
    StreamState& s = r.streams[static_cast<std::size_t>(st)];
    if (s.written == 0 && !s.ended) continue;  // first use: nothing to reset
    for (Handle h : s.items) release(h, out);
    s.items.clear();
    s.base = s.written = 0;
    s.ended = s.inflight = s.last_sent = false;
    s.cursor.reset();
  }
}

/// Chunks go out once the walk has reached the consumer (its place in the walk says when it
/// may run: put it in a Parallel with the producer to stream while the producer runs).
void Conductor::Impl::pump(Request& r, std::size_t st, Outcome* out) {
  StreamState& s = r.streams[st];
  if (s.inflight || s.consumer == nullptr || r.state != Request::State::running) return;
  Chunk chunk;
  switch (s.cursor.next(s.base, s.written, s.ended, &chunk)) {
    case ChunkCursor::Next::ready:
      s.inflight = true;
      s.last_sent = chunk.last;
      return dispatch(r, s.spec->consumer, nullptr, static_cast<int>(st), &chunk, out);
    case ChunkCursor::Next::finished:
      if (!s.last_sent && g.nodes[s.spec->consumer].on_stream_end) {
        // No chunk said `last` (the stream ended on a chunk boundary, or was empty): the
        // consumer asked to be told, with a stream-end item rather than an empty chunk.
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

void Conductor::Impl::clear_streams(Request& r, Outcome* out) {
  for (StreamState& s : r.streams)
    for (Handle h : s.items) release(h, out);
  r.streams.clear();
}

}  // namespace mstar

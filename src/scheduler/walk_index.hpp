// Per-walk lookups the Conductor computes once from the graph IR (walk_index.cpp checks the IR).
#pragma once

#include <cstdint>
#include <vector>

#include "mstar/graph.hpp"

namespace mstar::detail {

/// Per-walk lookups computed once from the IR.
struct WalkIndex {
  std::vector<int> node_section;                  // node -> its section, -1 if not in the walk
  std::vector<std::vector<NameId>> emit_names;    // node -> names it emits
  std::vector<std::vector<int>> produces_streams; // node -> streams it feeds
  // node -> the streams it consumes, in the order of its inputs (empty if none)
  std::vector<std::vector<int>> consumes_streams;
  std::vector<std::vector<int>> ends_streams;     // section -> streams its end closes
  // section -> streams that start afresh when it starts: each stream's producer scope, and the
  // innermost section holding both that scope and the consumer (so that a consumer that starts
  // before the producer scope, e.g. first in a Parallel inside an outer loop, never sees the
  // previous iteration's stream)
  std::vector<std::vector<int>> restarts_streams;
  std::vector<std::uint8_t> persist;              // name -> kept across walks
};

}  // namespace mstar::detail

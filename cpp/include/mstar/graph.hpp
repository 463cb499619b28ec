// mstar/graph.hpp — the compiled graph IR: what the Conductor runs.
//
// A model is (G, W): nodes (one component's forward pass each, run by an engine) and named walks,
// each a tree of sections over those nodes. GraphBuilder (graph_builder.hpp) validates a model and
// compiles it into this plain form; names (the data flowing between nodes) become small integer
// ids. The Conductor trusts the shape of the IR (Conductor::Conductor checks ids and throws on
// nonsense).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "mstar/chunk_policy.hpp"

namespace mstar {

using NameId = std::uint32_t;
using NodeId = std::uint32_t;
using WalkId = std::uint32_t;
using EngineId = std::uint32_t;
/// A value held by the embedding application's tensor store; 0 means "no value" and ~0 is
/// reserved (the Conductor uses it internally).
using Handle = std::uint64_t;
inline constexpr Handle kReservedHandle = ~Handle{0};

struct NodeSpec {
  std::string name;
  EngineId engine = 0;
  std::uint32_t max_batch = 1;   ///< the most work items of this node one batch may hold
  std::vector<NameId> inputs;    ///< in the order the node receives them
  std::vector<NameId> outputs;   ///< in the order the node reports them
  /// A stream consumer that wants to hear when its stream ends without a chunk marked `last`
  /// (it ended exactly where a chunk already sent ended, or carried no items): it then gets
  /// one stream-end work item (WorkItem::stream_end), with no chunk. Otherwise the end of
  /// stream costs no call, and either way every chunk is one the chunk policy makes.
  bool on_stream_end = false;
  /// A node whose work item is held open, not computed (a stream source the caller feeds,
  /// mstar_rt.StreamInput): how long it stays in flight says nothing of a node's cost, so it is
  /// kept out of the per-node run times that deadline admission (fail_late) estimates from.
  bool untimed = false;
};

/// `part`: one part of a request that advances on its own (e.g. a thinker and a talker of one
/// request, each a Part in a Parallel): it runs its children (sub-walks) one after another, each
/// chosen at run time by the model (Outcome::part_choices, Conductor::choose_part), and ends when
/// the model chooses none.
enum class SectionKind : std::uint8_t { node, sequential, parallel, loop, part };

struct SectionSpec {
  SectionKind kind = SectionKind::node;
  NodeId node = 0;                      ///< kind == node
  /// section indices (sequential, parallel; loop: one body; part: its sub-walks, in declaration
  /// order)
  std::vector<std::uint32_t> children;
  std::uint32_t max_iters = 1;          ///< loop
  bool dynamic = false;                 ///< loop: a DynamicLoop a node may stop per request
  NameId loop_name = 0;                 ///< dynamic loop: the name check_stop uses
  std::vector<NameId> outputs;          ///< loop: names visible after it with their last value
  std::vector<NameId> accumulated;      ///< loop: names visible after it as every iteration's value
  std::vector<NameId> scoped;           ///< loop: names made inside the body and dropped after it
  NameId part_name = 0;                 ///< part: its name (unique within the walk)
  std::vector<std::string> part_walks;  ///< part: the sub-walks' keys, aligned with children
};

/// A streaming edge: each execution of `producer` appends its output `name` as one item; the
/// consumer node runs on every chunk the policy makes of those items, reading them as `name`.
struct StreamSpec {
  NodeId producer = 0;
  NameId name = 0;
  NodeId consumer = 0;
  ChunkPolicy policy = ChunkPolicy::fixed(1);
  std::uint32_t producer_scope = 0;  ///< section whose end ends the stream (innermost loop or node)
  /// The consumer sits in a loop the producer is not in: each of its executions reads the next
  /// window (waiting for it), instead of one activation running every window of the stream.
  bool per_execution = false;
  /// A per-execution consumer goes on after the stream is over, reading empty windows.
  bool continue_after_done = false;
};

struct WalkSpec {
  std::string name;
  std::uint32_t root = 0;  ///< index into sections
  std::vector<SectionSpec> sections;
  std::vector<std::pair<NodeId, NameId>> emits;  ///< (node, output) pairs streamed to the caller
  std::vector<NameId> persist;                   ///< names kept for the next walk
  std::vector<StreamSpec> streams;
};

struct GraphSpec {
  std::vector<std::string> names;    ///< NameId -> name
  std::vector<std::string> engines;  ///< EngineId -> engine name
  std::vector<NodeSpec> nodes;
  std::vector<WalkSpec> walks;
};

}  // namespace mstar

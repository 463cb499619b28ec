// Checks the graph IR the Conductor is given and builds its per-walk lookups.
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

void Conductor::Impl::validate_and_index() {
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
    ix.consumes_streams.assign(g.nodes.size(), {});
    ix.ends_streams.resize(w.sections.size());
    ix.restarts_streams.resize(w.sections.size());
    ix.persist.assign(n_names, 0);
    if (w.root >= w.sections.size()) bad("walk '" + w.name + "' has no root section");
    std::vector<std::uint8_t> has_parent(w.sections.size(), 0);
    std::vector<int> parent(w.sections.size(), -1);
    for (std::uint32_t s = 0; s < w.sections.size(); ++s) {
      const SectionSpec& sec = w.sections[s];
      for (std::uint32_t c : sec.children) {
        // A tree: the root has no parent and every other section at most one, so a cycle
        // could only be one the root never reaches (and it is never run).
        if (c >= w.sections.size() || c == w.root || has_parent[c])
          bad("walk '" + w.name + "' sections do not form a tree");
        has_parent[c] = 1;
        parent[c] = static_cast<int>(s);
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
      if (sec.kind == SectionKind::part &&
          (sec.children.empty() || sec.part_name >= n_names ||
           sec.part_walks.size() != sec.children.size()))
        bad("walk '" + w.name + "' has a part without children, with an unknown name id, or "
            "whose walk keys do not match its children");
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
      const auto& inputs = g.nodes[st.consumer].inputs;
      if (std::find(inputs.begin(), inputs.end(), st.name) == inputs.end())
        bad("node '" + g.nodes[st.consumer].name + "' consumes a stream it does not read");
      for (int other : ix.consumes_streams[st.consumer])
        if (w.streams[static_cast<std::size_t>(other)].name == st.name)
          bad("node '" + g.nodes[st.consumer].name + "' consumes two streams of one name");
      ix.produces_streams[st.producer].push_back(static_cast<int>(k));
      ix.consumes_streams[st.consumer].push_back(static_cast<int>(k));
      ix.ends_streams[st.producer_scope].push_back(static_cast<int>(k));
      ix.restarts_streams[st.producer_scope].push_back(static_cast<int>(k));
      // The innermost section holding the producer scope and the consumer (at most
      // sections.size() steps up: a cycle the root never reaches is not walked forever).
      const auto at = [](int x) { return static_cast<std::size_t>(x); };
      std::vector<std::uint8_t> above_scope(w.sections.size(), 0);
      for (int x = static_cast<int>(st.producer_scope); x >= 0 && !above_scope[at(x)];
           x = parent[at(x)])
        above_scope[at(x)] = 1;
      int common = ix.node_section[st.consumer];
      for (std::size_t up = 0; common >= 0 && !above_scope[at(common)]; ++up)
        common = up < w.sections.size() ? parent[at(common)] : -1;
      if (common >= 0 && common != static_cast<int>(st.producer_scope))
        ix.restarts_streams[at(common)].push_back(static_cast<int>(k));
      // A Part may end without running its producer: its end ends the stream too (a consumer
      // outside it would otherwise wait forever). At most sections.size() steps up.
      int x = parent[st.producer_scope];
      for (std::size_t steps = 0; x >= 0 && steps < w.sections.size(); ++steps) {
        if (w.sections[at(x)].kind == SectionKind::part)
          ix.ends_streams[at(x)].push_back(static_cast<int>(k));
        x = parent[at(x)];
      }
    }
    for (NodeId n = 0; n < g.nodes.size(); ++n) {
      auto& mine = ix.consumes_streams[n];
      const auto& inputs = g.nodes[n].inputs;
      const auto position = [&](int st) {
        return std::find(inputs.begin(), inputs.end(), w.streams[static_cast<std::size_t>(st)].name) -
               inputs.begin();
      };
      std::sort(mine.begin(), mine.end(), [&](int a, int b) { return position(a) < position(b); });
      for (int st : mine)  // one consumer runs all its windows together, in one mode
        if (w.streams[static_cast<std::size_t>(st)].per_execution !=
            w.streams[static_cast<std::size_t>(mine.front())].per_execution)
          bad("node '" + g.nodes[n].name + "' consumes streams in two modes");
    }
    index.push_back(std::move(ix));
  }
}

}  // namespace mstar

// GraphBuilder: validates a graph and its walks and compiles them into the IR. The one home of the
// graph rules and their messages (see mstar/graph_builder.hpp); tests/python/test_graph_validation.py
// pins the messages, and checks that the Python DSL gets them word for word.
#include "mstar/graph_builder.hpp"

#include <algorithm>
#include <limits>
#include <map>
#include <set>
#include <tuple>

namespace mstar {

GraphBuilder& GraphBuilder::input(std::string name) {
  inputs_.push_back(std::move(name));
  return *this;
}

GraphBuilder& GraphBuilder::node(std::string name, std::vector<std::string> inputs,
                                 std::vector<Edge> outputs, std::string engine,
                                 std::uint32_t max_batch, bool on_stream_end, bool untimed) {
  nodes_.push_back({std::move(name), std::move(inputs), std::move(outputs), std::move(engine),
                    max_batch, on_stream_end, untimed});
  return *this;
}

GraphBuilder& GraphBuilder::walk(std::string name, Section root) {
  walks_.emplace_back(std::move(name), std::move(root));
  return *this;
}

GraphBuilder& GraphBuilder::elsewhere(std::string name) {
  elsewhere_.insert(std::move(name));
  return *this;
}

namespace {

using Node = GraphBuilder::Node;
using NodeMap = std::map<std::string, const Node*>;

struct Names {
  std::vector<std::string> list;
  std::map<std::string, NameId> ids;
  NameId operator()(const std::string& n) {
    auto it = ids.find(n);
    if (it != ids.end()) return it->second;
    list.push_back(n);
    return ids[n] = static_cast<NameId>(list.size() - 1);
  }
};

// As Python prints a sorted list of names: ['a', 'b'].
std::string name_list(std::set<std::string> names) {
  std::string s = "[";
  for (const auto& n : names) s += (s.size() > 1 ? ", '" : "'") + n + "'";
  return s + "]";
}

void nodes_in(const Section& s, std::vector<std::string>* out) {
  if (s.kind == SectionKind::node) {
    out->push_back(s.node);
    return;
  }
  for (const Section& c : s.children) nodes_in(c, out);
}

// node -> its path from the root: (section, kind, child index) per level.
using Step = std::tuple<const Section*, SectionKind, std::size_t>;
void paths(const Section& s, std::vector<Step> prefix, std::map<std::string, std::vector<Step>>* out) {
  if (s.kind == SectionKind::node) {
    (*out)[s.node] = prefix;
    return;
  }
  for (std::size_t i = 0; i < s.children.size(); ++i) {
    auto p = prefix;
    p.emplace_back(&s, s.kind, i);
    paths(s.children[i], p, out);
  }
}

// node -> innermost enclosing loop or sub-walk of a Part (nullptr outside both): the sub-walks of
// a Part run one at a time, as walks do, so each may produce the names the others do.
void loop_levels(const Section& s, const Section* loop, std::map<std::string, const Section*>* out) {
  if (s.kind == SectionKind::node) {
    (*out)[s.node] = loop;
    return;
  }
  for (const Section& c : s.children)
    loop_levels(c, s.kind == SectionKind::loop ? &s : s.kind == SectionKind::part ? &c : loop, out);
}

// Names a section leaves visible after it: its nodes' outputs, less what loops keep inside.
void made_by(const Section& s, const NodeMap& graph, const std::set<std::string>& persisted,
             std::set<std::string>* out);

std::vector<std::string> output_names(const Node& n) {
  std::vector<std::string> v;
  for (const Edge& e : n.outputs)
    if (std::find(v.begin(), v.end(), e.name) == v.end()) v.push_back(e.name);
  return v;
}

void made_by(const Section& s, const NodeMap& graph, const std::set<std::string>& persisted,
             std::set<std::string>* out) {
  if (s.kind == SectionKind::node) {
    auto n = graph.find(s.node);
    if (n != graph.end())
      for (const auto& o : output_names(*n->second)) out->insert(o);
    return;
  }
  if (s.kind != SectionKind::loop) {
    for (const Section& c : s.children) made_by(c, graph, persisted, out);
    return;
  }
  std::set<std::string> inside;
  for (const Section& c : s.children) made_by(c, graph, persisted, &inside);
  for (const auto& x : inside)
    if (persisted.count(x)) out->insert(x);
  out->insert(s.outputs.begin(), s.outputs.end());
  out->insert(s.accumulated.begin(), s.accumulated.end());
}

class WalkCompiler {
 public:
  WalkCompiler(const std::string& walk, const Section& root, const NodeMap& graph,
               const std::vector<std::string>& inputs, const std::set<std::string>& persisted,
               Names& names, const std::map<std::string, NodeId>& node_ids)
      : walk_(walk), graph_(graph), persisted_(persisted), names_(names), node_ids_(node_ids) {
    std::vector<std::string> members;
    nodes_in(root, &members);
    // Every unknown node before any repeated one: a misspelt name is the likelier mistake.
    for (const auto& n : members)
      if (!graph.count(n))
        throw GraphError("walk '" + walk + "' runs node '" + n + "', which is not in the graph; "
                         "add GraphNode('" + n + "', ...) to the model's nodes or fix the name");
    for (const auto& n : members)
      if (!members_.insert(n).second)
        throw GraphError("node '" + n + "' appears twice in walk '" + walk + "'; a node runs at "
                         "most once per place: use a Loop to repeat it");
    // Who produces what in this walk. Two producers of one name are allowed only in different
    // loop levels (an initial value outside a loop, overwritten inside it every iteration).
    std::map<std::string, const Section*> level;
    loop_levels(root, nullptr, &level);
    std::map<std::pair<std::string, const Section*>, std::string> by_level;
    for (const auto& n : members)
      for (const auto& out : output_names(*graph.at(n))) {
        auto key = std::make_pair(out, level[n]);
        if (by_level.count(key))
          throw GraphError("output '" + out + "' is produced by both '" + by_level[key] + "' and '" +
                           n + "' in walk '" + walk + "'; rename one of them");
        by_level[key] = n;
        producer_.emplace(out, n);
      }
    std::map<std::string, std::vector<Step>> path;
    paths(root, {}, &path);
    for (const auto& n : members)
      for (const Edge& e : graph.at(n)->outputs) {
        if (!e.streaming) continue;
        if (e.to == n)  // its chunks would wait for items it makes only after running on them
          throw GraphError("node '" + n + "' streams '" + e.name + "' to itself in walk '" +
                           walk + "'; stream to another node");
        if (!members_.count(e.to))
          throw GraphError("streaming edge '" + e.name + "' from '" + n + "' goes to '" + e.to +
                           "', which walk '" + walk + "' does not run; add '" + e.to + "' to the walk");
        auto& reads = stream_input_[e.to];
        if (std::find(reads.begin(), reads.end(), e.name) != reads.end())
          throw GraphError("node '" + e.to + "' receives two streams named '" + e.name +
                           "' in walk '" + walk + "'; rename one of them");
        reads.push_back(e.name);
        streams_.push_back({n, &e});
        per_execution_[&e] = check_stream_placement(n, e.to, path);
      }
    std::set<std::string> available(inputs.begin(), inputs.end());
    available.insert(persisted.begin(), persisted.end());
    root_ = compile(root, available, {}).first;
  }

  WalkSpec spec() {
    WalkSpec w;
    w.name = walk_;
    w.root = root_;
    w.sections = sections_;
    for (const auto& n : members_)
      for (const Edge& e : graph_.at(n)->outputs) {
        if (!e.streaming && e.to == kEmit) w.emits.emplace_back(node_ids_.at(n), names_(e.name));
        const NameId id = names_(e.name);
        if (e.persist && std::find(w.persist.begin(), w.persist.end(), id) == w.persist.end())
          w.persist.push_back(id);
      }
    for (const auto& [producer, edge] : streams_) {
      StreamSpec s;
      s.producer = node_ids_.at(producer);
      s.name = names_(edge->name);
      s.consumer = node_ids_.at(edge->to);
      s.policy = edge->policy;
      s.producer_scope = scope_of_.at(producer);
      s.per_execution = per_execution_.at(edge);
      s.continue_after_done = edge->continue_after_done;
      w.streams.push_back(s);
    }
    return w;
  }

 private:
  // A consumer's windows can only run once the walk reaches it, and it ends with the stream: it
  // must not come before its producer, nor sit inside the loop that feeds it. Returns whether
  // the consumer runs per execution: it sits in a loop its producer is not in, so each run of it
  // (each iteration) reads one window, rather than one run reading the whole stream.
  bool check_stream_placement(const std::string& producer, const std::string& consumer,
                              std::map<std::string, std::vector<Step>>& path) {
    const auto& a = path[producer];
    const auto& b = path[consumer];
    std::size_t common = 0;
    while (common < std::min(a.size(), b.size()) && a[common] == b[common]) ++common;
    const Section* inner_loop = nullptr;
    for (const auto& step : a)
      if (std::get<1>(step) == SectionKind::loop) inner_loop = std::get<0>(step);
    for (const auto& step : b)
      if (inner_loop != nullptr && std::get<0>(step) == inner_loop)
        throw GraphError("node '" + consumer + "' consumes the stream of '" + producer +
                         "' inside the same Loop in walk '" + walk_ + "', but the stream ends only "
                         "when that loop does; place '" + consumer + "' after the loop or in a "
                         "Parallel with it");
    if (common < std::min(a.size(), b.size()) && std::get<1>(a[common]) == SectionKind::part)
      throw GraphError("node '" + consumer + "' consumes the stream of '" + producer + "' from "
                       "another walk of Part '" + std::get<0>(a[common])->part_name + "' in walk '" +
                       walk_ + "'; the walks of one Part run one at a time, so it would wait "
                       "forever if its walk ran first: pass the value by name instead");
    if (common < std::min(a.size(), b.size()) && std::get<1>(a[common]) == SectionKind::sequential &&
        std::get<2>(b[common]) < std::get<2>(a[common]))
      throw GraphError("node '" + consumer + "' consumes the stream of '" + producer + "' but runs "
                       "before it in walk '" + walk_ + "' and would wait forever; move it after '" +
                       producer + "' or put both in a Parallel");
    for (std::size_t k = common; k < b.size(); ++k)
      if (std::get<1>(b[k]) == SectionKind::loop) return true;
    return false;
  }

  std::uint32_t add(SectionSpec s) {
    sections_.push_back(std::move(s));
    return static_cast<std::uint32_t>(sections_.size() - 1);
  }

  // Each returns (section index, names available after it).
  std::pair<std::uint32_t, std::set<std::string>> compile(const Section& s,
                                                          const std::set<std::string>& available,
                                                          std::vector<std::uint32_t> loops) {
    if (s.kind == SectionKind::node) return node(s.node, available, loops);
    const std::uint32_t index = add(SectionSpec{});
    sections_[index].kind = s.kind;
    if (s.kind == SectionKind::sequential) {
      std::set<std::string> avail = available;
      for (const Section& part : s.children) {
        auto [child, after] = compile(part, avail, loops);
        sections_[index].children.push_back(child);
        avail = std::move(after);
      }
      return {index, avail};
    }
    if (s.kind == SectionKind::parallel) {
      std::set<std::string> after = available;
      for (const Section& branch : s.children) {
        auto [child, b_after] = compile(branch, available, loops);
        sections_[index].children.push_back(child);
        for (const auto& x : available)
          if (!b_after.count(x)) after.erase(x);
        for (const auto& x : b_after) after.insert(x);
      }
      return {index, after};
    }
    if (s.kind == SectionKind::part) return part(s, index, available, loops);
    return loop(s, index, available, std::move(loops));
  }

  // A Part runs its sub-walks in the order the model chooses, each any number of times: each may
  // read what any of them makes (a wrong order fails the request at run time, naming the name).
  std::pair<std::uint32_t, std::set<std::string>> part(const Section& s, std::uint32_t index,
                                                       const std::set<std::string>& available,
                                                       const std::vector<std::uint32_t>& loops) {
    if (s.part_name.empty())
      throw GraphError("a Part in walk '" + walk_ + "' needs a name: the model's next_part_walk "
                       "is asked by it");
    const std::string label = "Part '" + s.part_name + "' in walk '" + walk_ + "'";
    if (!part_names_.insert(s.part_name).second)
      throw GraphError("two Parts are named '" + s.part_name + "' in walk '" + walk_ +
                       "'; names must be unique within a walk");
    if (s.children.empty())
      throw GraphError(label + " has no walks; give it at least one");
    std::set<std::string> keys;
    for (const auto& k : s.part_walks) {
      if (k.empty()) throw GraphError(label + " has a walk named ''; name each walk");
      if (!keys.insert(k).second)
        throw GraphError(label + " has two walks named '" + k + "'");
    }
    std::set<std::string> inside = available;
    for (const Section& c : s.children) made_by(c, graph_, persisted_, &inside);
    sections_[index].part_name = names_(s.part_name);
    sections_[index].part_walks = s.part_walks;
    for (const Section& c : s.children) {
      const std::uint32_t child = compile(c, inside, loops).first;
      sections_[index].children.push_back(child);
    }
    return {index, inside};
  }

  std::pair<std::uint32_t, std::set<std::string>> loop(const Section& s, std::uint32_t index,
                                                       const std::set<std::string>& available,
                                                       std::vector<std::uint32_t> loops) {
    const std::string label = s.dynamic ? "DynamicLoop '" + s.loop_name + "'" : "Loop";
    if (s.children.size() != 1) throw GraphError(label + " in walk '" + walk_ + "' needs one body");
    if (s.max_iters < 1)
      throw GraphError(label + " in walk '" + walk_ + "' has max_iters=" +
                       std::to_string(s.max_iters) + "; it must be an integer >= 1");
    if (s.max_iters > std::numeric_limits<std::uint32_t>::max())
      throw GraphError(label + " in walk '" + walk_ + "' has max_iters=" +
                       std::to_string(s.max_iters) + "; it must be at most 4294967295");
    std::vector<std::string> inner;
    nodes_in(s.children[0], &inner);
    std::set<std::string> inside;
    for (const auto& n : inner)
      for (const auto& o : output_names(*graph_.at(n))) inside.insert(o);
    std::set<std::string> both;
    for (const auto& name : s.outputs)
      if (std::find(s.accumulated.begin(), s.accumulated.end(), name) != s.accumulated.end())
        both.insert(name);
    if (!both.empty())
      throw GraphError(label + " in walk '" + walk_ + "' lists " + name_list(both) + " as both an "
                       "output and an accumulated output; choose one (last value or every value)");
    std::vector<std::string> listed = s.outputs;
    listed.insert(listed.end(), s.accumulated.begin(), s.accumulated.end());
    for (const auto& name : listed)
      if (!inside.count(name))
        throw GraphError(label + " in walk '" + walk_ + "' lists '" + name + "' as an output, but "
                         "no node inside it produces that; fix the name or add the node");
    SectionSpec& e = sections_[index];
    e.max_iters = static_cast<std::uint32_t>(s.max_iters);
    for (const auto& n : s.outputs) e.outputs.push_back(names_(n));
    for (const auto& n : s.accumulated) e.accumulated.push_back(names_(n));
    if (s.dynamic) {
      if (s.loop_name.empty())
        throw GraphError("a DynamicLoop in walk '" + walk_ + "' needs a name: check_stop stops "
                         "loops by name");
      if (!loop_names_.insert(s.loop_name).second)
        throw GraphError("two DynamicLoops named '" + s.loop_name + "' in walk '" + walk_ +
                         "'; names must be unique within a walk");
      e.dynamic = true;
      e.loop_name = names_(s.loop_name);
    }
    loops.push_back(index);
    const std::uint32_t child = compile(s.children[0], available, loops).first;
    sections_[index].children = {child};
    for (const auto& name : s.accumulated)  // inner loops are compiled by now
      if (accumulated_.count(name))
        throw GraphError(label + " in walk '" + walk_ + "' accumulates '" + name + "', which an "
                         "inner Loop already accumulates; nested accumulation is not supported: "
                         "accumulate it in one of the two loops");
    accumulated_.insert(s.accumulated.begin(), s.accumulated.end());
    std::set<std::string> kept(listed.begin(), listed.end());
    for (const auto& x : inside)
      if (persisted_.count(x)) kept.insert(x);
    std::set<std::string> after = available;
    std::vector<NameId> scoped;
    for (const auto& x : inside)
      if (!kept.count(x)) {
        kept_inside_.emplace(x, label);
        scoped.push_back(names_(x));
        after.erase(x);
      }
    std::sort(scoped.begin(), scoped.end());
    sections_[index].scoped = scoped;
    after.insert(kept.begin(), kept.end());
    return {index, after};
  }

  std::pair<std::uint32_t, std::set<std::string>> node(const std::string& name,
                                                       const std::set<std::string>& available,
                                                       const std::vector<std::uint32_t>& loops) {
    SectionSpec spec;
    spec.kind = SectionKind::node;
    spec.node = node_ids_.at(name);
    const std::uint32_t index = add(spec);
    scope_of_[name] = loops.empty() ? index : loops.back();
    const Node& n = *graph_.at(name);
    auto stream = stream_input_.find(name);
    for (const auto& x : n.inputs) {
      if ((stream != stream_input_.end() &&
           std::find(stream->second.begin(), stream->second.end(), x) != stream->second.end()) ||
          available.count(x))
        continue;
      if (kept_inside_.count(x))
        throw GraphError("node '" + name + "' in walk '" + walk_ + "' reads '" + x + "', which is "
                         "made inside a " + kept_inside_[x] + " and stays there; list '" + x +
                         "' in that loop's outputs or accumulated_outputs");
      auto p = producer_.find(x);
      if (p != producer_.end() && p->second != name)
        throw GraphError("node '" + name + "' in walk '" + walk_ + "' reads '" + x + "', which '" +
                         p->second + "' produces only later or in a parallel branch (a cycle "
                         "outside a loop?); run '" + p->second + "' first, or put both in a Loop");
      if (p != producer_.end())
        throw GraphError("node '" + name + "' in walk '" + walk_ + "' reads its own output '" + x +
                         "' with no value for the first run; give it one (a request input or an "
                         "earlier node) and put the node in a Loop");
      throw GraphError("node '" + name + "' in walk '" + walk_ + "' reads '" + x + "', which no "
                       "node produces; add an edge named '" + x + "' or rename the input");
    }
    std::set<std::string> after = available;
    for (const auto& o : output_names(n)) after.insert(o);
    return {index, after};
  }

  std::string walk_;
  const NodeMap& graph_;
  const std::set<std::string>& persisted_;
  Names& names_;
  const std::map<std::string, NodeId>& node_ids_;
  std::set<std::string> members_;
  std::map<std::string, std::string> producer_;
  std::map<std::string, std::vector<std::string>> stream_input_;  // consumer -> names read as windows
  std::map<const Edge*, bool> per_execution_;
  std::vector<std::pair<std::string, const Edge*>> streams_;
  std::map<std::string, std::uint32_t> scope_of_;  // producer -> section that ends its stream
  std::set<std::string> accumulated_;  // names the loops compiled so far accumulate
  std::set<std::string> loop_names_;
  std::set<std::string> part_names_;
  std::map<std::string, std::string> kept_inside_;  // name made inside a loop, dropped after it
  std::vector<SectionSpec> sections_;
  std::uint32_t root_ = 0;
};

}  // namespace

GraphSpec GraphBuilder::compile() const {
  NodeMap graph;
  for (const Node& n : nodes_) {
    if (n.name.empty() || n.name == kEmit)
      throw GraphError("a node needs a name other than '' and '" + kEmit + "'");
    for (std::size_t i = 0; i < n.inputs.size(); ++i)
      if (std::find(n.inputs.begin(), n.inputs.begin() + static_cast<std::ptrdiff_t>(i),
                    n.inputs[i]) != n.inputs.begin() + static_cast<std::ptrdiff_t>(i))
        throw GraphError("node '" + n.name + "' reads '" + n.inputs[i] +
                         "' twice; list each input once");
    if (!graph.emplace(n.name, &n).second)
      throw GraphError("two nodes are named '" + n.name + "'; node names must be unique");
    if (n.max_batch < 1)
      throw GraphError("node '" + n.name + "' has max_batch 0; it must be >= 1");
  }
  if (walks_.empty()) throw GraphError("the model has no walks; add at least one");
  if (nodes_.empty()) throw GraphError("the model has no nodes; add at least one GraphNode");
  std::set<std::string> persisted;
  for (const Node& n : nodes_)
    for (const Edge& e : n.outputs) {
      if ((!e.to.empty() || e.streaming) && e.to != kEmit) {  // "": a plain output
        auto to = graph.find(e.to);
        if (to == graph.end())
          throw GraphError("edge '" + e.name + "' from '" + n.name + "' goes to '" + e.to +
                           "', which is not a node; use an existing node or EMIT");
        const auto& in = to->second->inputs;
        if (std::find(in.begin(), in.end(), e.name) == in.end())
          throw GraphError("edge '" + e.name + "' from '" + n.name + "' goes to '" + e.to +
                           "', which does not read '" + e.name + "'; add it to " + e.to + "'s inputs");
      }
      if (e.streaming && e.to == kEmit)
        throw GraphError("streaming edge '" + e.name + "' from '" + n.name + "' goes to EMIT; "
                         "stream to a consumer node, or use GraphEdge(EMIT, ...) to emit each value");
      if (e.persist) persisted.insert(e.name);
    }
  Names names;
  for (const auto& x : inputs_) names(x);
  std::map<std::string, NodeId> node_ids;
  GraphSpec ir;
  for (const Node& n : nodes_) {
    node_ids[n.name] = static_cast<NodeId>(ir.nodes.size());
    NodeSpec spec;
    spec.name = n.name;
    auto e = std::find(ir.engines.begin(), ir.engines.end(), n.engine);
    if (e == ir.engines.end()) e = ir.engines.insert(ir.engines.end(), n.engine);
    spec.engine = static_cast<EngineId>(e - ir.engines.begin());
    spec.max_batch = n.max_batch;
    spec.on_stream_end = n.on_stream_end;
    spec.untimed = n.untimed;
    for (const auto& x : n.inputs) spec.inputs.push_back(names(x));
    for (const auto& x : output_names(n)) spec.outputs.push_back(names(x));
    ir.nodes.push_back(std::move(spec));
  }
  std::set<std::string> walk_names;
  for (const auto& [name, root] : walks_) {
    if (!walk_names.insert(name).second)
      throw GraphError("two walks are named '" + name + "'; walk names must be unique");
    WalkCompiler wc(name, root, graph, inputs_, persisted, names, node_ids);
    ir.walks.push_back(wc.spec());
  }
  std::vector<bool> walked(ir.nodes.size(), false);
  for (const WalkSpec& w : ir.walks)
    for (const SectionSpec& s : w.sections)
      if (s.kind == SectionKind::node) walked[s.node] = true;
  std::string idle;  // a node in no walk never runs: a walk it was meant for, forgotten
  for (std::size_t i = 0; i < walked.size(); ++i)
    if (!walked[i] && !elsewhere_.count(ir.nodes[i].name))
      idle += (idle.empty() ? "'" : ", '") + ir.nodes[i].name + "'";
  if (!idle.empty())
    throw GraphError("nodes [" + idle + "] are in no walk, so they would never run; put each "
                     "in a walk or leave it out of the model's nodes");
  ir.names = names.list;
  return ir;
}

}  // namespace mstar

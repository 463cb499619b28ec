// mstar::Section's factories (graph_builder.hpp): the section tree a walk is built from.
#include "mstar/graph_builder.hpp"

namespace mstar {

Section Section::seq(std::vector<Section> parts) {
  Section s;
  s.kind = SectionKind::sequential;
  s.children = std::move(parts);
  return s;
}

Section Section::par(std::vector<Section> branches) {
  Section s;
  s.kind = SectionKind::parallel;
  s.children = std::move(branches);
  return s;
}

Section Section::loop(Section body, std::int64_t max_iters, std::vector<std::string> outputs,
                      std::vector<std::string> accumulated) {
  Section s;
  s.kind = SectionKind::loop;
  s.children.push_back(std::move(body));
  s.max_iters = max_iters;
  s.outputs = std::move(outputs);
  s.accumulated = std::move(accumulated);
  return s;
}

Section Section::dynamic_loop(std::string name, Section body, std::int64_t max_iters,
                              std::vector<std::string> outputs, std::vector<std::string> accumulated) {
  Section s = loop(std::move(body), max_iters, std::move(outputs), std::move(accumulated));
  s.dynamic = true;
  s.loop_name = std::move(name);
  return s;
}

Section Section::part(std::string name, std::vector<std::pair<std::string, Section>> walks) {
  Section s;
  s.kind = SectionKind::part;
  s.part_name = std::move(name);
  for (auto& [key, walk] : walks) {
    s.part_walks.push_back(std::move(key));
    s.children.push_back(std::move(walk));
  }
  return s;
}

}  // namespace mstar

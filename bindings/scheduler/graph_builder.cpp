// Python classes GraphBuilder, GraphSpec, Edge, Section and the exception GraphError: the graph
// compiler (mstar/graph_builder.hpp) that python/mstar_rt/compiler.py lowers the DSL into, so
// that the rules and their messages live once, in C++.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "mstar/graph_builder.hpp"

namespace mstar::py_bind {

namespace py = pybind11;

namespace {

py::list names_of(const GraphSpec& g, const std::vector<NameId>& ids) {
  py::list out;
  for (NameId x : ids) out.append(g.names.at(x));
  return out;
}

}  // namespace

void bind_graph_builder(py::module_& m) {
  auto error = py::register_exception<GraphError>(m, "GraphError", PyExc_ValueError);
  error.attr("__doc__") =
      "A malformed graph or walk; the message names what is wrong, where, and what to do.";

  py::class_<Edge>(m, "Edge", "One output of a node (mstar::Edge): a value for a node, EMIT or "
                              "no one in particular, or a stream to a node.")
      .def(py::init([](std::string to, std::string name, bool persist) {
             return Edge{std::move(to), std::move(name), persist};
           }),
           py::arg("to"), py::arg("name"), py::arg("persist") = false)
      .def_static("output", &Edge::output, py::arg("name"), "A plain output, read by name.")
      .def_static("stream", &Edge::stream, py::arg("to"), py::arg("name"), py::arg("policy"),
                  py::arg("continue_after_done") = false)
      .def_readonly("to", &Edge::to)
      .def_readonly("name", &Edge::name)
      .def_readonly("persist", &Edge::persist)
      .def_readonly("streaming", &Edge::streaming);

  py::class_<Section>(m, "Section", "A walk's section tree (mstar::Section); a str is a node.")
      .def(py::init<std::string>(), py::arg("node"))
      .def_static("seq", &Section::seq, py::arg("parts"))
      .def_static("par", &Section::par, py::arg("branches"))
      .def_static("loop", &Section::loop, py::arg("body"), py::arg("max_iters"),
                  py::arg("outputs") = std::vector<std::string>{},
                  py::arg("accumulated") = std::vector<std::string>{})
      .def_static("dynamic_loop", &Section::dynamic_loop, py::arg("name"), py::arg("body"),
                  py::arg("max_iters"), py::arg("outputs") = std::vector<std::string>{},
                  py::arg("accumulated") = std::vector<std::string>{})
      .def_static("part", &Section::part, py::arg("name"), py::arg("walks"),
                  "A Part: sub-walks [(key, section)] the model chooses among at run time.");
  py::implicitly_convertible<py::str, Section>();

  // Opaque to Python but for what the runtime needs to look up by name; the Conductor takes it
  // as it is, so the IR never crosses the boundary as lists.
  py::class_<GraphSpec>(m, "GraphSpec", "The compiled graph IR (mstar::GraphSpec).")
      .def_property_readonly("names", [](const GraphSpec& g) { return g.names; })
      .def_property_readonly("engines", [](const GraphSpec& g) { return g.engines; })
      .def_property_readonly("walk_names", [](const GraphSpec& g) {
        py::list out;
        for (const WalkSpec& w : g.walks) out.append(w.name);
        return out;
      })
      .def_property_readonly(
          "nodes",
          [](const GraphSpec& g) {
            py::list out;
            for (const NodeSpec& n : g.nodes)
              out.append(py::make_tuple(n.name, n.engine, n.max_batch, n.inputs, n.outputs,
                                        n.on_stream_end));
            return out;
          },
          "[(name, engine id, max_batch, input name ids, output name ids, on_stream_end)]")
      .def("node_inputs", [](const GraphSpec& g, NodeId n) { return names_of(g, g.nodes.at(n).inputs); })
      .def("node_outputs", [](const GraphSpec& g, NodeId n) { return names_of(g, g.nodes.at(n).outputs); });

  py::class_<GraphBuilder>(m, "GraphBuilder", R"doc(
The graph compiler (mstar::GraphBuilder): declare inputs, nodes and walks, then compile() into a
GraphSpec for the Conductor, or raise GraphError naming what to fix. mstar_rt.compile_model
lowers the Python DSL into it; C++ models (mstar::Model) use the same one.)doc")
      .def(py::init<>())
      .def("input", &GraphBuilder::input, py::arg("name"), py::return_value_policy::reference_internal)
      .def("node", &GraphBuilder::node, py::arg("name"), py::arg("inputs"), py::arg("outputs"),
           py::arg("engine") = "default", py::arg("max_batch") = 1, py::arg("on_stream_end") = false,
           py::arg("untimed") = false, py::return_value_policy::reference_internal)
      .def("walk", &GraphBuilder::walk, py::arg("name"), py::arg("root"),
           py::return_value_policy::reference_internal)
      .def("elsewhere", &GraphBuilder::elsewhere, py::arg("name"),
           py::return_value_policy::reference_internal)
      .def("compile", &GraphBuilder::compile);
}

}  // namespace mstar::py_bind

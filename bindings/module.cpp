// mstar_rt._core: the compiled core. Python code imports the typed face in mstar_rt instead.
#include <pybind11/pybind11.h>

#include "core/producer.hpp"

namespace mstar::py_bind {
void bind_ring(py::module_& m);
void bind_stream(py::module_& m);
void bind_graph_builder(py::module_& m);
void bind_conductor(py::module_& m);
void bind_records(py::module_& m);
void bind_ready_queue(py::module_& m);
void bind_control(py::module_& m);
void bind_work_context(py::module_& m);
void bind_node_runner(py::module_& m);
void bind_spin(py::module_& m);
}  // namespace mstar::py_bind

PYBIND11_MODULE(_core, m) {
  namespace py = pybind11;
  m.doc() = "mstar_rt C++ core: lock-free rings, chunk policies, stream buffers, the graph "
            "compiler, the conductor";
  py::register_exception<mstar::py_bind::StreamClosed>(m, "StreamClosedError", PyExc_RuntimeError);
  mstar::py_bind::bind_ring(m);
  mstar::py_bind::bind_stream(m);
  mstar::py_bind::bind_work_context(m);
  mstar::py_bind::bind_graph_builder(m);  // before the Conductor, which takes its GraphSpec
  mstar::py_bind::bind_records(m);  // before the Conductor, which makes them
  mstar::py_bind::bind_node_runner(m);  // before the Conductor, which takes one
  mstar::py_bind::bind_conductor(m);
  mstar::py_bind::bind_ready_queue(m);
  mstar::py_bind::bind_control(m);
  mstar::py_bind::bind_spin(m);
}

// mstar_rt._core.WorkContext (request, iteration), built from C++ without calling into Python.
#pragma once

#include <pybind11/pybind11.h>

namespace mstar::py_bind {

namespace py = pybind11;

/// A new reference to WorkContext(request, iteration); nullptr with a Python error set on failure.
PyObject* new_work_context(PyObject* request, Py_ssize_t iteration);

void bind_work_context(py::module_& m);

}  // namespace mstar::py_bind

// mstar_rt.WorkContext: what a prepare_inputs hook gets per node execution. A C type, not a
// Python class: the Conductor's run_batch makes one per item of every batch it prepares, and a
// class with __init__ costs five times as much to build as this.
#include "scheduler/work_context.hpp"

#include <structmember.h>

#include <cstddef>

namespace mstar::py_bind {

namespace {

struct WorkContextObject {
  PyObject_HEAD
  PyObject* request;
  Py_ssize_t iteration;
};

PyTypeObject work_context_type = {PyVarObject_HEAD_INIT(nullptr, 0)};

WorkContextObject* as_wc(PyObject* self) { return reinterpret_cast<WorkContextObject*>(self); }

int wc_traverse(PyObject* self, visitproc visit, void* arg) {
  Py_VISIT(as_wc(self)->request);
  return 0;
}

int wc_clear(PyObject* self) {
  Py_CLEAR(as_wc(self)->request);
  return 0;
}

void wc_dealloc(PyObject* self) {
  PyObject_GC_UnTrack(self);
  wc_clear(self);
  Py_TYPE(self)->tp_free(self);
}

PyObject* wc_alloc(PyTypeObject* type, PyObject* request, Py_ssize_t iteration) {
  PyObject* self = type->tp_alloc(type, 0);
  if (self == nullptr) return nullptr;
  Py_INCREF(request);
  as_wc(self)->request = request;
  as_wc(self)->iteration = iteration;
  return self;
}

PyObject* wc_new(PyTypeObject* type, PyObject* args, PyObject* kwargs) {
  static const char* keywords[] = {"request", "iteration", nullptr};
  PyObject* request = nullptr;
  Py_ssize_t iteration = 0;
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O|n:WorkContext", const_cast<char**>(keywords),
                                   &request, &iteration))
    return nullptr;
  return wc_alloc(type, request, iteration);
}

PyObject* wc_repr(PyObject* self) {
  PyObject* id = PyObject_GetAttrString(as_wc(self)->request, "id");
  if (id == nullptr) {  // not a RequestContext: show the object itself
    PyErr_Clear();
    return PyUnicode_FromFormat("WorkContext(request=%R, iteration=%zd)", as_wc(self)->request,
                                as_wc(self)->iteration);
  }
  PyObject* text = PyUnicode_FromFormat("WorkContext(request=%S, iteration=%zd)", id,
                                        as_wc(self)->iteration);
  Py_DECREF(id);
  return text;
}

PyMemberDef wc_members[] = {
    {"request", T_OBJECT_EX, offsetof(WorkContextObject, request), 0,
     "The RequestContext: id, inputs, walk, and the model's own per-request state."},
    {"iteration", T_PYSSIZET, offsetof(WorkContextObject, iteration), 0,
     "The iteration of the innermost enclosing loop (0 outside loops)."},
    {nullptr, 0, 0, 0, nullptr}};

}  // namespace

PyObject* new_work_context(PyObject* request, Py_ssize_t iteration) {
  return wc_alloc(&work_context_type, request, iteration);
}

void bind_work_context(py::module_& m) {
  PyTypeObject& t = work_context_type;
  t.tp_name = "mstar_rt._core.WorkContext";
  t.tp_basicsize = sizeof(WorkContextObject);
  t.tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC;
  t.tp_doc =
      "WorkContext(request, iteration=0)\n\nPer-execution facts a submodule may want besides "
      "the inputs: the request and the iteration of the innermost enclosing loop.";
  t.tp_new = wc_new;
  t.tp_dealloc = wc_dealloc;
  t.tp_traverse = wc_traverse;
  t.tp_clear = wc_clear;
  t.tp_repr = wc_repr;
  t.tp_members = wc_members;
  if (PyType_Ready(&t) < 0) throw py::error_already_set();
  Py_INCREF(&t);
  m.add_object("WorkContext", py::reinterpret_borrow<py::object>(reinterpret_cast<PyObject*>(&t)));
}

}  // namespace mstar::py_bind

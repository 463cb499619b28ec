// mstar_rt._core.WorkItem and Outcome as C struct sequences (see records.hpp).
#include "scheduler/records.hpp"

#include <structseq.h>

namespace mstar::py_bind {

namespace {

PyStructSequence_Field work_item_fields[] = {
    {"id", "the work item's id (complete / fail_items take it)"},
    {"request", "the request's id"},
    {"iteration", "of the innermost enclosing loop (0 outside loops)"},
    {"inputs", "{input name: value, or a list for an accumulated output or stream chunk}"},
    {"chunk", "(begin, new_begin, end, last) of a stream consumer's chunk, else None"},
    {nullptr, nullptr}};
PyStructSequence_Desc work_item_desc = {
    "mstar_rt._core.WorkItem", "One node execution handed to an engine.", work_item_fields, 5};

PyStructSequence_Field outcome_fields[] = {
    {"emits", "[(request, name, value)] streamed to callers, in order"},
    {"walks_done", "[request] whose walk ended: ask the model for the next walk"},
    {"failed", "[(request, message)] that ended with an error"},
    {"expired", "[(request, node, refused, late_s)]: those of failed that their deadline ended"},
    {"part_choices", "[(request, section, part, finished)]: a Part waits for the model to choose "
                     "its next walk (finished: the index of the walk that ended, -1 at its start)"},
    {nullptr, nullptr}};
PyStructSequence_Desc outcome_desc = {
    "mstar_rt._core.Outcome", "What a Conductor call changed that the caller acts on.",
    outcome_fields, 5};

PyTypeObject* work_item_type = nullptr;
PyTypeObject* outcome_type = nullptr;

py::object make(PyTypeObject* type, std::initializer_list<PyObject*> fields) {
  PyObject* r = PyStructSequence_New(type);
  if (r == nullptr) throw py::error_already_set();
  Py_ssize_t i = 0;
  for (PyObject* f : fields) PyStructSequence_SET_ITEM(r, i++, f);  // steals f
  return py::reinterpret_steal<py::object>(r);
}

}  // namespace

py::object new_work_item(std::uint64_t id, std::uint64_t request, std::uint32_t iteration,
                         const py::object& inputs, const py::object& chunk) {
  return make(work_item_type, {PyLong_FromUnsignedLongLong(id),
                               PyLong_FromUnsignedLongLong(request),
                               PyLong_FromUnsignedLong(iteration), inputs.inc_ref().ptr(),
                               chunk.inc_ref().ptr()});
}

py::object new_outcome(const py::object& emits, const py::object& walks_done,
                       const py::object& failed, const py::object& expired,
                       const py::object& part_choices) {
  return make(outcome_type, {emits.inc_ref().ptr(), walks_done.inc_ref().ptr(),
                             failed.inc_ref().ptr(), expired.inc_ref().ptr(),
                             part_choices.inc_ref().ptr()});
}

void bind_records(py::module_& m) {
  work_item_type = PyStructSequence_NewType(&work_item_desc);
  outcome_type = PyStructSequence_NewType(&outcome_desc);
  if (work_item_type == nullptr || outcome_type == nullptr) throw py::error_already_set();
  m.add_object("WorkItem", py::reinterpret_borrow<py::object>(reinterpret_cast<PyObject*>(work_item_type)));
  m.add_object("Outcome", py::reinterpret_borrow<py::object>(reinterpret_cast<PyObject*>(outcome_type)));
}

}  // namespace mstar::py_bind

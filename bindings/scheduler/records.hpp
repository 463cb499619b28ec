// mstar_rt._core.WorkItem and Outcome: what crosses between the Conductor and Python, as named
// records (C struct sequences: built from C++ as cheaply as a tuple, read by name in Python).
#pragma once

#include <pybind11/pybind11.h>

namespace mstar::py_bind {

namespace py = pybind11;

/// WorkItem(id, request, iteration, inputs, chunk): one node execution handed to an engine;
/// `chunk` is (begin, new_begin, end, last) for a stream consumer (empty at a stream's end),
/// else None. Steals nothing: takes new references to `inputs` and `chunk`.
py::object new_work_item(std::uint64_t id, std::uint64_t request, std::uint32_t iteration,
                         const py::object& inputs, const py::object& chunk);

/// Outcome(emits, walks_done, failed, expired, part_choices): what a Conductor call changed that the caller
/// acts on: emits [(request, name, value)], walks_done [request], failed [(request, message)],
/// expired [(request, node name, refused, seconds late)] (those of `failed` their deadline ended),
/// part_choices [(request, section, part name, finished child or -1)].
py::object new_outcome(const py::object& emits, const py::object& walks_done,
                       const py::object& failed, const py::object& expired,
                       const py::object& part_choices);

void bind_records(py::module_& m);

}  // namespace mstar::py_bind

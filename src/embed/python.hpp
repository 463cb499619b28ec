// Shared by the embed sources: turning a Python exception into a message.
#pragma once

#include <pybind11/pybind11.h>

#include <string>

namespace mstar {

/// "TypeError: message"; with `where`, " (at file:line)" of the frame that raised. Needs the GIL.
std::string python_error_text(pybind11::error_already_set& e, bool where = false);

}  // namespace mstar

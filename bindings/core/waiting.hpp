// Blocking calls from Python: wait with the GIL released, in slices, so Ctrl-C still works.
#pragma once

#include <pybind11/pybind11.h>

#include <algorithm>
#include <chrono>
#include <optional>
#include <string>

#include "mstar/spsc_ring.hpp"

namespace mstar::py_bind {

namespace py = pybind11;

/// Python timeouts: None waits forever, a number is seconds (0 = do not wait).
inline Timeout to_timeout(std::optional<double> seconds) {
  if (!seconds) return kForever;
  // NaN fails every comparison (it waited forever); a cast of a value past the duration's range
  // is undefined: inf and anything from a year up are forever.
  if (!(*seconds >= 0)) throw py::value_error("timeout must be None or a number >= 0 seconds");
  if (*seconds >= 365.0 * 24 * 3600) return kForever;
  return std::chrono::duration_cast<Timeout>(std::chrono::duration<double>(*seconds));
}

/// Raises Python's built-in TimeoutError.
[[noreturn]] inline void raise_timeout(const std::string& message) {
  PyErr_SetString(PyExc_TimeoutError, message.c_str());
  throw py::error_already_set();
}

/// Calls `wait(slice)` (a function returning WaitStatus that blocks up to `slice`) with the GIL
/// released, 50 ms at a time, checking for KeyboardInterrupt between slices, until it reports
/// ready/closed or `timeout` passes. Must be called with the GIL held.
template <class Wait>
WaitStatus wait_released(Wait&& wait, Timeout timeout) {
  constexpr Timeout kSlice = std::chrono::milliseconds(50);
  const auto start = std::chrono::steady_clock::now();
  for (;;) {
    Timeout slice = kSlice;
    if (timeout != kForever) {
      const Timeout left =
          timeout - std::chrono::duration_cast<Timeout>(std::chrono::steady_clock::now() - start);
      slice = std::max(Timeout::zero(), std::min(slice, left));
    }
    WaitStatus status;
    if (slice == Timeout::zero()) {
      status = wait(slice);  // a poll: still reports ready or closed, so timeout=0 sees the end
    } else {
      py::gil_scoped_release nogil;
      status = wait(slice);
    }
    if (status != WaitStatus::timeout || slice == Timeout::zero()) return status;
    if (PyErr_CheckSignals() != 0) throw py::error_already_set();
  }
}

}  // namespace mstar::py_bind

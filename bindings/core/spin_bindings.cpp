// spin_until_changed: the placement transport's short wait for a shared-memory word
// (python/mstar_rt/placement/mailbox.py).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <chrono>
#include <cstdint>
#include <stdexcept>
#include <vector>

#include "core/spin_wait.hpp"

namespace py = pybind11;

namespace mstar::py_bind {

void bind_spin(py::module_& m) {
  m.def(
      "spin_until_changed",
      [](const std::vector<std::uintptr_t>& addresses, const std::vector<std::uint64_t>& values,
         double budget_s) {
        if (addresses.size() != values.size())
          throw py::value_error("spin_until_changed: one expected value per address");
        if (!(budget_s >= 0.0) || budget_s > 1.0)
          throw py::value_error("spin_until_changed: budget_s must be in [0, 1] seconds");
        for (std::uintptr_t a : addresses) {
          if (a == 0 || a % alignof(std::uint64_t) != 0)
            throw py::value_error("spin_until_changed: addresses must be 8-byte aligned words");
        }
        std::vector<const std::uint64_t*> words;
        words.reserve(addresses.size());
        for (std::uintptr_t a : addresses) words.push_back(reinterpret_cast<const std::uint64_t*>(a));
        const auto budget = std::chrono::nanoseconds(static_cast<std::int64_t>(budget_s * 1e9));
        py::gil_scoped_release release;
        return detail::spin_until_changed(words.data(), values.data(), words.size(), budget);
      },
      py::arg("addresses"), py::arg("values"), py::arg("budget_s"),
      "Index of the first 64-bit word (by address) that no longer holds its value, or -1 after "
      "budget_s seconds; the GIL is released meanwhile. The words must stay mapped: the caller "
      "holds what keeps them so.");
}

}  // namespace mstar::py_bind

// Python class Ring: an SpscRing of numpy items.
#include <pybind11/stl.h>

#include <cstring>

#include "core/producer.hpp"

namespace mstar::py_bind {

namespace {

class PyRing {
 public:
  PyRing(const py::object& dtype, std::size_t capacity, std::vector<py::ssize_t> item_shape,
         const std::string& overflow, std::size_t mirror)
      : layout_(dtype, std::move(item_shape)),
        ring_(layout_.item_bytes, capacity, parse_overflow(overflow), mirror) {}

  std::size_t push(py::array items, std::optional<double> timeout) {
    return push_array(ring_, layout_, producer_, std::move(items), timeout);
  }
  py::array reserve(py::object self, std::size_t max_count) {
    return reserve_view(ring_, layout_, producer_, max_count, self);
  }
  void commit(std::size_t count) { commit_reserved(ring_, producer_, count); }

  /// Copies up to max_count items out; None once closed and drained; TimeoutError otherwise.
  py::object pop(std::size_t max_count, std::optional<double> timeout) {
    if (max_count == 0) throw py::value_error("pop: max_count must be at least 1");
    if (peeked_ != 0) throw std::logic_error("pop: release() the peeked items first");
    if (ring_.size() == 0) {
      const WaitStatus status = wait_released(
          [&](Timeout slice) { return ring_.wait_for_items(1, slice); }, to_timeout(timeout));
      if (status == WaitStatus::closed) return py::none();
      if (status == WaitStatus::timeout) raise_timeout("pop: no item arrived within the timeout");
    }
    // Without a mirror band the stored items may sit in two spans (before and after the wrap).
    const std::size_t n = std::min(max_count, ring_.size());
    py::array out = layout_.view(nullptr, n, py::handle(), true);
    auto* dst = static_cast<std::byte*>(out.mutable_data());
    std::size_t done = 0;
    while (done < n) {
      const ReadRegion region = ring_.peek(n - done);
      if (region.count == 0) break;
      std::memcpy(dst + done * layout_.item_bytes, region.data, region.count * layout_.item_bytes);
      ring_.release(region.count);
      done += region.count;
    }
    return std::move(out);
  }

  py::array peek(py::object self, std::size_t max_count) {
    const ReadRegion region = ring_.peek(max_count);
    peeked_ = region.count;
    return layout_.view(region.data, region.count, self, /*writable=*/false);
  }
  void release(std::size_t count) {
    if (count > peeked_)
      throw py::value_error("release(" + std::to_string(count) + "): only " +
                            std::to_string(peeked_) + " items were peeked");
    peeked_ = 0;
    ring_.release(count);
  }

  bool wait_for_items(std::size_t count, std::optional<double> timeout) {
    if (count > ring_.capacity())
      throw py::value_error("wait_for_items(" + std::to_string(count) +
                            "): more than the ring's capacity " + std::to_string(ring_.capacity()));
    return wait_released([&](Timeout s) { return ring_.wait_for_items(count, s); },
                         to_timeout(timeout)) == WaitStatus::ready;
  }

  SpscRing& ring() { return ring_; }
  const ItemLayout& layout() const { return layout_; }

 private:
  ItemLayout layout_;
  SpscRing ring_;
  ProducerState producer_;
  std::size_t peeked_ = 0;
};

}  // namespace

void bind_ring(py::module_& m) {
  py::class_<PyRing>(m, "Ring", R"doc(
Bounded lock-free single-producer / single-consumer ring of fixed-size numpy items.

One thread pushes, one thread pops. Waits release the GIL. peek() returns a read-only view into
the ring's own memory (no copy) that stays valid until release(); reserve() returns a writable
view to fill in place before commit().)doc")
      .def(py::init<const py::object&, std::size_t, std::vector<py::ssize_t>, const std::string&,
                    std::size_t>(),
           py::arg("dtype"), py::arg("capacity"), py::arg("item_shape") = std::vector<py::ssize_t>{},
           py::arg("overflow") = "block", py::arg("mirror") = 0)
      .def("push", &PyRing::push, py::arg("items"), py::arg("timeout") = py::none())
      .def("reserve", [](py::object self, std::size_t n) { return self.cast<PyRing&>().reserve(self, n); },
           py::arg("max_count"))
      .def("commit", &PyRing::commit, py::arg("count"))
      .def("pop", &PyRing::pop, py::arg("max_count") = 1, py::arg("timeout") = py::none())
      .def("peek", [](py::object self, std::size_t n) { return self.cast<PyRing&>().peek(self, n); },
           py::arg("max_count"))
      .def("release", &PyRing::release, py::arg("count"))
      .def("wait_for_items", &PyRing::wait_for_items, py::arg("count"),
           py::arg("timeout") = py::none())
      .def("close", [](PyRing& r) { r.ring().close(); })
      .def_property_readonly("closed", [](PyRing& r) { return r.ring().closed(); })
      .def("__len__", [](PyRing& r) { return r.ring().size(); })
      .def_property_readonly("capacity", [](PyRing& r) { return r.ring().capacity(); })
      .def_property_readonly("dtype", [](PyRing& r) { return r.layout().dtype; })
      .def_property_readonly("item_shape", [](PyRing& r) { return py::tuple(py::cast(r.layout().shape)); })
      .def_property_readonly("overflow", [](PyRing& r) { return overflow_name(r.ring().overflow()); })
      .def_property_readonly("stats", [](PyRing& r) { return stats_dict(r.ring()); })
      .def_property_readonly("storage_range", [](PyRing& r) {
        return py::make_tuple(reinterpret_cast<std::uintptr_t>(r.ring().storage()),
                              r.ring().storage_bytes());
      });
}

}  // namespace mstar::py_bind

// Python class ReadyQueue: the Conductor's ready-queue order (mstar/ready_queue.hpp) for work a
// placement worker receives from its parent, so the worker runs it in the order the parent's
// Conductor would, with no Python copy of that order.
#include <pybind11/stl.h>

#include <condition_variable>
#include <mutex>
#include <stdexcept>
#include <vector>

#include "core/waiting.hpp"
#include "mstar/ready_queue.hpp"

namespace mstar::py_bind {

namespace {

struct Queued {
  std::uint64_t request = 0;
  py::object item;
};

/// One ReadyQueue per engine, a mutex and a condition variable. Python objects are created and
/// dropped only with the GIL held; waiting releases the GIL before it takes the mutex, and no
/// thread holding the mutex asks for the GIL, so the two never deadlock.
class PyReadyQueue {
 public:
  PyReadyQueue(std::size_t engines, std::vector<std::uint32_t> node_max_batch)
      : queues_(engines), max_batch_(std::move(node_max_batch)) {
    if (engines == 0) throw py::value_error("ReadyQueue: needs at least one engine");
  }

  void put(std::size_t engine, std::uint32_t node, std::uint32_t walk, std::uint64_t request,
           std::int64_t deadline_ns, std::int32_t priority, std::uint64_t arrival,
           std::uint64_t item_id, py::object item) {
    if (engine >= queues_.size()) throw py::value_error("ReadyQueue.put: unknown engine");
    if (node >= max_batch_.size()) throw py::value_error("ReadyQueue.put: unknown node");
    std::lock_guard<std::mutex> lock(mu_);
    queues_[engine].push({{deadline_ns, priority, arrival, item_id}, node, walk,
                          {request, std::move(item)}});
    cv_.notify_all();
  }

  /// (node, walk, [items]) of the most urgent node and walk, up to min(max_batch, the node's
  /// limit) items; None after `timeout_s` or shutdown().
  py::object next_batch(std::size_t engine, std::size_t max_batch, double timeout_s) {
    if (engine >= queues_.size()) throw py::value_error("ReadyQueue.next_batch: unknown engine");
    auto& q = queues_[engine];
    {
      py::gil_scoped_release nogil;
      std::unique_lock<std::mutex> lock(mu_);
      // An hour is "forever" for a worker loop (wait_for(max) would overflow).
      const auto timeout = std::min<Timeout>(to_timeout(timeout_s), std::chrono::hours(1));
      cv_.wait_for(lock, timeout, [&] { return stopping_ || !q.empty(); });
    }
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_ || q.empty()) return py::none();
    const std::uint32_t node = q.front().node, walk = q.front().walk;
    const std::size_t limit = std::min<std::size_t>(std::max<std::size_t>(max_batch, 1),
                                                    max_batch_[node]);
    py::list items;
    q.take_batch(limit, [&](ReadyQueue<Queued>::Entry& e) { items.append(std::move(e.value.item)); });
    return py::make_tuple(node, walk, items);
  }

  /// Drops the queued items of `request`; returns how many.
  std::size_t purge(std::uint64_t request) {
    std::lock_guard<std::mutex> lock(mu_);
    std::size_t n = 0;
    for (auto& q : queues_)
      n += q.remove_if([&](const ReadyQueue<Queued>::Entry& e) { return e.value.request == request; });
    return n;
  }

  std::size_t size() {
    std::lock_guard<std::mutex> lock(mu_);
    std::size_t n = 0;
    for (const auto& q : queues_) n += q.size();
    return n;
  }

  void shutdown() {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
    cv_.notify_all();
  }

 private:
  std::vector<ReadyQueue<Queued>> queues_;
  std::vector<std::uint32_t> max_batch_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool stopping_ = false;
};

}  // namespace

void bind_ready_queue(py::module_& m) {
  py::class_<PyReadyQueue>(m, "ReadyQueue", R"doc(
Work ready to run, per engine, in the Conductor's order: earliest deadline, then highest
priority, then earliest arrival, then item id. next_batch() takes the most urgent item and the
next most urgent of the same node and walk (waiting without the GIL).)doc")
      .def(py::init<std::size_t, std::vector<std::uint32_t>>(), py::arg("engines"),
           py::arg("node_max_batch"))
      .def("put", &PyReadyQueue::put, py::arg("engine"), py::arg("node"), py::arg("walk"),
           py::arg("request"), py::arg("deadline_ns"), py::arg("priority"), py::arg("arrival"),
           py::arg("item_id"), py::arg("item"))
      .def("next_batch", &PyReadyQueue::next_batch, py::arg("engine"), py::arg("max_batch"),
           py::arg("timeout"))
      .def("purge", &PyReadyQueue::purge, py::arg("request"))
      .def("shutdown", &PyReadyQueue::shutdown)
      .def("__len__", &PyReadyQueue::size);
}

}  // namespace mstar::py_bind

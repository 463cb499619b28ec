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

/// One ReadyQueue per engine, a mutex and a condition variable. No thread holding the mutex
/// waits for the GIL or runs Python: next_batch takes the mutex only without the GIL (the items
/// leave the queue by move, which touches no reference count), and purge moves its items out
/// and drops them after the mutex is free -- dropping one may run Python (a __del__), which may
/// hand the GIL to a thread that then waits for the mutex: a deadlock a worker hit when a
/// request's release met its engine thread taking a batch.
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
    std::vector<py::object> taken;  // filled without the GIL: moves only, never a reallocation
    taken.reserve(std::max<std::size_t>(max_batch, 1));
    std::uint32_t node = 0, walk = 0;
    {
      py::gil_scoped_release nogil;
      std::unique_lock<std::mutex> lock(mu_);
      // An hour is "forever" for a worker loop (wait_for(max) would overflow).
      const auto timeout = std::min<Timeout>(to_timeout(timeout_s), std::chrono::hours(1));
      if (timeout > Timeout(0))  // a look: an expired timed wait costs ~70 µs on a VM
        cv_.wait_for(lock, timeout, [&] { return stopping_ || (!held_ && !q.empty()); });
      if (!stopping_ && !held_ && !q.empty()) {
        node = q.front().node;
        walk = q.front().walk;
        const std::size_t limit = std::min<std::size_t>(std::max<std::size_t>(max_batch, 1),
                                                        max_batch_[node]);
        q.take_batch(limit, [&](ReadyQueue<Queued>::Entry& e) {
          taken.push_back(std::move(e.value.item));
        });
      }
    }  // the mutex is released before the GIL is taken back
    if (taken.empty()) return py::none();
    py::list items;
    for (auto& item : taken) items.append(std::move(item));
    return py::make_tuple(node, walk, items);
  }

  /// Drops the queued items of `request`; returns how many.
  std::size_t purge(std::uint64_t request) {
    std::vector<py::object> dropped;  // destroyed after the mutex is released (see the class)
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (auto& q : queues_)
        q.extract_if([&](const ReadyQueue<Queued>::Entry& e) { return e.value.request == request; },
                     [&](ReadyQueue<Queued>::Entry& e) { dropped.push_back(std::move(e.value.item)); });
    }
    return dropped.size();
  }

  std::size_t size() {
    std::lock_guard<std::mutex> lock(mu_);
    std::size_t n = 0;
    for (const auto& q : queues_) n += q.size();
    return n;
  }

  /// While held, no engine takes a batch: what a burst of messages puts is ordered as a whole
  /// (an engine woken by the burst's first item would otherwise take that one alone).
  void hold(bool held) {
    std::lock_guard<std::mutex> lock(mu_);
    held_ = held;
    if (!held) cv_.notify_all();
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
  bool held_ = false;
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
      .def("hold", &PyReadyQueue::hold, py::arg("held"))
      .def("shutdown", &PyReadyQueue::shutdown)
      .def("__len__", &PyReadyQueue::size);
}

}  // namespace mstar::py_bind

// Python classes ChunkPolicy, StreamBuffer and Chunk: chunked, zero-copy reads of a stream.
#include <pybind11/stl.h>

#include "mstar/stream_buffer.hpp"
#include "core/producer.hpp"

namespace mstar::py_bind {

namespace {

class PyStreamBuffer;

/// A ready chunk, pinned in the ring until release(). Its arrays view the ring's memory.
class PyChunk {
 public:
  PyChunk(py::object owner, PyStreamBuffer* buffer, const ChunkView& view, std::uint64_t serial)
      : owner_(std::move(owner)), buffer_(buffer), view_(view), serial_(serial) {}
  // A chunk dropped unreleased (its consumer raised) wedged the buffer: nothing was left to
  // release it. Its views keep it alive (they are based on it), so this runs once none is left.
  ~PyChunk() { release(); }
  PyChunk(PyChunk&& o) noexcept  // (into its Python object: the moved-from one releases nothing)
      : owner_(std::move(o.owner_)), buffer_(o.buffer_), view_(o.view_), serial_(o.serial_),
        released_(o.released_) {
    o.released_ = true;
  }
  PyChunk(const PyChunk&) = delete;
  PyChunk& operator=(const PyChunk&) = delete;
  PyChunk& operator=(PyChunk&&) = delete;

  py::array data();
  py::array fresh() {
    py::array all = data();
    const auto skip = static_cast<py::ssize_t>(view_.chunk.new_begin - view_.chunk.begin);
    return all[py::slice(skip, static_cast<py::ssize_t>(view_.chunk.size()), 1)];
  }
  void release();
  const Chunk& chunk() const { return view_.chunk; }
  bool released() const { return released_; }

 private:
  py::object owner_;  // keeps the StreamBuffer (and so the ring memory) alive
  PyStreamBuffer* buffer_;
  ChunkView view_;
  std::uint64_t serial_;
  bool released_ = false;
};

class PyStreamBuffer {
 public:
  PyStreamBuffer(const py::object& dtype, std::size_t capacity, const ChunkPolicy& policy,
                 std::vector<py::ssize_t> item_shape, const std::string& overflow)
      : layout_(dtype, std::move(item_shape)),
        buffer_(layout_.item_bytes, capacity, policy, parse_overflow(overflow)) {}

  std::size_t push(py::array items, std::optional<double> timeout) {
    return push_array(buffer_.ring(), layout_, producer_, std::move(items), timeout);
  }
  py::array reserve(py::object self, std::size_t n) {
    return reserve_view(buffer_.ring(), layout_, producer_, n, self);
  }
  void commit(std::size_t n) { commit_reserved(buffer_.ring(), producer_, n); }

  py::object next_chunk(py::object self, std::optional<double> timeout) {
    if (buffer_.holding())
      throw std::logic_error(
          "next_chunk: chunk " + std::to_string(held_index_) +
          " is still held; call its release() (or use 'with chunk:' / iterate the buffer)");
    ChunkView view;
    WaitStatus status = buffer_.try_next_chunk(&view);
    if (status == WaitStatus::timeout) {
      status = wait_released([&](Timeout slice) { return buffer_.next_chunk(&view, slice); },
                             to_timeout(timeout));
    }
    if (status == WaitStatus::closed) return py::none();
    if (status == WaitStatus::timeout)
      raise_timeout("next_chunk: no chunk was ready within the timeout (policy " +
                    buffer_.policy().describe() + ", " + std::to_string(buffer_.ring().size()) +
                    " items buffered)");
    held_index_ = view.chunk.index;
    return py::cast(PyChunk(self, this, view, ++serial_));
  }

  void release_chunk(std::uint64_t serial) {
    if (serial == serial_ && buffer_.holding()) buffer_.release_chunk();
  }

  StreamBuffer& buffer() { return buffer_; }
  const ItemLayout& layout() const { return layout_; }

 private:
  ItemLayout layout_;
  StreamBuffer buffer_;
  ProducerState producer_;
  std::uint64_t serial_ = 0;
  std::uint64_t held_index_ = 0;
};

/// `for chunk in buffer`: each step releases the previous chunk; so does dropping the iterator
/// (a `break` out of the loop), so a loop never leaves a chunk pinned.
class PyChunkIterator {
 public:
  PyChunkIterator(py::object owner, PyStreamBuffer* buffer)
      : owner_(std::move(owner)), buffer_(buffer) {}
  ~PyChunkIterator() { release_current(); }
  PyChunkIterator(const PyChunkIterator&) = delete;
  PyChunkIterator& operator=(const PyChunkIterator&) = delete;
  PyChunkIterator(PyChunkIterator&&) = default;

  /// New reference to the next chunk, or nullptr at the end of the stream (no exception set).
  PyObject* next() {
    release_current();
    current_ = py::object();
    py::object chunk = buffer_->next_chunk(owner_, std::nullopt);
    if (chunk.is_none()) return nullptr;
    current_ = chunk;
    return chunk.release().ptr();
  }

  /// tp_iternext: called by for-loops and next() without pybind11's per-call dispatch.
  static PyObject* iternext(PyObject* self) {
    try {
      return py::handle(self).cast<PyChunkIterator&>().next();
    } catch (py::error_already_set& e) {
      e.restore();
    } catch (const std::exception& e) {
      PyErr_SetString(PyExc_RuntimeError, e.what());
    }
    return nullptr;
  }

 private:
  void release_current() {
    if (current_) current_.cast<PyChunk&>().release();
  }
  py::object owner_;
  PyStreamBuffer* buffer_;
  py::object current_;
};

py::array PyChunk::data() {
  if (released_)
    throw std::logic_error("chunk " + std::to_string(view_.chunk.index) +
                           " was released; its items may already be overwritten");
  // based on the chunk, not the buffer: the chunk (and its place in the ring) is held while a
  // view of it lives; not cached here, as that would be a cycle Python cannot collect
  return buffer_->layout().view(view_.data, view_.chunk.size(),
                                   py::cast(this, py::return_value_policy::reference), false);
}

void PyChunk::release() {
  if (released_) return;
  released_ = true;
  buffer_->release_chunk(serial_);
}

}  // namespace

void bind_stream(py::module_& m) {
  py::class_<ChunkPolicy>(m, "ChunkPolicy", R"doc(
When a streaming consumer fires and on which items (see docs/chunk_policies.md). Build one with
Fixed, SlidingWindow, LeftContext or Ramp.)doc")
      .def_static("fixed", &ChunkPolicy::fixed, py::arg("k"))
      .def_static("sliding_window", &ChunkPolicy::sliding_window, py::arg("window"), py::arg("stride"))
      .def_static("left_context", &ChunkPolicy::left_context, py::arg("context"), py::arg("size"))
      .def_static("ramp", &ChunkPolicy::ramp, py::arg("first"), py::arg("steady"),
                  py::arg("context") = 0)
      .def_property_readonly("context", &ChunkPolicy::context)
      .def_property_readonly("max_chunk", &ChunkPolicy::max_chunk)
      .def("new_size", &ChunkPolicy::new_size, py::arg("index"))
      .def("__repr__", &ChunkPolicy::describe);

  py::class_<PyChunk>(m, "Chunk", R"doc(
A ready chunk: items [begin, end) of the stream, of which [new_begin, end) are new. `data` and
`new` are read-only views into the ring (no copy), valid until release(); a chunk dropped
unreleased is released once neither it nor a view of it is left.)doc")
      .def_property_readonly("data", &PyChunk::data)
      .def_property_readonly("new", &PyChunk::fresh)
      .def_property_readonly("begin", [](PyChunk& c) { return c.chunk().begin; })
      .def_property_readonly("new_begin", [](PyChunk& c) { return c.chunk().new_begin; })
      .def_property_readonly("end", [](PyChunk& c) { return c.chunk().end; })
      .def_property_readonly("index", [](PyChunk& c) { return c.chunk().index; })
      .def_property_readonly("last", [](PyChunk& c) { return c.chunk().last; })
      .def_property_readonly("released", &PyChunk::released)
      .def("__len__", [](PyChunk& c) { return c.chunk().size(); })
      .def("release", &PyChunk::release)
      .def("__enter__", [](py::object self) { return self; })
      .def("__exit__", [](PyChunk& c, py::args) { c.release(); })
      .def("__repr__", [](PyChunk& c) {
        const Chunk& k = c.chunk();
        return "Chunk(index=" + std::to_string(k.index) + ", begin=" + std::to_string(k.begin) +
               ", new_begin=" + std::to_string(k.new_begin) + ", end=" + std::to_string(k.end) +
               (k.last ? ", last=True)" : ")");
      });

  py::class_<PyChunkIterator> iterator(m, "ChunkIterator");
  iterator.def("__iter__", [](py::object self) { return self; })
      .def("__next__", [](PyChunkIterator& it) {
        PyObject* chunk = it.next();
        if (chunk == nullptr) throw py::stop_iteration();
        return py::reinterpret_steal<py::object>(chunk);
      });
  // After the def above (which installs CPython's generic slot), point the slot straight at C++.
  reinterpret_cast<PyTypeObject*>(iterator.ptr())->tp_iternext = &PyChunkIterator::iternext;

  py::class_<PyStreamBuffer>(m, "StreamBuffer", R"doc(
A ring plus a chunk policy: one streaming edge. The producer pushes items; the consumer takes
whole chunks as zero-copy views. A held chunk pins its items until released.)doc")
      .def(py::init<const py::object&, std::size_t, const ChunkPolicy&, std::vector<py::ssize_t>,
                    const std::string&>(),
           py::arg("dtype"), py::arg("capacity"), py::arg("policy"),
           py::arg("item_shape") = std::vector<py::ssize_t>{}, py::arg("overflow") = "block")
      .def("push", &PyStreamBuffer::push, py::arg("items"), py::arg("timeout") = py::none())
      .def("reserve", [](py::object self, std::size_t n) {
             return self.cast<PyStreamBuffer&>().reserve(self, n);
           }, py::arg("max_count"))
      .def("commit", &PyStreamBuffer::commit, py::arg("count"))
      .def("close", [](PyStreamBuffer& b) { b.buffer().close(); })
      .def("next_chunk", [](py::object self, std::optional<double> timeout) {
             return self.cast<PyStreamBuffer&>().next_chunk(self, timeout);
           }, py::arg("timeout") = py::none())
      .def("__iter__", [](py::object self) {
             return PyChunkIterator(self, &self.cast<PyStreamBuffer&>());
           })
      .def_property_readonly("closed", [](PyStreamBuffer& b) { return b.buffer().ring().closed(); })
      .def_property_readonly("holding", [](PyStreamBuffer& b) { return b.buffer().holding(); })
      .def_property_readonly("policy", [](PyStreamBuffer& b) { return b.buffer().policy(); })
      .def("__len__", [](PyStreamBuffer& b) { return b.buffer().ring().size(); })
      .def_property_readonly("capacity", [](PyStreamBuffer& b) { return b.buffer().ring().capacity(); })
      .def_property_readonly("dtype", [](PyStreamBuffer& b) { return b.layout().dtype; })
      .def_property_readonly("item_shape", [](PyStreamBuffer& b) { return py::tuple(py::cast(b.layout().shape)); })
      .def_property_readonly("overflow", [](PyStreamBuffer& b) { return overflow_name(b.buffer().ring().overflow()); })
      .def_property_readonly("stats", [](PyStreamBuffer& b) { return stats_dict(b.buffer().ring()); })
      .def_property_readonly("storage_range", [](PyStreamBuffer& b) {
        const SpscRing& r = b.buffer().ring();
        return py::make_tuple(reinterpret_cast<std::uintptr_t>(r.storage()), r.storage_bytes());
      });
}

}  // namespace mstar::py_bind

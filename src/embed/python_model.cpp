// PythonModel: a Python-defined model served by mstar_rt.Runtime in this process, with requests
// and outputs in C++ (see mstar/embed.hpp; the Python half is mstar_rt/embed/__init__.py).
#include <pybind11/embed.h>
#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include <cstring>
#include <stdexcept>

#include "embed/python.hpp"
#include "mstar/embed.hpp"
#include "runtime/request.hpp"

namespace py = pybind11;

namespace mstar {

namespace {

// C++ tensor -> numpy array (a copy: Python may keep it after the caller reuses its buffer).
py::array to_numpy(const Tensor& t, const std::string& name) {
  if (!t.defined()) throw std::invalid_argument("submit: input '" + name + "' is an undefined tensor");
  if (t.dtype() == DType::bfloat16)
    throw std::invalid_argument("submit: input '" + name + "' is bfloat16, which numpy cannot hold; "
                                "convert it to float32");
  std::vector<py::ssize_t> shape(t.shape().begin(), t.shape().end());
  py::array a(py::dtype(dtype_name(t.dtype())), shape);
  std::memcpy(a.mutable_data(), t.raw(), t.nbytes());
  return a;
}

// numpy array (C-contiguous, numeric, from mstar_rt.embed.to_array) -> owning C++ tensor.
Tensor from_numpy(const py::array& a) {
  const std::string dt = py::str(a.dtype()).cast<std::string>();
  const DType dtype = dtype_from_name(dt);
  Shape shape(a.shape(), a.shape() + a.ndim());
  Tensor t = Tensor::empty(dtype, shape);
  if (static_cast<std::size_t>(a.nbytes()) != t.nbytes())
    throw std::invalid_argument("numpy array of " + std::to_string(a.nbytes()) + " bytes for " + t.describe());
  std::memcpy(t.raw(), a.data(), t.nbytes());
  return t;
}

RequestStatus parse_status(const std::string& s) {
  if (s == "finished") return RequestStatus::finished;
  if (s == "cancelled") return RequestStatus::cancelled;
  return RequestStatus::failed;
}

}  // namespace

struct PythonModel::Impl {
  py::object runtime;  // mstar_rt.embed.EmbeddedRuntime; touched only with the GIL
  std::vector<std::string> inputs;
  bool closed = false;
};

PythonModel::PythonModel(const std::string& module, const std::string& cls,
                         const std::string& config_json, PythonConfig config)
    : impl_(std::make_shared<Impl>()) {
  PythonInterpreter::ensure(config);
  py::gil_scoped_acquire gil;
  try {
    impl_->runtime = py::module_::import("mstar_rt.embed").attr("load")(module, cls, config_json);
    for (py::handle x : impl_->runtime.attr("model").attr("inputs"))
      impl_->inputs.push_back(py::str(x).cast<std::string>());
  } catch (py::error_already_set& e) {
    throw PythonError("loading Python model " + module + "." + cls + "(**" + config_json +
                      ") failed: " + python_error_text(e, true));
  }
}

namespace {
bool own_thread_error(py::error_already_set& e) {
  return e.matches(py::module_::import("mstar_rt.lifetime").attr("OwnThreadError"));
}
}  // namespace

PythonModel::~PythonModel() {
  py::gil_scoped_acquire gil;
  if (!impl_->closed && impl_->runtime) {
    impl_->closed = true;
    try {
      impl_->runtime.attr("close")();
    } catch (py::error_already_set& e) {
      // Destroyed in its own on_output: the close goes on on a thread of its own. Any other
      // failure cannot leave a destructor.
      try {
        if (own_thread_error(e)) impl_->runtime.attr("close_soon")();
      } catch (py::error_already_set&) {
      }
    }
  }
  impl_->runtime = py::object();
}

std::vector<std::string> PythonModel::inputs() const { return impl_->inputs; }

Request PythonModel::submit(const std::map<std::string, Tensor>& inputs, RequestOptions options) {
  auto state = std::make_shared<Request::State>();
  state->on_output = std::move(options.on_output);
  std::weak_ptr<Impl> weak = impl_;
  state->live_timeline = [weak](RequestId r) {
    std::vector<NodeRun> runs;
    auto m = weak.lock();
    if (!m) return runs;
    py::gil_scoped_acquire gil;
    if (m->closed || !m->runtime) return runs;
    try {
      for (py::handle x : m->runtime.attr("timeline_of")(r)) {
        auto t = x.cast<py::tuple>();
        runs.push_back({t[0].cast<std::string>(), t[1].cast<std::string>(),
                        t[2].cast<std::uint32_t>(), t[3].cast<std::uint32_t>(),
                        t[4].cast<std::int64_t>(), t[5].cast<std::int64_t>(),
                        t[6].cast<std::int64_t>()});
      }
    } catch (py::error_already_set& e) {
      throw PythonError("timeline: " + python_error_text(e));
    }
    return runs;
  };
  state->cancel = [weak](RequestId r) {
    auto m = weak.lock();
    if (!m) return false;
    py::gil_scoped_acquire gil;
    if (m->closed || !m->runtime) return false;
    try {
      return m->runtime.attr("cancel_request")(r).cast<bool>();
    } catch (py::error_already_set& e) {
      throw PythonError("cancel: " + python_error_text(e));
    }
  };
  py::gil_scoped_acquire gil;
  if (impl_->closed) throw std::logic_error("submit: the Python model is closed");
  py::dict in;
  for (const auto& [name, value] : inputs) in[py::str(name)] = to_numpy(value, name);
  // Both callables run on Python threads holding the GIL; they copy and return at once.
  std::weak_ptr<Request::State> ws = state;
  py::cpp_function emit([ws](const std::string& name, const std::string& node, py::array value) {
    auto s = ws.lock();
    if (s) s->push({node, name, from_numpy(value)});
  });
  // on_output runs from here, called once Python let go of its sink lock: a slow callback
  // holds up its own worker only, not every other thread's submit.
  py::object deliver = py::none();
  if (state->on_output)
    deliver = py::cpp_function([ws]() {
      auto s = ws.lock();
      if (!s) return;
      py::gil_scoped_release nogil;
      s->deliver();
    });
  py::cpp_function end([ws](const std::string& status, const std::string& message,
                            const std::vector<std::tuple<std::string, std::string, std::uint32_t,
                                                         std::uint32_t, std::int64_t, std::int64_t,
                                                         std::int64_t>>& timeline) {
    auto s = ws.lock();
    if (!s) return;
    std::vector<NodeRun> runs;
    for (const auto& [node, walk, it, batch, q, st, f] : timeline)
      runs.push_back({node, walk, it, batch, q, st, f});
    s->end(parse_status(status), message, std::move(runs));
  });
  py::object deadline = py::none();
  if (options.deadline.count() > 0) deadline = py::float_(options.deadline.count() / 1e9);
  try {
    state->id = impl_->runtime.attr("submit_to")(in, deadline, options.priority,
                                                        options.fail_late).cast<RequestId>();
    impl_->runtime.attr("attach")(state->id, emit, end, deliver);
  } catch (py::error_already_set& e) {
    const std::string text = python_error_text(e);
    if (e.matches(PyExc_ValueError) || e.matches(PyExc_TypeError) || e.matches(PyExc_KeyError))
      throw std::invalid_argument(text);
    throw PythonError("submit: " + text);
  }
  return Request(state);
}

void PythonModel::close() {
  py::gil_scoped_acquire gil;
  if (impl_->closed || !impl_->runtime) return;
  try {
    impl_->runtime.attr("close")();  // joins the workers; the join releases the GIL
  } catch (py::error_already_set& e) {
    // from one of its own workers (on_output): refused before anything was shut, as
    // Runtime::close() refuses it
    if (own_thread_error(e))
      throw std::logic_error("PythonModel::close() called from one of the model's own worker "
                             "threads (an on_output callback); close it from another thread");
    impl_->closed = true;
    throw PythonError("close: " + python_error_text(e));
  }
  impl_->closed = true;
}

}  // namespace mstar

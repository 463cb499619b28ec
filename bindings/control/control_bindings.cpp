// Python classes ActionChunkBuffer, LatencyTracker, ControlLoop, SimulatedClock, TickInfo.
#include <pybind11/functional.h>
#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <exception>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <utility>

#include "mstar/action_chunk_buffer.hpp"
#include "mstar/control_loop.hpp"

namespace py = pybind11;

namespace mstar::py_bind {

namespace {

MergeMode parse_mode(const std::string& m) {
  if (m == "latest") return MergeMode::latest;
  if (m == "weighted") return MergeMode::weighted;
  if (m == "rtc") return MergeMode::rtc;
  throw py::value_error("mode must be 'latest', 'weighted' or 'rtc', got '" + m + "'");
}

RtcSchedule parse_schedule(const std::string& s) {
  if (s == "linear") return RtcSchedule::linear;
  if (s == "exp") return RtcSchedule::exp;
  if (s == "ones") return RtcSchedule::ones;
  if (s == "zeros") return RtcSchedule::zeros;
  throw py::value_error("schedule must be 'linear', 'exp', 'ones' or 'zeros', got '" + s + "'");
}

using FloatArray = py::array_t<float, py::array::c_style | py::array::forcecast>;

/// A count or tick from Python: taken signed, so -1 is refused by name instead of pybind's dump of
/// every overload's signature.
std::uint64_t count_arg(const char* what, std::int64_t v) {
  if (v < 0) throw py::value_error(std::string(what) + " must be >= 0, got " + std::to_string(v));
  return static_cast<std::uint64_t>(v);
}

/// The buffer plus the one output array pop() hands back (reused: no allocation per tick).
struct PyActionBuffer {
  explicit PyActionBuffer(const ActionChunkOptions& o) : buffer(o), last(static_cast<py::ssize_t>(o.action_dim)) {}
  ActionChunkBuffer buffer;
  FloatArray last;
};

/// "(4, 3)": an array's shape as numpy prints it, for error messages.
std::string shape_text(const py::array& a) {
  std::string out = "(";
  for (py::ssize_t i = 0; i < a.ndim(); ++i)
    out += (i ? ", " : "") + std::to_string(a.shape(i));
  return out + (a.ndim() == 1 ? ",)" : ")");
}

py::dict stats_dict(const ActionBufferStats& s) {
  py::dict d;
  d["ticks"] = s.ticks;
  d["starved_ticks"] = s.starved_ticks;
  d["published"] = s.published;
  d["applied"] = s.applied;
  d["superseded"] = s.superseded;
  d["rejected"] = s.rejected;
  d["nonfinite"] = s.nonfinite;
  d["stale"] = s.stale;
  d["max_switch_jump"] = s.max_switch_jump;
  d["last_delay_ticks"] = s.last_delay_ticks;
  return d;
}

/// A ControlLoop whose tick is either a Python callable (called with the GIL) or, with no
/// callable, a pure C++ tick that pops the next action from an ActionChunkBuffer.
class PyControlLoop {
 public:
  PyControlLoop(ControlLoopOptions options, py::object callback, std::shared_ptr<PyActionBuffer> actions,
                std::shared_ptr<Clock> clock)
      : callback_(std::move(callback)), actions_(std::move(actions)) {
    if (callback_.is_none() && !actions_)
      throw py::value_error("ControlLoop needs a callback(tick_info) or an action_buffer to pop from");
    if (actions_) action_.assign(actions_->buffer.options().action_dim, 0.0f);
    loop_ = std::make_unique<ControlLoop>(options, [this](const TickInfo& t) { tick(t); }, std::move(clock));
  }
  ~PyControlLoop() {
    started().erase(this);
    py::gil_scoped_release nogil;
    loop_.reset();
  }

  void run(std::int64_t ticks_arg) {
    const std::uint64_t ticks = count_arg("run: ticks", ticks_arg);
    if (callback_.is_none()) return run_interruptible(ticks);
    // A Python tick runs on this thread (a renderer's context may be bound to it); Ctrl-C
    // reaches it as a KeyboardInterrupt from the callback, at the next tick.
    try {
      py::gil_scoped_release nogil;
      loop_->run(ticks);
    } catch (...) {
      if (!error_) throw;  // the loop's own error; a callback's is rethrown below, as raised
    }
    rethrow();
  }
  void start(std::int64_t ticks) {
    const std::uint64_t n = count_arg("start: ticks", ticks);
    {
      py::gil_scoped_release nogil;  // the new thread's first tick may want the GIL at once
      loop_->start(n);
    }
    started().insert(this);
  }
  void stop() {
    started().erase(this);
    try {
      py::gil_scoped_release nogil;
      loop_->stop();
    } catch (...) {
      if (!error_) throw;
    }
    rethrow();
  }

  /// Stops every loop still started (an atexit hook): a tick that wants the GIL while the
  /// interpreter finalizes would end its thread from under the loop.
  static void stop_all_at_exit() {
    const std::set<PyControlLoop*> loops = std::exchange(started(), {});
    for (PyControlLoop* l : loops) {
      try {
        l->stop();
      } catch (py::error_already_set& e) {
        e.discard_as_unraisable("a ControlLoop stopped at interpreter exit: its callback");
      } catch (const std::exception&) {  // the loop's own trouble: nobody is left to tell
      }
    }
  }
  ControlLoop& loop() { return *loop_; }
  std::uint64_t starved() const { return starved_.load(std::memory_order_relaxed); }
  FloatArray last_action() const {
    FloatArray out(static_cast<py::ssize_t>(action_.size()));
    std::memcpy(out.mutable_data(), action_.data(), action_.size() * sizeof(float));
    return out;
  }

 private:
  void tick(const TickInfo& t) {
    if (actions_) {
      if (!actions_->buffer.pop(t.tick, action_.data()))
        starved_.store(starved_.load(std::memory_order_relaxed) + 1, std::memory_order_relaxed);
      if (callback_.is_none()) return;
    }
    py::gil_scoped_acquire gil;
    try {
      callback_(t);
    } catch (py::error_already_set& e) {
      error_ = std::current_exception();
      throw std::runtime_error("control loop callback raised");  // stops the loop
    }
  }
  /// run() of the C++ tick: the loop on its own thread, this one waiting in short slices so
  /// that Ctrl-C stops it at once (the tick never enters Python to see the signal).
  void run_interruptible(std::uint64_t ticks) {
    if (loop_->running()) throw std::logic_error("ControlLoop::run: the loop is already running");
    start(static_cast<std::int64_t>(ticks));
    while (true) {
      {
        py::gil_scoped_release nogil;
        for (int i = 0; i < 5 && loop_->running(); ++i)
          std::this_thread::sleep_for(std::chrono::milliseconds(10));
      }
      if (!loop_->running()) break;
      if (PyErr_CheckSignals() != 0) {
        py::error_already_set interrupt;  // takes the KeyboardInterrupt (or a handler's error)
        try {
          stop();
        } catch (const std::exception&) {  // the interrupt is what the caller must see
        }
        throw interrupt;
      }
    }
    stop();
  }
  static std::set<PyControlLoop*>& started() {  // read and changed with the GIL held
    static std::set<PyControlLoop*> loops;
    return loops;
  }
  void rethrow() {
    if (error_) {
      auto e = error_;
      error_ = nullptr;
      std::rethrow_exception(e);
    }
  }

  py::object callback_;
  std::shared_ptr<PyActionBuffer> actions_;
  std::vector<float> action_;
  std::atomic<std::uint64_t> starved_{0};
  std::exception_ptr error_;
  std::unique_ptr<ControlLoop> loop_;
};

}  // namespace

void bind_control(py::module_& m) {
  py::class_<PyActionBuffer, std::shared_ptr<PyActionBuffer>>(m, "ActionChunkBuffer", R"doc(
Chunks of actions in (any thread), one action per control tick out (the loop's thread), lock-free.
mode: 'latest' | 'weighted' (weight_new blend over the overlap) | 'rtc' (real-time chunking with
schedule 'linear' | 'exp' | 'ones' | 'zeros' and execution_horizon s).)doc")
      .def(py::init([](std::int64_t horizon, std::int64_t action_dim, const std::string& mode,
                       float weight_new, const std::string& schedule, std::int64_t execution_horizon,
                       std::int64_t slots) {
             ActionChunkOptions o;
             o.horizon = count_arg("horizon", horizon);
             o.action_dim = count_arg("action_dim", action_dim);
             o.mode = parse_mode(mode);
             o.weight_new = weight_new;
             o.schedule = parse_schedule(schedule);
             o.execution_horizon = count_arg("execution_horizon", execution_horizon);
             o.slots = count_arg("slots", slots);
             return std::make_shared<PyActionBuffer>(o);
           }),
           py::arg("horizon"), py::arg("action_dim"), py::arg("mode") = "latest",
           py::arg("weight_new") = 0.7f, py::arg("schedule") = "exp",
           py::arg("execution_horizon") = 0, py::arg("slots") = 4)
      .def("publish", [](PyActionBuffer& b, const FloatArray& actions, std::int64_t obs_tick_arg) {
             const std::uint64_t obs_tick = count_arg("publish: obs_tick", obs_tick_arg);
             const auto a = static_cast<py::ssize_t>(b.buffer.options().action_dim);
             if (actions.ndim() != 2 || actions.shape(1) != a)
               throw py::value_error("publish: actions must have shape (n, " + std::to_string(a) +
                                     "), got " + shape_text(actions));
             if (actions.shape(0) < 1 || static_cast<std::size_t>(actions.shape(0)) > b.buffer.options().horizon)
               throw py::value_error("publish: a chunk holds 1.." + std::to_string(b.buffer.options().horizon) +
                                     " actions, got " + std::to_string(actions.shape(0)));
             return b.buffer.publish(actions.data(), static_cast<std::size_t>(actions.shape(0)), obs_tick);
           }, py::arg("actions"), py::arg("obs_tick"))
      .def("pop", [](PyActionBuffer& b, std::int64_t tick) {
             FloatArray out(static_cast<py::ssize_t>(b.buffer.options().action_dim));
             const bool ok = b.buffer.pop(count_arg("pop: tick", tick), out.mutable_data());
             return py::make_tuple(out, ok);
           }, py::arg("tick"), "Returns (action, fresh); fresh is False on starvation (the last action is held).")
      .def("pop_into", [](PyActionBuffer& b, std::int64_t tick, py::array out) {
             // Written in place or refused: a converted copy would take the action, and the
             // caller's array would keep the old one while pop_into reported a fresh action.
             const auto n = static_cast<py::ssize_t>(b.buffer.options().action_dim);
             const bool contiguous = (out.flags() & py::array::c_style) != 0;
             if (!out.dtype().is(py::dtype::of<float>()) || !contiguous || !out.writeable() ||
                 out.size() != n)
               throw py::value_error(
                   "pop_into: out must be a writeable, C-contiguous float32 array of " +
                   std::to_string(n) + " values; got " +
                   py::str(out.dtype()).cast<std::string>() + " of shape " + shape_text(out) +
                   (contiguous ? "" : ", not contiguous") + (out.writeable() ? "" : ", read-only"));
             return b.buffer.pop(count_arg("pop_into: tick", tick),
                                 static_cast<float*>(out.mutable_data()));
           }, py::arg("tick"), py::arg("out"),
           "pop() into `out` (float32 [action_dim], C-contiguous): no array made per tick.")
      .def("remaining", [](PyActionBuffer& b, std::int64_t tick) {
             const auto& o = b.buffer.options();
             std::vector<float> tmp(o.horizon * o.action_dim);
             const std::size_t n =
                 b.buffer.remaining(count_arg("remaining: tick", tick), tmp.data(), o.horizon);
             FloatArray out({static_cast<py::ssize_t>(n), static_cast<py::ssize_t>(o.action_dim)});
             std::memcpy(out.mutable_data(), tmp.data(), n * o.action_dim * sizeof(float));
             return out;
           }, py::arg("tick"), "The actions the plan still holds from `tick` on, shape (n, action_dim).")
      .def("rtc_weight", [](PyActionBuffer& b, std::int64_t k, std::int64_t d) {
             return b.buffer.rtc_weight(count_arg("rtc_weight: k", k), count_arg("rtc_weight: d", d));
           }, py::arg("k"), py::arg("d"))
      .def_property_readonly("stats", [](PyActionBuffer& b) { return stats_dict(b.buffer.stats()); })
      .def_property_readonly("horizon", [](PyActionBuffer& b) { return b.buffer.options().horizon; })
      .def_property_readonly("action_dim", [](PyActionBuffer& b) { return b.buffer.options().action_dim; });

  py::class_<LatencyTracker>(m, "LatencyTracker",
                             "Inference latency over the last `window` samples -> delay d in ticks.")
      .def(py::init([](std::int64_t window, double control_period_s) {
             return std::make_unique<LatencyTracker>(count_arg("window", window), control_period_s);
           }), py::arg("window"), py::arg("control_period_s"))
      .def("record", &LatencyTracker::record, py::arg("latency_s"))
      .def_property_readonly("max_s", &LatencyTracker::max_s)
      .def_property_readonly("p95_s", &LatencyTracker::p95_s)
      .def_property_readonly("delay_ticks", &LatencyTracker::delay_ticks)
      .def("__len__", &LatencyTracker::count);

  py::class_<Clock, std::shared_ptr<Clock>>(m, "Clock");
  py::class_<SimulatedClock, Clock, std::shared_ptr<SimulatedClock>>(m, "SimulatedClock",
      "Deterministic time for closed-loop tests: sleeping jumps to the deadline.")
      .def(py::init<>())
      .def_property_readonly("now_ns", &SimulatedClock::now_ns)
      .def("advance", &SimulatedClock::advance, py::arg("ns"));

  py::class_<TickInfo>(m, "TickInfo")
      .def_readonly("tick", &TickInfo::tick)
      .def_readonly("deadline_ns", &TickInfo::deadline_ns)
      .def_readonly("woke_ns", &TickInfo::woke_ns)
      .def_readonly("missed", &TickInfo::missed)
      .def("__repr__", [](const TickInfo& t) {
        return "TickInfo(tick=" + std::to_string(t.tick) + ", missed=" + std::to_string(t.missed) + ")";
      });

  py::module_::import("atexit").attr("register")(
      py::cpp_function(&PyControlLoop::stop_all_at_exit));
  py::class_<PyControlLoop>(m, "ControlLoop", R"doc(
A fixed-rate loop on absolute deadlines (clock_nanosleep TIMER_ABSTIME). The tick is a Python
callable(tick_info) — called with the GIL — or, with no callable, a C++ tick that pops one action
per tick from `action_buffer` without touching Python. run() blocks (GIL released while it
sleeps; Ctrl-C stops it); start()/stop() run it on its own thread, and a loop still started
when the interpreter exits is stopped then.)doc")
      .def(py::init([](double rate_hz, py::object callback, std::shared_ptr<PyActionBuffer> action_buffer,
                       bool realtime, int priority, int cpu, bool lock_memory,
                       std::shared_ptr<Clock> clock, double histogram_max_ms, std::size_t histogram_bins) {
             ControlLoopOptions o;
             o.rate_hz = rate_hz;
             o.realtime = realtime;
             o.priority = priority;
             o.cpu = cpu;
             o.lock_memory = lock_memory;
             o.histogram_max_ms = histogram_max_ms;
             o.histogram_bins = histogram_bins;
             return std::make_unique<PyControlLoop>(o, std::move(callback), std::move(action_buffer), std::move(clock));
           }),
           py::arg("rate_hz"), py::arg("callback") = py::none(), py::arg("action_buffer") = nullptr,
           py::arg("realtime") = false, py::arg("priority") = 80, py::arg("cpu") = -1,
           py::arg("lock_memory") = false, py::arg("clock") = nullptr,
           py::arg("histogram_max_ms") = 20.0, py::arg("histogram_bins") = 2000)
      .def("run", &PyControlLoop::run, py::arg("ticks") = 0)
      .def("start", &PyControlLoop::start, py::arg("ticks") = 0)
      .def("stop", &PyControlLoop::stop)
      .def_property_readonly("running", [](PyControlLoop& l) { return l.loop().running(); })
      .def_property_readonly("mode", [](PyControlLoop& l) { return l.loop().mode(); })
      .def_property_readonly("period_s", [](PyControlLoop& l) { return l.loop().period_s(); })
      .def_property_readonly("starved_ticks", &PyControlLoop::starved)
      .def_property_readonly("last_action", &PyControlLoop::last_action,
                             "The action the C++ tick last popped (read it after stop()/run()).")
      .def_property_readonly("lateness_bins_ms", [](PyControlLoop& l) {
             const auto& h = l.loop().lateness();
             return py::make_tuple(py::array(py::cast(h.bins())), h.bin_width());
           })
      .def_property_readonly("stats", [](PyControlLoop& l) {
             const ControlLoopStats s = l.loop().stats();
             py::dict d;
             d["ticks"] = s.ticks;
             d["missed_deadlines"] = s.missed_deadlines;
             d["lateness_p50_ms"] = s.lateness_p50_ms;
             d["lateness_p99_ms"] = s.lateness_p99_ms;
             d["lateness_p999_ms"] = s.lateness_p999_ms;
             d["lateness_max_ms"] = s.lateness_max_ms;
             d["tick_p50_ms"] = s.tick_p50_ms;
             d["tick_p99_ms"] = s.tick_p99_ms;
             d["tick_max_ms"] = s.tick_max_ms;
             d["minor_faults"] = s.minor_faults;
             d["major_faults"] = s.major_faults;
             d["mode"] = l.loop().mode();
             return d;
           });
}

}  // namespace mstar::py_bind

// The process's embedded Python interpreter (see mstar/embed.hpp).
//
// Started once with PyConfig: program_name is the chosen Python executable, so that CPython's
// path calculation finds a venv's pyvenv.cfg next to it and puts that venv's site-packages on
// sys.path, exactly as running that executable would. The GIL is released right after start;
// every later call takes it for its own duration.
#include <pybind11/embed.h>

#include <cstdlib>
#include <filesystem>
#include <mutex>
#include <sys/stat.h>

#include "embed/python.hpp"
#include "mstar/embed.hpp"

namespace py = pybind11;

namespace mstar {

namespace {

std::mutex g_mu;
bool g_started = false;
std::string g_executable;

bool is_file(const std::string& path) {
  struct stat st {};
  return !path.empty() && ::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

std::string choose_executable(const PythonConfig& config) {
  if (!config.executable.empty()) {
    if (!is_file(config.executable))
      throw PythonError("PythonConfig::executable '" + config.executable + "' is not a file; name a "
                        "Python executable (e.g. .venv/bin/python) whose environment has mstar_rt");
    return config.executable;
  }
  if (const char* env = std::getenv("MSTAR_PYTHON"); env != nullptr && *env) {
    if (!is_file(env))
      throw PythonError(std::string("$MSTAR_PYTHON '") + env + "' is not a file");
    return env;
  }
  if (const char* venv = std::getenv("VIRTUAL_ENV"); venv != nullptr && *venv) {
    const std::string candidate = std::string(venv) + "/bin/python";
    if (is_file(candidate)) return candidate;
  }
#ifdef MSTAR_BUILD_PYTHON_EXECUTABLE
  if (is_file(MSTAR_BUILD_PYTHON_EXECUTABLE)) return MSTAR_BUILD_PYTHON_EXECUTABLE;
#endif
  return "";  // CPython's own defaults: its install prefix, no venv
}

void add_paths_locked(const std::vector<std::string>& paths) {
  if (paths.empty()) return;
  py::list sys_path = py::module_::import("sys").attr("path");
  for (auto it = paths.rbegin(); it != paths.rend(); ++it) {
    py::str p(*it);
    if (!sys_path.contains(p)) sys_path.insert(0, p);
  }
}

}  // namespace

std::string python_error_text(py::error_already_set& e, bool where) {
  // "Type: message" — pybind11's what() appends the whole traceback, which buries the message.
  try {
    std::string text = py::str(e.type().attr("__name__")).cast<std::string>() + ": " +
                       py::str(e.value()).cast<std::string>();
    if (where && e.trace()) {
      py::list frames = py::module_::import("traceback").attr("extract_tb")(e.trace());
      if (!frames.empty()) {
        py::object f = frames[frames.size() - 1];
        text += " (at " + py::str(f.attr("filename")).cast<std::string>() + ":" +
                py::str(f.attr("lineno")).cast<std::string>() + ")";
      }
    }
    return text;
  } catch (const std::exception&) {
    return e.what();
  }
}

namespace {
bool same_file(const std::string& a, const std::string& b) {
  if (a == b) return true;
  std::error_code ec;  // another spelling of one path (a symlink, a relative path) is the same
  return !b.empty() && std::filesystem::equivalent(a, b, ec) && !ec;
}
}  // namespace

void PythonInterpreter::ensure(const PythonConfig& config) {
  std::lock_guard<std::mutex> lock(g_mu);
  if (!g_started) {
    if (Py_IsInitialized()) {
      g_executable = "";  // the host process is Python: use its interpreter as it is
    } else {
      g_executable = choose_executable(config);
      PyConfig pc;
      PyConfig_InitPythonConfig(&pc);
      pc.install_signal_handlers = 0;  // the host program owns SIGINT and friends
      pc.parse_argv = 0;
      if (!g_executable.empty()) {
        PyStatus st = PyConfig_SetBytesString(&pc, &pc.program_name, g_executable.c_str());
        if (PyStatus_Exception(st)) {
          PyConfig_Clear(&pc);
          throw PythonError("could not set the Python program name to " + g_executable);
        }
      }
      try {
        py::initialize_interpreter(&pc, 0, nullptr, false);
      } catch (const std::exception& e) {
        throw PythonError(std::string("starting the embedded Python interpreter failed: ") + e.what());
      }
      // From here on every call takes the GIL itself; Python's own threads need it free.
      PyEval_SaveThread();
    }
    g_started = true;
  } else if (!config.executable.empty() && !same_file(config.executable, g_executable)) {
    // One interpreter per process: a later model's executable was ignored without a word.
    throw PythonError("PythonConfig::executable is " + config.executable + ", but this process's " +
                      "embedded Python already runs " +
                      (g_executable.empty() ? std::string("(the host process's own)") : g_executable) +
                      "; a process has one interpreter: leave executable empty after the first model");
  }
  py::gil_scoped_acquire gil;
  try {
    add_paths_locked(config.paths);
    py::module_::import("mstar_rt.embed");
  } catch (py::error_already_set& e) {
    py::object sys_path = py::module_::import("sys").attr("path");
    throw PythonError("the embedded interpreter (" +
                      (g_executable.empty() ? std::string("default prefix") : g_executable) +
                      ") cannot import mstar_rt: " + python_error_text(e) + "; sys.path is " +
                      py::str(sys_path).cast<std::string>() +
                      ". Install mstar_rt into that environment, or set PythonConfig::executable "
                      "/ $MSTAR_PYTHON to a Python that has it, or add its folder to "
                      "PythonConfig::paths / $PYTHONPATH");
  }
}

std::string PythonInterpreter::executable() {
  std::lock_guard<std::mutex> lock(g_mu);
  return g_executable;
}

std::string PythonInterpreter::version() {
  ensure();
  py::gil_scoped_acquire gil;
  return py::module_::import("sys").attr("version").cast<std::string>();
}

void PythonInterpreter::exec(const std::string& source) {
  ensure();
  py::gil_scoped_acquire gil;
  try {
    py::exec(source);
  } catch (py::error_already_set& e) {
    throw PythonError(python_error_text(e));
  }
}

}  // namespace mstar

// mstar/embed.hpp — serve a model defined in Python from a C++ program (target mstar_rt::embed,
// which links libpython; mstar_rt::runtime does not).
//
//   mstar::PythonModel policy("examples/robot/policy.py", "ChunkPolicyModel");
//   mstar::Request r = policy.submit({{"obs", obs}});
//   auto actions = r.result().at("actions").front();   // a C++ Tensor (a copy)
//
// The model is mstar_rt.Model subclass `cls` of `module` (a dotted module name found on the
// Python path, or a path to a .py file whose folder is put on the path), built as
// cls(**config) from a JSON object, and served by mstar_rt.Runtime inside this process. Its
// EMIT outputs come back as C++ tensors through the same Request handle the C++ Runtime gives.
//
// Threads and the GIL: the interpreter is started once per process (or joined, when the host
// process is Python already) and the GIL is released at once. submit(), cancel() and close()
// take the GIL for the call only; the Python Runtime's worker threads run the nodes; waiting on
// a Request (next/wait/result) never holds it. A control tick that only pops an
// ActionChunkBuffer filled by a ChunkFeeder calling a PythonModel never touches Python.
//
// Finding Python packages: the interpreter takes the environment (venv site-packages) of the
// Python executable named by, in order: PythonConfig::executable, $MSTAR_PYTHON,
// $VIRTUAL_ENV/bin/python, the Python mstar_rt was built with. After find_package(mstar_rt),
// mstar_rt_PYTHON_EXECUTABLE names the one an installed wheel lives in. PythonConfig::paths
// (and $PYTHONPATH) go first on sys.path.
// The interpreter lives until the process exits: numpy and torch cannot be loaded twice.
#pragma once

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "mstar/runtime.hpp"

namespace mstar {

/// Python raised; the message holds the exception type, text and the traceback's last lines.
class PythonError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

struct PythonConfig {
  std::string executable;          ///< "" = $MSTAR_PYTHON, $VIRTUAL_ENV/bin/python, build Python
  std::vector<std::string> paths;  ///< prepended to sys.path
};

/// The process's embedded interpreter. The first call starts it with `config` (later calls add
/// their paths to sys.path; one naming another executable throws PythonError, as a process
/// has one interpreter); throws PythonError if Python or mstar_rt cannot be loaded.
class PythonInterpreter {
 public:
  static void ensure(const PythonConfig& config = {});
  static std::string executable();  ///< the executable whose environment it took ("" if unknown)
  static std::string version();     ///< sys.version
  /// Runs Python source in __main__ (with the GIL); throws PythonError. For setup and tests.
  static void exec(const std::string& source);
};

class PythonModel {
 public:
  /// Loads and serves the model; throws PythonError naming what failed (import, class lookup,
  /// a config the constructor rejects, a graph error).
  PythonModel(const std::string& module, const std::string& cls,
              const std::string& config_json = "{}", PythonConfig config = {});
  /// close(); destroyed in its own on_output callback, it lets the close finish on a thread of
  /// its own (a thread cannot join itself). Never throws.
  ~PythonModel();
  PythonModel(const PythonModel&) = delete;
  PythonModel& operator=(const PythonModel&) = delete;

  /// The request inputs the model declares.
  std::vector<std::string> inputs() const;
  /// Starts a request; inputs are copied into numpy arrays. Throws std::invalid_argument when
  /// the model refuses them (unknown or missing names, its validate_inputs), std::logic_error
  /// after close(). options.on_output runs on a Python worker thread, without the GIL or any
  /// lock of the model's. A fail_late request whose deadline cannot be met comes back failed
  /// ("deadline cannot be met: ..."), as from Runtime::submit.
  Request submit(const std::map<std::string, Tensor>& inputs, RequestOptions options = {});
  /// Cancels running requests and stops the Python Runtime's workers. Called from one of its own
  /// worker threads (on_output) it throws std::logic_error and closes nothing.
  void close();

  struct Impl;

 private:
  std::shared_ptr<Impl> impl_;
};

}  // namespace mstar

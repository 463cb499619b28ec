// The shared state behind a Request handle: outputs waiting to be taken, the status, and how to
// cancel it. Filled by whatever serves the request (the C++ Runtime, or an embedded Python
// model in embed.cpp), read by the application's threads through Request.
#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <string>
#include <vector>

#include "mstar/runtime.hpp"

namespace mstar {

struct Request::State {
  RequestId id = 0;
  OutputCallback on_output;
  std::string walk;  // the walk running now (the C++ Runtime writes it under its own lock)
  bool fail_late = false;  // RequestOptions::fail_late
  // Set by the server before the handle is returned; each holds only a weak reference to it.
  std::function<bool(RequestId)> cancel;
  std::function<std::vector<NodeRun>(RequestId)> live_timeline;

  mutable std::mutex mu;
  std::condition_variable changed;
  std::deque<Output> outputs;
  RequestStatus status = RequestStatus::running;
  std::string error;
  std::vector<NodeRun> timeline;  // set at the end

  std::mutex deliver_mu;  // one callback delivery at a time, in queue order

  void push(Output out) {
    {
      std::lock_guard<std::mutex> lock(mu);
      outputs.push_back(std::move(out));
    }
    changed.notify_all();
  }

  /// False if it was already over.
  bool end(RequestStatus how, std::string message, std::vector<NodeRun> runs) {
    {
      std::lock_guard<std::mutex> lock(mu);
      if (status != RequestStatus::running) return false;
      status = how;
      error = std::move(message);
      timeline = std::move(runs);
    }
    changed.notify_all();
    return true;
  }

  /// Hands queued outputs to on_output, in order, one delivery at a time. A throwing callback
  /// is ignored: it must not take the serving thread down.
  void deliver() {
    std::lock_guard<std::mutex> order(deliver_mu);
    for (;;) {
      Output out;
      {
        std::lock_guard<std::mutex> lock(mu);
        if (outputs.empty()) return;
        out = std::move(outputs.front());
        outputs.pop_front();
      }
      try {
        on_output(id, out);
      } catch (...) {
      }
    }
  }
};

}  // namespace mstar

// Request: the application's handle on a request, over the shared Request::State that whatever
// serves the request fills (the C++ Runtime, or an embedded Python model).
#include <stdexcept>

#include "mstar/runtime.hpp"
#include "runtime/request.hpp"

namespace mstar {

const char* status_name(RequestStatus status) noexcept {
  switch (status) {
    case RequestStatus::running: return "running";
    case RequestStatus::finished: return "finished";
    case RequestStatus::failed: return "failed";
    case RequestStatus::cancelled: return "cancelled";
  }
  return "?";
}

Request::Request(std::shared_ptr<State> state) : state_(std::move(state)) {
  if (!state_) throw std::invalid_argument("Request: no request state (a Request comes from submit())");
}

RequestId Request::id() const noexcept { return state_->id; }

bool Request::next(Output* out, std::chrono::nanoseconds timeout) {
  std::unique_lock<std::mutex> lock(state_->mu);
  auto ready = [&] { return !state_->outputs.empty() || state_->status != RequestStatus::running; };
  if (timeout == std::chrono::nanoseconds::max())
    state_->changed.wait(lock, ready);
  else
    state_->changed.wait_for(lock, timeout, ready);
  if (state_->outputs.empty()) return false;
  *out = std::move(state_->outputs.front());
  state_->outputs.pop_front();
  return true;
}

RequestStatus Request::wait(std::chrono::nanoseconds timeout) {
  std::unique_lock<std::mutex> lock(state_->mu);
  auto over = [&] { return state_->status != RequestStatus::running; };
  if (timeout == std::chrono::nanoseconds::max())
    state_->changed.wait(lock, over);
  else
    state_->changed.wait_for(lock, timeout, over);
  return state_->status;
}

std::map<std::string, std::vector<Tensor>> Request::result() {
  const RequestStatus status = wait();
  std::lock_guard<std::mutex> lock(state_->mu);
  if (status != RequestStatus::finished) throw RequestError(status, state_->error);
  std::map<std::string, std::vector<Tensor>> out;
  for (Output& o : state_->outputs) out[o.name].push_back(std::move(o.value));
  state_->outputs.clear();
  return out;
}

bool Request::cancel() { return state_->cancel ? state_->cancel(state_->id) : false; }

RequestStatus Request::status() const {
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->status;
}

std::string Request::error() const {
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->error;
}

std::vector<NodeRun> Request::timeline() const {
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    if (state_->status != RequestStatus::running) return state_->timeline;
  }
  return state_->live_timeline ? state_->live_timeline(state_->id) : std::vector<NodeRun>{};
}

}  // namespace mstar

// The C++ application API used wrongly, as a first-time embedder might: each mistake is refused
// by name at the call that makes it, and none crashes the process or leaves anything behind.
#include <gtest/gtest.h>

#include <chrono>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "mstar/runtime.hpp"

namespace {

using namespace std::chrono_literals;
using mstar::Edge;
using mstar::GraphError;
using mstar::Model;
using mstar::NodeCall;
using mstar::RequestStatus;
using mstar::Runtime;
using mstar::Tensor;

Model doubler() {
  Model m;
  m.input("x");
  m.node("double", {"x"}, {Edge::emit("y")}, [](NodeCall& c) {
    const Tensor& x = c.input("x");
    Tensor y = Tensor::empty(x.dtype(), x.shape());
    for (std::size_t i = 0; i < x.numel(); ++i) y.data<float>()[i] = 2 * x.data<float>()[i];
    c.output("y", y);
  });
  m.walk("main", "double");
  return m;
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

TEST(RuntimeMisuse, AnInputDeclaredTwiceIsRefused) {
  Model m;
  m.input("x");
  EXPECT_NE(error_of([&] { m.input("x"); }).find("input 'x' is declared twice"), std::string::npos);
}

TEST(RuntimeMisuse, LoadRefusesAnInputTheIrDoesNotHave) {
  const mstar::GraphSpec ir = doubler().compile();
  // it loaded, and every submit then failed with a bare "map::at"
  const std::string e = error_of([&] { Model::load(ir, {"obs"}); });
  EXPECT_NE(e.find("Model::load: input 'obs' is not a value of the IR (its values are ['x', 'y'])"),
            std::string::npos) << e;
  Model ok = Model::load(ir, {"x"});
  ok.bind("double", [](NodeCall& c) { c.output("y", c.input("x")); });
  Runtime rt(std::move(ok));
  EXPECT_EQ(rt.submit({{"x", Tensor::from<float>({1}, {1})}}).wait(10s), RequestStatus::finished);
  EXPECT_EQ(rt.stats().stored_tensors, 0u);
}

TEST(RuntimeMisuse, AStreamEndCallbackOnANodeThatReadsNoStreamIsRefused) {
  Model m = doubler();
  m.on_stream_end("double", [](NodeCall&) {});
  const std::string e = error_of([&] { m.compile(); });
  EXPECT_NE(e.find("on_stream_end: node 'double' reads no stream"), std::string::npos) << e;
}

TEST(RuntimeMisuse, ARequestMadeFromNothingIsRefused) {
  // it compiled, and status() then dereferenced null
  EXPECT_THROW(mstar::Request r(nullptr), std::invalid_argument);
}

TEST(RuntimeMisuse, DestroyingTheRuntimeInItsOwnCallbackStopsItSafely) {
  // The owner drops the runtime when an output arrives: ~Runtime threw from close() (a thread
  // cannot join itself) and the process aborted.
  auto rt = std::make_unique<Runtime>(doubler());
  std::mutex mu;
  mstar::RequestOptions opt;
  opt.on_output = [&](mstar::RequestId, const mstar::Output&) {
    std::lock_guard<std::mutex> lock(mu);
    rt.reset();
  };
  mstar::Request r = rt->submit({{"x", Tensor::from<float>({1, 2}, {2})}}, opt);
  EXPECT_NE(r.wait(10s), RequestStatus::running);
  {
    std::lock_guard<std::mutex> lock(mu);
    EXPECT_EQ(rt, nullptr);
  }
  std::this_thread::sleep_for(50ms);  // the worker exits and frees the runtime (ASan: no leak)
  EXPECT_FALSE(r.cancel());
}

}  // namespace

// mstar_rt::embed: a model defined in Python (tests/cpp/embed_tiny_model.py) served from C++
// through the embedded interpreter; outputs come back as C++ tensors. Not run under the
// sanitizers: libpython and numpy are not instrumented (see tests/cpp/CMakeLists.txt).
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <mutex>
#include <thread>

#include "mstar/embed.hpp"

#ifndef MSTAR_TEST_MODEL
#error "MSTAR_TEST_MODEL must name embed_tiny_model.py"
#endif

namespace {

using namespace std::chrono_literals;
using mstar::DType;
using mstar::PythonModel;
using mstar::RequestStatus;
using mstar::Tensor;

TEST(EmbedModel, ServesAPythonModelAndReturnsCppTensors) {
  PythonModel model(MSTAR_TEST_MODEL, "TinyModel", R"({"factor": 3.0, "steps": 4})");
  EXPECT_EQ(model.inputs(), std::vector<std::string>{"x"});
  auto r = model.submit({{"x", Tensor::from<float>({1, 2}, {2})}});
  mstar::Output out;
  std::vector<std::string> order;
  std::vector<double> steps;
  Tensor y;
  while (r.next(&out, std::chrono::seconds(30))) {
    order.push_back(out.name);
    if (out.name == "y") y = out.value;
    else steps.push_back(out.value.data<double>()[0]);
  }
  ASSERT_EQ(r.status(), RequestStatus::finished) << r.error();
  EXPECT_EQ(order, (std::vector<std::string>{"y", "step", "step", "step", "step"}));
  ASSERT_EQ(y.describe(), "float32[2]");
  EXPECT_EQ(y.data<float>()[1], 6.0f);
  EXPECT_EQ(steps, (std::vector<double>{9, 10, 11, 12}));  // iteration + sum(y) = i + 9
  EXPECT_FALSE(r.timeline().empty());
  EXPECT_NE(mstar::PythonInterpreter::version().find("3."), std::string::npos);
}

TEST(EmbedModel, BadInputIsRefusedAndANodeErrorFailsOnlyItsRequest) {
  PythonModel model(MSTAR_TEST_MODEL, "TinyModel");
  try {
    model.submit({{"x", Tensor::from<float>({1, 2, 3, 4}, {2, 2})}});
    FAIL() << "a 2-d x was accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("x must be 1-d, got shape (2, 2)"), std::string::npos) << e.what();
  }
  EXPECT_THROW(model.submit({{"nope", Tensor::scalar<float>(1)}}), std::invalid_argument);
  auto bad = model.submit({{"x", Tensor::from<float>({-1}, {1})}});
  auto good = model.submit({{"x", Tensor::from<float>({1}, {1})}});
  EXPECT_EQ(bad.wait(std::chrono::seconds(30)), RequestStatus::failed);
  EXPECT_NE(bad.error().find("x[0] is -1.0; this model takes x[0] >= 0"), std::string::npos) << bad.error();
  EXPECT_THROW(bad.result(), mstar::RequestError);
  auto res = good.result();
  EXPECT_EQ(res.at("y").at(0).data<float>()[0], 2.0f);
  EXPECT_EQ(res.at("step").size(), 3u);
}

TEST(EmbedModel, CancelStopsAPythonRequest) {
  PythonModel model(MSTAR_TEST_MODEL, "TinyModel", R"({"steps": 1000, "delay_s": 0.005})");
  auto r = model.submit({{"x", Tensor::from<float>({1}, {1})}});
  mstar::Output out;
  ASSERT_TRUE(r.next(&out, std::chrono::seconds(30)));
  EXPECT_TRUE(r.cancel());
  EXPECT_EQ(r.wait(std::chrono::seconds(30)), RequestStatus::cancelled);
  EXPECT_FALSE(r.cancel());
  model.close();
  EXPECT_THROW(model.submit({{"x", Tensor::from<float>({1}, {1})}}), std::logic_error);
}

TEST(EmbedModel, OutputsReachACallbackFromAPythonThread) {
  PythonModel model(MSTAR_TEST_MODEL, "TinyModel", R"({"steps": 2})");
  std::mutex mu;
  std::vector<std::string> names;
  mstar::RequestOptions opt;
  opt.on_output = [&](mstar::RequestId, const mstar::Output& o) {
    std::lock_guard<std::mutex> lock(mu);
    names.push_back(o.name);
  };
  auto r = model.submit({{"x", Tensor::from<std::int64_t>({5}, {1})}}, opt);
  EXPECT_EQ(r.wait(std::chrono::seconds(30)), RequestStatus::finished) << r.error();
  std::lock_guard<std::mutex> lock(mu);
  EXPECT_EQ(names, (std::vector<std::string>{"y", "step", "step"}));
}

TEST(EmbedModel, AnOutputCppCannotHoldFailsItsRequestByName) {
  PythonModel model(MSTAR_TEST_MODEL, "TinyModel", R"({"y_dtype": "uint16", "steps": 1})");
  auto r = model.submit({{"x", Tensor::from<float>({1}, {1})}});
  EXPECT_EQ(r.wait(std::chrono::seconds(30)), RequestStatus::failed);
  EXPECT_NE(r.error().find("EMIT output 'y': an EMIT output of dtype uint16 cannot reach C++"),
            std::string::npos) << r.error();
}

TEST(EmbedModel, FailLateKeepsTheDeadline) {
  PythonModel model(MSTAR_TEST_MODEL, "TinyModel", R"({"steps": 3, "delay_s": 0.2})");
  mstar::RequestOptions opt;
  opt.deadline = 1ms;
  opt.fail_late = true;
  auto late = model.submit({{"x", Tensor::from<float>({1}, {1})}}, opt);
  EXPECT_EQ(late.wait(std::chrono::seconds(30)), RequestStatus::failed);
  EXPECT_NE(late.error().find("deadline"), std::string::npos) << late.error();
  opt.fail_late = false;  // only ordered by it
  auto kept = model.submit({{"x", Tensor::from<float>({1}, {1})}}, opt);
  EXPECT_EQ(kept.wait(std::chrono::seconds(30)), RequestStatus::finished) << kept.error();
}

TEST(EmbedModel, LoadErrorsNameWhatFailed) {
  try {
    PythonModel m(MSTAR_TEST_MODEL, "NoSuchModel");
    FAIL();
  } catch (const mstar::PythonError& e) {
    EXPECT_NE(std::string(e.what()).find("has no class 'NoSuchModel'"), std::string::npos) << e.what();
  }
  try {
    PythonModel m(MSTAR_TEST_MODEL, "TinyModel", R"({"colour": 1})");
    FAIL();
  } catch (const mstar::PythonError& e) {
    EXPECT_NE(std::string(e.what()).find("colour"), std::string::npos) << e.what();
  }
  try {  // in a C++ caller's words, not the YAML config's (model.class, model.path)
    PythonModel m("no_such_module_xyz", "M");
    FAIL();
  } catch (const mstar::PythonError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("put its folder in PythonConfig::paths or $PYTHONPATH"), std::string::npos) << what;
    EXPECT_EQ(what.find("model.path"), std::string::npos) << what;
  }
}

TEST(EmbedModel, ALaterModelNamingAnotherPythonIsRefused) {
  PythonModel first(MSTAR_TEST_MODEL, "TinyModel");  // the interpreter runs from here on
  mstar::PythonConfig other;
  other.executable = "/no/such/python3.12";  // ignored without a word
  try {
    PythonModel second(MSTAR_TEST_MODEL, "TinyModel", "{}", other);
    FAIL();
  } catch (const mstar::PythonError& e) {
    EXPECT_NE(std::string(e.what()).find("a process has one interpreter"), std::string::npos) << e.what();
  }
  mstar::PythonConfig same;
  same.executable = mstar::PythonInterpreter::executable();
  if (!same.executable.empty()) PythonModel third(MSTAR_TEST_MODEL, "TinyModel", "{}", same);
}

TEST(EmbedModel, AFailLateRequestThatCannotMakeItComesBackFailedNotThrown) {
  PythonModel model(MSTAR_TEST_MODEL, "TinyModel", R"({"steps": 1, "delay_s": 0.2})");
  for (int i = 0; i < 2; ++i)  // the Conductor learns how long count takes
    ASSERT_EQ(model.submit({{"x", Tensor::from<float>({1}, {1})}}).wait(30s), RequestStatus::finished);
  for (int k = 0; k < 2; ++k) {
    auto busy = model.submit({{"x", Tensor::from<float>({1}, {1})}});
    mstar::Output y;
    ASSERT_TRUE(busy.next(&y, 30s));  // scale ran: its 200 ms count starts, ahead of r's
    std::this_thread::sleep_for(50ms);  // (started: r's count cannot join its batch)
    mstar::RequestOptions opt;
    opt.deadline = 50ms;
    opt.fail_late = true;
    mstar::Request r = model.submit({{"x", Tensor::from<float>({1}, {1})}}, opt);  // threw
    EXPECT_EQ(r.wait(30s), RequestStatus::failed);
    EXPECT_NE(r.error().find("deadline cannot be met"), std::string::npos) << r.error();
    EXPECT_EQ(busy.wait(30s), RequestStatus::finished);
  }
  // nothing of theirs is left waiting for a C++ sink on the Python side
  mstar::PythonInterpreter::exec(
      "import gc\nfrom mstar_rt.embed import EmbeddedRuntime\n"
      "left = [len(o._pending) for o in gc.get_objects() if isinstance(o, EmbeddedRuntime) "
      "and not o.closed]\nassert left == [0], left\n");
}

TEST(EmbedModel, ASlowOutputCallbackHoldsUpNoOtherSubmit) {
  PythonModel model(MSTAR_TEST_MODEL, "TinyModel", R"({"steps": 1})");
  std::atomic<bool> inside{false};
  mstar::RequestOptions opt;
  opt.on_output = [&](mstar::RequestId, const mstar::Output&) {
    inside = true;
    std::this_thread::sleep_for(800ms);
  };
  auto slow = model.submit({{"x", Tensor::from<float>({1}, {1})}}, opt);
  while (!inside) std::this_thread::sleep_for(1ms);
  const auto t0 = std::chrono::steady_clock::now();
  auto quick = model.submit({{"x", Tensor::from<float>({1}, {1})}});  // took the 800 ms
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 400ms);
  EXPECT_EQ(slow.wait(30s), RequestStatus::finished);
  EXPECT_EQ(quick.wait(30s), RequestStatus::finished);
}

TEST(EmbedModel, ARunningRequestsTimelineShowsItsNodesSoFar) {
  PythonModel model(MSTAR_TEST_MODEL, "TinyModel", R"({"steps": 50, "delay_s": 0.01})");
  auto r = model.submit({{"x", Tensor::from<float>({1}, {1})}});
  mstar::Output out;
  ASSERT_TRUE(r.next(&out, 30s));
  ASSERT_TRUE(r.next(&out, 30s));  // a step: scale has run
  const auto runs = r.timeline();  // was always empty while it ran
  ASSERT_FALSE(runs.empty());
  EXPECT_EQ(runs.front().node, "scale");
  EXPECT_EQ(runs.front().walk, "main");
  r.cancel();
}

TEST(EmbedModel, CloseInItsOwnCallbackIsRefusedAndDestroyingItThereIsSafe) {
  PythonModel model(MSTAR_TEST_MODEL, "TinyModel", R"({"steps": 1})");
  std::string refused;
  mstar::RequestOptions opt;
  opt.on_output = [&](mstar::RequestId, const mstar::Output&) {
    if (!refused.empty()) return;
    try {
      model.close();
      refused = "closed";
    } catch (const std::logic_error& e) {
      refused = e.what();
    }
  };
  EXPECT_EQ(model.submit({{"x", Tensor::from<float>({1}, {1})}}, opt).wait(30s), RequestStatus::finished);
  EXPECT_NE(refused.find("from one of the model's own worker threads"), std::string::npos) << refused;
  // it closed nothing (it had marked the model closed): the model still serves
  EXPECT_EQ(model.submit({{"x", Tensor::from<float>({1}, {1})}}).wait(30s), RequestStatus::finished);

  // The owner drops the model in its output callback: the process aborted (a throwing destructor).
  auto owned = std::make_unique<PythonModel>(MSTAR_TEST_MODEL, "TinyModel", R"({"steps": 3})");
  std::mutex mu;
  mstar::RequestOptions drop;
  drop.on_output = [&](mstar::RequestId, const mstar::Output&) {
    std::lock_guard<std::mutex> lock(mu);
    owned.reset();
  };
  auto r = owned->submit({{"x", Tensor::from<float>({1}, {1})}}, drop);
  const auto status = r.wait(30s);
  EXPECT_NE(status, RequestStatus::running);
  std::lock_guard<std::mutex> lock(mu);
  EXPECT_EQ(owned, nullptr);
}

}  // namespace

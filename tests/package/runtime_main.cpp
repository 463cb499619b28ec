// A C++ Model on the Runtime: a DynamicLoop streams 1, 2, 4, ... until the value passes 100;
// a node that throws fails only its request. Exit code 0 = pass.
#include <mstar/runtime.hpp>

#include <cstdio>

int main() {
  using mstar::Tensor;
  mstar::Model m;
  m.input("v", mstar::TensorSpec::of(mstar::DType::int64, {}));
  m.node("grow", {"v"}, {mstar::Edge::emit("out"), mstar::Edge::to_node("grow", "v")},
         [](mstar::NodeCall& c) {
           const std::int64_t v = c.input("v").data<std::int64_t>()[0];
           if (v < 0) throw std::domain_error("v must be >= 0");
           c.output("out", Tensor::scalar<std::int64_t>(v));
           c.output("v", Tensor::scalar<std::int64_t>(v * 2));
           if (v * 2 > 100) c.stop("grow");
         });
  m.walk("main", mstar::Section::dynamic_loop("grow", "grow", 64, {"v"}));
  mstar::Runtime rt(std::move(m));
  mstar::Request ok = rt.submit({{"v", Tensor::scalar<std::int64_t>(1)}});
  mstar::Request bad = rt.submit({{"v", Tensor::scalar<std::int64_t>(-1)}});
  mstar::Output out;
  std::int64_t expect = 1;
  while (ok.next(&out)) {
    if (out.value.data<std::int64_t>()[0] != expect) return 1;
    expect *= 2;
  }
  const bool good = ok.status() == mstar::RequestStatus::finished && expect == 128 &&
                    bad.wait() == mstar::RequestStatus::failed &&
                    bad.error().find("v must be >= 0") != std::string::npos;
  std::printf("runtime_consumer: streamed up to %lld, bad request: %s\n",
              static_cast<long long>(expect / 2), bad.error().c_str());
  return good ? 0 : 1;
}

// A Python-defined model (consumer_model.py) served from C++ through the embedded interpreter
// of the environment the wheel is installed in. Exit code 0 = pass.
#include <mstar/embed.hpp>

#include <cstdio>

int main() {
  mstar::PythonConfig config;
  config.executable = CONSUMER_PYTHON;  // mstar_rt_PYTHON_EXECUTABLE from find_package
  try {
    mstar::PythonModel model(CONSUMER_MODEL, "AffineModel", R"({"gain": 2.0, "offset": 0.5})", config);
    // The package must come from the installed wheel, not from a source tree.
    mstar::PythonInterpreter::exec(
        "import mstar_rt, sys\n"
        "assert 'site-packages' in mstar_rt.__file__, mstar_rt.__file__\n"
        "print('embed_consumer: mstar_rt from', mstar_rt.__file__, 'python', sys.version.split()[0])\n");
    auto y = model.submit({{"x", mstar::Tensor::from<float>({1, 2, 3}, {3})}}).result().at("y").at(0);
    const float* v = y.data<float>();
    std::printf("embed_consumer: %s = [%g, %g, %g] via %s\n", y.describe().c_str(), v[0], v[1], v[2],
                mstar::PythonInterpreter::executable().c_str());
    return (v[0] == 2.5f && v[1] == 4.5f && v[2] == 6.5f) ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "embed_consumer: %s\n", e.what());
    return 1;
  }
}

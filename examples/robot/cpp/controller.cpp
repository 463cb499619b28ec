// A C++ robot controller at a fixed rate, fed action chunks by a Python-defined policy served in
// this process (examples/robot/policy.py through served_policy.py, on mstar_rt.Runtime).
//
// Three kinds of thread:
//   control loop  mstar::ControlLoop on absolute deadlines. Each tick pops one action from the
//                 ActionChunkBuffer (lock-free), steps a 2-link arm simulation one period, and
//                 hands the observation to the ChunkFeeder (a lock-free triple buffer). C++
//                 only: it never takes the GIL.
//   feeder        when fewer than H/2 planned actions are left, submits the newest observation
//                 to the Python model (taking the GIL for the submit only), waits for the chunk
//                 and publishes it stamped with the observation's tick (RTC merge).
//   Python        the Runtime's engine worker runs the policy's walk (normalize -> mlp ->
//                 denormalize) with torch.
//
// Prints lateness (how late each tick woke: p50 / p99 / p99.9 / max), starvation (ticks with no
// action), deadline misses, inference latency and how close the arm got to its targets; exits
// 1 if any tick starved after the first chunk (or with --max-starved N, more than N).
//
//   controller [--seconds 10] [--rate-hz 100] [--mode rtc|latest|weighted] [--realtime]
//              [--policy path/to/module.py] [--class ServedPolicy] [--config '{...}']
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "mstar/chunk_feeder.hpp"
#include "mstar/embed.hpp"
#include "mstar/runtime.hpp"

#ifndef MSTAR_EXAMPLE_POLICY
#define MSTAR_EXAMPLE_POLICY "served_policy.py"
#endif

namespace {

struct Args {
  double seconds = 10, rate_hz = 100;
  std::string mode = "rtc", policy = MSTAR_EXAMPLE_POLICY, cls = "ServedPolicy", config = "{}";
  bool realtime = false;
  long max_starved = 0;
};

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "%s needs a value\n", k.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (k == "--seconds") a.seconds = std::stod(value());
    else if (k == "--rate-hz") a.rate_hz = std::stod(value());
    else if (k == "--mode") a.mode = value();
    else if (k == "--policy") a.policy = value();
    else if (k == "--class") a.cls = value();
    else if (k == "--config") a.config = value();
    else if (k == "--max-starved") a.max_starved = std::stol(value());
    else if (k == "--realtime") a.realtime = true;
    else {
      std::fprintf(stderr, "unknown argument %s (see the header of controller.cpp)\n", k.c_str());
      std::exit(2);
    }
  }
  return a;
}

// A planar 2-link arm with position servos (the set-point is the action), integrated with
// semi-implicit Euler: a stand-in for the MuJoCo arm of examples/robot/arm_env.py, with the
// same observation layout: q (2), qd (2), target xy (2), end effector xy (2).
struct Arm {
  static constexpr double kL = 0.2, kKp = 400, kKv = 20, kDt = 0.001;
  double q[2] = {0.3, 1.2}, qd[2] = {0, 0}, target[2] = {0.2, 0.2}, set[2] = {0.3, 1.2};

  void ee(double* xy) const {
    xy[0] = kL * std::cos(q[0]) + kL * std::cos(q[0] + q[1]);
    xy[1] = kL * std::sin(q[0]) + kL * std::sin(q[0] + q[1]);
  }
  double distance() const {
    double xy[2];
    ee(xy);
    return std::hypot(xy[0] - target[0], xy[1] - target[1]);
  }
  void step(double seconds) {
    for (int n = static_cast<int>(std::lround(seconds / kDt)); n > 0; --n)
      for (int j = 0; j < 2; ++j) {
        qd[j] += (kKp * (set[j] - q[j]) - kKv * qd[j]) * kDt;
        q[j] += qd[j] * kDt;
      }
  }
  void observe(float* obs) const {
    double xy[2];
    ee(xy);
    const double v[8] = {q[0], q[1], qd[0], qd[1], target[0], target[1], xy[0], xy[1]};
    for (int i = 0; i < 8; ++i) obs[i] = static_cast<float>(v[i]);
  }
  // Targets on a fixed cycle inside the reachable annulus (deterministic, no allocation).
  void next_target(std::uint64_t k) {
    const double phi = -2.0 + 0.9 * static_cast<double>(k % 5), r = 0.18 + 0.04 * static_cast<double>(k % 3);
    target[0] = r * std::cos(phi);
    target[1] = r * std::sin(phi);
  }
};

mstar::MergeMode parse_mode(const std::string& m) {
  if (m == "latest") return mstar::MergeMode::latest;
  if (m == "weighted") return mstar::MergeMode::weighted;
  if (m == "rtc") return mstar::MergeMode::rtc;
  std::fprintf(stderr, "--mode must be rtc, latest or weighted\n");
  std::exit(2);
}

}  // namespace

int main(int argc, char** argv) {
  const Args args = parse(argc, argv);
  // One OpenMP thread for torch, set before Python loads it (see examples/robot/demo.py).
  setenv("OMP_NUM_THREADS", "1", 0);

  std::printf("loading %s:%s(%s) in the embedded interpreter ...\n", args.policy.c_str(),
              args.cls.c_str(), args.config.c_str());
  mstar::PythonModel policy(args.policy, args.cls, args.config);
  std::printf("python: %s\n", mstar::PythonInterpreter::executable().c_str());

  auto infer = [&](const mstar::Tensor& obs, std::uint64_t) {
    return policy.submit({{"obs", obs}}).result().at("actions").front();
  };
  // The chunk's shape tells the buffer its horizon and action size.
  Arm arm;
  mstar::Tensor obs0 = mstar::Tensor::empty(mstar::DType::float32, {8});
  arm.observe(obs0.data<float>());
  const mstar::Tensor first = infer(obs0, 0);
  if (first.ndim() != 2) {
    std::fprintf(stderr, "the policy returned %s; expected float32[H, A]\n", first.describe().c_str());
    return 2;
  }
  mstar::ActionChunkOptions ao;
  ao.horizon = static_cast<std::size_t>(first.dim(0));
  ao.action_dim = static_cast<std::size_t>(first.dim(1));
  ao.mode = parse_mode(args.mode);
  auto actions = mstar::Runtime::make_action_buffer(ao);
  actions->publish(first.data<float>(), ao.horizon, 0);  // primed: tick 0 has a plan

  mstar::ChunkFeederOptions fo;
  fo.obs_dim = 8;
  mstar::ChunkFeeder feeder(actions, fo, infer);

  mstar::ControlLoopOptions lo;
  lo.rate_hz = args.rate_hz;
  lo.realtime = args.realtime;
  lo.lock_memory = args.realtime;
  const double period = 1.0 / args.rate_hz;
  const auto ticks_per_target = static_cast<std::uint64_t>(std::lround(3.0 * args.rate_hz));
  std::uint64_t targets = 0, reached = 0, last_tick = 0;
  double distance_sum = 0;
  bool reached_this = false;
  float obs[8];
  auto loop = mstar::Runtime::make_control_loop(
      lo, actions, [&](const mstar::TickInfo& t, const float* action, bool) {
        arm.set[0] = action[0];
        arm.set[1] = action[1];
        arm.step(period * static_cast<double>(t.tick - last_tick + (t.tick == 0 ? 1 : 0)));
        last_tick = t.tick;
        if (arm.distance() < 0.02) reached_this = true;
        if ((t.tick + 1) % ticks_per_target == 0) {  // a new target every 3 s
          distance_sum += arm.distance();
          reached += reached_this ? 1 : 0;
          reached_this = false;
          arm.next_target(++targets);
        }
        arm.observe(obs);
        feeder.observe(obs, t.tick + 1);
      });
  feeder.start();
  const auto ticks = static_cast<std::uint64_t>(std::llround(args.seconds * args.rate_hz));
  loop->run(ticks);
  feeder.stop();
  policy.close();

  const mstar::ControlLoopStats s = loop->stats();
  const mstar::ActionBufferStats b = actions->stats();
  const mstar::ChunkFeederStats f = feeder.stats();
  std::printf("\nC++ control loop %.0f Hz for %.1f s, policy %s served in-process (%s merge)\n",
              args.rate_hz, args.seconds, args.cls.c_str(), args.mode.c_str());
  std::printf("  mode              %s\n", loop->mode().c_str());
  std::printf("  ticks             %llu (missed deadlines %llu)\n",
              static_cast<unsigned long long>(s.ticks), static_cast<unsigned long long>(s.missed_deadlines));
  std::printf("  lateness ms       p50 %.3f  p99 %.3f  p99.9 %.3f  max %.3f\n", s.lateness_p50_ms,
              s.lateness_p99_ms, s.lateness_p999_ms, s.lateness_max_ms);
  std::printf("  tick time ms      p50 %.3f  p99 %.3f  max %.3f\n", s.tick_p50_ms, s.tick_p99_ms, s.tick_max_ms);
  std::printf("  starved ticks     %llu\n", static_cast<unsigned long long>(b.starved_ticks));
  std::printf("  chunks            %llu published, %llu applied, %llu stale, %llu rejected, %llu failed\n",
              static_cast<unsigned long long>(f.chunks), static_cast<unsigned long long>(b.applied),
              static_cast<unsigned long long>(b.stale), static_cast<unsigned long long>(f.rejected),
              static_cast<unsigned long long>(f.failures));
  std::printf("  inference ms      p50 %.2f  p99 %.2f  max %.2f (submit -> chunk, from C++)\n",
              f.latency_p50_ms, f.latency_p99_ms, f.latency_max_ms);
  if (targets > 0)
    std::printf("  targets           %llu, reached within 2 cm: %llu, mean final distance %.3f m\n",
                static_cast<unsigned long long>(targets), static_cast<unsigned long long>(reached),
                distance_sum / static_cast<double>(targets));
  if (f.failures > 0) std::printf("  last policy error %s\n", feeder.last_error().c_str());
  if (static_cast<long>(b.starved_ticks) > args.max_starved || f.failures > 0) {
    std::printf("FAIL: %llu starved ticks (allowed %ld), %llu policy failures\n",
                static_cast<unsigned long long>(b.starved_ticks), args.max_starved,
                static_cast<unsigned long long>(f.failures));
    return 1;
  }
  return 0;
}

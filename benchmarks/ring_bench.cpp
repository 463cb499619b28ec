// ring_bench — mstar::SpscRing against boost::lockfree::spsc_queue, in one binary.
//
// Three measurements, each for 8-byte and 64-byte items and a small and a large ring:
//   throughput  one producer, one consumer, item by item (ours: try_push_as / try_pop_as)
//   bulk        64 items per call (ours: reserve/commit + peek/release in place;
//               boost: push(const T*, n) / pop(T*, n) through a local batch)
//   roundtrip   ping-pong over two rings, one item in flight
// The two threads are pinned to CPUs 0 and 1 when the machine allows it. Every measurement checks
// the stream (sequence numbers in order, a checksum over every word of every item) and the program
// exits with status 2 on the first mismatch, so a broken ring cannot look fast. Ours and boost
// alternate (the first one swaps every repetition); benchmarks/ring.py takes the medians.
//
// stdout: one JSON object with every raw sample and its median. stderr: progress lines
// "progress <done> <total> <label>".
#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <boost/lockfree/spsc_queue.hpp>

#include "mstar/spsc_ring.hpp"

namespace {

using Clock = std::chrono::steady_clock;
constexpr std::size_t kBatch = 64;

// ---- items ------------------------------------------------------------------------------------

template <std::size_t Bytes>
struct Item {
  static constexpr std::size_t kWords = Bytes / 8;
  std::uint64_t w[kWords];
};
using Item8 = Item<8>;
using Item64 = Item<64>;
static_assert(sizeof(Item8) == 8 && sizeof(Item64) == 64, "items must have the advertised size");

// Word 0 is the sequence number; the others are derived from it so a torn or stale item changes
// the checksum.
template <class T>
inline void fill(T& item, std::uint64_t seq) noexcept {
  item.w[0] = seq;
  for (std::size_t i = 1; i < T::kWords; ++i) item.w[i] = seq ^ (i * 0x9E3779B97F4A7C15ull);
}

template <class T>
inline std::uint64_t word_sum(const T& item) noexcept {
  std::uint64_t s = 0;
  for (std::size_t i = 0; i < T::kWords; ++i) s += item.w[i];
  return s;
}

// What the consumer saw; compared with what the producer sent.
struct Tally {
  std::uint64_t count = 0;
  std::uint64_t sum = 0;
  bool in_order = true;
  template <class T>
  void see(const T& item) noexcept {
    in_order &= item.w[0] == count;
    sum += word_sum(item);
    ++count;
  }
};

[[noreturn]] void fail(const std::string& what) {
  std::fprintf(stderr, "ring_bench: VERIFICATION FAILED: %s\n", what.c_str());
  std::fflush(stderr);
  std::exit(2);
}

void check(const Tally& sent, const Tally& got, const char* label) {
  if (!got.in_order) fail(std::string(label) + ": items out of order or corrupted");
  if (sent.count != got.count || sent.sum != got.sum)
    fail(std::string(label) + ": sent " + std::to_string(sent.count) + " items (sum " +
         std::to_string(sent.sum) + "), received " + std::to_string(got.count) + " (sum " +
         std::to_string(got.sum) + ")");
}

// ---- threads ----------------------------------------------------------------------------------

bool g_pin = true;
std::atomic<int> g_pin_failures{0};

void pin_to(int cpu) {
  if (!g_pin) return;
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(cpu, &set);
  if (pthread_setaffinity_np(pthread_self(), sizeof(set), &set) != 0) g_pin_failures++;
}

// Busy-waits on `ready`, identical for both rings. Yields now and then so an unpinned run on one
// CPU still finishes.
template <class F>
inline void spin_until(F&& ready) {
  // A pause per failed poll, as any production spin loop has: it stops a side that found the
  // ring empty (or full) from stealing the shared cache line back on every cycle.
  unsigned n = 0;
  while (!ready()) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
    if (++n == (1u << 14)) {
      n = 0;
      std::this_thread::yield();
    }
  }
}

// Runs a on CPU 0 and b on CPU 1, both released together.
template <class A, class B>
void run_pair(A&& a, B&& b) {
  std::atomic<int> arrived{0};
  auto start = [&arrived] {
    arrived.fetch_add(1);
    while (arrived.load() < 2) {
    }
  };
  std::thread tb([&] {
    pin_to(1);
    start();
    b();
  });
  pin_to(0);  // the calling thread plays a: one thread less to create
  start();
  a();
  tb.join();
}

// ---- the two rings behind one interface --------------------------------------------------------

template <class T>
struct Ours {
  static constexpr const char* kName = "ours";
  mstar::SpscRing ring;
  explicit Ours(std::size_t capacity) : ring(sizeof(T), capacity, mstar::Overflow::block, 0) {}
  bool push(const T& v) noexcept { return ring.try_push_as(v); }
  bool pop(T& v) noexcept { return ring.try_pop_as(v); }

  // In place: the producer builds items straight in the ring's storage.
  template <class Make>
  std::size_t push_bulk(std::uint64_t first, std::size_t max, Make&& make) noexcept {
    const mstar::WriteRegion r = ring.reserve(max);
    for (std::size_t k = 0; k < r.count; ++k) {
      T v;
      make(v, first + k);
      std::memcpy(r.data + k * sizeof(T), &v, sizeof(T));
    }
    if (r.count) ring.commit(r.count);
    return r.count;
  }
  template <class See>
  std::size_t pop_bulk(See&& see) noexcept {
#ifdef COPYOUT
    T out[kBatch];
    const mstar::ReadRegion r = ring.peek(kBatch);
    std::memcpy(out, r.data, r.count * sizeof(T));
    if (r.count) ring.release(r.count);
    for (std::size_t k = 0; k < r.count; ++k) see(out[k]);
    return r.count;
#else
    const mstar::ReadRegion r = ring.peek(kBatch);
    for (std::size_t k = 0; k < r.count; ++k) {
      T v;
      std::memcpy(&v, r.data + k * sizeof(T), sizeof(T));
      see(v);
    }
    if (r.count) ring.release(r.count);
    return r.count;
#endif
  }
};

template <class T>
struct Boost {
  static constexpr const char* kName = "boost";
  boost::lockfree::spsc_queue<T> q;  // run-time capacity, as ours
  explicit Boost(std::size_t capacity) : q(capacity) {}
  bool push(const T& v) noexcept { return q.push(v); }
  bool pop(T& v) noexcept { return q.pop(v); }

  // Boost's bulk API copies from / to caller arrays: build a batch, push what fits, keep the rest.
  // The batch is the producer's: keep it off the line of the queue's last (consumer) fields.
  alignas(128) T batch[kBatch];
  std::size_t batch_off = 0, batch_len = 0;
  template <class Make>
  std::size_t push_bulk(std::uint64_t first, std::size_t max, Make&& make) noexcept {
    if (batch_off == batch_len) {
      batch_len = std::min(max, kBatch);
      for (std::size_t k = 0; k < batch_len; ++k) make(batch[k], first + k);
      batch_off = 0;
    }
    const std::size_t n = q.push(batch + batch_off, batch_len - batch_off);
    batch_off += n;
    return n;
  }
  template <class See>
  std::size_t pop_bulk(See&& see) noexcept {
    T out[kBatch];
    const std::size_t n = q.pop(out, kBatch);
    for (std::size_t k = 0; k < n; ++k) see(out[k]);
    return n;
  }
};

// One lap through the whole ring, single-threaded, before any timing: faults in pages the
// allocator left untouched (boost's storage is never written before the first push).
template <class T, class Q>
void warm_lap(Q& q, std::size_t capacity) {
  T v;
  for (std::size_t i = 0; i < capacity; ++i) {
    fill(v, i);
    if (!q.push(v)) fail("warm-up push refused before the ring was full");
  }
  for (std::size_t i = 0; i < capacity; ++i)
    if (!q.pop(v) || v.w[0] != i) fail("warm-up pop mismatch");
}

// ---- measurements (one sample each) ------------------------------------------------------------

double seconds(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

// Each thread keeps its own Tally and hands it over at the end: tallies shared on one cache line
// would add false sharing to the very thing being measured.

// items per second
template <class T, class Q>
double measure_throughput(Q& q, std::uint64_t n, const char* label) {
  Tally sent, got;
  Clock::time_point t0, t1;
  run_pair(
      [&] {
        t0 = Clock::now();
        Tally mine;
        T v;
        for (std::uint64_t i = 0; i < n; ++i) {
          fill(v, i);
          spin_until([&] { return q.push(v); });
          mine.sum += word_sum(v);
        }
        mine.count = n;
        sent = mine;
      },
      [&] {
        Tally mine;
        T v;
        for (std::uint64_t i = 0; i < n; ++i) {
          spin_until([&] { return q.pop(v); });
          mine.see(v);
        }
        t1 = Clock::now();
        got = mine;
      });
  check(sent, got, label);
  return static_cast<double>(n) / seconds(t0, t1);
}

// items per second
template <class T, class Q>
double measure_bulk(Q& q, std::uint64_t n, const char* label) {
  Tally sent, got;
  Clock::time_point t0, t1;
  run_pair(
      [&] {
        t0 = Clock::now();
        Tally mine;
        auto make = [&mine](T& v, std::uint64_t seq) {
          fill(v, seq);
          mine.sum += word_sum(v);
        };
        std::uint64_t next = 0;
        while (next < n) {
          const auto max = static_cast<std::size_t>(std::min<std::uint64_t>(kBatch, n - next));
          spin_until([&] {
            const std::size_t pushed = q.push_bulk(next, max, make);
            next += pushed;
            return pushed != 0;
          });
        }
        mine.count = n;
        sent = mine;
      },
      [&] {
        Tally mine;
        auto see = [&mine](const T& v) { mine.see(v); };
        while (mine.count < n) spin_until([&] { return q.pop_bulk(see) != 0; });
        t1 = Clock::now();
        got = mine;
      });
  check(sent, got, label);
  return static_cast<double>(n) / seconds(t0, t1);
}

// nanoseconds per round trip (item out through `there`, back through `back`)
template <class T, class Q>
double measure_roundtrip(Q& there, Q& back, std::uint64_t n, const char* label) {
  const std::uint64_t warm = std::min<std::uint64_t>(n / 10 + 1, 10000);
  Tally sent, got;
  Clock::time_point t0, t1;
  run_pair(
      [&] {
        Tally out, in;
        T v, r;
        for (std::uint64_t i = 0; i < warm + n; ++i) {
          if (i == warm) t0 = Clock::now();
          fill(v, i);
          spin_until([&] { return there.push(v); });
          out.sum += word_sum(v);
          spin_until([&] { return back.pop(r); });
          in.see(r);
        }
        t1 = Clock::now();
        out.count = warm + n;
        sent = out;
        got = in;
      },
      [&] {
        T v;
        for (std::uint64_t i = 0; i < warm + n; ++i) {
          spin_until([&] { return there.pop(v); });
          spin_until([&] { return back.push(v); });
        }
      });
  check(sent, got, label);
  return seconds(t0, t1) * 1e9 / static_cast<double>(n);
}

// ---- driver -----------------------------------------------------------------------------------

struct Options {
  std::uint64_t items = 20'000'000;
  std::uint64_t bulk_items = 40'000'000;
  std::uint64_t roundtrips = 300'000;
  int reps = 9;
  std::vector<std::size_t> capacities{1024, std::size_t{1} << 20};
  std::vector<std::size_t> sizes{8, 64};
  bool kinds[3] = {true, true, true};  // throughput, bulk, roundtrip
};

struct Series {
  std::string kind, impl, unit;
  std::size_t item_bytes, capacity;
  std::vector<double> samples;
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const std::size_t m = v.size() / 2;
  return v.size() % 2 ? v[m] : 0.5 * (v[m - 1] + v[m]);
}

struct Progress {
  int done = 0, total = 0;
  void step(const std::string& label) {
    std::fprintf(stderr, "progress %d %d %s\n", ++done, total, label.c_str());
    std::fflush(stderr);
  }
};

template <class T>
void run_config(const Options& o, std::size_t capacity, std::vector<Series>& out, Progress& progress) {
  const std::size_t bytes = sizeof(T);
  // Two rings of each kind (the round trip needs both directions), reused by every repetition.
  auto ours_a = std::make_unique<Ours<T>>(capacity), ours_b = std::make_unique<Ours<T>>(capacity);
  auto boost_a = std::make_unique<Boost<T>>(capacity), boost_b = std::make_unique<Boost<T>>(capacity);
  warm_lap<T>(*ours_a, capacity);
  warm_lap<T>(*ours_b, capacity);
  warm_lap<T>(*boost_a, capacity);
  warm_lap<T>(*boost_b, capacity);

  enum { kThroughput, kBulk, kRoundtrip };
  const char* kinds[] = {"throughput", "bulk", "roundtrip"};
  const char* units[] = {"items_per_s", "items_per_s", "ns"};
  Series s[3][2];  // [kind][0 = ours, 1 = boost]
  for (int k = 0; k < 3; ++k)
    for (int i = 0; i < 2; ++i)
      s[k][i] = Series{kinds[k], i ? "boost" : "ours", units[k], bytes, capacity, {}};

  const std::string tag = std::to_string(bytes) + "B cap " + std::to_string(capacity);
  for (int rep = 0; rep < o.reps; ++rep) {
    for (int k = 0; k < 3; ++k) {
      if (!o.kinds[k]) continue;
      for (int turn = 0; turn < 2; ++turn) {
        const int impl = (turn + rep) % 2;  // who goes first alternates with the repetition
        const std::string label = std::string(kinds[k]) + " " + tag + " " + (impl ? "boost" : "ours") +
                                  " rep " + std::to_string(rep + 1);
        double v = 0;
        if (k == kThroughput)
          v = impl ? measure_throughput<T>(*boost_a, o.items, label.c_str())
                   : measure_throughput<T>(*ours_a, o.items, label.c_str());
        else if (k == kBulk)
          v = impl ? measure_bulk<T>(*boost_a, o.bulk_items, label.c_str())
                   : measure_bulk<T>(*ours_a, o.bulk_items, label.c_str());
        else
          v = impl ? measure_roundtrip<T>(*boost_a, *boost_b, o.roundtrips, label.c_str())
                   : measure_roundtrip<T>(*ours_a, *ours_b, o.roundtrips, label.c_str());
        s[k][impl].samples.push_back(v);
        progress.step(label);
      }
    }
  }
  for (int k = 0; k < 3; ++k)
    if (o.kinds[k])
      for (auto& series : s[k]) out.push_back(std::move(series));
}

std::vector<std::string> split(const std::string& list) {
  std::vector<std::string> parts;
  for (std::size_t p = 0; p <= list.size();) {
    const std::size_t q = std::min(list.find(',', p), list.size());
    parts.push_back(list.substr(p, q - p));
    p = q + 1;
  }
  return parts;
}

std::uint64_t parse_count(const char* flag, const char* text) {
  char* end = nullptr;
  const double v = std::strtod(text, &end);  // accepts 2e7
  if (end == text || *end != '\0' || v < 1)
    fail(std::string("bad value for ") + flag + ": '" + text + "' (want a positive number)");
  return static_cast<std::uint64_t>(v);
}

void usage() {
  std::fprintf(stderr,
               "usage: ring_bench [--items N] [--bulk-items N] [--roundtrips N] [--reps R]\n"
               "                  [--capacities C1,C2] [--sizes 8,64] [--kinds throughput,bulk,roundtrip]\n"
               "                  [--no-pin]\n");
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> const char* {
      if (i + 1 >= argc) {
        usage();
        std::exit(64);
      }
      return argv[++i];
    };
    if (a == "--items") o.items = parse_count("--items", value());
    else if (a == "--bulk-items") o.bulk_items = parse_count("--bulk-items", value());
    else if (a == "--roundtrips") o.roundtrips = parse_count("--roundtrips", value());
    else if (a == "--reps") o.reps = static_cast<int>(parse_count("--reps", value()));
    else if (a == "--capacities") {
      o.capacities.clear();
      for (const auto& c : split(value())) o.capacities.push_back(parse_count("--capacities", c.c_str()));
    } else if (a == "--sizes") {
      o.sizes.clear();
      for (const auto& c : split(value())) {
        o.sizes.push_back(parse_count("--sizes", c.c_str()));
        if (o.sizes.back() != 8 && o.sizes.back() != 64) fail("--sizes takes 8 and/or 64");
      }
    } else if (a == "--kinds") {
      const char* names[] = {"throughput", "bulk", "roundtrip"};
      for (bool& k : o.kinds) k = false;
      for (const auto& c : split(value())) {
        const auto* it = std::find(std::begin(names), std::end(names), c);
        if (it == std::end(names)) fail("--kinds takes throughput, bulk and/or roundtrip, got '" + c + "'");
        o.kinds[it - std::begin(names)] = true;
      }
    } else if (a == "--no-pin") g_pin = false;
    else {
      usage();
      return 64;
    }
  }
  const unsigned ncpu = std::thread::hardware_concurrency();
  if (ncpu < 2) g_pin = false;  // pinning both threads to CPU 0 and 1 needs two CPUs

  std::vector<Series> series;
  Progress progress;
  const int nkinds = static_cast<int>(std::count(std::begin(o.kinds), std::end(o.kinds), true));
  progress.total = static_cast<int>(o.capacities.size() * o.sizes.size()) * o.reps * nkinds * 2;
  for (std::size_t cap : o.capacities)
    for (std::size_t bytes : o.sizes) {
      if (bytes == 8) run_config<Item8>(o, cap, series, progress);
      else run_config<Item64>(o, cap, series, progress);
    }

  std::printf("{\"driver\": \"ring_bench\", \"reps\": %d, \"items\": %llu, \"bulk_items\": %llu, "
              "\"roundtrips\": %llu, \"batch\": %zu, \"hardware_concurrency\": %u, "
              "\"pinned\": %s, \"pin_failures\": %d, \"verified\": true,\n \"series\": [",
              o.reps, static_cast<unsigned long long>(o.items),
              static_cast<unsigned long long>(o.bulk_items),
              static_cast<unsigned long long>(o.roundtrips), kBatch, ncpu,
              g_pin && g_pin_failures.load() == 0 ? "true" : "false", g_pin_failures.load());
  for (std::size_t i = 0; i < series.size(); ++i) {
    const Series& s = series[i];
    std::printf("%s\n  {\"kind\": \"%s\", \"impl\": \"%s\", \"item_bytes\": %zu, \"capacity\": %zu, "
                "\"unit\": \"%s\", \"median\": %.6g, \"samples\": [",
                i ? "," : "", s.kind.c_str(), s.impl.c_str(), s.item_bytes, s.capacity,
                s.unit.c_str(), median(s.samples));
    for (std::size_t j = 0; j < s.samples.size(); ++j)
      std::printf("%s%.6g", j ? ", " : "", s.samples[j]);
    std::printf("]}");
  }
  std::printf("\n]}\n");
  return 0;
}

#include "core/spin_wait.hpp"

#include <sched.h>

#include "core/cpu_relax.hpp"

namespace mstar::detail {

namespace {

int changed(const std::uint64_t* const* words, const std::uint64_t* values,
            std::size_t n) noexcept {
  for (std::size_t i = 0; i < n; ++i) {
    // An acquire load: what the writer stored before the word is visible after it.
    if (__atomic_load_n(words[i], __ATOMIC_ACQUIRE) != values[i]) return static_cast<int>(i);
  }
  return -1;
}

}  // namespace

int spin_until_changed(const std::uint64_t* const* words, const std::uint64_t* values,
                       std::size_t n, std::chrono::nanoseconds budget) noexcept {
  using Clock = std::chrono::steady_clock;
  constexpr auto kPureSpin = std::chrono::microseconds(5);
  const auto start = Clock::now();
  for (;;) {
    const int hit = changed(words, values, n);
    if (hit >= 0) return hit;
    const auto spent = Clock::now() - start;
    if (spent >= budget) return -1;
    if (spent < kPureSpin) {
      for (int i = 0; i < 32; ++i) cpu_relax();
    } else {
      sched_yield();
    }
  }
}

}  // namespace mstar::detail

// spin_until_changed: sees another thread's store, names the word that changed, and gives up
// after its budget.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <thread>

#include "core/spin_wait.hpp"

using mstar::detail::spin_until_changed;
using namespace std::chrono_literals;

namespace {

void store(std::uint64_t& word, std::uint64_t value) {
  __atomic_store_n(&word, value, __ATOMIC_RELEASE);
}

}  // namespace

TEST(SpinWait, ReturnsAtOnceWhenAWordAlreadyDiffers) {
  std::uint64_t a = 1, b = 7;
  const std::uint64_t* words[] = {&a, &b};
  const std::uint64_t values[] = {1, 6};
  EXPECT_EQ(spin_until_changed(words, values, 2, 1s), 1);
}

TEST(SpinWait, SeesAnotherThreadsStoreAndNamesTheWord) {
  alignas(64) std::uint64_t a = 0;
  alignas(64) std::uint64_t b = 0;
  const std::uint64_t* words[] = {&a, &b};
  const std::uint64_t values[] = {0, 0};
  std::thread writer([&] {
    std::this_thread::sleep_for(2ms);
    store(b, 42);
  });
  const auto t0 = std::chrono::steady_clock::now();
  const int hit = spin_until_changed(words, values, 2, 2s);
  const auto waited = std::chrono::steady_clock::now() - t0;
  writer.join();
  EXPECT_EQ(hit, 1);
  EXPECT_LT(waited, 1s);
}

TEST(SpinWait, GivesUpAfterItsBudget) {
  std::uint64_t a = 3;
  const std::uint64_t* words[] = {&a};
  const std::uint64_t values[] = {3};
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_EQ(spin_until_changed(words, values, 1, 3ms), -1);
  const auto waited = std::chrono::steady_clock::now() - t0;
  EXPECT_GE(waited, 3ms);
  EXPECT_LT(waited, 1s);
  EXPECT_EQ(spin_until_changed(words, values, 0, 1ms), -1);  // nothing to watch
}

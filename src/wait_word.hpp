// Sleep on a 32-bit word until another thread changes it: a futex on Linux, a short sleep elsewhere.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>

namespace mstar::detail {

/// Sleeps while `word` still equals `expected`, at most `timeout` (Timeout::max() = no limit).
/// May return early (spurious wake-ups are allowed); the caller re-checks its condition.
void wait_on(std::atomic<std::uint32_t>& word, std::uint32_t expected,
             std::chrono::nanoseconds timeout) noexcept;

/// Wakes every thread sleeping on `word`.
void wake_all(std::atomic<std::uint32_t>& word) noexcept;

}  // namespace mstar::detail

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

/// True when heavy_barrier() works (Linux membarrier PRIVATE_EXPEDITED, registered on first
/// call). Then a compiler barrier on one side plus heavy_barrier() on the other order like a
/// full fence on both.
bool heavy_barrier_available() noexcept;

/// A full memory barrier executed on every running thread of this process.
void heavy_barrier() noexcept;

}  // namespace mstar::detail

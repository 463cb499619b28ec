// Wait briefly, without sleeping, for another process to write a shared-memory word.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>

namespace mstar::detail {

/// Spins until one of the `n` 64-bit words at `words[i]` no longer holds `values[i]`, for at
/// most `budget`; returns the index of a word that changed, or -1. The first microseconds are
/// pure pause loops; after that each round also yields the CPU, so a runnable thread of any
/// process on this core goes first and the wait costs only an idle core's time.
///
/// Why: a receiver asleep in poll() or a futex takes tens of microseconds to wake on a virtual
/// machine (the waker's CPU sends an inter-processor interrupt to a halted vCPU), and a waker
/// pays most of that too. A reply expected within a crossing's time is cheaper to watch for.
/// The words must stay mapped for the call (the caller's lock).
int spin_until_changed(const std::uint64_t* const* words, const std::uint64_t* values,
                       std::size_t n, std::chrono::nanoseconds budget) noexcept;

}  // namespace mstar::detail

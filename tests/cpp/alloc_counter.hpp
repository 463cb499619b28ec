// Replaces the global operator new/delete of a test executable with counting versions, so a test
// can prove that a hot path allocates nothing. Include it from exactly one translation unit of
// the executable (every test here is one file).
#pragma once

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <new>

inline std::atomic<std::uint64_t> g_allocations{0};

// noinline: once inlined next to the caller's `new`, GCC flags free() as a mismatched delete.
__attribute__((noinline)) void* operator new(std::size_t n) {
  g_allocations.fetch_add(1, std::memory_order_relaxed);
  if (void* p = std::malloc(n ? n : 1)) return p;
  throw std::bad_alloc();
}
__attribute__((noinline)) void operator delete(void* p) noexcept { std::free(p); }
__attribute__((noinline)) void operator delete(void* p, std::size_t) noexcept { std::free(p); }

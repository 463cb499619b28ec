// A CPU pause for spin-waits: lets the sibling hyperthread run and saves power.
#pragma once

namespace mstar::detail {

inline void cpu_relax() noexcept {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#endif
}

}  // namespace mstar::detail

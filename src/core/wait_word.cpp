#include "core/wait_word.hpp"

#include <cstdlib>
#include <thread>

#if defined(__linux__)
#include <linux/futex.h>
#include <linux/membarrier.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>
#endif

namespace mstar::detail {

static_assert(sizeof(std::atomic<std::uint32_t>) == sizeof(std::uint32_t),
              "a futex needs the atomic to be a bare 32-bit word");

#if defined(__linux__)

void wait_on(std::atomic<std::uint32_t>& word, std::uint32_t expected,
             std::chrono::nanoseconds timeout) noexcept {
  timespec ts{};
  timespec* tsp = nullptr;
  if (timeout != std::chrono::nanoseconds::max()) {
    const auto ns = timeout.count() < 0 ? 0 : timeout.count();
    ts.tv_sec = static_cast<time_t>(ns / 1000000000);
    ts.tv_nsec = static_cast<long>(ns % 1000000000);
    tsp = &ts;
  }
  // Private futex: the ring never crosses a process boundary.
  syscall(SYS_futex, reinterpret_cast<std::uint32_t*>(&word), FUTEX_WAIT_PRIVATE, expected, tsp,
          nullptr, 0);
}

void wake_all(std::atomic<std::uint32_t>& word) noexcept {
  syscall(SYS_futex, reinterpret_cast<std::uint32_t*>(&word), FUTEX_WAKE_PRIVATE, INT32_MAX,
          nullptr, nullptr, 0);
}

bool heavy_barrier_available() noexcept {
  // Registration is once per process; a thread-safe static does it exactly once.
  static const bool available = [] {
    // Escape hatch for hosts where membarrier's inter-processor interrupts are slow (some VMs):
    // MSTAR_NO_MEMBARRIER=1 makes every ring use a full fence per operation instead.
    const char* off = std::getenv("MSTAR_NO_MEMBARRIER");
    if (off != nullptr && off[0] != '\0' && off[0] != '0') return false;
    const long cmds = syscall(SYS_membarrier, MEMBARRIER_CMD_QUERY, 0, 0);
    if (cmds < 0 || !(cmds & MEMBARRIER_CMD_PRIVATE_EXPEDITED)) return false;
    return syscall(SYS_membarrier, MEMBARRIER_CMD_REGISTER_PRIVATE_EXPEDITED, 0, 0) == 0;
  }();
  return available;
}

void heavy_barrier() noexcept {
  if (syscall(SYS_membarrier, MEMBARRIER_CMD_PRIVATE_EXPEDITED, 0, 0) != 0)
    std::atomic_thread_fence(std::memory_order_seq_cst);  // unreachable once registered
}

#else

bool heavy_barrier_available() noexcept { return false; }
void heavy_barrier() noexcept { std::atomic_thread_fence(std::memory_order_seq_cst); }

void wait_on(std::atomic<std::uint32_t>& word, std::uint32_t expected,
             std::chrono::nanoseconds timeout) noexcept {
  // Portable fallback: poll in 50 µs naps. Correct, just slower to wake than a futex.
  const auto nap = std::chrono::microseconds(50);
  if (word.load(std::memory_order_acquire) == expected)
    std::this_thread::sleep_for(timeout < nap ? timeout : std::chrono::nanoseconds(nap));
}

void wake_all(std::atomic<std::uint32_t>&) noexcept {}

#endif

}  // namespace mstar::detail

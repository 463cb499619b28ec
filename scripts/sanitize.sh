#!/usr/bin/env bash
# Builds the C++ core and its tests with a sanitizer and runs them under ctest.
#
#   bash scripts/sanitize.sh thread     # ThreadSanitizer
#   bash scripts/sanitize.sh address    # AddressSanitizer + UndefinedBehaviorSanitizer
#
# Build directory: build/sanitize-<kind>. The stress tests move MSTAR_STRESS_ITEMS items
# (default here 2000000, so that an instrumented run stays short). Exits non-zero on any failure.
set -euo pipefail

kind="${1:-}"
if [[ "$kind" != "thread" && "$kind" != "address" ]]; then
  echo "usage: bash scripts/sanitize.sh thread|address" >&2
  exit 2
fi

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="$root/build/sanitize-$kind"
generator=()
if command -v ninja >/dev/null 2>&1; then generator=(-G Ninja); fi
jobs="$(nproc 2>/dev/null || echo 2)"

# No mstar_rt::embed: its tests do not run under the sanitizers (libpython, numpy and torch
# are not instrumented; see tests/cpp/CMakeLists.txt), so building it would only cost time.
cmake -S "$root" -B "$build" "${generator[@]}" \
  -DMSTAR_SANITIZE="$kind" -DMSTAR_BUILD_TESTS=ON -DMSTAR_BUILD_PYTHON=OFF -DMSTAR_BUILD_EMBED=OFF \
  -DCMAKE_BUILD_TYPE=RelWithDebInfo
cmake --build "$build" --parallel "$jobs"

export MSTAR_STRESS_ITEMS="${MSTAR_STRESS_ITEMS:-2000000}"
export TSAN_OPTIONS="${TSAN_OPTIONS:-halt_on_error=1 second_deadlock_stack=1 history_size=4 report_signal_unsafe=1 exitcode=66}"
export ASAN_OPTIONS="${ASAN_OPTIONS:-halt_on_error=1 abort_on_error=0 detect_leaks=1 detect_stack_use_after_return=1 check_initialization_order=1 strict_init_order=1 strict_string_checks=1 exitcode=66}"
export UBSAN_OPTIONS="${UBSAN_OPTIONS:-halt_on_error=1 print_stacktrace=1 exitcode=66}"

log="$build/ctest-output.log"
run_ctest() {
  "$@" ctest --test-dir "$build" --output-on-failure --no-tests=error --timeout 900 \
    2>&1 | tee "$log"
  return "${PIPESTATUS[0]}"
}

status=0
run_ctest || status=$?
# TSan (and sometimes ASan) cannot map its shadow memory when the kernel randomizes mmap
# addresses with more bits than the runtime expects; running without ASLR works around it.
if [[ $status -ne 0 ]] && grep -q "unexpected memory mapping" "$log"; then
  echo "sanitize.sh: the $kind runtime rejected the ASLR memory layout; rerunning under setarch -R" >&2
  status=0
  run_ctest setarch "$(uname -m)" -R || status=$?
fi

if [[ $status -eq 0 ]]; then
  echo "sanitize.sh: $kind build clean ($MSTAR_STRESS_ITEMS stress items)"
else
  echo "sanitize.sh: $kind run FAILED (exit $status); see $log" >&2
fi
exit "$status"

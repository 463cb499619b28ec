#!/usr/bin/env bash
# Sets up (scripts/setup.sh) and runs every test: C++ (ctest), the C++ tests again under
# ThreadSanitizer and AddressSanitizer+UBSan, the installed-package C++ consumer, and Python.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PATH="$PWD/.venv/bin:$PATH"
GEN=(-G Ninja)

echo "== C++ tests (Release)"
# The venv's Python: the embedding tests (mstar_rt::embed) serve models from its site-packages.
cmake -S . -B build/cpp-tests "${GEN[@]}" -DMSTAR_BUILD_TESTS=ON -DMSTAR_BUILD_PYTHON=OFF \
  -DPython_EXECUTABLE="$PWD/.venv/bin/python" >/dev/null
cmake --build build/cpp-tests
ctest --test-dir build/cpp-tests --output-on-failure

echo "== C++ tests under ThreadSanitizer"
bash scripts/sanitize.sh thread
echo "== C++ tests under AddressSanitizer + UBSan"
bash scripts/sanitize.sh address

echo "== Python tests (including the wheel and find_package consumer checks)"
python -m pytest tests/python

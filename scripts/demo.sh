#!/usr/bin/env bash
# Sets up (scripts/setup.sh) and runs the main demo: a MuJoCo arm reaching targets under a C++
# control loop at a fixed rate, fed action chunks asynchronously by a policy served as a walk
# graph, at injected inference delays of 0, 2 and 5 ticks. Prints a table, writes a PNG.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
mkdir -p build
exec .venv/bin/python examples/robot/demo.py --out build/robot_demo.png "$@"

#!/usr/bin/env bash
# Sets up (scripts/setup.sh) and runs the main demo: a MuJoCo arm reaching targets under a C++
# control loop at a fixed rate (50 Hz), fed action chunks asynchronously by a miniature pi0-style
# VLA served as its walk graph (prefix + flow-matching action_gen loop), with the delay d and the
# frozen actions passed per request (real-time chunking), at injected inference delays of 0, 2
# and 5 ticks. Prints a table, writes a PNG. Extra arguments go to examples/robot/demo.py
# (e.g. --policy pi0,mlp to compare with the small MLP policy).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
mkdir -p build
exec .venv/bin/python examples/robot/demo.py --out build/robot_demo.png "$@"

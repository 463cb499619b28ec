#!/usr/bin/env bash
# Create the separate virtual environment that holds LeRobot 0.6.1, the
# reference PyTorch implementation of pi0 / pi0.5 / SmolVLA used to generate
# the parity fixtures under tests/reference/fixtures/.
#
# LeRobot 0.6.1 needs Python >= 3.12 and pins torch < 2.12 and
# transformers 5.4-5.5, so it cannot share the project's environment.  CI never
# needs this venv: it only reads the committed fixtures.
#
# Usage:
#   bash tests/reference/setup_lerobot_venv.sh
# Environment:
#   LEROBOT_VENV   venv path          (default /work/venvs/lerobot)
#   LEROBOT_PYTHON python >= 3.12     (default /root/.pyenv/versions/3.12.1/bin/python,
#                                      else python3.12 on PATH)
#   TORCH_INDEX_URL  optional extra --index-url for torch (e.g. the CPU wheel index)
#
# Idempotent: an existing venv is reused and pip skips what is already installed.
set -euo pipefail

VENV="${LEROBOT_VENV:-/work/venvs/lerobot}"
PY="${LEROBOT_PYTHON:-}"
if [[ -z "$PY" ]]; then
  if [[ -x /root/.pyenv/versions/3.12.1/bin/python ]]; then
    PY=/root/.pyenv/versions/3.12.1/bin/python
  else
    PY="$(command -v python3.12 || true)"
  fi
fi
if [[ -z "$PY" ]]; then
  echo "no Python 3.12 found; set LEROBOT_PYTHON" >&2
  exit 1
fi

if [[ ! -x "$VENV/bin/python" ]]; then
  echo "creating venv $VENV with $PY"
  mkdir -p "$(dirname "$VENV")"
  "$PY" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip install --disable-pip-version-check)

"$VENV/bin/python" -m pip install --disable-pip-version-check -q --upgrade pip

# torch (the large CUDA build from PyPI also runs on CPU).
if [[ -n "${TORCH_INDEX_URL:-}" ]]; then
  "${PIP[@]}" --index-url "$TORCH_INDEX_URL" "torch==2.13.0" "torchvision==0.28.0"
else
  "${PIP[@]}" "torch==2.13.0" "torchvision==0.28.0"
fi

# LeRobot without its dependency closure (its pins fight the torch above),
# then only what the pi0 / pi0.5 / SmolVLA policy code imports.
"${PIP[@]}" --no-deps "lerobot==0.6.1"
"${PIP[@]}" \
  "transformers>=5.4,<5.6" \
  "draccus>=0.11.6,<0.12" \
  "einops>=0.8,<0.9" \
  termcolor \
  "gymnasium>=1.1.1,<2" \
  opencv-python-headless \
  "num2words>=0.5.14,<0.6" \
  requests \
  tqdm \
  safetensors \
  tokenizers

"$VENV/bin/python" - <<'PY'
import torch, transformers, lerobot
print("torch", torch.__version__, "transformers", transformers.__version__,
      "lerobot", getattr(lerobot, "__version__", "?"))
PY
echo "LeRobot venv ready: $VENV"

#!/usr/bin/env bash
# Wheels the lent GPU machine lacks, fetched here for it to carry (it reaches no network).
#
# Its image has Python 3.12, torch 2.11 (cu130), nvcc 13, msgpack, tqdm, transformers,
# safetensors, pybind11 and CMake, but not FlashInfer or pyzmq. Everything below, about 22 MB,
# fits one call's 64 MiB carry limit; FlashInfer 0.7 (101 MB) does not, so 0.5.3 (7 MB, its
# kernels compiled by nvcc at first use) is the version checked there. nvidia-cutlass-dsl is
# left out: only kernels gpu_check never asks for import it.
#
#   bash scripts/gpu_wheels.sh        # -> .whl/ (kept out of git)
#
# then, on the device (the `run` tool, carry [".whl"]), before benchmarks/gpu_check.py:
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
#       --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:python
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=.whl
mkdir -p "$DEST"
grep -qx "/$DEST/" .git/info/exclude 2>/dev/null || echo "/$DEST/" >> .git/info/exclude
PLATFORMS=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_26_x86_64 \
         manylinux_2_24_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 any; do
  PLATFORMS+=(--platform "$p")
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp "${PLATFORMS[@]}" -d "$DEST" \
  flashinfer-python==0.5.3 "apache-tvm-ffi<0.2,>=0.1" nvidia-cudnn-frontend pyzmq
du -sh "$DEST"
ls "$DEST"

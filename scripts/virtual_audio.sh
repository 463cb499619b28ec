#!/usr/bin/env bash
# Clocked virtual audio devices for tests and headless runs: a PulseAudio server with two null
# sinks, reached by PortAudio through ALSA's "pulse" device (libasound2-plugins).
#   mstar_mic  play into it (paplay --device=mstar_mic); its monitor mstar_mic.monitor is the mic
#   mstar_spk  the speaker; record what was played from mstar_spk.monitor
# Usage: scripts/virtual_audio.sh [start|stop|status]. start is idempotent.
set -euo pipefail

STATE="${MSTAR_AUDIO_STATE:-/tmp/mstar-virtual-audio}"
SINKS=(mstar_mic mstar_spk)
RATE="${MSTAR_AUDIO_RATE:-48000}"

server_up() { timeout 5 pactl info >/dev/null 2>&1; }

start_server() {
  if server_up; then return; fi
  for tool in pulseaudio pactl pacat; do
    if ! command -v "$tool" >/dev/null; then
      echo "virtual_audio: $tool is missing (apt: pulseaudio pulseaudio-utils)" >&2
      exit 1
    fi
  done
  mkdir -p "$STATE"
  # -n: none of the desktop modules (no suspend-on-idle, no hardware probing); root is allowed
  # as a per-user server, which is what a container needs. Never exits on idle.
  # Real-time/high priority where the container allows it: a starved server stalls every stream.
  pulseaudio --daemonize=yes --system=false --disallow-exit --exit-idle-time=-1 -n \
    --realtime=yes --high-priority=yes \
    --use-pid-file=yes --log-target="file:$STATE/pulseaudio.log" \
    --load=module-native-protocol-unix >/dev/null 2>&1 || true
  for _ in $(seq 50); do server_up && break; sleep 0.1; done
  if ! server_up; then
    echo "virtual_audio: PulseAudio did not start; see $STATE/pulseaudio.log" >&2
    exit 1
  fi
  touch "$STATE/owned"  # we started it: we may set its defaults
}

ensure_sink() {
  if ! pactl list short sinks | awk '{print $2}' | grep -qx "$1"; then
    pactl load-module module-null-sink sink_name="$1" rate="$RATE" channels=1 \
      sink_properties=device.description="$1" >/dev/null
  fi
}

# Changing the default sink moves every stream that did not pin its device through a restore
# database (pacat --device does not), so set defaults once, before any stream exists.
set_default() {
  [ "$(pactl "get-default-$1")" = "$2" ] || pactl "set-default-$1" "$2"
}

ensure_keepalive() {
  local sink=$1
  # A fresh stream on an idle null sink moves nothing for 1-2 s; a silent low-latency stream
  # keeps each sink's clock running.
  local pidfile="$STATE/keepalive-$sink.pid"
  if [ -f "$pidfile" ] && kill -0 "$(cat "$pidfile")" 2>/dev/null; then return; fi
  # setsid: the keep-alive outlives the shell (or test session) that started it.
  setsid pacat --playback --device="$sink" --latency-msec=20 --raw --rate="$RATE" --channels=1 \
    --format=s16le /dev/zero </dev/null >"$STATE/keepalive-$sink.log" 2>&1 &
  echo $! >"$pidfile"
}

case "${1:-start}" in
  start)
    mkdir -p "$STATE"
    start_server
    for sink in "${SINKS[@]}"; do ensure_sink "$sink"; done
    if [ -f "$STATE/owned" ]; then
      set_default sink mstar_spk
      set_default source mstar_mic.monitor
    fi
    for sink in "${SINKS[@]}"; do ensure_keepalive "$sink"; done
    cat <<EOF
virtual audio ready: sinks ${SINKS[*]} at $RATE Hz
  PortAudio device: "pulse" (ALSA host API); pick the endpoint per stream with
  PULSE_SINK=mstar_spk (speaker) / PULSE_SOURCE=mstar_mic.monitor (microphone) in the environment
  play into the mic:    paplay --device=mstar_mic file.wav
  record the speaker:   parecord --device=mstar_spk.monitor out.wav
EOF
    ;;
  stop)
    for sink in "${SINKS[@]}"; do
      pidfile="$STATE/keepalive-$sink.pid"
      [ -f "$pidfile" ] && kill "$(cat "$pidfile")" 2>/dev/null || true
      rm -f "$pidfile"
    done
    if [ -f "$STATE/owned" ]; then pulseaudio --kill 2>/dev/null || true; rm -f "$STATE/owned"; fi
    ;;
  status)
    server_up || { echo "PulseAudio: not running"; exit 1; }
    pactl list short sinks
    ;;
  *) echo "usage: $0 [start|stop|status]" >&2; exit 2 ;;
esac

#!/usr/bin/env bash
# A Docker engine for the bundle's images and compose stack, the project's way.
#
#   scripts/docker-engine.sh up      # use a running engine, else install and start one
#   scripts/docker-engine.sh down    # stop the engine only if `up` started it
#   scripts/docker-engine.sh client  # print the docker client that builds with BuildKit
#
# `up` uses an engine that already answers (the user's own, any address
# pools). Otherwise, as root (or with sudo), it installs Debian's docker.io
# and starts dockerd with its networks in 198.19.0.0/16 (RFC 2544's benchmark
# range, never a real network; the multi-host twin keeps to 198.18.0.0/16),
# waits for it with a deadline, and records that it started it, so `down`
# stops only what `up` started.
set -euo pipefail
cd "$(dirname "$0")/.."

STATE=run/docker-engine
PIDFILE=$STATE/dockerd.pid
LOG=$STATE/dockerd.log
# The default bridge and every network compose creates without a subnet.
BRIDGE_IP=198.19.0.1/24
ADDRESS_POOL=base=198.19.0.0/16,size=24
START_DEADLINE_S=60

say() { echo "docker-engine: $*" >&2; }

# Debian's docker.io 20.10 client builds with its built-in BuildKit
# (DOCKER_BUILDKIT=1); a newer client without the buildx plugin cannot.
client() {
  local candidate
  for candidate in docker /usr/bin/docker; do
    command -v "$candidate" >/dev/null || continue
    if "$candidate" buildx version >/dev/null 2>&1; then
      command -v "$candidate"; return 0
    fi
    local major
    major=$("$candidate" version --format '{{.Client.Version}}' 2>/dev/null | cut -d. -f1)
    if [[ "$major" =~ ^[0-9]+$ ]] && (( major < 23 )); then
      command -v "$candidate"; return 0
    fi
  done
  return 1
}

answers() { "$1" info >/dev/null 2>&1; }

sudo_or_root() {
  if [ "$(id -u)" -eq 0 ]; then echo ""; return 0; fi
  if command -v sudo >/dev/null && sudo -n true 2>/dev/null; then echo "sudo"; return 0; fi
  return 1
}

up() {
  local docker
  if docker=$(client) && answers "$docker"; then
    say "using the running engine ($("$docker" version --format '{{.Server.Version}}'))"
    return 0
  fi
  local sudo
  if ! sudo=$(sudo_or_root); then
    say "no Docker engine answers, and starting one needs root or passwordless sudo."
    say "Install Docker Engine (Debian/Ubuntu: apt-get install docker.io), start it,"
    say "and add your user to the 'docker' group; then run this again."
    exit 1
  fi
  scripts/install-apt.sh docker.io
  docker=$(client) || { say "no docker client that builds with BuildKit"; exit 1; }
  if answers "$docker"; then
    say "the engine installed by docker.io is running"; return 0
  fi
  mkdir -p "$STATE"
  say "starting dockerd (networks in 198.19.0.0/16; log: $LOG)"
  # setsid: the engine outlives the make recipe that starts it.
  $sudo setsid dockerd --bip "$BRIDGE_IP" --default-address-pool "$ADDRESS_POOL" \
    >"$LOG" 2>&1 </dev/null &
  echo $! >"$PIDFILE"
  local deadline=$((SECONDS + START_DEADLINE_S))
  until answers "$docker"; do
    if ! kill -0 "$(cat "$PIDFILE")" 2>/dev/null; then
      rm -f "$PIDFILE"
      say "dockerd exited at start; its log:"; tail -20 "$LOG" >&2; exit 1
    fi
    if (( SECONDS > deadline )); then
      say "dockerd did not answer within ${START_DEADLINE_S}s; its log:"
      tail -20 "$LOG" >&2; exit 1
    fi
    sleep 1
  done
  say "dockerd $("$docker" version --format '{{.Server.Version}}') is up"
}

down() {
  if [ ! -f "$PIDFILE" ]; then
    say "no engine started by this checkout; leaving Docker alone"; return 0
  fi
  local pid sudo
  pid=$(cat "$PIDFILE")
  sudo=$(sudo_or_root) || sudo=""
  if kill -0 "$pid" 2>/dev/null; then
    $sudo kill -TERM "$pid"
    local deadline=$((SECONDS + 30))
    while kill -0 "$pid" 2>/dev/null && (( SECONDS < deadline )); do sleep 1; done
    if kill -0 "$pid" 2>/dev/null; then
      say "dockerd ($pid) did not stop in 30s; killing it"; $sudo kill -KILL "$pid"
    fi
  fi
  rm -f "$PIDFILE"
  say "stopped the dockerd this checkout started"
}

case "${1:-}" in
  up) up ;;
  down) down ;;
  client) client || { say "no docker client that builds with BuildKit"; exit 1; } ;;
  *) echo "usage: $0 up|down|client" >&2; exit 2 ;;
esac

#!/usr/bin/env bash
# What the compose stack may leave behind, checked:
#
#   scripts/compose-leftovers.sh DOCKER PROJECT snapshot   # before `up`
#   scripts/compose-leftovers.sh DOCKER PROJECT check      # after `down`
#
# `check` fails, naming them, if a container or network of the project is
# left, or a volume of it other than the named ones kept on purpose (the model
# cache, the monitoring data: docs/gpu.md), or an anonymous volume appeared
# since `snapshot`.
set -euo pipefail
cd "$(dirname "$0")/.."
docker=$1 project=$2 action=$3
STATE=run/compose-leftovers
KEPT="pd-model-cache ${project}_prometheus-data ${project}_grafana-data"

dangling() { "$docker" volume ls --quiet --filter dangling=true | sort; }

case "$action" in
  snapshot)
    mkdir -p "$STATE"
    dangling >"$STATE/dangling.before" ;;
  check)
    label="label=com.docker.compose.project=$project"
    left=()
    while read -r name; do [ -n "$name" ] && left+=("container $name"); done \
      < <("$docker" ps --all --filter "$label" --format '{{.Names}}')
    while read -r name; do [ -n "$name" ] && left+=("network $name"); done \
      < <("$docker" network ls --filter "$label" --format '{{.Name}}')
    while read -r name; do
      [ -n "$name" ] && [[ " $KEPT " != *" $name "* ]] && left+=("volume $name")
    done < <("$docker" volume ls --filter "$label" --format '{{.Name}}')
    if [ -f "$STATE/dangling.before" ]; then
      # Unused after `down`, the kept volumes are dangling too: not leftovers.
      while read -r name; do
        [ -n "$name" ] && [[ " $KEPT " != *" $name "* ]] && left+=("anonymous volume $name")
      done < <(comm -13 "$STATE/dangling.before" <(dangling))
    fi
    if [ ${#left[@]} -gt 0 ]; then
      echo "compose-leftovers: the stack left behind:" >&2
      printf '  %s\n' "${left[@]}" >&2
      exit 1
    fi
    echo "compose-leftovers: nothing of $project left (kept: $KEPT)" ;;
  *) echo "usage: $0 DOCKER PROJECT snapshot|check" >&2; exit 2 ;;
esac

#!/usr/bin/env bash
# The Debian base image the CPU serving image and the router image build FROM:
#
#   scripts/debian-base.sh DOCKER IMAGE     # e.g. /usr/bin/docker debian:bookworm-slim
#
# Present locally: nothing to do. Pullable: pulled. Neither (no registry
# reachable, as on this project's CI machines): made from Debian's packages
# with debootstrap (root) and imported under IMAGE, the name the Dockerfiles
# expect, labelled as made here. Only bookworm is made this way: the
# Dockerfiles install Debian bookworm's Python 3.11, which the wheelhouse is
# downloaded for.
set -euo pipefail
cd "$(dirname "$0")/.."
docker=$1 image=$2
SUITE=bookworm
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}

say() { echo "debian-base: $*" >&2; }

if "$docker" image inspect "$image" >/dev/null 2>&1; then exit 0; fi
if "$docker" pull "$image" >/dev/null 2>&1; then say "pulled $image"; exit 0; fi
case "$image" in
  debian:bookworm*) ;;
  *) say "cannot pull $image and can only make debian:bookworm* locally"; exit 1 ;;
esac
if [ "$(id -u)" -ne 0 ]; then
  say "cannot pull $image; making it with debootstrap needs root (or pull it elsewhere)"
  exit 1
fi
scripts/install-apt.sh debootstrap
root=$(mktemp -d /tmp/pd-debian-base.XXXXXX)
trap 'rm -rf "$root"' EXIT
say "no registry: making $image with debootstrap ($SUITE, minbase, from $MIRROR)"
start=$SECONDS
debootstrap --variant=minbase "$SUITE" "$root" "$MIRROR" >"$root.log" 2>&1 \
  || { tail -20 "$root.log" >&2; rm -f "$root.log"; exit 1; }
rm -f "$root.log"
# As Docker's official image does: updates and security fixes in the sources,
# no apt caches in the layer.
printf 'deb %s %s main\n' "$MIRROR" "$SUITE" "$MIRROR" "$SUITE-updates" \
  http://deb.debian.org/debian-security "$SUITE-security" >"$root/etc/apt/sources.list"
rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
tar -C "$root" -c . | "$docker" import \
  --change 'LABEL org.opencontainers.image.description="Debian bookworm minbase, made locally by scripts/debian-base.sh (debootstrap)"' \
  --change 'CMD ["bash"]' - "$image" >/dev/null
say "made $image in $((SECONDS - start)) s"

#!/usr/bin/env bash
# Build the local Debian bookworm base image the image tests use (no registry is reachable
# from CI): debootstrap a minimal root filesystem with Debian's Python 3.11, put this
# machine's CA bundle in it (pip inside the build must trust the same CAs as pip here),
# and `docker import` it. The root filesystem is cached as a tarball, so only the first run
# on a machine pays for debootstrap (about 3-4 minutes); later runs import it in seconds.
#   usage: tools/build-base-image.sh [IMAGE]     (default triptych-base:bookworm)
set -euo pipefail
image="${1:-${TRIPTYCH_BASE_IMAGE:-triptych-base:bookworm}}"
cache="${TRIPTYCH_TOOLS_CACHE:-$HOME/.cache/triptych}/docker"
tarball="$cache/debian-bookworm-python3-rootfs.tar.gz"
ca="${PIP_CERT:-/etc/ssl/certs/ca-certificates.crt}"
log() { echo "[build-base-image] $*" >&2; }

if docker image inspect "$image" >/dev/null 2>&1; then
  log "$image already present"
  exit 0
fi
mkdir -p "$cache"
exec 9>"$cache/.lock"
flock -w 900 9
if [ ! -s "$tarball" ]; then
  command -v debootstrap >/dev/null || { log "debootstrap is not installed"; exit 1; }
  root="$(mktemp -d /tmp/triptych-rootfs.XXXXXX)"
  trap 'rm -rf "$root"' EXIT
  log "debootstrap bookworm into $root (a few minutes)"
  start=$(date +%s)
  timeout 900 debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
    bookworm "$root" http://deb.debian.org/debian >/tmp/triptych-debootstrap.log 2>&1 \
    || { log "debootstrap failed (log: /tmp/triptych-debootstrap.log)"; exit 1; }
  [ -f "$ca" ] && cp "$ca" "$root/etc/ssl/certs/ca-certificates.crt"
  rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
  tar -C "$root" -czf "$tarball.tmp" . && mv "$tarball.tmp" "$tarball"
  log "root filesystem cached in $tarball after $(( $(date +%s) - start )) s"
fi
docker import "$tarball" "$image" >/dev/null
log "imported $image"

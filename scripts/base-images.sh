#!/usr/bin/env bash
# Local Debian base images, built without pulling from any container registry:
#   debootstrap (minbase + python3, python3-venv, ca-certificates) → tarball cached in .cache/base/ → docker import.
# Foreign architectures (arm64 on an x86 host) run debootstrap's second stage under qemu-user-static (binfmt).
#
#   bash scripts/base-images.sh [amd64] [arm64]       (default: amd64 arm64)
#
# Tags g5g-local/<suite>:<arch> in the engine given by DOCKER_HOST. With G5G_REGISTRY=host:port set (provision.sh
# writes it into .cache/docker.env) it also pushes the per-arch images there and assembles the multi-platform
# index <registry>/g5g-local/<suite>:latest, for builders that cannot see the engine's local images.
# Idempotent: a cached tarball is reused, an image already present is not imported again. Needs root.
set -euo pipefail
cd "$(dirname "$0")/.."

SUITE=${G5G_BASE_SUITE:-bookworm}
REPO=g5g-local/$SUITE
CACHE=.cache/base
ARCHES=("$@")
[ ${#ARCHES[@]} -gt 0 ] || ARCHES=(amd64 arm64)
INCLUDE=python3,python3-venv,ca-certificates

log() { printf 'base-images: %s\n' "$*" >&2; }

# The Debian mirror this machine already uses (never hard-coded in the repo).
mirror() {
  if [ -n "${G5G_DEBIAN_MIRROR:-}" ]; then echo "$G5G_DEBIAN_MIRROR"; return; fi
  local codename
  codename=$(. /etc/os-release && echo "${VERSION_CODENAME:-}")
  apt-get indextargets --format '$(REPO_URI) $(RELEASE)' 2>/dev/null \
    | awk -v c="$codename" '$2 == c {print $1; exit}'
}

tarball() {  # arch → path of the cached rootfs tarball, building it when missing
  local arch=$1 out="$CACHE/$SUITE-$1.tar" root
  if [ -s "$out" ]; then echo "$out"; return; fi
  local url; url=$(mirror)
  [ -n "$url" ] || { log "no Debian mirror found in this machine's apt sources (set G5G_DEBIAN_MIRROR)"; return 1; }
  mkdir -p "$CACHE"
  root=$(mktemp -d "$CACHE/rootfs-$arch.XXXX")
  log "debootstrap $SUITE/$arch (minbase + $INCLUDE)…"
  local start=$SECONDS
  if ! debootstrap --variant=minbase --include="$INCLUDE" --arch="$arch" "$SUITE" "$root" "$url" \
      >"$CACHE/debootstrap-$SUITE-$arch.log" 2>&1; then
    log "debootstrap $arch failed; last lines of $CACHE/debootstrap-$SUITE-$arch.log:"
    tail -n 5 "$CACHE/debootstrap-$SUITE-$arch.log" >&2
    rm -rf "$root"; return 1
  fi
  # Smaller and reproducible-ish: no package lists, no downloaded debs, no logs.
  rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/archives/*.deb "$root"/var/cache/apt/*.bin \
         "$root"/var/log/* "$root"/debootstrap
  tar --numeric-owner -C "$root" -cf "$out.tmp" .
  mv "$out.tmp" "$out"
  rm -rf "$root"
  log "$arch rootfs: $(du -h "$out" | cut -f1) in $((SECONDS - start)) s"
  echo "$out"
}

import() {  # arch → tag g5g-local/<suite>:<arch>
  local arch=$1 ref="$REPO:$1" tar
  if docker image inspect "$ref" >/dev/null 2>&1; then log "$ref present"; return; fi
  tar=$(tarball "$arch")
  docker import --platform "linux/$arch" \
    --change 'ENV LANG=C.UTF-8' --change 'CMD ["/bin/bash"]' \
    --message "debootstrap $SUITE minbase + $INCLUDE" "$tar" "$ref" >/dev/null
  log "imported $ref"
}

for a in "${ARCHES[@]}"; do import "$a"; done

# Multi-platform index in the loopback registry: push each arch under its own tag, then join them.
if [ -n "${G5G_REGISTRY:-}" ]; then
  refs=()
  for a in "${ARCHES[@]}"; do
    docker tag "$REPO:$a" "$G5G_REGISTRY/$REPO:$a"
    docker push -q "$G5G_REGISTRY/$REPO:$a" >/dev/null
    refs+=("$G5G_REGISTRY/$REPO:$a")
  done
  docker buildx imagetools create -t "$G5G_REGISTRY/$REPO:latest" "${refs[@]}" >/dev/null 2>&1 \
    && log "pushed index $G5G_REGISTRY/$REPO:latest (${ARCHES[*]})" \
    || log "could not assemble the index $G5G_REGISTRY/$REPO:latest (per-arch tags are pushed)"
fi

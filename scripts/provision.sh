#!/usr/bin/env bash
# Provision a private Docker engine from Debian's packages, for developers, scripts/test.sh and .ci/run.
#
#   bash scripts/provision.sh          install what is missing, start what is not running (idempotent)
#   bash scripts/provision.sh stop     stop the dockerd and registry this script started
#
# What it sets up (root, Debian bookworm):
#   - dockerd 26.1 from Debian trixie's docker.io (only the binaries, unpacked into .cache/engine/; bookworm's
#     docker.io supplies containerd, runc, tini and the CLI) with the containerd image store, on the private
#     socket unix:///run/g5g-docker.sock, data in /var/lib/g5g-docker; bookworm's dockerd 20.10 as a fallback;
#   - buildx 0.13 from Debian trixie's docker-buildx (bookworm has none), unpacked into the CLI plugin folder;
#     trixie packages come through a private apt configuration under .cache/apt-trixie (the machine's own apt
#     sources are not touched; the same for other suites, .cache/apt-SUITE);
#   - QEMU 10 (qemu-user-static from bookworm-backports, through a private apt config as below: bookworm's 7.2
#     segfaults in `import torch` of PyPI's aarch64 wheel) with the arm64 binfmt handler registered (flag F, so it
#     works inside containers); G5G_QEMU_SUITE picks another suite, e.g. the machine's own (`bookworm`);
#   - Debian's docker-registry on 127.0.0.1:$G5G_REGISTRY_PORT (default 5055);
#   - debootstrap, and the local base images (scripts/base-images.sh: bookworm amd64 + arm64, and trixie amd64 for
#     the g4dn profile; G5G_BASE_IMAGES=0 skips, or a list
#     like "amd64" to build only those).
# It writes .cache/docker.env (DOCKER_HOST, G5G_REGISTRY) for `. .cache/docker.env`, logs to .cache/*.log,
# prints one line per thing it could not do, and exits non-zero only when no engine is usable.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
CACHE=$ROOT/.cache
mkdir -p "$CACHE"

# G5G_ENGINE_NAME and G5G_REGISTRY_PORT let a second, throwaway instance run beside the usual one. Give it a
# bridge of its own (`ip link add g5gtest0 type bridge; ip addr add 10.99.0.1/24 dev g5gtest0`, then
# G5G_DOCKERD_ARGS="--bridge=g5gtest0"): two daemons must not share docker0, and `--bridge=none` deletes docker0
# from under the first one.
NAME=${G5G_ENGINE_NAME:-g5g-docker}
SOCK=/run/$NAME.sock
DOCKER_HOST_URL=unix://$SOCK
DATA_ROOT=/var/lib/$NAME
EXEC_ROOT=/run/$NAME
PIDFILE=/run/$NAME.pid
REG_PORT=${G5G_REGISTRY_PORT:-5055}
REG_ADDR=127.0.0.1:$REG_PORT
REG_DIR=/var/lib/g5g-registry-$REG_PORT
REG_PIDFILE=/run/g5g-registry-$REG_PORT.pid
PLUGINS=${DOCKER_CONFIG:-${HOME:-/root}/.docker}/cli-plugins
PACKAGES=(docker.io docker-registry binfmt-support debootstrap)
# QEMU for linux/arm64 RUN steps. Bookworm's qemu-user-static 7.2 shows the aarch64 process the host's x86
# /proc/cpuinfo and segfaults in `import torch` of PyPI's aarch64 2.14.0; 10.0 (bookworm-backports) emulates an
# aarch64 /proc/cpuinfo and imports it (benchmarks/results/g5g_rehearsal.md). QEMU_MIN is the oldest we accept.
QEMU_SUITE=${G5G_QEMU_SUITE:-$(. /etc/os-release && echo "${VERSION_CODENAME:-bookworm}")-backports}
QEMU_MIN=10.0
QEMU_PACKAGES=(qemu-user qemu-user-binfmt qemu-user-static)  # 10.x: qemu-user is the static build, no dependencies
QEMU_BIN=/usr/libexec/qemu-binfmt/aarch64-binfmt-P         # the binfmt interpreter, 7.2 and 10.x alike
QEMU_CHANGED=
export DEBIAN_FRONTEND=noninteractive
export DOCKER_HOST=$DOCKER_HOST_URL

failed=()
log() { printf 'provision: %s\n' "$*" >&2; }
fail() { failed+=("$*"); log "could not: $*"; }

stop() {
  local f pid prog
  for f in "$PIDFILE:dockerd" "$REG_PIDFILE:docker-registry"; do
    prog=${f##*:} f=${f%:*}
    if alive "$f" "$prog"; then
      pid=$(cat "$f")
      kill "$pid"
      for _ in $(seq 50); do alive "$f" "$prog" || break; sleep 0.2; done
      log "stopped $prog (pid $pid)"
    fi
    rm -f "$f"
  done
  # dockerd bind-mounts its data root onto itself; a killed one leaves the mount behind.
  if mountpoint -q "$DATA_ROOT" && ! alive "$PIDFILE" dockerd; then umount "$DATA_ROOT" 2>/dev/null || true; fi
}

# A pid from a pidfile that is still our program: not gone, not a zombie nobody reaped (PID 1 here may not
# reap), not a recycled pid. kill -0 alone says yes to zombies, and so does dockerd's own pidfile check.
alive() {  # pidfile program
  local pid state
  pid=$(cat "$1" 2>/dev/null) || return 1
  state=$(awk '{print $3}' "/proc/$pid/stat" 2>/dev/null) || return 1
  [ "$state" != Z ] && [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = "$2" ]
}

engine_up() { docker version --format '{{.Server.Version}}' >/dev/null 2>&1; }

install_packages() {  # package…
  local missing=() p
  for p in "$@"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
  done
  [ ${#missing[@]} -eq 0 ] && return
  log "apt-get install ${missing[*]}"
  # No daemons from maintainer scripts: this script starts what it needs, on its own socket.
  local rc_d=/usr/sbin/policy-rc.d had_rc_d=0
  [ -e $rc_d ] && had_rc_d=1
  if [ $had_rc_d = 0 ]; then printf '#!/bin/sh\nexit 101\n' > $rc_d; chmod +x $rc_d; fi
  { apt-get update -q && apt-get install -y -q --no-install-recommends "${missing[@]}"; } \
    >"$CACHE/apt.log" 2>&1 || fail "apt-get install ${missing[*]} (see .cache/apt.log)"
  [ $had_rc_d = 1 ] || rm -f $rc_d
}

# The installed QEMU's version ("qemu-aarch64 version 10.0.2 (Debian …)"), or nothing. (The binfmt interpreter,
# 7.2's wrapper, only runs through binfmt_misc.)
qemu_version() { qemu-aarch64-static --version 2>/dev/null | awk 'NR == 1 {print $3}'; }

install_qemu() {  # sets QEMU_CHANGED when it installed a QEMU
  local have debs=() p deb
  have=$(qemu_version)
  if [ -n "$have" ] && dpkg --compare-versions "$have" ge "$QEMU_MIN"; then return; fi
  for p in "${QEMU_PACKAGES[@]}"; do
    deb=$(suite_deb "$QEMU_SUITE" "$p") || { debs=(); break; }
    debs+=("$deb")
  done
  if [ ${#debs[@]} -gt 0 ] && dpkg -i --auto-deconfigure "${debs[@]}" >>"$CACHE/apt.log" 2>&1; then
    QEMU_CHANGED=1
    return
  fi
  fail "QEMU >= $QEMU_MIN from $QEMU_SUITE (see .cache/apt-$QEMU_SUITE.log, .cache/apt.log): under ${have:+QEMU }${have:-no QEMU}," \
    "linux/arm64 steps that import torch segfault"
  if [ -z "$have" ]; then
    install_packages qemu-user-static && QEMU_CHANGED=1
  fi
}

binfmt_ok() {
  local e=/proc/sys/fs/binfmt_misc/qemu-aarch64
  grep -q '^enabled' $e 2>/dev/null && grep -q '^flags:.*F' $e && grep -q "^interpreter $QEMU_BIN\$" $e
}

# Flag F: the kernel opens the interpreter once, when the handler is registered, and keeps that file; a QEMU
# installed since then is only used once the handler is registered again. 10.x ships its handler for
# systemd-binfmt (/usr/lib/binfmt.d: the very line the kernel takes), 7.2 for update-binfmts.
enable_binfmt() {
  local f=/proc/sys/fs/binfmt_misc conf=/usr/lib/binfmt.d/qemu-aarch64.conf
  [ -e $f/register ] || mount -t binfmt_misc binfmt_misc $f 2>/dev/null
  if [ -n "$QEMU_CHANGED" ] || ! binfmt_ok; then
    [ -e $f/qemu-aarch64 ] && echo -1 > $f/qemu-aarch64
    if [ -r $conf ]; then
      grep -v '^[#;]' $conf | head -n1 > $f/register
    else
      update-binfmts --enable qemu-aarch64 >/dev/null 2>&1
    fi
  fi
  binfmt_ok && return
  fail "arm64 binfmt (qemu-aarch64: $QEMU_BIN with flag F in $f): linux/arm64 builds and runs will fail"
}

# The machine's own Debian mirror, as its apt sources name it (read at run time, never stored in the repo).
debian_mirror() {
  local codename
  codename=$(. /etc/os-release && echo "${VERSION_CODENAME:-}")
  apt-get indextargets --format '$(REPO_URI) $(RELEASE)' 2>/dev/null | awk -v c="$codename" '$2 == c {print $1; exit}'
}

# A package from a Debian suite (trixie, bookworm-backports…), downloaded (not installed) through a private apt
# configuration under .cache/apt-SUITE: the machine's own apt sources and package database stay as they are.
# Prints the .deb path.
suite_deb() {
  local suite=$1 pkg=$2 apt_dir=$CACHE/apt-$1 log=$CACHE/apt-$1.log deb mirror opts
  deb=$(ls "$apt_dir"/debs/"${pkg}"_*.deb 2>/dev/null | head -n1)
  if [ -n "$deb" ]; then echo "$deb"; return; fi
  mirror=$(debian_mirror)
  [ -n "$mirror" ] || { log "no Debian mirror in this machine's apt sources"; return 1; }
  mkdir -p "$apt_dir/lists/partial" "$apt_dir/cache/archives/partial" "$apt_dir/debs"
  echo "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] $mirror $suite main" > "$apt_dir/sources.list"
  opts=(-o "Dir::Etc::SourceList=$apt_dir/sources.list" -o Dir::Etc::SourceParts=/dev/null
        -o "Dir::State::Lists=$apt_dir/lists" -o "Dir::Cache=$apt_dir/cache" -o APT::Sandbox::User=root)
  if [ ! -s "$apt_dir/lists/updated" ]; then
    apt-get "${opts[@]}" update -q >>"$log" 2>&1 || return 1
    date > "$apt_dir/lists/updated"
  fi
  if ! (cd "$apt_dir/debs" && apt-get "${opts[@]}" download "$pkg") >>"$log" 2>&1; then
    # A stale index names a file the mirror no longer has: refresh once and retry.
    apt-get "${opts[@]}" update -q >>"$log" 2>&1 || return 1
    (cd "$apt_dir/debs" && apt-get "${opts[@]}" download "$pkg") >>"$log" 2>&1 || return 1
  fi
  ls "$apt_dir"/debs/"${pkg}"_*.deb | head -n1
}

install_buildx() {
  if docker buildx version >/dev/null 2>&1; then return; fi
  local deb tmp
  deb=$(suite_deb trixie docker-buildx) || { fail "buildx: download of trixie's docker-buildx (see .cache/apt-trixie.log)"; return; }
  tmp=$(mktemp -d)
  dpkg-deb -x "$deb" "$tmp" && mkdir -p "$PLUGINS" \
    && install -m 0755 "$tmp/usr/libexec/docker/cli-plugins/docker-buildx" "$PLUGINS/docker-buildx"
  rm -rf "$tmp"
  docker buildx version >/dev/null 2>&1 || fail "buildx: $PLUGINS/docker-buildx does not run"
}

# The daemon: trixie's dockerd 26.1 (BuildKit 0.13: named build contexts, and with the containerd image store
# multi-platform images and cache export) runs on bookworm's libc with bookworm's containerd, runc and tini
# (installed with docker.io). Only its two binaries are unpacked, into .cache/engine/. Bookworm's dockerd 20.10
# (BuildKit 0.8: none of those) is the fallback when trixie's package cannot be had.
install_engine() {  # sets ENGINE_BIN
  local deb
  ENGINE_BIN=$CACHE/engine/usr/sbin
  [ -x "$ENGINE_BIN/dockerd" ] && return
  if deb=$(suite_deb trixie docker.io) && mkdir -p "$CACHE/engine" && dpkg-deb -x "$deb" "$CACHE/engine" \
      && "$ENGINE_BIN/dockerd" --version >/dev/null 2>&1; then
    return
  fi
  fail "dockerd 26 from trixie (see .cache/apt-trixie.log): using bookworm's dockerd 20.10 (no named contexts, no multi-platform)"
  ENGINE_BIN=$(dirname "$(command -v dockerd || echo /usr/sbin/dockerd)")
}

start_dockerd() {
  if engine_up; then return; fi
  install_engine
  local bin=$ENGINE_BIN
  [ -x "$bin/dockerd" ] || { fail "dockerd: not installed"; return; }
  # A stale pidfile from a killed run makes dockerd refuse to start.
  if [ -e "$PIDFILE" ] && ! alive "$PIDFILE" dockerd; then rm -f "$PIDFILE"; fi
  local config=()
  if "$bin/dockerd" --version | grep -qv ' 20\.'; then
    echo '{"features": {"containerd-snapshotter": true}}' >"$CACHE/daemon.json"
    config=(--config-file "$CACHE/daemon.json")
  fi
  log "starting $("$bin/dockerd" --version | cut -d, -f1) on $DOCKER_HOST_URL (log: .cache/dockerd.log)"
  # $bin first in PATH: dockerd runs the docker-proxy of its own version.
  PATH="$bin:$PATH" setsid "$bin/dockerd" "${config[@]}" --host "$DOCKER_HOST_URL" --data-root "$DATA_ROOT" \
    --exec-root "$EXEC_ROOT" --pidfile "$PIDFILE" ${G5G_DOCKERD_ARGS:-} \
    </dev/null >>"$CACHE/dockerd.log" 2>&1 &
  for _ in $(seq 60); do engine_up && return; sleep 0.5; done
  fail "dockerd: no answer on $DOCKER_HOST_URL after 30 s; last log lines:"
  tail -n 5 "$CACHE/dockerd.log" >&2
}

registry_up() { curl -fs -o /dev/null --max-time 2 "http://$REG_ADDR/v2/"; }

start_registry() {
  if registry_up; then return; fi
  command -v docker-registry >/dev/null || { fail "registry: docker-registry not installed"; return; }
  mkdir -p "$REG_DIR"
  cat >"$CACHE/registry.yml" <<EOF
version: 0.1
log: {level: warn}
storage:
  filesystem: {rootdirectory: $REG_DIR}
  delete: {enabled: true}
http:
  addr: $REG_ADDR
EOF
  setsid docker-registry serve "$CACHE/registry.yml" </dev/null >>"$CACHE/registry.log" 2>&1 &
  echo $! > "$REG_PIDFILE"
  for _ in $(seq 40); do registry_up && return; sleep 0.25; done
  fail "registry: nothing answers on http://$REG_ADDR/v2/ (see .cache/registry.log)"
}

if [ "${1:-}" = stop ]; then stop; exit 0; fi
[ "$(id -u)" = 0 ] || { log "must run as root"; exit 1; }

start=$SECONDS
install_packages "${PACKAGES[@]}"
install_qemu
enable_binfmt
install_buildx
start_dockerd
start_registry
{
  echo "export DOCKER_HOST=$DOCKER_HOST_URL"
  registry_up && echo "export G5G_REGISTRY=$REG_ADDR"
} >"$CACHE/docker.env"

if engine_up && [ "${G5G_BASE_IMAGES:-amd64 arm64}" != 0 ]; then
  # shellcheck disable=SC2086
  (registry_up && export G5G_REGISTRY=$REG_ADDR; bash scripts/base-images.sh ${G5G_BASE_IMAGES:-amd64 arm64}) \
    || fail "base images (see above)"
  # The CUDA profiles' base: Debian trixie (GCC 14; vLLM needs >= 13). amd64 (g4dn) only: g5g's arm64 one,
  # `G5G_BASE_SUITE=trixie bash scripts/base-images.sh arm64`, takes minutes under QEMU and no test needs it.
  (registry_up && export G5G_REGISTRY=$REG_ADDR; G5G_BASE_SUITE=trixie bash scripts/base-images.sh amd64) \
    || fail "trixie base image (see above)"
fi

log "done in $((SECONDS - start)) s: engine $(docker version --format '{{.Server.Version}}' 2>/dev/null || echo none)," \
    "buildx $(docker buildx version 2>/dev/null | awk '{print $2}'), registry $(registry_up && echo "$REG_ADDR" || echo none)"
for f in "${failed[@]}"; do log "FAILED: $f"; done
engine_up

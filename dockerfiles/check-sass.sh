#!/usr/bin/env bash
# The SASS a library really carries, read with cuobjdump (no GPU at build time):
#   check-sass.sh [--only] "ARCH..." FILE...        e.g. check-sass.sh --only "7.5" vllm/*.so
# Every FILE with device code must hold SASS for every ARCH; with --only, for those archs only and no PTX but for an
# ARCH written X+PTX, whose PTX it must then hold (TORCH_CUDA_ARCH_LIST's notation; our own libraries, built for them
# alone). An ELF file without device code passes and says so; anything else cuobjdump
# cannot read (not ELF, no such file, a broken fatbin) fails the check. CUOBJDUMP names the binary (default: cuobjdump on PATH).
set -euo pipefail
only=0
if [ "${1:-}" = --only ]; then only=1; shift; fi
[ $# -ge 2 ] || { echo "usage: check-sass.sh [--only] \"ARCH...\" FILE..." >&2; exit 2; }
want=$(for a in $1; do a=${a%+PTX}; printf 'sm_%s\n' "${a//./}"; done)
want_ptx=$(for a in $1; do case "$a" in *+PTX) a=${a%+PTX}; printf 'sm_%s\n' "${a//./}" ;; esac; done)
[ -n "$want" ] || { echo "check-sass.sh: no ARCH given (an empty arch list would pass any library)" >&2; exit 2; }
shift
for f in "$@"; do
  # cuobjdump reports some non-ELF files as "no device code": only a readable ELF file may pass as host-only
  [ "$(head -c 4 "$f" | od -An -c | tr -d ' ')" = '177ELF' ] || { echo "$f: not a readable ELF file" >&2; exit 1; }
  # a truncated library (an interrupted copy) reads as "no device code": its section table must lie within the file
  # (ELF64 little-endian, as on x86_64 and aarch64; a file shorter than its ELF header is left to cuobjdump)
  size=$(stat -c %s "$f")
  if [ "$size" -ge 64 ]; then
    shoff=$(od -An -t u8 -j 40 -N 8 "$f" | tr -d ' ')
    shsize=$(( $(od -An -t u2 -j 58 -N 2 "$f") * $(od -An -t u2 -j 60 -N 2 "$f") ))
    [ $(( shoff + shsize )) -le "$size" ] || { echo "$f: truncated (its section table ends past the file)" >&2; exit 1; }
  fi
  rc=0
  out=$("${CUOBJDUMP:-cuobjdump}" "$f" 2>&1) || rc=$?
  if [ "$rc" = 255 ] && grep -q 'does not contain device code' <<<"$out"; then
    echo "$f: no device code"
    continue
  fi
  [ "$rc" = 0 ] || { echo "$f: cuobjdump failed (exit $rc): $out" >&2; exit 1; }
  sass=$(awk '/^Fatbin /{elf = /elf/} elf && /^arch = /{print $3}' <<<"$out" | sort -u)
  ptx=$(awk '/^Fatbin /{ptx = /ptx/} ptx && /^arch = /{print $3}' <<<"$out" | sort -u)
  echo "$f sass: $(echo $sass) ptx: $(echo ${ptx:-none})"
  for s in $want; do
    grep -qx "$s" <<<"$sass" || { echo "$f: no $s SASS (it has: $(echo $sass))" >&2; exit 1; }
  done
  if [ $only = 1 ]; then
    for s in $sass; do
      grep -qx "$s" <<<"$want" || { echo "$f: unexpected SASS $s (built for $(echo $want) only)" >&2; exit 1; }
    done
    for s in $ptx; do
      grep -qx "$s" <<<"$want_ptx" || { echo "$f: carries PTX ($(echo $ptx)): only SASS is expected${want_ptx:+, and PTX for $(echo $want_ptx)}" >&2; exit 1; }
    done
    for s in $want_ptx; do
      grep -qx "$s" <<<"$ptx" || { echo "$f: no $s PTX (asked with +PTX; it has: $(echo ${ptx:-none}))" >&2; exit 1; }
    done
  fi
done

#!/usr/bin/env bash
# JAX's sm_75 proven on the libraries of its CUDA plugin, not read off a label (issue 51):
#   check-jax-sass.sh "ARCH..." SITE_PACKAGES        e.g. check-jax-sass.sh "7.5" /opt/venv/lib/python3.13/site-packages
# Every shared library of the PJRT plugin (jax_plugins/xla_cuda*/: XLA's own kernels) and of jax_cuda*_plugin/ (the
# custom calls' kernels) that holds device code must carry SASS for every ARCH: check-sass.sh (beside this script),
# without --only, since NVIDIA-wide wheels also carry other archs and PTX. No plugin library, or none with device
# code, fails: a check with nothing to read is not a pass. CUOBJDUMP names the binary, as for check-sass.sh.
set -euo pipefail
[ $# = 2 ] || { echo "usage: check-jax-sass.sh \"ARCH...\" SITE_PACKAGES" >&2; exit 2; }
mapfile -t libs < <(find "$2"/jax_plugins/xla_cuda* "$2"/jax_cuda*_plugin -name '*.so*' -type f 2>/dev/null | sort)
[ ${#libs[@]} -gt 0 ] || {
  echo "check-jax-sass.sh: no JAX CUDA plugin library under $2 (jax_plugins/xla_cuda*/, jax_cuda*_plugin/)" >&2; exit 1; }
log=$(mktemp)
trap 'rm -f "$log"' EXIT
bash "$(dirname "$0")/check-sass.sh" "$1" "${libs[@]}" | tee "$log"   # stops at the first library without an ARCH
grep -qv ': no device code$' "$log" || {
  echo "check-jax-sass.sh: none of the ${#libs[@]} plugin libraries under $2 holds device code" >&2; exit 1; }
echo "check-jax-sass.sh: ${#libs[@]} JAX CUDA plugin libraries, every one with device code has SASS for $1"

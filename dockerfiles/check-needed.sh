#!/usr/bin/env bash
# Every DT_NEEDED of every shared library under DIR... resolves (ldd prints no "not found"), except the driver's
# libcuda.so.1 and libnvidia-ml.so.1, which the NVIDIA container toolkit mounts at run time. The loader path is the
# caller's: /etc/ld.so.conf.d plus LD_LIBRARY_PATH (e.g. torch/lib for vLLM's extensions, loaded after torch).
#   check-needed.sh DIR...
set -euo pipefail
[ $# -ge 1 ] || { echo "usage: check-needed.sh DIR..." >&2; exit 2; }
n=0
bad=0
while IFS= read -r -d '' f; do
  [ "$(head -c 4 "$f" | od -An -c | tr -d ' ')" = '177ELF' ] || continue
  n=$((n + 1))
  out=$(ldd "$f" 2>&1) || { echo "$f: ldd failed: $out" >&2; exit 1; }
  missing=$(awk '/=> not found/ && $1 != "libcuda.so.1" && $1 != "libnvidia-ml.so.1" {print $1}' <<<"$out")
  if [ -n "$missing" ]; then
    echo "$f: not found: $(echo $missing)" >&2
    bad=1
  fi
done < <(find "$@" -name '*.so*' -type f -print0 | sort -z)
[ "$n" -gt 0 ] || { echo "no shared library under $*" >&2; exit 1; }
[ "$bad" = 0 ] || exit 1
echo "every DT_NEEDED of $n libraries under $* resolves (the driver's libcuda.so.1 aside)"

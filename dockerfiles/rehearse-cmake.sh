#!/usr/bin/env bash
# build.py --rehearse: `cmake` on PATH while vLLM's setup.py builds its wheel. Every call but the build goes to the
# real cmake unchanged, so the configure is setup.py's own (its flags, arch list, job pool). The build call
# (`cmake --build DIR …`) compiles only the sampled objects instead — REHEARSE_OBJECTS, ninja targets of DIR, each
# checked to exist first — copies them and ninja's log to REHEARSE_OUT, and stops the wheel build with exit 97:
# the long compile is what a rehearsal cuts. Environment: REHEARSE_REAL_CMAKE, REHEARSE_OBJECTS, REHEARSE_OUT, MAX_JOBS.
set -euo pipefail
[ "${1:-}" = --build ] || exec "$REHEARSE_REAL_CMAKE" "$@"
cd "$2"
targets=$(ninja -t targets all | sed 's/: [^ ]*$//')
cuda=$(grep -c '\.cu\.o$' <<<"$targets" || true)
for o in $REHEARSE_OBJECTS; do
  grep -qxF "$o" <<<"$targets" || { echo "rehearsal: $o is not a target of this build (ninja -t targets all)" >&2; exit 1; }
done
echo "rehearsal: compiling $(wc -w <<<"$REHEARSE_OBJECTS") of the build's $cuda CUDA objects: $REHEARSE_OBJECTS"
start=$(date +%s)
# The sample only; ninja builds what each object needs first (generated sources), nothing else.
# shellcheck disable=SC2086
ninja -j "${MAX_JOBS:-1}" $REHEARSE_OBJECTS
mkdir -p "$REHEARSE_OUT/objects"
for o in $REHEARSE_OBJECTS; do cp "$o" "$REHEARSE_OUT/objects/"; done
cp .ninja_log "$REHEARSE_OUT/ninja_log"
echo "cuda_objects_in_build $cuda" > "$REHEARSE_OUT/sample.txt"
echo "sample_wall_s $(( $(date +%s) - start ))" >> "$REHEARSE_OUT/sample.txt"
echo "rehearsal: sample compiled in $(( $(date +%s) - start )) s; the wheel build stops here (exit 97)"
exit 97

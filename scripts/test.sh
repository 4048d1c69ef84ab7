#!/usr/bin/env bash
# The test command: a virtualenv with the pinned dependencies, the Docker engine and registry when we can
# provision them (root on Debian), then pytest. End-to-end tests skip with a reason when no engine is reachable
# (with G5G_REQUIRE_E2E=1, as .ci/run sets, they fail instead).
# As root, provisioning (apt, dockerd, base images under QEMU) runs in the background while pip installs;
# its output is in .cache/provision.log and is printed before the tests start. Timings go to stderr.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .cache
t0=$SECONDS
stamp() { printf 'test.sh: %-34s %4d s\n' "$1" $((SECONDS - t0)) >&2; }

provision_pid=
if [ "$(id -u)" = 0 ] && [ -x scripts/provision.sh ]; then
  bash scripts/provision.sh >.cache/provision.log 2>&1 &
  provision_pid=$!
fi

python3 -m venv .venv
.venv/bin/pip install -q -e '.[dev]'
stamp "venv + pip install -e .[dev]"

if [ -n "$provision_pid" ]; then
  wait "$provision_pid" || echo "provision: some parts failed (see above); end-to-end tests will say what they skip"
  cat .cache/provision.log
  stamp "provision (in parallel)"
fi
[ -f .cache/docker.env ] && . .cache/docker.env
set +e
.venv/bin/python -m pytest -ra "$@"
rc=$?
stamp "pytest (rc $rc)"
exit $rc

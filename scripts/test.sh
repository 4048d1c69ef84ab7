#!/usr/bin/env bash
# The test command: a virtualenv with the pinned dependencies, the Docker engine and registry when we can
# provision them (root on Debian), then pytest. End-to-end tests skip with a reason when no engine is reachable.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
.venv/bin/pip install -q -e '.[dev]'
if [ "$(id -u)" = 0 ] && [ -x scripts/provision.sh ]; then
  bash scripts/provision.sh || echo "provision: some parts failed (see above); end-to-end tests will say what they skip"
fi
[ -f .cache/docker.env ] && . .cache/docker.env
exec .venv/bin/python -m pytest -ra "$@"

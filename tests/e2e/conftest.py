"""End-to-end tests on a real Docker engine (scripts/provision.sh starts one; .ci/run always does).

Every module here sets `pytestmark = pytest.mark.e2e`. Without a reachable engine and buildx they are
skipped, saying why (tests/fixtures/engine.py; where G5G_REQUIRE_E2E=1 they fail instead).
Builds go through `python build.py …` exactly as a user types it; logs of every command are kept under
pytest's tmp dir and their tails are shown on failure.
"""
from __future__ import annotations

import pytest

from tests.e2e.harness import Engine, engine_env


@pytest.fixture(scope="session")
def engine(docker_client, buildx, tmp_path_factory) -> Engine:
    return Engine(env=engine_env(), logs=tmp_path_factory.mktemp("e2e-logs"))

"""End-to-end tests on a real Docker engine (scripts/provision.sh starts one; .ci/run always does).

Every module here sets `pytestmark = pytest.mark.e2e`. Without a reachable engine and buildx they are
skipped, saying why.
Builds go through `python build.py …` exactly as a user types it; logs of every command are kept under
pytest's tmp dir and their tails are shown on failure.
"""
from __future__ import annotations

import subprocess

import pytest

from tests.e2e.harness import Engine, engine_env, unavailable


@pytest.fixture(scope="session")
def engine(tmp_path_factory) -> Engine:
    env = engine_env()
    try:
        import docker

        client = docker.DockerClient(base_url=env.get("DOCKER_HOST") or "unix:///var/run/docker.sock", timeout=10)
        client.ping()
        version = client.version().get("Version", "?")
        client.close()
    except Exception as e:  # noqa: BLE001 - any failure means: no engine to test against
        unavailable(f"no Docker engine reachable at {env.get('DOCKER_HOST', 'the default socket')} ({e.__class__.__name__}); "
                    "run `sudo bash scripts/provision.sh` (scripts/test.sh does when root)")
    buildx = subprocess.run(["docker", "buildx", "version"], env=env, capture_output=True, text=True)
    if buildx.returncode != 0:
        unavailable(f"docker engine {version} is up but buildx is missing ({buildx.stderr.strip()[:200]}); "
                    "scripts/provision.sh installs it")
    return Engine(env=env, logs=tmp_path_factory.mktemp("e2e-logs"))
